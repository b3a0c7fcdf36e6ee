"""recompute_tail: with gradient checkpointing, stock PEFT's layer runs the down projection's base matmul again
in the backward's recomputation, though the backward never reads its output; the compiled layers run it once,
last and eager, and the recomputation stops before it. Losses and gradients stay eager's, dropout included."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from grpo_patches import recompute_tail
from grpo_patches.compiled_training import enable_compiled_training
from tests.test_compiled_training import ids, peft_model, step

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def down_bases(model):
    return [m.base_layer for n, m in model.named_modules() if n.endswith("mlp.down_proj")]


@pytest.mark.parametrize("device", DEVICES)
def test_the_recomputation_stops_before_the_down_projections_base_matmul(monkeypatch, device):
    layers = 2
    eager = peft_model(dropout=0.2, layers=layers).to(device)
    compiled = copy.deepcopy(eager)
    enable_compiled_training(compiled)

    done: list[str] = []  # one entry per base matmul of a down projection that ran to its end
    for model in (eager, compiled):
        for base in down_bases(model):
            base.register_forward_hook(lambda *_: done.append("peft"))
    real = recompute_tail._base_last

    @torch.compiler.disable
    def counted(*args):
        out = real(*args)
        done.append("tail")
        return out

    monkeypatch.setattr(recompute_tail, "_base_last", counted)
    torch._dynamo.reset()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()

    counts = []
    for model in (eager, compiled):
        with autocast:
            step(model, ids(9).to(device))  # compiles; the counts below are of the next step
            done.clear()
            model.zero_grad()
            torch.manual_seed(7)
            loss = model(input_ids=ids(11, 1).to(device), labels=ids(11, 1).to(device)).loss
        forward = list(done)
        done.clear()
        loss.backward()
        counts.append((forward, list(done)))
    (eager_fwd, eager_bwd), (kit_fwd, kit_bwd) = counts
    assert (eager_fwd, eager_bwd) == (["peft"] * layers, ["peft"] * layers), "stock: forward, then recomputed"
    assert (kit_fwd, kit_bwd) == (["tail"] * layers, []), "the kit: forward only, last and eager"
    if device == "cuda":  # bf16: test_compiled_training's GPU test bounds the rounding
        return
    loss_e, grads_e = step(eager, ids(13, 2))
    loss_c, grads_c = step(compiled, ids(13, 2))
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert grads_c.keys() == grads_e.keys()
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-4, atol=1e-6, msg=name)
