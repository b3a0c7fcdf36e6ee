"""Adapter for the vendored DeepSeekMath-style trainer (``grpo_patches.vendored.dsm_grpo``).

It is single-process, so of the kit's options only fast generation applies: its one
``model.generate`` call (:meth:`DSMGRPOTrainer.sample`) goes through :func:`fast_generate` with the
options of the ``apply()`` in force when the trainer was built (as for TRL's trainer).
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from .. import options as _options
from ..generation import FAST_GEN_ATTR, FastGenerationState, fast_generate
from . import Adapter

__all__ = ["ADAPTER"]


def wrap_init(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    opts = _options.active()
    if opts is not None and opts.fast_generation is not None:
        setattr(instance, FAST_GEN_ATTR, FastGenerationState(opts.fast_generation))


def wrap_sample(wrapped, instance, args, kwargs):
    state: FastGenerationState | None = getattr(instance, FAST_GEN_ATTR, None)
    if state is None:
        return wrapped(*args, **kwargs)
    state.calls += 1  # sample(input_ids, attention_mask): fast_generate's own first parameters
    return fast_generate(instance.model, *args, generation_config=instance.generation_config, config=state.config,
                         **kwargs)


ADAPTER = Adapter(
    key="dsm",
    releases=SpecifierSet(),  # vendored: every version of the kit carries its own copy
    module="grpo_patches.vendored.dsm_grpo",
    class_name="DSMGRPOTrainer",
    wrappers={"__init__": wrap_init, "sample": wrap_sample},
    signatures={"sample": ("input_ids", "attention_mask")},
    summary="vendored DeepSeekMath-style trainer: fast generation of its one generate call",
)
