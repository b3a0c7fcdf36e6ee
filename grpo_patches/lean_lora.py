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

The layer (a subclass of PEFT's, same name) then skips the copy in its input cast (PEFT's
``_cast_input_dtype``, where the user's ``cast_input_dtype_enabled`` switch is read), for the call at
hand and only where the equality holds: a vanilla LoRA ``Linear`` (no DoRA or other
variant, no per-row ``adapter_names``), dropout an ``nn.Dropout`` or none, autocast on for the
input's device with the input's dtype, the adapter in fp32. Anywhere else PEFT's cast runs.

With a live dropout (an ``nn.Dropout`` with ``p > 0``, training) the layer goes further:
``lora_A(dropout(x))`` is one op (:func:`adapter_input`, :func:`~grpo_patches.lora_dropout.dropout_lora_a`, a
Triton kernel on CUDA) that reads ``x`` once and keeps no mask: it draws the mask from a seed (taken per call
from torch's generator on ``x``'s device, so ``torch.manual_seed`` fixes the masks and gradient checkpointing's
RNG restore redraws them in the recomputation) and the backward draws it again. PEFT's path writes the dropped
copy of ``x`` and a mask for each adapted projection and reads them back. Taken only where the lean cast holds,
for a single active adapter, no per-call keyword arguments, the layer and its dropout training, ``x`` on CUDA
with Triton (or on the CPU in Triton's interpreter); anywhere else PEFT's forward runs. The compiled layers'
fused gate / up projections and their down projection's adapter take it too. On that path the dropout and
``lora_A`` modules are not called (their hooks do not run).

What differs from stock: with dropout > 0 the masks are other draws (on the fused path the kernel's Philox,
each element kept with probability ``1 - round(p * 2**16) / 2**16``; elsewhere ATen's dropout for the input's
dtype instead of the fp32 one), so a run is not bit-identical to stock's; with dropout 0, or in eval mode, it
is.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from . import lora_dropout
from .swapped import same_name_subclass

__all__ = ["adapter_input", "check_supported", "enable_lean_lora", "lean_layers"]

_MARK = "_grpo_lean_lora"  # class attribute of the lean subclass


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


def _castless(module: nn.Module, x: Any) -> bool:
    """Whether PEFT's fp32 copy of ``x`` changes nothing in this call (see the module docstring). PEFT's
    per-row ``adapter_names`` path casts with ``.to`` itself and never gets here."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
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


def _fuses(module: nn.Module, name: str, x: Any) -> bool:
    """Whether :func:`adapter_input` runs the fused op for adapter ``name``: a lean layer in training whose
    input cast is skipped for ``x``, a live ``nn.Dropout`` (``p > 0``), no ``lora_A`` bias, the kernel on
    ``x``'s device."""
    if not getattr(type(module), _MARK, False) or not module.training or not _castless(module, x):
        return False
    dropout = module.lora_dropout[name]
    if type(dropout) is not nn.Dropout or not dropout.training or not dropout.p > 0:
        return False
    return module.lora_A[name].bias is None and lora_dropout.use_kernel(x.device)


def _fused_adapter(module: nn.Module, x: Any, args: tuple, kwargs: dict) -> str | None:
    """The one active adapter whose ``lora_A(dropout(x))`` the layer's forward fuses in this call, or None
    where PEFT's forward runs (per-call arguments, several active adapters, :func:`_fuses` false)."""
    names = [name for name in module.active_adapters if name in module.lora_A]
    if args or kwargs or len(names) != 1 or not _fuses(module, names[0], x):
        return None
    return names[0]


def adapter_input(module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """PEFT's ``lora_A(dropout(x))`` for adapter ``name`` of the LoRA ``Linear`` ``module`` (its input cast
    included), as one op where the lean layer fuses it (see the module docstring)."""
    if _fuses(module, name, x):
        return _fused_input(module, name, x)
    lora_a = module.lora_A[name]
    return lora_a(module.lora_dropout[name](module._cast_input_dtype(x, lora_a.weight.dtype)))


def _fused_input(module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """The fused op's ``lora_A(dropout(x))``, where :func:`_fuses` holds (checked by the caller)."""
    seed = torch.randint(0, 2**31 - 1, (1,), device=x.device)  # torch's generator: manual_seed, checkpointing
    return lora_dropout.dropout_lora_a(x, module.lora_A[name].weight, module.lora_dropout[name].p, seed)


def _lean_subclass(linear: type) -> type:
    """PEFT's ``Linear`` with an input cast that ``_castless`` skips and a forward that fuses a live
    dropout into ``lora_A``. A subclass, not forward hooks: a hook is a per-layer object that
    ``torch.compile`` guards on (``compile_training`` would compile one graph per layer, hit dynamo's
    recompile limit after 8 and run the rest eager), and its flag flips are side effects; these are
    methods of one class, with no state. Same name as PEFT's (``swapped``)."""
    def _cast_input_dtype(self: nn.Module, x: Any, dtype: torch.dtype) -> Any:
        if _castless(self, x):
            return x
        return linear._cast_input_dtype(self, x, dtype)

    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        name = _fused_adapter(self, x, args, kwargs)
        if name is None:
            return linear.forward(self, x, *args, **kwargs)
        result = self.base_layer(x)
        u = _fused_input(self, name, x)  # _fused_adapter has checked _fuses
        return (result + self.lora_B[name](u) * self.scaling[name]).to(result.dtype)

    return same_name_subclass(linear, _lean_subclass, {"_cast_input_dtype": _cast_input_dtype, "forward": forward,
                                                       _MARK: True})


def lean_layers(model: nn.Module) -> list[nn.Module]:
    """The LoRA ``Linear`` layers of ``model`` that :func:`enable_lean_lora` has switched."""
    return [m for m in model.modules() if getattr(type(m), _MARK, False)]


def enable_lean_lora(model: nn.Module) -> int:
    """Switch every LoRA ``Linear`` layer of ``model`` (once) to the lean subclass; returns how many
    layers run it.

    Its input cast decides per call, from the input and the autocast state, whether PEFT's copy can
    be skipped. A model without LoRA ``Linear`` layers is left alone, with a warning (0).
    """
    linear = _lora_linear()
    # Triton probed, the op registered and checked on the model's device here, not inside a compiled layer's trace
    lora_dropout.prepare(next((p.device for p in model.parameters()), None))
    count = 0
    for module in model.modules() if linear is not None else ():
        if type(module) is linear:  # not other subclasses (quantized, tensor-parallel): they cast for their own reasons
            module.__class__ = _lean_subclass(linear)
        elif not getattr(type(module), _MARK, False):
            continue
        count += 1
    if not count:
        warnings.warn(f"grpo_patches: lean_lora=True, but {type(model).__name__} has no LoRA Linear layer (peft's "
                      "lora.Linear): nothing changed. Train with a LoRA peft_config, or drop lean_lora.", stacklevel=3)
    return count
