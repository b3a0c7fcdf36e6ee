"""The classes the kit switches a model's layers to (lean_lora, compile_training) keep the model picklable:
pickle finds a class by its name, and those subclasses carry their base's name (``grpo_patches/swapped.py``).

Upstream first: a plain same-name subclass cannot be pickled at all.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

from grpo_patches.compiled_training import compiled_layers, enable_compiled_training
from grpo_patches.lean_lora import enable_lean_lora, lean_layers
from tests.helpers import PROJ, live_lora_policy


def test_a_plain_same_name_subclass_does_not_pickle():
    from peft.tuners.lora.layer import Linear

    model = live_lora_policy(0.0)
    layer = next(m for m in model.modules() if type(m) is Linear)
    layer.__class__ = type("Linear", (Linear,), {"__module__": Linear.__module__, "__qualname__": "Linear"})
    with pytest.raises(pickle.PicklingError, match="not the same object"):
        pickle.dumps(model)


def switched_model():
    model = live_lora_policy(0.0)
    enable_lean_lora(model)
    enable_compiled_training(model)
    return model


def test_switched_layers_pickle_back_to_the_kits_classes_with_their_weights():
    model = switched_model()
    clone = pickle.loads(pickle.dumps(model))
    assert [type(m) for m in lean_layers(clone)] == [type(m) for m in lean_layers(model)]
    assert len(lean_layers(clone)) == 2 * len(PROJ) and len(compiled_layers(clone)) == len(compiled_layers(model)) > 0
    for (name, p), (_, q) in zip(model.state_dict().items(), clone.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    ids = torch.randint(0, 19, (2, 7))
    with torch.no_grad():  # no grad: the eager layer, so no compilation here
        assert torch.equal(clone(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_fresh_process_unpickles_them_without_the_kit_having_switched_anything(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(switched_model(), path)
    code = ("import torch; from grpo_patches.lean_lora import lean_layers; "
            "from grpo_patches.compiled_training import compiled_layers; "
            f"m = torch.load({str(path)!r}, weights_only=False); "
            "print(len(lean_layers(m)), len(compiled_layers(m)), type(lean_layers(m)[0]).__qualname__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(2 * len(PROJ)), str(len(compiled_layers(switched_model()))), "Linear"]
