"""The LoRA dropout fused into ``lora_A``: the op (grpo_patches/lora_dropout.py, one Triton kernel that draws the
mask from a seed and stores none) against PEFT's ``lora_A(dropout(x))``, eager and compiled.

  python benchmarks/lora_dropout.py --check --bench --out FILE   # GPU: T = 36864, K = 1536 and 8960, R = 16
  python benchmarks/lora_dropout.py --sweep                      # GPU: the op's time per tile config
  python benchmarks/lora_dropout.py --tiny                       # CPU: Triton's interpreter, small shapes

``--check`` runs the op forward and backward at T = 36864 tokens (128 x 288), K = 1536 (the attention
projections' and up / gate's input) and 8960 (down's), R = 16, bf16 and fp32, and compares ``u``, ``grad_x`` and
``grad_A`` with plain torch math on the same mask (:func:`grpo_patches.lora_dropout.keep_mask`, computed in torch
on the GPU): the maximum error relative to the largest reference value, and the keep rate against ``1 - p``.
``--bench`` times, at those shapes in bf16 with p = 0.05, forward and forward + backward of (a) PEFT's path as the
lean layers run it under bf16 autocast (``lora_A(dropout(x))``, an fp32 ``nn.Linear``), eager; (b) the same
compiled by inductor with ``fallback_random=True`` (as ``compile_training`` compiles the layers); (c) the op,
with its seed drawn per call by ``torch.randint`` as the lean layer does, eager and (d) inside an inductor graph
(``fullgraph=True``: the op is one opaque call there). Medians of ``triton.testing.do_bench``
(L2 flushed between runs), in ms, with the HBM floor of the bytes each must move at 4.3 TB/s: the forward one
read of ``x``, forward + backward three passes (the forward's read, the backward's read of ``x`` and write of
``grad_x``). ``--sweep`` times the op's forward and backward kernels per tile config (the ``TILES`` table's
source). ``--tiny`` runs the check and the timings on CPU (the op interpreted; timings that mean nothing) to
smoke-test the script. The GPU run (--check --bench --sweep) took 40 s on an H100 (most of it compilation:
inductor's two PEFT graphs per shape, two Triton kernels per swept config). The floors are the H200's HBM rate;
on an H100 (3.35 TB/s) they are ~1.3x higher.
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

from grpo_patches import lora_dropout as ld  # noqa: E402

HBM = 4.3e12  # bytes / s (H200: 4.8 nominal; 4.3 sustained by a streaming read)
P = 0.05
RANK = 16
SWEEP = tuple((bt, bk, w, 10) for bt, bk, w in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (32, 128, 4), (128, 128, 8),
                                                 (64, 256, 8))) + ((32, 128, 4, 7),)  # (block_t, block_k, warps, Philox rounds)


def shapes(tiny: bool) -> list[tuple[int, int]]:
    return [(130, 97), (64, 64)] if tiny else [(36864, 1536), (36864, 8960)]


def reference(x: torch.Tensor, a: torch.Tensor, grad_u: torch.Tensor, seed: torch.Tensor, p: float,
              chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """u, grad_x, grad_A in plain torch from keep_mask (in fp32 from the dropped input rounded to x's dtype,
    as autocast's matmuls see it), row chunk by row chunk; and the keep rate."""
    rows, k = x.shape
    a_in = a.to(x.dtype).float()
    scale = 1.0 / (1.0 - p)
    u = torch.empty(rows, a.shape[0], device=x.device)
    grad_x = torch.empty(rows, k, device=x.device)
    grad_a = torch.zeros(a.shape, device=x.device)
    kept = 0
    with torch.autocast(x.device.type, enabled=False):
        for t0 in range(0, rows, chunk):
            keep = ld.keep_mask(seed, min(chunk, rows - t0), k, p, first_row=t0, device=x.device)
            kept += int(keep.sum())
            dropped = torch.where(keep, x[t0:t0 + chunk].float() * scale, 0.0).to(x.dtype).float()
            gu = grad_u[t0:t0 + chunk].float()
            u[t0:t0 + chunk] = dropped @ a_in.T
            grad_x[t0:t0 + chunk] = torch.where(keep, (gu @ a_in) * scale, 0.0)
            grad_a += gu.T @ dropped
    return u, grad_x, grad_a, kept / (rows * k)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def check(device: str, tiny: bool) -> tuple[int, list[dict]]:
    torch.backends.cuda.matmul.allow_tf32 = False
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
    failures, rows_out = 0, []
    for rows, k in shapes(tiny):
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.Generator(device=device).manual_seed(rows + k)
            x = torch.randn(rows, k, device=device, generator=g).to(dtype).requires_grad_()
            a = (torch.randn(RANK, k, device=device, generator=g) * k ** -0.5).requires_grad_()
            grad_u = torch.randn(rows, RANK, device=device, generator=g).to(dtype)
            seed = torch.tensor([987654321], device=device)
            u = ld.dropout_lora_a(x, a, P, seed)
            u.backward(grad_u)
            want_u, want_gx, want_ga, rate = reference(x.detach(), a.detach(), grad_u, seed, P)
            # the mask's keep rate: within 5 sigma of 1 - p (binomial over rows * k draws)
            sigma = (P * (1 - P) / (rows * k)) ** 0.5
            errors = {"u": rel(u, want_u), "grad_x": rel(x.grad, want_gx), "grad_A": rel(a.grad, want_ga)}
            ok = all(e <= tolerance[dtype] for e in errors.values()) and abs(rate - (1 - P)) <= 5 * sigma
            ok = ok and u.dtype == x.grad.dtype == dtype and a.grad.dtype == torch.float32
            failures += not ok
            row = {"T": rows, "K": k, "R": RANK, "dtype": str(dtype).split(".")[-1], "keep_rate": rate,
                   **{f"rel_err_{n}": e for n, e in errors.items()}, "ok": ok}
            rows_out.append(row)
            print(f"check T={rows} K={k} R={RANK} {row['dtype']:8s} keep {rate:.6f} (1-p {1 - P})  "
                  + "  ".join(f"{n} {e:.2e}" for n, e in errors.items()) + ("" if ok else "  FAIL"), flush=True)
    return failures, rows_out


def timer(tiny: bool):
    if tiny:
        def run(fn, reps=2):
            fn()
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - start) / reps * 1e3
        return run
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median")


def bench_shape(device: str, rows: int, k: int, measure) -> dict:
    dtype = torch.bfloat16
    x = torch.randn(rows, k, device=device, dtype=dtype, requires_grad=True)
    lora_a = torch.nn.Linear(k, RANK, bias=False, device=device)  # fp32, as PEFT keeps the adapter
    dropout = torch.nn.Dropout(P)
    grad_u = torch.randn(rows, RANK, device=device, dtype=dtype)

    def peft():
        return lora_a(dropout(x))

    def fused():
        seed = torch.randint(0, 2**31 - 1, (1,), device=x.device)
        return ld.dropout_lora_a(x, lora_a.weight, P, seed)

    def forward(fn):
        with torch.autocast(device, dtype=dtype), torch.no_grad():
            fn()

    def both(fn):
        x.grad = lora_a.weight.grad = None
        with torch.autocast(device, dtype=dtype):
            u = fn()
        u.backward(grad_u)

    options = {"fallback_random": True}
    compiled = torch.compile(peft, options=options) if device == "cuda" else peft
    fused_compiled = torch.compile(fused, options=options, fullgraph=True) if device == "cuda" else fused
    row = {"T": rows, "K": k, "R": RANK, "dtype": "bfloat16", "p": P}
    for name, fn in (("peft_eager", peft), ("peft_compiled", compiled), ("op", fused), ("op_compiled", fused_compiled)):
        row[f"{name}_fwd_ms"] = measure(lambda fn=fn: forward(fn))
        row[f"{name}_fwd_bwd_ms"] = measure(lambda fn=fn: both(fn))
    row["floor_fwd_ms"] = rows * k * x.element_size() / HBM * 1e3
    row["floor_fwd_bwd_ms"] = 3 * row["floor_fwd_ms"]
    return row


def bench(device: str, tiny: bool) -> list[dict]:
    measure = timer(tiny)
    out = [bench_shape(device, rows, k, measure) for rows, k in shapes(tiny)]
    names = ("peft_eager", "peft_compiled", "op", "op_compiled", "floor")
    print(f"\n{'T':>6} {'K':>5}  " + "  ".join(f"{n + ' fwd':>18} {n + ' f+b':>18}" for n in names))
    for row in out:
        print(f"{row['T']:>6} {row['K']:>5}  " + "  ".join(
            f"{row[n + '_fwd_ms']:>18.3f} {row[n + '_fwd_bwd_ms']:>18.3f}" for n in names))
    print("(ms, medians; floor: HBM bytes at 4.3 TB/s: fwd one read of x, f+b three passes)", flush=True)
    return out


def sweep_shape(device: str, rows: int, k: int, configs, measure) -> list[dict]:
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    a = torch.randn(RANK, k, device=device)
    grad_u = torch.randn(rows, RANK, device=device, dtype=torch.bfloat16)
    seed = torch.tensor([5], device=device)
    out = []
    for tiles in configs:
        row = {"T": rows, "K": k, "tiles": list(tiles)}
        try:
            row["fwd_ms"] = measure(lambda tiles=tiles: ld._forward(x, a, seed, P, *tiles))
            row["bwd_ms"] = measure(lambda tiles=tiles: ld._backward(grad_u, x, a, seed, P, *tiles))
        except Exception as exc:  # noqa: BLE001 - a config that fails (registers, shared memory) is recorded
            row["error"] = repr(exc)[:200]
            print(f"sweep T={rows} K={k} tiles={tiles}: {row['error']}", flush=True)
            out.append(row)
            continue
        out.append(row)
        print(f"sweep T={rows} K={k} tiles (block_t, block_k, warps, rounds)={tiles}: fwd {row['fwd_ms']:.3f} ms  "
              f"bwd {row['bwd_ms']:.3f} ms", flush=True)
    return out


def sweep(device: str, tiny: bool) -> list[dict]:
    """The op's forward and backward (its two kernels, called directly) per tile config, bf16."""
    configs = SWEEP[:2] if tiny else SWEEP
    return [row for rows, k in shapes(tiny) for row in sweep_shape(device, rows, k, configs, timer(tiny))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="CPU, Triton's interpreter, small shapes")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    tiny = args.tiny or not torch.cuda.is_available()
    device = "cpu" if tiny else "cuda"
    if tiny and not (args.check or args.bench or args.sweep):
        args.check = args.bench = args.sweep = True
    if not ld.prepare():
        print("grpo_patches.lora_dropout: Triton is not available", file=sys.stderr)
        return 2
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreted)",
                    "torch": torch.__version__}
    failures = 0
    if args.check:
        failures, result["check"] = check(device, tiny)
    if args.bench:
        result["bench"] = bench(device, tiny)
    if args.sweep:
        result["sweep"] = sweep(device, tiny)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
