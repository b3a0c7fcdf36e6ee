"""The compiled training layers' first step, cold and warm: one step in a fresh process with an empty
inductor cache, then one in another fresh process over the cache the first left (what a user's second run
meets), with the counters of inductor's and AOTAutograd's on-disk caches.

    python benchmarks/warm_start.py --tiny --out warm-cpu.json   # anywhere: the code path, small shapes
    python benchmarks/warm_start.py --out warm.json              # a GPU: 1.5B-shaped layers, 128 x 288 tokens
    python benchmarks/warm_start.py --tiny --bypass              # AOTAutograd's default: the fused gate/up bypasses it

Each step: ``--layers`` decoder layers (random weights) with the kit's pinned LoRA, ``lean_lora`` and
``compile_training`` (its fused gate/up included), gradient checkpointing on, bf16 autocast on a GPU, one
forward and backward of ``--micro-batch`` x ``--seq`` tokens. ``--bypass`` leaves AOTAutograd's setting for
custom autograd functions as torch ships it. The cache folder is a temporary one, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> dict:
    import contextlib

    import torch
    from torch._dynamo.utils import counters

    sys.path.insert(0, str(ROOT))
    from benchmarks.compiled_rng import decoder_stack
    from grpo_patches import compiled_training

    if args.bypass:
        compiled_training._cacheable_autograd_functions = contextlib.nullcontext
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    inner, cfg = decoder_stack("tiny" if args.tiny else "1.5b", args.layers, device)
    compiled_training.enable_compiled_training(inner)
    ids = torch.randint(4, cfg.vocab_size, (args.micro_batch, args.seq), device=device)
    t0 = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
        hidden = inner(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    hidden.float().pow(2).mean().backward()
    if cuda:
        torch.cuda.synchronize()
    return {"first_step_s": time.perf_counter() - t0, "aot_autograd": dict(counters["aot_autograd"]),
            "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shapes (a CPU check)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=128)
    p.add_argument("--seq", type=int, default=288)
    p.add_argument("--bypass", action="store_true", help="AOTAutograd's default for custom autograd functions")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.tiny:
        args.micro_batch, args.seq, args.layers = 2, 16, 2
    if args.child:
        print(json.dumps(child(args)))
        return
    runs = {}
    with tempfile.TemporaryDirectory(prefix="warm-start-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
        argv = [sys.executable, __file__, "--child", "--layers", str(args.layers), "--micro-batch",
                str(args.micro_batch), "--seq", str(args.seq)] + (["--tiny"] if args.tiny else []) + (
                ["--bypass"] if args.bypass else [])
        for run in ("cold", "warm"):
            done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"{run} run failed:\n{done.stderr[-3000:]}")
            runs[run] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{run}: first step {runs[run]['first_step_s']:.1f} s, AOTAutograd {runs[run]['aot_autograd']}, "
                  f"inductor {runs[run]['inductor']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **runs}, indent=2))


if __name__ == "__main__":
    main()
