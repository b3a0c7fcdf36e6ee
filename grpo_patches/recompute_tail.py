"""The MLP's down projection as the compiled training layer's last matmul, run outside its graph, so that
gradient checkpointing's recomputation stops before it.

With checkpointing, the backward runs each layer's forward again to get back the tensors the backward reads.
The down projection's base product only feeds the layer's residual sum, which the backward never reads, yet a
recomputation of the compiled layer runs its whole graph: that matmul is 29% of a Qwen2.5-1.5B layer's linear
FLOPs, about a tenth of the training phase's. ``torch.utils.checkpoint`` (non-reentrant, early stop on, its
default) stops a recomputation as soon as every saved tensor is back, and a matmul with a frozen weight saves
only that weight, before it computes. So the compiled graph ends at the projection's input and its adapter's
output, and one eager ``addmm`` (input, frozen base weight, adapter output as the added term) closes the MLP:
the recomputation stops at its save, never running it.

Taken where ``fused_gate_up._adapter`` accepts the projection (a vanilla LoRA ``Linear``, frozen bias-free
base). What differs from PEFT: the base product and the adapter output are summed in the matmul's accumulator
(PEFT rounds the product to the autocast dtype first), and each layer call is two compiled graphs around the
``addmm`` (a graph break). With reentrant checkpointing or none, the matmul runs once per forward as before.
"""

from __future__ import annotations

import torch
from torch import nn

from .lean_lora import adapter_input

__all__ = ["down_projection"]


@torch.compiler.disable
def _base_last(h: torch.Tensor, weight: torch.Tensor, added: torch.Tensor) -> torch.Tensor:
    """``h @ weight.T + added`` as one eager matmul, outside the compiled graph (see the module docstring)."""
    flat = torch.addmm(added.reshape(-1, added.shape[-1]), h.reshape(-1, h.shape[-1]), weight.t())
    return flat.view(*h.shape[:-1], weight.shape[0])


def down_projection(down: nn.Module, adapter: str, h: torch.Tensor) -> torch.Tensor:
    """PEFT's ``down(h)`` for its one active ``adapter``: the adapter's output in the compiled graph (PEFT's
    input cast, dropout and scaling, in its order), the base matmul last and eager."""
    lora_b = down.lora_B[adapter]
    update = lora_b(adapter_input(down, adapter, h))
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else down.base_layer.weight.dtype
    return _base_last(h, down.base_layer.weight, (update * down.scaling[adapter]).to(dtype))
