"""Prototype Triton skinny GEMM ``y = x @ W.T (+ bias)`` for M <= 16 decode rows (issue-16 follow-up).

W is [N, K] row-major (nn.Linear layout). Each program reads a [BLOCK_N, BLOCK_K] tile of W per step along
its K range (contiguous along K, so coalesced), and computes ``tl.dot(W_tile, x_tile^T)`` into an fp32
[BLOCK_N, 16] accumulator ("swap AB": N takes the MMA's large M slot, the <= 16 rows of x are padded to 16
with masked loads). With SPLIT_K > 1 the grid is (N tiles, SPLIT_K) and each program writes its fp32 partial
to a [SPLIT_K, M, N] workspace, which is then reduced in a fixed order (deterministic) in one of two ways:
  reduce="kernel": a second tiny kernel sums the partials, adds the bias, casts (two launches, no state);
  reduce="fixup":  one launch; each program bumps a per-N-tile counter and the last one to arrive sums the
                   partials and resets the counter (the counter buffer is zero between calls).
Neither uses tl.atomic_add on the output: fp32 atomics would need a zeroed buffer plus a cast kernel (three
launches) and would make the summation order, hence the bf16 rounding, nondeterministic.

  TRITON_INTERPRET=1 python benchmarks/gemv_prototype.py --check        # CPU: small shapes, interpreter
  python benchmarks/gemv_prototype.py --check                           # GPU: the real 1.5B shapes, bf16
  python benchmarks/gemv_prototype.py --bench --out results.json        # GPU only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

if "--check" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16


@triton.jit(do_not_specialize=["M"])
def _skinny_mm(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, k_per_split,
               HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, FIXUP: tl.constexpr, EVEN_K: tl.constexpr,
               UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ld = offs_n % N  # wrap instead of masking the W load; the wrapped rows are never stored
    k_start = pid_k * k_per_split
    w_ptrs = w_ptr + n_ld[:, None] * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    m_mask = offs_m < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kk in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0, eviction_policy="evict_last")
        else:
            k_mask = (k_start + kk + offs_k) < K
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_last")
        if UPCAST:  # the Triton interpreter's bf16 tl.dot is wrong; bf16*bf16 is exact in fp32 anyway
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out_mask = (offs_n < N)[:, None] & m_mask[None, :]
    mn = offs_m[None, :] * N + offs_n[:, None]  # y and the partials are contiguous [.., M, N]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n_ld).to(tl.float32)[:, None]
        tl.store(y_ptr + mn, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(part_ptr + pid_k * M * N + mn, acc, mask=out_mask)
        if FIXUP:
            tl.debug_barrier()  # all threads' partial stores happen-before the release below
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                tl.debug_barrier()
                tot = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in range(SPLIT_K):  # fixed order: same rounding whichever program arrives last
                    tot += tl.load(part_ptr + s * M * N + mn, mask=out_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    tot += tl.load(b_ptr + n_ld).to(tl.float32)[:, None]
                tl.store(y_ptr + mn, tot.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)


@triton.jit
def _splitk_reduce(part_ptr, b_ptr, y_ptr, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    tot = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        tot += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        tot += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, tot.to(y_ptr.dtype.element_ty), mask=mask)


class Cfg(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


# Qwen2.5-1.5B decode shapes: name -> (N, K, has_bias, calls per decode step)
SHAPES = {
    "qkv": (2048, 1536, True, 28),
    "o": (1536, 1536, False, 28),
    "gate_up": (17920, 1536, False, 28),
    "down": (1536, 8960, False, 28),
    "lm_head": (151936, 1536, False, 1),
}
# Hand-picked candidates per (N, K), sized for 132 SMs (H200): the small-N shapes split K so that
# 100-340 programs are in flight; K splits of down (8960 = 70 * 128) divide 70 so every split is full.
CANDIDATES = {
    (2048, 1536): [Cfg(64, 128, 4), Cfg(64, 128, 6), Cfg(32, 128, 4), Cfg(64, 64, 8, 4, 4), Cfg(128, 128, 6, 8)],
    (1536, 1536): [Cfg(64, 128, 6), Cfg(64, 128, 4), Cfg(32, 128, 4), Cfg(32, 128, 6), Cfg(64, 64, 12)],
    (17920, 1536): [Cfg(64, 128, 1, 4, 4), Cfg(32, 128, 1, 4, 4), Cfg(128, 128, 1, 8), Cfg(64, 128, 2, 4, 4),
                    Cfg(128, 64, 1, 4, 4)],
    (1536, 8960): [Cfg(64, 128, 5, 4, 4), Cfg(64, 128, 7, 4, 4), Cfg(64, 128, 10, 4, 4), Cfg(32, 128, 5, 4, 4),
                   Cfg(64, 128, 14), Cfg(128, 128, 10, 8, 4)],
    (151936, 1536): [Cfg(128, 128, 1, 4, 4), Cfg(64, 128, 1, 4, 4), Cfg(256, 64, 1, 8), Cfg(128, 256, 1, 8)],
}
TUNED: dict[tuple[int, int, int], Cfg] = {}  # (M bucket, N, K) -> best, filled by --bench's tuning
_COUNTERS: dict[str, torch.Tensor] = {}


def heuristic_cfg(N: int, K: int, sms: int = 132) -> Cfg:
    bn = 128 if N // (4 * sms) >= 128 else 64 if N // sms >= 64 else 32
    tiles = triton.cdiv(N, bn)
    bk = 128 if K >= 128 else max(16, triton.next_power_of_2(K))
    return Cfg(bn, bk, max(1, min(2 * sms // tiles, K // 256, 16)))


def skinny_linear(x, weight, bias=None, cfg: Cfg | None = None, reduce: str = "kernel"):
    """F.linear(x, weight, bias) for x with <= 16 rows (after flattening the leading dims)."""
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    assert 1 <= M <= BLOCK_M and weight.shape[1] == K, (x.shape, weight.shape)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    cfg = cfg or TUNED.get((M, N, K)) or heuristic_cfg(N, K)
    split = max(1, min(cfg.split_k, triton.cdiv(K, cfg.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_per_split)  # no empty splits
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    tiles = triton.cdiv(N, cfg.block_n)
    part = torch.empty((split, M, N), device=x.device, dtype=torch.float32) if split > 1 else y
    fixup = reduce == "fixup" and split > 1
    cnt = y
    if fixup:
        key = str(x.device)
        if key not in _COUNTERS or _COUNTERS[key].numel() < tiles:
            _COUNTERS[key] = torch.zeros(max(tiles, 4096), device=x.device, dtype=torch.int32)
        cnt = _COUNTERS[key]
    b = bias if bias is not None else y
    _skinny_mm[(tiles, split)](
        x2, weight, b, y, part, cnt, M, N, K, x2.stride(0), weight.stride(0), k_per_split,
        HAS_BIAS=bias is not None, SPLIT_K=split, FIXUP=fixup, EVEN_K=(K % k_per_split == 0),
        UPCAST=INTERPRET or x.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1 and not fixup:
        _splitk_reduce[(triton.cdiv(M * N, 1024),)](part, b, y, M * N, N, SPLIT_K=split,
                                                    HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4)
    return y.reshape(*x.shape[:-1], N)


# ---------------------------------------------------------------- --check
def check(device: str) -> int:
    real = [(n, k, bias, CANDIDATES[(n, k)]) for (n, k, bias, _) in SHAPES.values()]
    # the five shapes scaled down (same block/split structure), then odd shapes (N, K not block multiples)
    small = [(256, 256, True, [Cfg(64, 128, 2), Cfg(32, 64, 4)]),    # qkv-like, split-K
             (192, 256, False, [Cfg(64, 128, 2), Cfg(32, 64, 3)]),   # o-like, split-K
             (320, 128, False, [Cfg(64, 128, 1), Cfg(128, 64, 1)]),  # gate_up-like
             (128, 1120, False, [Cfg(64, 128, 5), Cfg(32, 64, 7)]),  # down-like: 1120 = 5 * 224
             (1000, 128, False, [Cfg(128, 128, 1)]),                 # lm_head-like, N % 128 != 0
             (77, 203, True, [Cfg(32, 64, 3), Cfg(64, 128, 1)]), (5, 33, False, [Cfg(16, 16, 2)]),
             (300, 1000, True, [Cfg(64, 128, 4), Cfg(32, 256, 3)]), (129, 48, False, [Cfg(64, 32, 1)])]
    if device == "cuda":
        plan = [(torch.bfloat16, [1, 8, 16], real + small)]
    else:  # interpreter: the real shapes (bf16, M=8 only: ~2 min), the small ones at every M in both dtypes
        plan = [(dt, [1, 5, 8, 16], small) for dt in (torch.float32, torch.bfloat16)]
        plan.append((torch.bfloat16, [8], real))
    gen = torch.Generator(device=device).manual_seed(0)
    fails = n_runs = 0
    t0 = time.time()
    for dtype, ms, cases in plan:
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.5e-2)
        for N, K, has_bias, cfgs in cases:
            w = (torch.randn(N, K, device=device, generator=gen) / K**0.5).to(dtype)
            b0 = torch.randn(N, device=device, generator=gen).to(dtype)
            for M in ms + ([3, 13] if (N, K) == (77, 203) else []):
                x = torch.randn(M, K, device=device, generator=gen).to(dtype)
                for bias in ([b0, None] if has_bias or (N, K) == (77, 203) else [None]):
                    ref = F.linear(x, w, bias).float()
                    for cfg in cfgs + [None]:
                        for reduce in ("kernel", "fixup"):
                            if reduce == "fixup" and (cfg is None or cfg.split_k == 1):
                                continue
                            y = skinny_linear(x, w, bias, cfg, reduce).float()
                            n_runs += 1
                            try:
                                torch.testing.assert_close(y, ref, **tol)
                            except AssertionError as e:
                                fails += 1
                                print(f"FAIL {dtype} M={M} N={N} K={K} bias={bias is not None} {cfg} {reduce}:"
                                      f" {str(e).splitlines()[-2:]}")
        print(f"  {dtype} M in {ms} (+3, 13 for 77x203): {len(cases)} shapes, {time.time() - t0:.0f} s", flush=True)
    print(f"--check on {device} ({'TRITON_INTERPRET=1' if INTERPRET else 'compiled'}): {n_runs} runs, "
          f"{fails} failures, {time.time() - t0:.0f} s")
    return 1 if fails else 0


# ---------------------------------------------------------------- --bench
def graph_ms(calls, iters):
    """Capture all calls in one CUDA graph, replay `iters` times, return ms per replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    del g
    return a.elapsed_time(b) / iters


def _eager_ms(calls, iters):
    for c in calls:
        c()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        for c in calls:
            c()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def _binder(x, ws, bias, reps):
    """calls(f) -> `reps` zero-arg calls of f, cycling through the weight copies (no L2 reuse)."""
    order = [ws[i % len(ws)] for i in range(reps)]
    return lambda f: [lambda w=w: f(x, w, bias) for w in order]


def _linear(x, w, b):
    return F.linear(x, w, b)


def _inductor_opts(opts):
    """The subset of `opts` ("triton.x": v) that this torch's inductor config has."""
    import torch._inductor.config as ic

    return {k: v for k, v in opts.items() if hasattr(ic.triton, k.split(".", 1)[1])}


def bench(args, dev: str = "cuda") -> None:
    import torch._inductor.config  # noqa: F401  (config.patch below)

    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    shapes = {k: v for k, v in SHAPES.items() if k in args.shapes.split(",")}
    ms_list = [int(m) for m in args.m.split(",")]
    reps = args.reps
    inductor_variants = {} if args.no_compile else {
        "compile_max_autotune": {},
        # decompose_k (bmm over K splits + sum) is only offered for aten.mm when K >= thr*M and K >= thr*N;
        # the default thr 32 excludes every shape here; thr 0 lets down_proj (K/N = 5.8) get splits 2, 4, 5.
        "compile_decomposeK_tma": {"triton.decompose_k_threshold": 0, "triton.num_decompose_k_splits": 10,
                                   "triton.enable_persistent_tma_matmul": True},
    }
    rows, res = [], {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "triton": triton.__version__, "sms": sms, "reps": reps, "iters": args.iters, "shapes": {}}
    inductor_variants = {k: _inductor_opts(o) for k, o in inductor_variants.items()}
    res["inductor_options_applied"] = inductor_variants
    for name, (N, K, has_bias, per_step) in shapes.items():
        copies = reps if N * K * 2 * reps <= 4e9 else 2  # lm_head (0.47 GB) is larger than L2 anyway
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K**0.5 for _ in range(copies)]
        bias = torch.randn(N, device=dev, dtype=torch.bfloat16) if has_bias else None
        gb = N * K * 2 / 1e9
        for M in ms_list:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            calls = _binder(x, ws, bias, reps)
            entry, cands = {}, {}
            cfgs = CANDIDATES.get((N, K), [heuristic_cfg(N, K, sms)])
            for reduce in ("kernel", "fixup"):
                best = None
                for cfg in cfgs:
                    try:
                        t = graph_ms(calls(lambda a, w, b, c=cfg, r=reduce: skinny_linear(a, w, b, c, r)),
                                      args.iters) / reps
                    except Exception as e:  # e.g. out of shared memory for a large tile on this GPU
                        cands[f"{reduce}:{tuple(cfg)}"] = f"{type(e).__name__}: {str(e)[:200]}"
                        continue
                    cands[f"{reduce}:{tuple(cfg)}"] = t
                    if best is None or t < best[0]:
                        best = (t, cfg)
                if best is None:
                    continue
                if reduce == "kernel":
                    TUNED[(M, N, K)] = best[1]
                y = skinny_linear(x, ws[0], bias, best[1], reduce)
                err = (y.float() - F.linear(x, ws[0], bias).float()).abs().max().item()
                entry[f"triton_{reduce}"] = {"cfg": best[1]._asdict(), "max_abs_err_vs_cublas": err}
            methods = {"cublas": F.linear}
            methods.update({f"triton_{r}": (lambda a, w, b, c=entry[f"triton_{r}"]["cfg"], r=r:
                                            skinny_linear(a, w, b, Cfg(**c), r))
                            for r in ("kernel", "fixup") if f"triton_{r}" in entry})
            if M in [int(v) for v in args.compile_m.split(",")]:
                methods.update(dict.fromkeys(inductor_variants))
            for meth, f in methods.items():
                t0 = time.time()
                try:
                    with torch._inductor.config.patch(inductor_variants.get(meth, {})):
                        if f is None:  # fresh dynamo cache: the variants share _linear's code object
                            torch._dynamo.reset()
                            f = torch.compile(_linear, mode="max-autotune-no-cudagraphs", dynamic=False)
                        g_ms = graph_ms(calls(f), args.iters) / reps
                        e_ms = _eager_ms(calls(f), max(1, args.iters // 4)) / reps
                except Exception as e:  # an inductor variant may fail to compile on this torch
                    entry[meth] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    continue
                entry.setdefault(meth, {}).update(graph_ms=g_ms, eager_ms=e_ms, graph_gbps=gb / g_ms * 1e3,
                                                  setup_s=time.time() - t0)
            base = entry["cublas"]["graph_ms"]
            for meth, e in entry.items():
                if "graph_ms" in e:
                    e["speedup_vs_cublas"] = base / e["graph_ms"]
                    rows.append((name, M, meth, e))
            entry["candidates_graph_ms"] = cands
            res["shapes"].setdefault(name, {"N": N, "K": K, "bias": has_bias, "per_step": per_step,
                                            "weight_gb": gb, "weight_copies": copies})[f"M{M}"] = entry
            print(f"done {name} M={M}: " + ", ".join(f"{meth} {e['graph_ms'] * 1e3:.2f} us ({e['graph_gbps']:.0f} GB/s)"
                                                     for meth, e in entry.items() if "graph_ms" in e), flush=True)
        del ws
        torch.cuda.empty_cache()
    print("\n| shape | M | method | graph ms/call | GB/s (graph) | eager ms/call | speedup vs cuBLAS |")
    print("|---|---|---|---|---|---|---|")
    for name, M, meth, e in rows:
        print(f"| {name} | {M} | {meth} | {e['graph_ms'] * 1e3:.2f} us | {e['graph_gbps']:.0f} | "
              f"{e['eager_ms'] * 1e3:.2f} us | {e['speedup_vs_cublas']:.2f} |")
    floor_ms = sum(N * K * 2 * p for N, K, _, p in SHAPES.values()) / 4.8e12 * 1e3
    res["floor_ms_4p8TBs"], res["step"] = floor_ms, {}
    print(f"\nDecode step = 28 x (qkv + o + gate_up + down) + lm_head, from graph ms/call; "
          f"floor {floor_ms:.3f} ms at 4.8 TB/s (profile's param floor 0.66 ms)\n")
    print("| M | method | step matmul ms | x floor |\n|---|---|---|---|")
    for M in ms_list:
        per = [res["shapes"].get(s, {}).get(f"M{M}", {}) for s in SHAPES]
        for meth in per[0]:
            if all("graph_ms" in e.get(meth, {}) for e in per):
                step = sum(e[meth]["graph_ms"] * SHAPES[s][3] for s, e in zip(SHAPES, per, strict=True))
                res["step"][f"M{M}:{meth}"] = step
                print(f"| {M} | {meth} | {step:.3f} | {step / floor_ms:.2f} |")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
        print(f"wrote {args.out}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--m", default="8,1,16", help="rows per matmul to bench")
    p.add_argument("--compile-m", default="8", help="M values that also get the torch.compile columns")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile columns")
    p.add_argument("--reps", type=int, default=28, help="calls per captured graph (distinct weight copies)")
    p.add_argument("--iters", type=int, default=50, help="graph replays per timing")
    args = p.parse_args()
    if args.check:
        rc = check("cuda" if torch.cuda.is_available() else "cpu")
        if rc or not args.bench:
            return rc
    if args.bench:
        if not torch.cuda.is_available():
            print("--bench needs CUDA")
            return 2
        bench(args)
        return 0
    p.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
