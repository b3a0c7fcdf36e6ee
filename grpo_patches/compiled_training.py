"""The policy's decoder layers compiled for the training forward and backward (``apply(compile_training=True)``).

In the H200 GRPO step the training phase runs at ~3x the time of its matmuls: the eager decoder layer
is chains of small kernels (PEFT's dropout, scaling and add around each of the seven adapted
projections, RMSNorm and RoPE as elementwise sequences), run three times with gradient checkpointing
(forward, recomputation, backward): of the 132.8k kernel launches of one profiled step at batch 192
(1.5B policy on an H200), ~105k were the 257 decode steps' and the rest (~27k) mostly this; at small batches
each launch also costs host time. Compiled
(inductor), a layer's elementwise chains become a few fused kernels; the matmuls stay library calls.

One compiled function serves every layer (the layer is an argument, so its weights are graph inputs),
compiled with dynamic shapes: a run compiles its graphs at its first training forward (two, before and after
the down projection's eager base matmul, ``recompute_tail``, and their backwards), not per layer or per sequence
length. Only calls with autograd on take it (the training forward
and its checkpointed recomputation): sampling and no-grad log-prob passes run the eager layer, so
generation compiles nothing new and runs exactly as without the option.

The LoRA dropout's random numbers come from ATen's generator (inductor's ``fallback_random``), the
masks eager PyTorch draws: inductor's own generator runs a Philox draw per element inside each fused
kernel, and on the H200 that made the compiled layer 6% slower (30.1 against 28.3 ms per 1.5B layer at
128 x 288 tokens, ``benchmarks/compiled_rng.py``). The checkpointed recomputation reproduces the masks,
as in eager, from the restored RNG state.

Inside those layers the MLP's gate and up projections, with their adapters, run as one matmul
(``fused_gate_up``), and the down projection's base matmul last, outside the graph, where the checkpointed
recomputation stops before it (``recompute_tail``; imported when layers are switched, as marking it for dynamo
imports dynamo). AOTAutograd's on-disk cache takes the graphs with that custom autograd function (it bypasses
such graphs by default), so a later run loads the layers instead of tracing them again.

What differs from stock: inductor's fused kernels round differently (fp32 intermediates between the
fused elementwise ops). Single process and DDP only: FSDP and DeepSpeed are refused when the trainer
is built.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

import torch
from torch import nn

from .swapped import same_name_subclass

__all__ = ["check_layout", "compiled_layers", "decoder_layers", "enable_compiled_training"]

_MARK = "_grpo_compiled_training"  # class attribute of the compiled subclasses
_OPTIONS = {"fallback_random": True}  # inductor settings of the compiled layers: ATen's generator (see above)
_compiled: Any = None


def _layer_forward(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return type(layer).__mro__[1].forward(layer, *args, **kwargs)  # the model's own class


def _compiled_forward() -> Any:
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_layer_forward, dynamic=True, options=dict(_OPTIONS))
    return _compiled


@functools.cache
def _functorch_config() -> Any:
    """torch's functorch settings where they have AOTAutograd's switch for custom autograd functions, else None.
    Imported here: ``torch`` alone does not load the module."""
    from torch._functorch import config

    return config if hasattr(config, "autograd_cache_allow_custom_autograd_functions") else None


def _cacheable_autograd_functions() -> Any:
    """AOTAutograd's cache takes graphs with custom autograd functions (``fused_gate_up``'s), which it bypasses
    by default: without it every run traces and partitions the layer again (a warm start saves one compile).
    The functions' forward and backward are traced into the graph the cache key is made of. A no-op where
    torch has no such setting."""
    config = _functorch_config()
    if config is None:
        return contextlib.nullcontext()
    return config.patch(autograd_cache_allow_custom_autograd_functions=True)


def _resumed_in_place() -> Any:
    """Dynamo resumes after ``recompute_tail``'s graph break inside the MLP's frame, so a layer call is two
    graphs (up to the down projection's base matmul, and the residual sum after it); by default the break
    bubbles up to the layer function, which then runs four graphs, one per nested frame. A no-op where torch
    has no such setting."""
    import torch._dynamo.config as config

    if not hasattr(config, "nested_graph_breaks"):
        return contextlib.nullcontext()
    return config.patch(nested_graph_breaks=True)


def _subclass(cls: type) -> type:
    """``cls`` with a forward that takes the compiled function when autograd is on; same name, picklable
    (``swapped``)."""
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            with _cacheable_autograd_functions(), _resumed_in_place():
                return _compiled_forward()(self, *args, **kwargs)
        return cls.forward(self, *args, **kwargs)

    return same_name_subclass(cls, _subclass, {"forward": forward, _MARK: True})


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks transformers' models in ``model`` name in ``_no_split_modules`` (their decoder
    layers), whatever wraps them (PEFT, DDP). The compiled subclasses keep those names."""
    modules = list(model.modules())
    names = {n for m in modules for n in (getattr(m, "_no_split_modules", None) or ())}
    return [m for m in modules if type(m).__name__ in names]


def compiled_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of ``model`` that :func:`enable_compiled_training` has switched."""
    return [m for m in model.modules() if getattr(type(m), _MARK, False)]


def enable_compiled_training(model: nn.Module, accelerator: Any = None) -> int:
    """Switch every decoder layer of ``model`` (once) to the compiled training forward; returns how
    many layers run it. ``accelerator``: the trainer's, whose layout :func:`check_layout` checks first.
    A model without named decoder layers is left alone, with a warning (0)."""
    if accelerator is not None:
        check_layout(accelerator)
    if torch.cuda.is_available():
        # Inductor initializes CUDA when it first compiles, i.e. inside the first checkpointed layer forward,
        # which torch.utils.checkpoint refuses ("device state was initialized in the forward pass"): a model
        # trained on the CPU of a machine with a GPU. Initialized here, before any forward (no-op when done).
        torch.cuda.init()
    # imported here: it imports dynamo (~1 s), which apply() without compile_training never needs
    from .fused_gate_up import enable_fused_gate_up

    layers = decoder_layers(model)
    for layer in layers:
        if not getattr(type(layer), _MARK, False):
            layer.__class__ = _subclass(type(layer))
    enable_fused_gate_up(layers)
    if not layers:
        warnings.warn(f"grpo_patches: compile_training=True, but {type(model).__name__} names no decoder layers "
                      "(transformers' _no_split_modules): nothing is compiled. Drop compile_training for this "
                      "model.", stacklevel=3)
    return len(layers)


def check_layout(accelerator: Any, option: str = "compile_training") -> None:
    """Refuse ``option=True`` (a compiling option) under FSDP or DeepSpeed (not tested there: their parameter
    gathering runs around each layer's forward)."""
    kind = str(getattr(accelerator, "distributed_type", "")).rsplit(".", 1)[-1]
    if kind in ("FSDP", "DEEPSPEED"):
        raise ValueError(f"grpo_patches: {option}=True runs on one process or under DDP; this trainer runs "
                         f"under {kind}. Drop {option} (apply({option}=False)) or train under DDP.")
