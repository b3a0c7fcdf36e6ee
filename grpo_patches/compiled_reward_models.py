"""The reward models' decoder layers compiled for scoring (``apply(compile_reward_models=True)``).

A reward model scores every completion of a step in forwards without autograd. Eager, its decoder layer is
chains of small ATen kernels (RMSNorm, RoPE and SiLU as elementwise sequences, the copies between them): in
the 1.5B GRPO step on an H100 (0.5B reward model, 1024 completions in chunks of 128) they took 471 of the
reward phase's 832 ms of device time, the matmuls 299. Compiled (inductor), each chain is one or a few fused
kernels; the matmuls and attention stay library calls.

As ``compile_training`` does for the policy, one compiled function serves every layer of every reward model
(the layer is an argument, its weights graph inputs), with dynamic shapes: one graph for all layers, batch
sizes and sequence lengths, compiled at the first scoring. The models' ``config.use_cache`` is set to
``False``: a classifier's forward would fill a KV cache that nothing reads (the scores are the same). Only
calls without autograd take it (TRL and the vendored trainer score under ``inference_mode`` / ``no_grad``);
a call with autograd on runs the eager layer.

What differs from stock: inductor's fused kernels round differently (fp32 intermediates between the fused
ops), so the scores differ in their last bf16 bits. Single process and DDP only: FSDP and DeepSpeed, whose
parameter gathering runs around each module's forward, are refused when the trainer is built.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .compiled_training import check_layout, decoder_layers
from .swapped import same_name_subclass

__all__ = ["enable_compiled_reward_models", "scoring_layers"]

_MARK = "_grpo_compiled_scoring"  # class attribute of the compiled subclasses
_compiled: Any = None


def _scoring_forward(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The layer's own forward. A function of its own: dynamo keeps its graphs per code object, and those of
    ``compile_training``'s function (autograd on, other inductor settings) are not shared with these."""
    return type(layer).__mro__[1].forward(layer, *args, **kwargs)  # the model's own class


def _compiled_forward() -> Any:
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_scoring_forward, dynamic=True)
    return _compiled


def _subclass(cls: type) -> type:
    """``cls`` with a forward that takes the compiled function when autograd is off; same name, picklable."""
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return cls.forward(self, *args, **kwargs)
        return _compiled_forward()(self, *args, **kwargs)

    return same_name_subclass(cls, _subclass, {"forward": forward, _MARK: True})


def scoring_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of ``model`` that :func:`enable_compiled_reward_models` has switched."""
    return [m for m in model.modules() if getattr(type(m), _MARK, False)]


def enable_compiled_reward_models(reward_funcs: Iterable[Any], accelerator: Any = None) -> int:
    """Switch the decoder layers of every ``nn.Module`` among ``reward_funcs`` (once) to the compiled scoring
    forward; plain reward functions are left as they are. Returns how many layers run it. ``accelerator``: the
    trainer's, whose layout :func:`~grpo_patches.compiled_training.check_layout` checks first."""
    models = [f for f in reward_funcs if isinstance(f, nn.Module)]
    if not models:
        return 0
    if accelerator is not None:
        check_layout(accelerator, option="compile_reward_models")
    count = 0
    for model in models:
        layers = decoder_layers(model)
        config = getattr(model, "config", None)
        if layers and getattr(config, "use_cache", None):
            # A scoring forward fills a KV cache nobody reads; with it each layer indexes the cache by its
            # own layer_idx, which dynamo guards on: a graph per layer, past its recompile limit eager again.
            config.use_cache = False
        for layer in layers:
            if not getattr(type(layer), _MARK, False):
                layer.__class__ = _subclass(type(layer))
        count += len(layers)
        if not layers:
            warnings.warn(f"grpo_patches: compile_reward_models=True, but the reward model {type(model).__name__} "
                          "names no decoder layers (transformers' _no_split_modules): it scores eagerly.",
                          stacklevel=3)
    return count
