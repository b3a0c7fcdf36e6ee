"""LoRA layers that keep their input in the autocast dtype (``apply(lean_lora=True)``).

PEFT keeps a LoRA adapter's weights in fp32 under a bf16 base (``autocast_adapter_dtype``) and so
copies every adapted projection's input to fp32 before the adapter's dropout:
``lora_B(lora_A(dropout(x.to(float32))))``. Under bf16 (or fp16) autocast that copy changes no
value: autocast casts the dropout's output back to bf16 for ``lora_A``, and
``bf16(dropout(fp32(x)))`` is ``dropout(x)`` in bf16 (both round ``x * mask / (1 - p)``, computed
in fp32, once); the backward's casts likewise. It costs three extra passes over each input, in the
forward, the checkpointed recomputation and the backward, and 2-4 transient bytes per element
(the down projection's input is batch x sequence x intermediate): on the H200 GRPO step of the
benchmarks the copies and the fp32 dropout were about a fifth of the training phase's kernel time.

The layer then skips the copy, through PEFT's own switch (``cast_input_dtype_enabled``), for the
call at hand and only where the equality holds: a vanilla LoRA ``Linear`` (no DoRA or other
variant, no per-row ``adapter_names``), dropout an ``nn.Dropout`` or none, autocast on for the
input's device with the input's dtype, the adapter in fp32. Anywhere else PEFT's cast runs.

What differs from stock: with dropout > 0 the masks are drawn by the kernel for the input's dtype
instead of the fp32 one (the same ``p``, other draws), so a run is not bit-identical to stock's;
with dropout 0, or in eval mode, it is.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

__all__ = ["check_supported", "enable_lean_lora", "lean_layers"]

_HOOKED = "_grpo_lean_lora"  # on each hooked layer (a flag, not the handles: the model stays deep-copyable)
_FLIPPED = "_grpo_lean_lora_flipped"  # set while a call runs with PEFT's cast switched off by the kit


def _lora_linear() -> type | None:
    try:
        from peft.tuners.lora.layer import Linear
    except Exception:  # pragma: no cover - no PEFT: no LoRA layers to find
        return None
    return Linear


def check_supported() -> None:
    """Refuse ``lean_lora=True`` where PEFT has no switch for its input cast (before PEFT 0.15 the
    LoRA layer casts unconditionally, so the option would silently change nothing)."""
    linear = _lora_linear()
    if linear is None or not hasattr(linear, "_cast_input_dtype"):
        import importlib.metadata as md

        try:
            installed = md.version("peft")
        except md.PackageNotFoundError:
            installed = "not installed"
        raise ValueError(f"grpo_patches.apply: lean_lora=True needs peft >= 0.15 (its LoRA layers' "
                         f"cast_input_dtype_enabled switch); peft is {installed}. Upgrade peft or drop lean_lora.")


def _castless(module: nn.Module, x: Any, kwargs: dict) -> bool:
    """Whether PEFT's fp32 copy of ``x`` changes nothing in this call (see the module docstring)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or kwargs.get("adapter_names") is not None:
        return False
    device = x.device.type
    try:
        if not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) != x.dtype:
            return False
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return False
    if module.disable_adapters or module.merged or not getattr(module, "cast_input_dtype_enabled", True):
        return False
    variants = getattr(module, "lora_variant", {}) or {}  # DoRA & co. (peft >= 0.16)
    dora = getattr(module, "use_dora", {}) or {}  # DoRA (peft 0.15)
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if name in variants or dora.get(name) or module.lora_A[name].weight.dtype != torch.float32:
            return False
        if type(module.lora_dropout[name]) not in (nn.Dropout, nn.Identity):
            return False
    return True


def _before(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if args and _castless(module, args[0], kwargs):
        module.cast_input_dtype_enabled = False
        setattr(module, _FLIPPED, True)


def _after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    if getattr(module, _FLIPPED, False):  # also after an exception (always_call)
        module.cast_input_dtype_enabled = True
        setattr(module, _FLIPPED, False)


def lean_layers(model: nn.Module) -> list[nn.Module]:
    """The LoRA ``Linear`` layers of ``model`` that :func:`enable_lean_lora` has hooked."""
    return [m for m in model.modules() if getattr(m, _HOOKED, False)]


def enable_lean_lora(model: nn.Module) -> int:
    """Hook every LoRA ``Linear`` layer of ``model`` (once); returns how many layers are hooked.

    The hooks decide per call, from the input and the autocast state, whether PEFT's input cast
    can be skipped. A model without LoRA ``Linear`` layers is left alone, with a warning (0).
    """
    linear = _lora_linear()
    count = 0
    for module in model.modules() if linear is not None else ():
        if type(module) is not linear:  # subclasses (quantized, tensor-parallel) cast for their own reasons
            continue
        if not getattr(module, _HOOKED, False):
            module.register_forward_pre_hook(_before, with_kwargs=True)
            module.register_forward_hook(_after, with_kwargs=True, always_call=True)
            setattr(module, _HOOKED, True)
        count += 1
    if not count:
        warnings.warn(f"grpo_patches: lean_lora=True, but {type(model).__name__} has no LoRA Linear layer (peft's "
                      "lora.Linear): nothing changed. Train with a LoRA peft_config, or drop lean_lora.", stacklevel=3)
    return count
