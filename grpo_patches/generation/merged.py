"""Sampling from merged LoRA weights kept in a separate buffer (the base weights are never written).

An unmerged LoRA projection costs three kernels more than the base one at every token (the A and B
matmuls, the scaled add): 196 projections of a 28-layer policy make the decode step bound by kernel
count, not by bandwidth. Merging into the base in place and unmerging afterwards does not give the
base back bit-identically (``W + BA*s - BA*s != W`` in floating point), so here ``W + s * B @ A`` is
computed (fp32 accumulate, one rounding to the weight's dtype) into a buffer of its own, once per
generation call, and while sampling each adapted layer's ``base_layer.weight`` points at its slice
of that buffer and the layer is marked merged (PEFT's own flag: its forward then calls the base
layer alone). Both are put back exactly afterwards. Computed from the adapter at every call, the
buffer can never hold stale weights.

Only plain LoRA on ``nn.Linear`` is merged (no DoRA or other variant, no ``lora_bias``, no
``fan_in_fan_out``, no quantized base, no active dropout); every other layer keeps PEFT's path.
After :meth:`MergedLoRAWeights.release` the allocator often hands the same blocks back, and a CUDA
graph recorded over them keeps its addresses (``moves`` counts the calls where not).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .config import warn_once

__all__ = ["MergedLoRAWeights", "mergeable_layers"]

_ALIGN = 128  # elements: every slice starts 256-byte aligned in bf16


def _lora_linear_type() -> type | None:
    try:
        from peft.tuners.lora.layer import Linear
    except Exception:  # pragma: no cover - peft missing or reorganized: nothing is merged
        return None
    return Linear


def mergeable_layers(model: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """``(lora_layer, active adapter names)`` for every layer whose adapter can be merged exactly."""
    linear = _lora_linear_type()
    if linear is None:
        return []
    out = []
    for module in model.modules():
        if not isinstance(module, linear) or module.disable_adapters or module.merged:
            continue
        base = module.get_base_layer()
        if type(base) is not nn.Linear or not base.weight.dtype.is_floating_point or getattr(module, "fan_in_fan_out",
                                                                                              False):
            continue
        adapters = tuple(a for a in module.active_adapters if a in module.lora_A)
        if not adapters or any(_unmergeable(module, a) for a in adapters):
            continue
        out.append((module, adapters))
    return out


def _unmergeable(module: Any, adapter: str) -> bool:
    if adapter in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(adapter, False):
        return True
    if getattr(module, "lora_bias", {}).get(adapter, False):
        return True
    dropout = module.lora_dropout[adapter]
    return isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0


class MergedLoRAWeights:
    """The merged-weight buffer of one policy, refreshed at each :meth:`applied` block.

    One allocation per decoder layer (its projections back to back, in module order, so q/k/v and
    gate/up are each one contiguous matrix: the fused decode step's views). Per layer rather than one
    block for the whole policy: after a release, a 2.4 GiB block needs a hole that large again, and
    the long-lived tensors the training phase creates in the freed block (optimizer state at the
    first step) leave none under a tight memory cap; an ~90 MB layer fits between them.
    """

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []
        self._layout: tuple | None = None
        self._params: list[nn.Parameter] = []
        self.refreshes = 0
        self.allocations = 0
        self.moves = 0  # allocations that landed at other addresses (a CUDA graph re-records then)
        self.skipped = 0  # calls that sampled unmerged because the buffer did not fit in memory
        self._addresses: tuple | None = None

    @property
    def flat(self) -> torch.Tensor | None:
        """The first layer's block (None when released): its address stands for the buffer's."""
        return self.chunks[0] if self.chunks else None

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.chunks)

    def _allocate(self, model: nn.Module, layers: list[tuple[nn.Module, tuple[str, ...]]]) -> None:
        weights = [m.get_base_layer().weight for m, _ in layers]
        dtype, device = weights[0].dtype, weights[0].device
        layout = tuple((id(m), tuple(w.shape), w.dtype, w.device) for (m, _), w in zip(layers, weights, strict=True))
        if self.chunks and layout == self._layout:
            return
        owner = {id(m): name.rsplit(".", 2)[0] for name, m in model.named_modules()}  # "...layers.3"
        groups: list[list[int]] = []
        for i, (m, _) in enumerate(layers):
            if groups and owner.get(id(m)) == owner.get(id(layers[groups[-1][0]][0])):
                groups[-1].append(i)
            else:
                groups.append([i])
        self.chunks, self._params = [], []
        params: list[nn.Parameter | None] = [None] * len(layers)
        for group in groups:
            offsets, total = [], 0
            for i in group:
                offsets.append(total)
                total += -(-weights[i].numel() // _ALIGN) * _ALIGN
            chunk = torch.empty(total, dtype=dtype, device=device)
            self.chunks.append(chunk)
            for i, o in zip(group, offsets, strict=True):
                w = weights[i]
                params[i] = nn.Parameter(chunk[o:o + w.numel()].view(w.shape), requires_grad=False)
        self._params = params  # type: ignore[assignment]
        self._layout = layout
        self.allocations += 1
        addresses = tuple(c.data_ptr() for c in self.chunks)
        if self._addresses is not None and addresses != self._addresses:
            self.moves += 1
        self._addresses = addresses

    @torch.no_grad()
    def _refresh(self, layers: list[tuple[nn.Module, tuple[str, ...]]]) -> None:
        for (module, adapters), merged in zip(layers, self._params, strict=True):
            acc = module.get_base_layer().weight.float()
            for a in adapters:
                acc = acc.addmm(module.lora_B[a].weight.float(), module.lora_A[a].weight.float(),
                                alpha=float(module.scaling[a]))
            merged.copy_(acc)
        self.refreshes += 1

    @contextlib.contextmanager
    def applied(self, model: nn.Module) -> Iterator[int]:
        """Inside the block the model samples from the merged buffer; yields how many layers merged."""
        layers = mergeable_layers(model)
        if layers:  # one dtype and device: layers of another (rare) keep PEFT's own path
            first = layers[0][0].get_base_layer().weight
            layers = [(m, a) for m, a in layers if (m.get_base_layer().weight.dtype, m.get_base_layer().weight.device)
                      == (first.dtype, first.device)]
        if not layers:
            yield 0
            return
        try:
            self._allocate(model, layers)
        except torch.OutOfMemoryError:  # the buffer is a speed-up, never a reason to fail: sample unmerged
            self.release()
            self.skipped += 1
            warn_once("merge-oom", "grpo_patches fast_generation: no memory for the merged LoRA buffer "
                      f"({sum(m.get_base_layer().weight.numel() for m, _ in layers) * 2} bytes in bf16); sampling "
                      "with the adapter's own matmuls (merge_lora=False avoids the attempt).")
            yield 0
            return
        self._refresh(layers)
        saved = []
        try:
            for (module, adapters), merged in zip(layers, self._params, strict=True):
                base = module.get_base_layer()
                saved.append((module, base, base._parameters["weight"], module.merged_adapters))
                base._parameters["weight"] = merged
                module.merged_adapters = list(adapters)
            yield len(layers)
        finally:
            for module, base, weight, merged_adapters in reversed(saved):
                base._parameters["weight"] = weight
                module.merged_adapters = merged_adapters

    def release(self) -> None:
        """Free the buffer (the next :meth:`applied` allocates and fills it again)."""
        self.chunks = []
        self._params = []
        self._layout = None
