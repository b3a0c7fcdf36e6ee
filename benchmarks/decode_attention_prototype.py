"""Prototype: one Triton kernel for the fused decode step's attention over the static cache (issue 16).

The fused step (`grpo_patches/generation/fused.py`) attends with three kernels per layer: the QK matmul of
each K/V head's query heads against its cache, an fp32 softmax (inductor fuses the scale and the key mask
into it), the PV matmul. At 8 rows and a few hundred cache slots each is a small launch (~8 us a layer
together on the H200 profile). This kernel does it in one: a program per (row, K/V head) loads the
``groups`` query heads of that K/V head (padded to 16 rows for ``tl.dot``), walks the cache in blocks with
an online softmax in fp32, and writes the heads' outputs in transformers' layout ``[B, 1, heads * D]``.

  TRITON_INTERPRET=1 python benchmarks/decode_attention_prototype.py --check   # CPU, the interpreter (fp32)
  python benchmarks/decode_attention_prototype.py --check --bench --out FILE   # GPU: 1.5B shapes, bf16

``--bench`` captures 28 calls (one per layer, each with its own cache, so L2 holds none of them across the
graph) in one CUDA graph, for the kernel and for the fused step's own arithmetic compiled by inductor (the
baseline: what the step runs today), and reports ms per 28 calls.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if "--check" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gemv_prototype import graph_ms  # noqa: E402  (benchmarks/ is this script's sys.path[0])

GROUP_PAD = 16
ITERS = 200  # graph replays per timing


@triton.jit
def _decode_attn(q_ptr, k_ptr, v_ptr, mask_ptr, pos_ptr, o_ptr, L, scale,
                 stride_qb, stride_kb, stride_kh, stride_kl, stride_mb, stride_ob,
                 GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_L: tl.constexpr, GROUP_PAD: tl.constexpr,
                 PRECISION: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    g_ok = g < GROUPS
    # query head h * GROUPS + g of row b: q is [B, heads * D]
    q = tl.load(q_ptr + b * stride_qb + (h * GROUPS + g)[:, None] * D + d[None, :], mask=g_ok[:, None], other=0.0)
    pos = tl.load(pos_ptr)
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D), tl.float32)
    base_k = k_ptr + b * stride_kb + h * stride_kh
    base_v = v_ptr + b * stride_kb + h * stride_kh
    for start in range(0, L, BLOCK_L):
        ls = start + tl.arange(0, BLOCK_L)
        l_ok = ls < L
        k = tl.load(base_k + ls[:, None] * stride_kl + d[None, :], mask=l_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # [GROUP_PAD, BLOCK_L]
        keep = tl.load(mask_ptr + b * stride_mb + ls, mask=l_ok, other=0) != 0
        keep = keep & l_ok & (ls <= pos)
        s = tl.where(keep[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(base_v + ls[:, None] * stride_kl + d[None, :], mask=l_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m = m_new
    out = acc / total[:, None]
    tl.store(o_ptr + b * stride_ob + (h * GROUPS + g)[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=g_ok[:, None])


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor,
                     cache_position: torch.Tensor, block_l: int = 64, num_warps: int = 4,
                     num_stages: int = 2) -> torch.Tensor:
    """q [B, heads * D]; keys / values [B, kv_heads, L, D] (contiguous); key_mask [B, L] bool; cache_position
    [1] int: the slot of the new token. Returns [B, heads * D] in q's dtype."""
    batch, kv_heads, length, dim = keys.shape
    groups = q.shape[1] // (kv_heads * dim)
    out = torch.empty_like(q)
    _decode_attn[(batch, kv_heads)](
        q, keys, values, key_mask, cache_position, out, length, dim ** -0.5,
        q.stride(0), keys.stride(0), keys.stride(1), keys.stride(2), key_mask.stride(0), out.stride(0),
        GROUPS=groups, D=dim, BLOCK_L=block_l, GROUP_PAD=GROUP_PAD,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages)
    return out


def reference(q, keys, values, key_mask, cache_position):
    """The fused step's arithmetic (grpo_patches/generation/fused.py): QK, fp32 softmax with the key mask, PV."""
    batch, kv_heads, length, dim = keys.shape
    groups = q.shape[1] // (kv_heads * dim)
    visible = key_mask & (torch.arange(length, device=q.device) <= cache_position)
    bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, torch.finfo(q.dtype).min)
    qg = q.view(batch, kv_heads, groups, dim)
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * dim ** -0.5 + bias[:, None, None, :]
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values).reshape(batch, kv_heads * groups * dim)


def inputs(batch, heads, kv_heads, dim, length, pos, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(batch, heads * dim, generator=g).to(device, dtype)
    keys = torch.randn(batch, kv_heads, length, dim, generator=g).to(device, dtype)
    values = torch.randn(batch, kv_heads, length, dim, generator=g).to(device, dtype)
    pad = torch.randint(0, max(pos // 2, 1), (batch,), generator=g)  # left padding of each row
    key_mask = (torch.arange(length)[None, :] >= pad[:, None]).to(device)
    return q, keys, values, key_mask, torch.tensor([pos], device=device)


def check(device: str) -> int:
    dtypes = [torch.float32] if device == "cpu" else [torch.float32, torch.bfloat16]
    shapes = [(2, 4, 2, 16, 48, 30), (3, 6, 2, 32, 64, 63), (1, 12, 2, 128, 96, 5)] if device == "cpu" else \
        [(8, 12, 2, 128, 384, p) for p in (80, 200, 383)] + [(1, 12, 2, 128, 384, 100), (16, 12, 2, 128, 320, 150)]
    failures = 0
    for dtype in dtypes:
        for shape in shapes:
            for block in (16, 64) if device == "cpu" else ((64,) if dtype == torch.float32 else (64, 128)):
                args = inputs(*shape, dtype=dtype, device=device)
                got = decode_attention(*args, block_l=block).float()
                want = reference(*args).float()
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
                err = (got - want).abs().max().item()
                ok = err <= tol * max(1.0, want.abs().max().item())
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {str(dtype):15s} shape={shape} block={block} max|err|={err:.2e}")
    print(f"--check on {device}: {failures} failures")
    return failures


def bench(out: str | None) -> None:
    results = []
    compiled = torch.compile(reference, dynamic=False)
    for batch, length in ((8, 384), (8, 640), (192, 384)):
        layers = [inputs(batch, 12, 2, 128, length, length // 2, torch.bfloat16, "cuda", seed=i) for i in range(28)]
        row = {"batch": batch, "cache_slots": length}
        row["inductor_ms_28"] = graph_ms([lambda a=a: compiled(*a) for a in layers], ITERS)
        for block, warps in ((64, 4), (128, 4), (64, 8)):
            row[f"triton_b{block}_w{warps}_ms_28"] = graph_ms(
                [lambda a=a, bl=block, w=warps: decode_attention(*a, block_l=bl, num_warps=w) for a in layers], ITERS)
        best = min(v for k, v in row.items() if k.startswith("triton"))
        row["saving_ms_per_step"] = row["inductor_ms_28"] - best
        print(json.dumps(row), flush=True)
        results.append(row)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": results}, f, indent=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    failures = check(device) if args.check else 0
    if args.bench and device == "cuda" and not failures:
        bench(args.out)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
