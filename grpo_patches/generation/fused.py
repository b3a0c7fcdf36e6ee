"""The kit's own decode-step forward for Llama / Qwen2 / Mistral-shaped decoders (``fused_decode``).

transformers' forward costs more kernels per token than the step needs: seven projection matmuls
per layer, a 4-D mask built at every step, ``repeat_kv`` materializing every K/V head group of the
whole cache (at batch 192 that copy dominates the step). This step runs, per layer, one matmul for
q/k/v and one for gate/up (the merged-weight buffer lays each group out contiguously, so the fused
weight is a view, not a copy), attention over the static cache with the query heads grouped onto
their K/V head (no ``repeat_kv``), and the same arithmetic as transformers otherwise (RMSNorm in
fp32, RoPE from the model's own rotary module, softmax in fp32).

Attention runs either as two batched matmuls and an fp32 softmax over the whole static cache, or
(``FastGenerationConfig.decode_attention``) as one Triton kernel that reads only the slots up to the
new token's (:mod:`~grpo_patches.generation.decode_attention`); the caller picks with ``kernel``.

It reads the weights the model would use at that moment, so it is only taken where that is the base
weight of every projection: plain ``nn.Linear`` layers, and LoRA layers that sample from the merged
buffer (or have their adapters disabled). An active unmerged adapter, a quantized base, sliding
windows, dynamic RoPE, a non-SiLU MLP or another architecture keep transformers' forward (the step
would silently drop what it does not implement; :func:`fused_support` says why).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .decode_attention import decode_attention

__all__ = ["FusedDecoder", "fused_support"]

_FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_Piece = tuple[torch.Tensor, torch.Tensor | None]  # (weight [out, in], bias [out] or None)


@dataclass(frozen=True)
class DecoderShape:
    """The Python constants of one decoder's step."""

    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def fused_support(model: nn.Module) -> tuple[DecoderShape | None, str]:
    """``(shape, "")`` if the fused step computes exactly what this model's forward computes, else
    ``(None, why)`` (checked on the architecture; the weights are checked by :meth:`FusedDecoder.bind`)."""
    base = _base(model)
    name = type(base).__name__
    if name not in _FAMILIES:
        return None, f"{name} has no fused decode step (Llama / Qwen2 / Mistral-shaped decoders only)"
    cfg = base.config
    inner = getattr(base, "model", None)
    if getattr(cfg, "hidden_act", None) != "silu":
        return None, f"hidden_act={getattr(cfg, 'hidden_act', None)!r} (SiLU only)"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return None, f"pretraining_tp={cfg.pretraining_tp}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type in ("dynamic", "longrope"):
        return None, f"rope_type={rope_type!r} changes with the sequence length"
    layer_types = getattr(cfg, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types) or (name == "MistralForCausalLM"
                                                          and getattr(cfg, "sliding_window", None) is not None):
        return None, "sliding-window attention"
    if base.training and float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0:
        return None, "attention dropout is live (training mode)"
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return None, f"{name} does not have the expected model.embed_tokens / layers / norm / rotary_emb"
    if type(inner.embed_tokens) is not nn.Embedding or type(base.lm_head) is not nn.Linear:
        return None, "the embeddings or the LM head are wrapped (e.g. modules_to_save)"
    heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return DecoderShape(heads, kv_heads, head_dim, int(cfg.intermediate_size), float(cfg.rms_norm_eps)), ""


def _lora_linear_type() -> type | None:
    try:
        from peft.tuners.lora.layer import LoraLayer
    except Exception:  # pragma: no cover - peft missing: only plain linears then
        return None
    return LoraLayer


def _piece(module: nn.Module) -> _Piece | None:
    """The weight and bias ``module`` applies right now, if that is a plain linear map, else None."""
    if type(module) is nn.Linear:
        return module.weight, module.bias
    lora = _lora_linear_type()
    if lora is not None and isinstance(module, lora):
        active = [a for a in module.active_adapters if a in module.lora_A]
        if module.merged or module.disable_adapters or not active:  # PEFT's forward: the base layer alone
            base = module.get_base_layer()
            if type(base) is nn.Linear:
                return base.weight, base.bias
    return None


def _fuse(pieces: list[_Piece], owner: nn.Module) -> list[_Piece]:
    """One piece whose weight is a view over ``pieces``' weights if they lie back to back in memory
    (the merged buffer's layout), else ``pieces`` unchanged. ``owner``: the module holding them."""
    weights = [w for w, _ in pieces]
    first = weights[0]
    size = first.element_size()
    adjacent = all(w.is_contiguous() and w.dtype == first.dtype and w.device == first.device
                   and w.shape[1] == first.shape[1] for w in weights)
    adjacent = adjacent and all(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                                and a.data_ptr() + a.numel() * size == b.data_ptr()
                                for a, b in zip(weights, weights[1:], strict=False))
    if not adjacent or len(pieces) == 1:
        return pieces
    rows = sum(w.shape[0] for w in weights)
    fused = first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, first.shape[1]))
    return [(fused, _fused_bias(pieces, owner))]


_BIASES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owning module -> (biases, versions, fused)


def _fused_bias(pieces: list[_Piece], owner: nn.Module) -> torch.Tensor | None:
    """The pieces' biases as one vector (zeros where a piece has none): the same tensor at every call
    while they are the same tensors, unchanged in place, so a captured graph keeps its address."""
    biases = tuple(b for _, b in pieces)
    if all(b is None for b in biases):
        return None
    versions = tuple(None if b is None else b._version for b in biases)
    kept = _BIASES.get(owner)
    if kept is not None and kept[1] == versions and all(x is y for x, y in zip(kept[0], biases, strict=True)):
        return kept[2]
    fused = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in pieces])
    _BIASES[owner] = (biases, versions, fused)
    return fused


def _linear(x: torch.Tensor, pieces: list[_Piece]) -> torch.Tensor:
    outs = [F.linear(x, w, b) for w, b in pieces]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _plain_rms_norm(module: Any) -> bool:
    """transformers' own RMSNorm class (a PEFT ``modules_to_save`` wrapper would forward ``.weight`` to
    the original module, not to the trained copy it runs)."""
    return (type(module).__name__ in ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")
            and isinstance(getattr(module, "weight", None), torch.Tensor) and hasattr(module, "variance_epsilon"))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm / Qwen2RMSNorm, operation for operation."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_bias(key_mask: torch.Tensor, cache_position: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[B, 1, 1, L]`` for :func:`matmul_attention`: 0 where slot ``l`` holds a real token
    (``key_mask``) at or before ``cache_position`` (the causal part), the dtype's minimum elsewhere."""
    slots = torch.arange(key_mask.shape[-1], device=key_mask.device)
    visible = key_mask & (slots <= cache_position)
    bias = torch.zeros(visible.shape, dtype=dtype, device=key_mask.device).masked_fill(~visible, torch.finfo(dtype).min)
    return bias[:, None, None, :]


def matmul_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One new token's attention per row over the whole static cache ``[B, kv_heads, L, D]``: two batched
    matmuls and an fp32 softmax; ``q`` holds ``heads * D`` values per row, returned as ``[B, heads * D]``.

    Query head ``j`` reads K/V head ``j // groups`` (transformers' ``repeat_kv``), without the copy.
    """
    batch, kv_heads, _, dim = keys.shape
    qg = q.reshape(batch, kv_heads, -1, dim)  # [B, kv, groups, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale + bias  # [B, kv, groups, L]
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values).reshape(batch, -1)


def fused_forward(shape: DecoderShape, embed: torch.Tensor, layers: list[tuple], norm: torch.Tensor,
                  head: torch.Tensor, rotary: nn.Module, keys: list[torch.Tensor], values: list[torch.Tensor],
                  tokens: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor,
                  key_mask: torch.Tensor, kernel: bool = False,
                  shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Logits ``[batch, vocab]`` of one new token per row; writes its K/V at ``cache_position``.

    ``key_mask[b, l]``: cache slot ``l`` holds a real token of row ``b`` (left padding is 0); slots
    after ``cache_position`` are masked here (the causal part). ``kernel``: attend with
    :func:`~grpo_patches.generation.decode_attention.decode_attention` (the caller checks that it runs
    there: :func:`~grpo_patches.generation.decode_attention.use_kernel`), else with the matmuls. ``shared``:
    the kernel's ``(source, shared_slots)``, rows reading a prompt's slots from its first row (the matmul path
    reads every row's own: the same values).
    """
    batch = tokens.shape[0]
    x = F.embedding(tokens, embed)  # [B, 1, h]
    cos, sin = rotary(x, position_ids)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, 1, D]
    bias = None if kernel else attention_bias(key_mask, cache_position, x.dtype)  # once per token, not per layer
    q_size, kv_size = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    scale = shape.head_dim ** -0.5
    source, slots = shared if shared is not None else (None, None)
    for i, (ln1, qkv, o, ln2, gate_up, down) in enumerate(layers):
        h = _rms(x, ln1, shape.eps)
        q, k, v = _linear(h, qkv).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(batch, 1, shape.heads, shape.head_dim).transpose(1, 2)
        k = k.view(batch, 1, shape.kv_heads, shape.head_dim).transpose(1, 2)
        v = v.view(batch, 1, shape.kv_heads, shape.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys[i].index_copy_(2, cache_position, k)
        values[i].index_copy_(2, cache_position, v)
        if kernel:  # the same arithmetic over slots 0 .. cache_position only
            attn = decode_attention(q, keys[i], values[i], key_mask, cache_position, scale, source=source,
                                    shared_slots=slots).view(batch, 1, q_size)
        else:
            attn = matmul_attention(q, keys[i], values[i], bias, scale).view(batch, 1, q_size)
        x = x + _linear(attn, o)
        h = _rms(x, ln2, shape.eps)
        gate, up = _linear(h, gate_up).split([shape.intermediate, shape.intermediate], dim=-1)
        x = x + _linear(F.silu(gate) * up, down)
    return F.linear(_rms(x, norm, shape.eps)[:, -1], head)


class FusedDecoder:
    """The tensors of one bound model for :func:`fused_forward` (rebound at every generation call,
    inside the merged-buffer block, so it reads exactly the weights that call samples from)."""

    def __init__(self, shape: DecoderShape, args: tuple, fused_groups: int) -> None:
        self.shape = shape
        self.args = args  # embed, layers, norm, head, rotary
        self.fused_groups = fused_groups  # q/k/v and gate/up groups running as one matmul

    @classmethod
    def bind(cls, model: nn.Module) -> tuple[FusedDecoder | None, str]:
        shape, why = fused_support(model)
        if shape is None:
            return None, why
        base = _base(model)
        inner = base.model
        layers, fused = [], 0
        for index, layer in enumerate(inner.layers):
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            names = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
            owners = (attn, attn, mlp, mlp)
            groups = []
            for owner, group in zip(owners, names, strict=True):
                pieces = [_piece(getattr(owner, n, None)) if owner is not None else None for n in group]
                if any(p is None for p in pieces):
                    return None, (f"layer {index} {'/'.join(group)}: not a plain linear map right now (an unmerged "
                                  "adapter, a quantized base or another module)")
                groups.append(_fuse(pieces, owner))
                fused += len(group) > 1 and len(groups[-1]) == 1
            ln1, ln2 = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
            if not all(_plain_rms_norm(n) for n in (ln1, ln2)):
                return None, f"layer {index}: the norms are not the model's own RMSNorm (wrapped or replaced)"
            if getattr(attn, "k_norm", None) is not None or getattr(attn, "q_norm", None) is not None:
                return None, f"layer {index}: q/k norms"
            layers.append((ln1.weight, groups[0], groups[1], ln2.weight, groups[2], groups[3]))
        if not _plain_rms_norm(inner.norm):
            return None, "the final norm is not the model's own RMSNorm (wrapped or replaced)"
        args = (inner.embed_tokens.weight, layers, inner.norm.weight, base.lm_head.weight, inner.rotary_emb)
        return cls(shape, args, fused), ""

    def __call__(self, keys: list[torch.Tensor], values: list[torch.Tensor], tokens: torch.Tensor,
                 position_ids: torch.Tensor, cache_position: torch.Tensor, key_mask: torch.Tensor,
                 forward: Any = fused_forward, kernel: bool = False) -> torch.Tensor:
        return forward(self.shape, *self.args, keys, values, tokens, position_ids, cache_position, key_mask,
                       kernel=kernel)
