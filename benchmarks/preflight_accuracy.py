"""Preflight's predicted peak vs the peaks measured by bench_grpo.py on GPU (same configurations).

    python benchmarks/preflight_accuracy.py > benchmarks/results/2026-11-29-h200-preflight/preflight_accuracy.md

The runs of 2026-11-29-h200-x4: the commands are in that folder's README.

The 1.5B runs: ``accelerate launch --num_processes 1 --mixed_precision bf16 benchmarks/bench_grpo.py
--policy 1.5b --grad-ckpt {off,on} --variants stock --steps 1 --warmup 1 --completion-len 128`` on
one H200.

Reads the measured records (``results.jsonl`` / merged parts) of the runs below and predicts each
(variant, rank) with :func:`grpo_patches.preflight` on the meta device (``fast_generation=True``
for the fast-generation variants). The error is taken against the peak minus what was still
allocated when the variant started (an earlier variant's leftovers in the same process are not
this run's memory).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
GiB = 2**30
RUNS = [ROOT / "benchmarks/results/2026-11-29-h200-x2-grpo/results.jsonl",
        ROOT / "benchmarks/results/2026-11-29-h200-preflight/results_1.5b_ckpt_off.jsonl",
        ROOT / "benchmarks/results/2026-11-29-h200-preflight/results_1.5b_ckpt_on.jsonl",
        *sorted(ROOT.glob("benchmarks/results/2026-11-29-h200-x4/*/results.jsonl")),
        *sorted(ROOT.glob("benchmarks/results/2026-11-29-h200-x4/24gb-*/probes/results.jsonl"))]
#: preflight models DDP (a full replica per rank); FSDP shards are out of its scope.
SKIP_DISTRIBUTED = {"FSDP"}


def main() -> None:
    warnings.filterwarnings("ignore")
    from bench_grpo import POLICIES, PROMPT_WORDS
    from transformers import Qwen2Config

    from grpo_patches.preflight import preflight

    print("| run | policy | GPUs | batch x completion | grad ckpt | variant | rank | predicted peak GiB | "
          "measured peak GiB | measured above start GiB | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for path in RUNS:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if not r.get("peak_allocated_bytes") or r.get("distributed") in SKIP_DISTRIBUTED:
                continue
            policy = Qwen2Config(**POLICIES[r["policy"]])
            rm = Qwen2Config(**POLICIES["0.5b"])
            placement = "main" if r["variant"] == "patched-main" else "local"
            fast = bool(r.get("fast_generation"))
            report = preflight(
                policy,
                grpo_config=dict(per_device_train_batch_size=r.get("per_device_batch", 8),
                                 num_generations=r.get("num_generations", 8),
                                 max_completion_length=r["completion_len"], steps_per_generation=1,
                                 gradient_accumulation_steps=1, gradient_checkpointing=r["grad_ckpt"] == "on"),
                world_size=r["world_size"], gpu_memory_gb=141, reward_models=[rm], reward_placement=placement,
                prompt_length=PROMPT_WORDS + 2, raise_on_error=False, warn=False, fast_generation=fast,
            )
            predicted = report.ranks[r["rank"]].peak / GiB
            measured = r["peak_allocated_bytes"] / GiB
            own = (r["peak_allocated_bytes"] - r.get("base_allocated_bytes", 0)) / GiB
            run = path.parent.parent.name + "/probes" if path.parent.name == "probes" else path.parent.name
            print(f"| {run} | {r['policy']} | {r['world_size']} | {r['per_device_batch']} x {r['completion_len']} | "
                  f"{r['grad_ckpt']} | {r['variant']} | {r['rank']} | {predicted:.2f} | {measured:.2f} | {own:.2f} | "
                  f"{100 * (predicted / own - 1):+.1f}% |")


if __name__ == "__main__":
    main()
