"""One Triton kernel for the fused decode step's attention that reads only the filled cache slots.

The fused step's matmul path (:func:`~grpo_patches.generation.fused.fused_forward`) attends over the
whole static cache: the QK and PV matmuls and the fp32 softmax read every slot, filled or not, the
unfilled ones masked. All rows share one ``cache_position`` (left-padded prompts), so at a decode step
only slots ``0 .. cache_position`` can be visible. This kernel runs one program per (row, K/V head):
it loads the head's query group (padded to 16 rows for ``tl.dot``), walks the cache in blocks up to
``cache_position`` (read on the device, so one CUDA graph serves every step) with an online softmax
in fp32, casts the probabilities to the value dtype before the PV product as the matmul path does,
and writes the heads' outputs as ``[B, heads * D]``.

GRPO samples G completions of each prompt, so G rows hold the same prompt in their first slots (prefilled
once, copied to each). Given each row's ``source`` (the first row of its prompt), the kernel reads those
slots from the source row for every row of the group: the same values, so the same result, but the rows of a
group run side by side and the copies after the first come from the L2 cache instead of HBM. The prompt's
share of the reads is ``prompt / (prompt + position)``: a third on average for 64-token prompts and 256 new
tokens, most of them for long prompts.

It is a torch custom op (``grpo_patches::decode_attention``; in a fork's copy of this module the
fork's top package names it, so both can be imported in one process), registered at its first use, so the
compiled step treats it as one opaque call and the fused loop's CUDA-graph capture records it. Triton is optional: this module
imports without it (:func:`available` is then False) and imports Triton only when the kernel runs.
CPU tensors run in Triton's interpreter, which needs ``TRITON_INTERPRET=1`` set before Triton is
first imported (tests, ``benchmarks/decode_attention.py --tiny``); :func:`use_kernel` picks the kernel
for CPU tensors only then.
"""

import functools
import os
from typing import Optional

import torch

from .config import DECODE_ATTENTIONS

__all__ = ["KERNEL_MIN_BATCH", "available", "decode_attention", "use_kernel"]

KERNEL_MIN_BATCH = 64  # "auto": the kernel on CUDA from this batch on (below it the matmul path is as fast)
GROUP_PAD = 16  # tl.dot's smallest M
_HAS_CUSTOM_OP = hasattr(torch, "library") and hasattr(torch.library, "custom_op")
_NAMESPACE = __name__.split(".")[0]  # the custom op's namespace: this package's


@functools.cache
def available() -> bool:
    """Triton imports and this torch has ``torch.library.custom_op`` (torch >= 2.4)."""
    if not _HAS_CUSTOM_OP:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken: the matmul path
        return False
    return True


def interpreted() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs kernels in its interpreter (CPU tensors included)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_kernel(setting: str, device: torch.device | str, batch: int) -> bool:
    """Whether the fused step attends with the kernel: ``"matmul"`` never; ``"kernel"`` wherever it
    runs (CUDA, or CPU under ``TRITON_INTERPRET=1``); ``"auto"`` on CUDA from ``KERNEL_MIN_BATCH`` rows."""
    if setting not in DECODE_ATTENTIONS:
        raise ValueError(f"decode_attention={setting!r} must be one of {DECODE_ATTENTIONS}.")
    device = torch.device(device)
    if setting == "matmul":
        return False
    if device.type == "cuda":
        chosen = (setting == "kernel" or batch >= KERNEL_MIN_BATCH) and available()
    else:
        chosen = setting == "kernel" and device.type == "cpu" and interpreted() and available()
    if chosen:
        _op()  # registered here, outside the compiled step
    return chosen


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_attn(q_ptr, k_ptr, v_ptr, mask_ptr, pos_ptr, src_ptr, slots_ptr, o_ptr, L, scale,
                     stride_qb, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, stride_mb,
                     stride_ob, GROUPS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                     BLOCK_L: tl.constexpr, GROUP_PAD: tl.constexpr, PRECISION: tl.constexpr,
                     SHARED: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        g_ok = g < GROUPS
        d_ok = d < D
        # query head h * GROUPS + g of row b (transformers' repeat_kv order): q is [B, heads * D]
        q_off = b * stride_qb + (h * GROUPS + g)[:, None] * D + d[None, :]
        q = tl.load(q_ptr + q_off, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        pos = tl.load(pos_ptr)
        m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        total = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, D_PAD), tl.float32)
        if SHARED:  # slots before ``n_shared`` are read from row ``src`` (the same prompt's keys and values)
            src = tl.load(src_ptr + b)
            n_shared = tl.load(slots_ptr)
        for start in range(0, pos + 1, BLOCK_L):  # the filled slots only: the bound is read on the device
            ls = start + tl.arange(0, BLOCK_L)
            live = (ls <= pos) & (ls < L)  # causal: no slot after the new token's is read
            if SHARED:
                row = tl.where(ls < n_shared, src, b).to(tl.int64)[:, None]
                at_k = k_ptr + row * stride_kb + h * stride_kh + ls[:, None] * stride_kl + d[None, :]
                at_v = v_ptr + row * stride_vb + h * stride_vh + ls[:, None] * stride_vl + d[None, :]
            else:
                at_k = k_ptr + b * stride_kb + h * stride_kh + ls[:, None] * stride_kl + d[None, :]
                at_v = v_ptr + b * stride_vb + h * stride_vh + ls[:, None] * stride_vl + d[None, :]
            k = tl.load(at_k, mask=live[:, None] & d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # [GROUP_PAD, BLOCK_L]
            keep = tl.load(mask_ptr + b * stride_mb + ls, mask=live, other=0) != 0
            s = tl.where(keep[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(at_v, mask=live[:, None] & d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            m = m_new
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        o_off = b * stride_ob + (h * GROUPS + g)[:, None] * D + d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])

    return _decode_attn


def _launch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor,
            cache_position: torch.Tensor, scale: float, block_l: int, num_warps: int, num_stages: int = 0,
            source: torch.Tensor | None = None, shared_slots: torch.Tensor | None = None) -> torch.Tensor:
    if q.device.type == "cpu" and not interpreted():
        raise RuntimeError("decode_attention: CPU tensors run in Triton's interpreter only (TRITON_INTERPRET=1 "
                           "set before Triton is imported)")
    batch, kv_heads, length, dim = keys.shape
    groups = q.shape[1] // (kv_heads * dim)
    if q.stride(1) != 1:
        q = q.contiguous()
    if keys.stride(3) != 1:
        keys = keys.contiguous()
    if values.stride(3) != 1:
        values = values.contiguous()
    if key_mask.stride(1) != 1:
        key_mask = key_mask.contiguous()
    out = torch.empty(batch, q.shape[1], dtype=q.dtype, device=q.device)
    shared = source is not None and shared_slots is not None
    _kernel()[(batch, kv_heads)](
        q, keys, values, key_mask, cache_position, source if shared else cache_position,
        shared_slots if shared else cache_position, out, length, scale,
        q.stride(0), keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1),
        values.stride(2), key_mask.stride(0), out.stride(0),
        GROUPS=groups, D=dim, D_PAD=max(16, 1 << (dim - 1).bit_length()), BLOCK_L=block_l,
        GROUP_PAD=max(GROUP_PAD, 1 << (groups - 1).bit_length()),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SHARED=shared, num_warps=num_warps,
        **({"num_stages": num_stages} if num_stages else {}))  # 0: Triton's default
    return out


@functools.cache
def _op():
    """Register the custom op, once, at the first use (importing the kit registers nothing)."""

    @torch.library.custom_op(f"{_NAMESPACE}::decode_attention", mutates_args=())
    def op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor,
           cache_position: torch.Tensor, scale: float, block_l: int, num_warps: int, num_stages: int,
           source: Optional[torch.Tensor], shared_slots: Optional[torch.Tensor]) -> torch.Tensor:  # noqa: UP045
        # (``Optional``: the schema inference of older torch releases does not read ``X | None``)
        return _launch(q, keys, values, key_mask, cache_position, scale, block_l, num_warps, num_stages, source,
                       shared_slots)

    @op.register_fake
    def _(q, keys, values, key_mask, cache_position, scale, block_l, num_warps, num_stages, source, shared_slots):
        return q.new_empty(q.shape)

    global _OP
    _OP = getattr(torch.ops, _NAMESPACE).decode_attention
    return _OP


_OP = None  # the registered op (set by _op(): the compiled step reads this global, never the cached call)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor,
                     cache_position: torch.Tensor, scale: float, block_l: int = 64,
                     num_warps: int = 4, num_stages: int = 0, source: torch.Tensor | None = None,
                     shared_slots: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per row over the static cache, slots ``0 .. cache_position`` only.

    ``q``: ``[B, heads * D]`` (or any shape of ``B`` rows in that order, e.g. the fused step's
    ``[B, heads, 1, D]``); ``keys`` / ``values``: ``[B, kv_heads, L, D]``; ``key_mask``: ``[B, L]``,
    nonzero where a slot holds a real token of the row; ``cache_position``: ``[1]`` integer, the new
    token's slot. Query head ``j`` reads K/V head ``j // (heads / kv_heads)``. Returns ``[B, heads * D]``
    in ``q``'s dtype: ``softmax(q k^T * scale)`` in fp32, cast to the value dtype, times ``v``.
    ``block_l``, ``num_warps``, ``num_stages`` (0: Triton's default): the launch's settings, which
    ``benchmarks/decode_attention.py --configs`` times. ``source`` (``[B]`` integer) and ``shared_slots`` (``[1]``
    integer), both or neither: row ``b`` reads slots ``0 .. shared_slots - 1`` from row ``source[b]``'s cache instead of
    its own; the caller vouches that they hold the same keys and values there (a prompt's G copies, prefilled
    once). The result is the same; the reads of one prompt's slots come from one place, which rows running
    side by side then find in the L2 cache.
    """
    q = q.reshape(q.shape[0], -1)
    op = _OP if _OP is not None else _op()
    if (source is None) != (shared_slots is None):
        raise ValueError("decode_attention: pass source and shared_slots together, or neither")
    return op(q, keys, values, key_mask, cache_position, float(scale), int(block_l), int(num_warps), int(num_stages),
              source, shared_slots)
