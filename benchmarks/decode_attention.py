"""The fused decode step's attention: the Triton kernel (grpo_patches/generation/decode_attention.py, which
reads the cache slots up to ``cache_position`` only) against the matmul path it replaces (two batched matmuls
and an fp32 softmax over the whole static cache, compiled by inductor as the compiled step runs it).

  python benchmarks/decode_attention.py --check --bench --out FILE   # GPU: 1.5B shapes, fp32 and bf16
  python benchmarks/decode_attention.py --tiny                       # CPU: Triton's interpreter, small shapes

``--check`` compares the kernel with the matmul path's arithmetic (``reference``): bf16 within 2e-2, fp32
within 1e-4 (relative to the largest output), positions at the start, middle and end of a 384-slot cache,
each row left-padded (on CPU: the small shapes in fp32 only; the interpreter's bf16 ``tl.dot`` is not
faithful). ``--bench`` captures 28 calls (one per layer, each with its own caches, so L2 holds
none of them across the graph) in one CUDA graph and reports ms per 28 calls (one decode step's attention)
for the matmul path and for the kernel at a few block sizes / warp counts, at batch 8, 64, 192 and 1024,
with a 384-slot cache and the new token at slot 64 + {16, 128, 255} (a 64-token prompt, 256 new tokens).
The kernel's time grows with the position and the matmul path's does not: the average over positions
64..319 is interpolated from the three, and the smallest batch whose best kernel average beats the matmul
path is the candidate for ``decode_attention.KERNEL_MIN_BATCH``. ``--tiny`` runs both on CPU (the kernel
interpreted, no CUDA graph, eager timings that mean nothing) to smoke-test the script. ``--group G`` also times
the kernel (``shared_kernel_*``) on the same caches with each run of G rows holding one prompt's slots and
reading them from the run's first row (GRPO's G completions of a prompt).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if "--tiny" in sys.argv or not torch.cuda.is_available():  # before Triton is imported: CPU tensors run in
    os.environ.setdefault("TRITON_INTERPRET", "1")  # its interpreter (importing torch does not import Triton)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from grpo_patches.generation import decode_attention as attn  # noqa: E402
from grpo_patches.generation.fused import attention_bias, matmul_attention  # noqa: E402

ITERS = 200  # graph replays per timing
CONFIGS = ((64, 4, 0), (128, 4, 0), (64, 8, 0), (32, 4, 0))  # kernel (block_l, num_warps, num_stages; 0: Triton's)


def reference(q, keys, values, key_mask, cache_position, scale):
    """The fused step's matmul path (grpo_patches/generation/fused.py) on q ``[B, heads * D]``."""
    return matmul_attention(q, keys, values, attention_bias(key_mask, cache_position, q.dtype), scale)


def inputs(batch, heads, kv_heads, dim, length, pos, dtype, device, seed=0):
    """q, caches, key mask (each row left-padded by 0 .. pos // 2 slots), cache_position, scale."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, heads * dim, generator=g, device=device).to(dtype)
    keys = torch.randn(batch, kv_heads, length, dim, generator=g, device=device).to(dtype)
    values = torch.randn(batch, kv_heads, length, dim, generator=g, device=device).to(dtype)
    pad = torch.randint(0, max(pos // 2, 1), (batch,), generator=g, device=device)
    key_mask = torch.arange(length, device=device)[None, :] >= pad[:, None]
    return q, keys, values, key_mask, torch.tensor([pos], device=device), dim ** -0.5


def check(device: str, tiny: bool) -> int:
    if tiny:
        dtypes, shapes = [torch.float32], [(2, 4, 2, 16, 48, p) for p in (0, 21, 47)] + [(3, 6, 1, 32, 70, 40)]
        blocks = {torch.float32: (16, 64)}
    else:
        dtypes = [torch.float32, torch.bfloat16]
        shapes = ([(8, 12, 2, 128, 384, p) for p in (0, 1, 64, 80, 200, 319, 382, 383)]
                  + [(1, 12, 2, 128, 384, 100), (16, 12, 2, 128, 320, 150), (192, 12, 2, 128, 384, 255)])
        blocks = {torch.float32: (64,), torch.bfloat16: (32, 64, 128)}
    failures = 0
    for dtype in dtypes:
        for shape in shapes:
            for block in blocks[dtype]:
                args = inputs(*shape, dtype=dtype, device=device)
                got = attn.decode_attention(*args, block_l=block).float()
                want = reference(*args).float()
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
                err = (got - want).abs().max().item()
                ok = err <= tol * max(1.0, want.abs().max().item())
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {str(dtype):15s} shape={shape} block={block} max|err|={err:.2e}")
    print(f"--check on {device}: {failures} failures", flush=True)
    return failures


def graph_ms(calls, iters=ITERS):
    """Capture all calls in one CUDA graph, replay ``iters`` times, return ms per replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    del graph
    return a.elapsed_time(b) / iters


def eager_ms(calls, iters=2):
    for c in calls:
        c()
    started = time.perf_counter()
    for _ in range(iters):
        for c in calls:
            c()
    return (time.perf_counter() - started) * 1e3 / iters


def average_over(prompt: int, new: int, points: dict[int, float]) -> float:
    """Mean over positions prompt .. prompt + new - 1 of the piecewise-linear curve through ``points``
    (extended linearly past the first and the last)."""
    xs = sorted(points)

    def at(p):
        i = 0 if p <= xs[1] else min(len(xs) - 2, next(j for j in range(len(xs) - 1) if p <= xs[j + 1]))
        x0, x1 = xs[i], xs[i + 1]
        return points[x0] + (points[x1] - points[x0]) * (p - x0) / (x1 - x0)

    return sum(at(p) for p in range(prompt, prompt + new)) / new


def share_prompt(args: tuple, group: int, prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Make each run of ``group`` rows of ``inputs``' caches hold its first row's ``prompt`` slots (a prompt's G
    completions, prefilled once); returns the kernel's ``source`` and ``shared_slots``."""
    q, keys, values, key_mask, position, _ = args
    source = torch.arange(q.shape[0], device=q.device) // group * group
    keys[:, :, :prompt] = keys[source, :, :prompt]
    values[:, :, :prompt] = values[source, :, :prompt]
    key_mask[:, :prompt] = key_mask[source, :prompt]
    return source, torch.tensor([prompt], device=q.device)


def bench(device: str, tiny: bool, configs: tuple = CONFIGS, batches: tuple = (8, 64, 192, 1024),
          prompt: int = 64, group: int = 1) -> dict:
    if tiny:
        batches, layers, (heads, kv_heads, dim), length, prompt, new = (2, 4), 2, (4, 2, 16), 48, 8, 32
        dtype, timer, configs, compiled = torch.float32, eager_ms, configs[:2], reference
    else:
        layers, (heads, kv_heads, dim), new = 28, (12, 2, 128), 256
        length = prompt + new + 64  # the bucketed static cache: 384 slots for 64-token prompts
        dtype, timer = torch.bfloat16, graph_ms
        compiled = torch.compile(reference, dynamic=False)
    positions = (prompt + new // 16, prompt + new // 2, prompt + new - 1)
    rows, summary = [], []
    for batch in batches:
        caches = [inputs(batch, heads, kv_heads, dim, length, positions[0], dtype, device, seed=i)
                  for i in range(layers)]
        shared = [share_prompt(a, group, prompt) for a in caches] if group > 1 else []
        times: dict[str, dict[int, float]] = {}
        for pos in positions:
            for args in caches:
                args[4].fill_(pos)
            row = {"batch": batch, "cache_slots": length, "position": pos}
            row["matmul_ms"] = timer([lambda a=a: compiled(*a) for a in caches])
            for block, warps, stages in configs:
                row[f"kernel_b{block}_w{warps}" + (f"_s{stages}" if stages else "") + "_ms"] = timer(
                    [lambda a=a, bl=block, w=warps, st=stages: attn.decode_attention(*a, block_l=bl, num_warps=w,
                                                                                     num_stages=st)
                     for a in caches])
                if shared:  # the same caches, each run of ``group`` rows reading the prompt from its first row
                    row[f"shared_kernel_b{block}_w{warps}" + (f"_s{stages}" if stages else "") + "_ms"] = timer(
                        [lambda a=a, sh=sh, bl=block, w=warps, st=stages: attn.decode_attention(
                            *a, block_l=bl, num_warps=w, num_stages=st, source=sh[0], shared_slots=sh[1])
                         for a, sh in zip(caches, shared, strict=True)])
            for key, value in row.items():
                if key.endswith("_ms"):
                    times.setdefault(key, {})[pos] = value
            print(json.dumps(row), flush=True)
            rows.append(row)
        averages = {key: average_over(prompt, new, points) for key, points in times.items()}
        best = min((k for k in averages if "kernel" in k), key=averages.get)
        line = {"batch": batch, "average_positions": [prompt, prompt + new - 1],
                **{f"avg_{k}": round(v, 4) for k, v in averages.items()}, "best_kernel": best,
                "saving_ms_per_step": round(averages["matmul_ms"] - averages[best], 4)}
        print(json.dumps(line), flush=True)
        summary.append(line)
        del caches
    pays = [s["batch"] for s in summary if s["saving_ms_per_step"] > 0]
    first = next((b for b in batches if all(p in pays for p in batches if p >= b)), None)
    print(f"the kernel pays from batch {first} on (of {list(batches)}; KERNEL_MIN_BATCH is "
          f"{attn.KERNEL_MIN_BATCH})", flush=True)
    return {"layers": layers, "dtype": str(dtype), "shapes": {"heads": heads, "kv_heads": kv_heads, "head_dim": dim},
            "rows": rows, "averages": summary, "kernel_pays_from_batch": first}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="kernel vs the matmul path's arithmetic")
    p.add_argument("--bench", action="store_true", help="ms per 28 layers in one CUDA graph (GPU)")
    p.add_argument("--tiny", action="store_true", help="small shapes on CPU, the kernel in Triton's interpreter")
    p.add_argument("--out", help="write the results here (JSON)")
    p.add_argument("--configs", default=",".join("x".join(map(str, c)) for c in CONFIGS),
                   help="kernel configs BLOCK_LxNUM_WARPSxNUM_STAGES (0 stages: Triton's default), comma list")
    p.add_argument("--batches", default="8,64,192,1024", help="GPU batches, comma list")
    p.add_argument("--prompt", type=int, default=64, help="GPU: prompt tokens before the 256 new ones")
    p.add_argument("--group", type=int, default=1,
                   help="also time the kernel with each run of GROUP rows reading the prompt's slots from its first row")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if not attn.available():
        print("Triton (or torch.library.custom_op) is missing: nothing to run")
        return 1
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("on CPU the kernel runs in Triton's interpreter: use --tiny or --check (or TRITON_INTERPRET=1)")
        return 1
    started = time.perf_counter()
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
                    "torch": torch.__version__}
    import triton

    result["triton"] = triton.__version__
    failures = check(device, args.tiny or device == "cpu") if (args.check or args.tiny) else 0  # CPU: fp32 only
    result["check_failures"] = failures
    if (args.bench or args.tiny) and not failures:
        if device == "cpu" and not args.tiny:
            print("--bench needs CUDA (--tiny runs its code on CPU)")
        else:
            configs = tuple(tuple(int(x) for x in (c.split("x") + ["0"])[:3]) for c in args.configs.split(","))
            result["bench"] = bench(device, args.tiny, configs, tuple(int(b) for b in args.batches.split(",")),
                                    args.prompt, args.group)
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(f"done in {result['seconds']} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
