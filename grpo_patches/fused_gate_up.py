"""The MLP's gate and up projections, with their LoRA adapters, as one matmul in the compiled training layers.

PEFT runs each adapted projection as the base matmul plus ``lora_B(lora_A(dropout(x))) * scaling``: the base
output and the adapter's output are each written in full (batch x sequence x intermediate for gate and up) and
read back to be added, and the backward reads each projection's output gradient once more for ``lora_B``'s
input gradient. For gate and up, which share their input, one matmul gives both outputs with the adapters
inside: ``[x | u_gate | u_up] @ [[W_gate, s B_gate, 0], [W_up, 0, s B_up]]^T`` (``u = lora_A(dropout(x))``,
rank r; the weight is assembled per call, 2r more columns than the base's), and its backward one matmul gives
the input gradients of ``x`` and both ``u``. Only ``B``'s gradients are computed for the adapter, by an
autograd function, not the whole assembled weight's.

Used by the MLPs of the layers ``compile_training`` switches, while they are being compiled (the training
forward and its recomputation) and only where it changes nothing of PEFT's semantics: both projections a
vanilla LoRA ``Linear`` (one active adapter, no DoRA or other variant, no bias, not merged, base weight
frozen), dropout an ``nn.Dropout`` or none, and an MLP whose ``forward`` is transformers'
``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (checked on its source). The adapters see what PEFT gives them (its own input cast, so
``lean_lora`` applies as it would) and the dropout masks are drawn in PEFT's order, gate's first. What differs:
the base and adapter products are summed in the matmul's fp32 accumulator, where PEFT rounds each to the
autocast dtype before adding them, and ``s B`` is rounded to that dtype as one factor.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from typing import Any

import torch
from torch import nn

from . import recompute_tail
from .lean_lora import _lora_linear, adapter_input
from .swapped import same_name_subclass

__all__ = ["enable_fused_gate_up", "fused_mlps"]

_MARK = "_grpo_fused_gate_up"
# transformers' gated MLP forward (Llama, Qwen2 / Qwen3, Mistral, ...), whitespace removed
_GATED = "down_proj=self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))returndown_proj"


class _GateUp(torch.autograd.Function):
    """``[x | ug | uu] @ [[wg, bg, 0], [wu, 0, bu]]^T``: gate and up side by side; gradients for ``x``, ``ug``,
    ``uu``, ``bg`` and ``bu`` (the base weights are frozen)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ug: torch.Tensor, uu: torch.Tensor, wg: torch.Tensor,
                wu: torch.Tensor, bg: torch.Tensor, bu: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ug, uu, wg, wu, bg, bu)
        return torch.cat([x, ug, uu], -1) @ _weight(wg, wu, bg, bu).t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ug, uu, wg, wu, bg, bu = ctx.saved_tensors
        k, r = wg.shape[1], ug.shape[-1]
        grad_in = grad @ _weight(wg, wu, bg, bu)
        flat = grad.reshape(-1, grad.shape[-1])
        n = wg.shape[0]
        grad_bg = flat[:, :n].t() @ ug.reshape(-1, r)
        grad_bu = flat[:, n:].t() @ uu.reshape(-1, r)
        return grad_in[..., :k], grad_in[..., k:k + r], grad_in[..., k + r:], None, None, grad_bg, grad_bu


def _weight(wg: torch.Tensor, wu: torch.Tensor, bg: torch.Tensor, bu: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.cat([wg, bg, torch.zeros_like(bu)], 1), torch.cat([wu, torch.zeros_like(bg), bu], 1)])


def _adapter(module: nn.Module) -> str | None:
    """The one active adapter of a vanilla PEFT LoRA ``Linear`` (see the module docstring), else None."""
    linear = _lora_linear()
    if linear is None or not isinstance(module, linear) or type(module).__name__ != "Linear":
        return None
    if module.disable_adapters or module.merged or getattr(module, "fan_in_fan_out", False):
        return None
    active = [name for name in module.active_adapters if name in module.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    if name in (getattr(module, "lora_variant", {}) or {}) or (getattr(module, "use_dora", {}) or {}).get(name):
        return None
    base = module.base_layer
    if type(base) is not nn.Linear or base.bias is not None or module.lora_B[name].bias is not None:
        return None
    if base.weight.requires_grad:  # a trained base weight: its gradient is PEFT's path's to compute
        return None
    if type(module.lora_dropout[name]) not in (nn.Dropout, nn.Identity):
        return None
    return name


def _fused(mlp: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(gate_proj(x), up_proj(x))`` as one matmul, or None where the projections are not both fusable."""
    gate, up = mlp.gate_proj, mlp.up_proj
    a, b = _adapter(gate), _adapter(up)
    if a is None or b is None:
        return None
    # PEFT's order: gate's adapter input and dropout mask first
    ug, uu = adapter_input(gate, a, x), adapter_input(up, b, x)
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    wg, wu = gate.base_layer.weight, up.base_layer.weight
    bg = (gate.lora_B[a].weight * gate.scaling[a]).to(dtype)
    bu = (up.lora_B[b].weight * up.scaling[b]).to(dtype)
    both = _GateUp.apply(x.to(dtype), ug.to(dtype), uu.to(dtype), wg.to(dtype), wu.to(dtype), bg, bu)
    gate_out, up_out = both.split(wg.shape[0], -1)
    return gate_out, up_out


def _subclass(cls: type) -> type:
    """``cls`` with a forward that, while compiling with autograd on, fuses gate and up and runs the down
    projection's base matmul last (``recompute_tail``); same name (``swapped``)."""
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not (torch.compiler.is_compiling() and torch.is_grad_enabled()):
            return cls.forward(self, x)
        pair = _fused(self, x)
        gate, up = pair if pair is not None else (self.gate_proj(x), self.up_proj(x))
        h = self.act_fn(gate) * up
        adapter = _adapter(self.down_proj)
        return self.down_proj(h) if adapter is None else recompute_tail.down_projection(self.down_proj, adapter, h)

    return same_name_subclass(cls, _subclass, {"forward": forward, _MARK: True})


@functools.cache
def _gated(cls: type) -> bool:
    """Whether ``cls.forward``'s body is transformers' gated MLP (its statements; annotations, docstring and
    formatting aside)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    function = tree.body[0] if tree.body else None
    if not isinstance(function, ast.FunctionDef):
        return False
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # the docstring
    return re.sub(r"\s+", "", "".join(ast.unparse(statement) for statement in body)) == _GATED


def fused_mlps(model: nn.Module) -> list[nn.Module]:
    """The MLPs of ``model`` that :func:`enable_fused_gate_up` has switched."""
    return [m for m in model.modules() if getattr(type(m), _MARK, False)]


def enable_fused_gate_up(layers: list[nn.Module]) -> int:
    """Switch the gated MLPs inside ``layers`` (once) to the fused forward; returns how many run it."""
    count = 0
    for layer in layers:
        for module in layer.modules():
            cls = type(module)
            if getattr(cls, _MARK, False):
                count += 1
            elif all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")) and _gated(cls):
                module.__class__ = _subclass(cls)
                count += 1
    return count
