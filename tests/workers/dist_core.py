"""Worker for the core's multi-process tests (no TRL): ``python -m tests.workers.dist_core OUTDIR SCENARIO ...``.

Scenarios: ``scatter PLACEMENT CHUNK`` (unequal per-rank counts), ``fault KIND RANK PLACEMENT``
with KIND in raise / wronglen / nan / sleep.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from grpo_patches.collectives import FailFastGroup
from grpo_patches.rewards import RewardBatch, Scored, compute_rewards, reward_column

G = 2
TIMEOUT = 3.0


def reward_of(text: str) -> float:
    return float(sum(ord(c) for c in text) % 97) / 97.0


def make_batch(rank: int) -> RewardBatch:
    n = (rank + 1) * G  # unequal per-rank counts
    completions = [f"r{rank}-c{i}" for i in range(n)]
    return RewardBatch([f"p{rank}-{i // G}" for i in range(n)], completions,
                       [[rank, i] for i in range(n)], {"row": [rank * 100 + i // G for i in range(n)]})


def main() -> int:
    outdir, scenario, *args = sys.argv[1:]
    if os.environ.get("GRPO_PATCHES_TEST_DEVICE") == "cuda":  # NCCL default group; the kit adds gloo
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    calls: list[dict] = []
    group = FailFastGroup(TIMEOUT + 4.0)
    batch = make_batch(rank)
    data: dict = {"rank": rank}
    code = 0
    try:
        if scenario == "scatter":
            placement, chunk = args[0], int(args[1]) or None

            def score(b: RewardBatch, group_ids: list[int]) -> Scored:
                calls.append({"rank": rank, "n": len(b), "group_ids": group_ids, "rows": b.columns["row"]})
                return Scored(torch.tensor([[reward_of(c)] for c in b.completions]),
                              {"echo": list(b.completions)})

            result = compute_rewards(batch, score, group=group, placement=placement, num_generations=G,
                                     chunk_size=chunk, timeout=TIMEOUT)
            data.update(local=result.local[:, 0].tolist(), expected=[reward_of(c) for c in batch.completions],
                        extras=result.extras.get("echo"), completions=batch.completions, calls=calls,
                        counts=result.counts, has_all=result.all is not None)
        elif scenario == "fault":
            kind, bad_rank, placement = args[0], int(args[1]), args[2]

            def score(b: RewardBatch, group_ids: list[int]) -> Scored:
                if rank == bad_rank:
                    if kind == "raise":
                        raise KeyError("injected failure in my_reward")
                    if kind == "sleep":
                        time.sleep(3600)
                    if kind == "wronglen":
                        reward_column([1.0] * (len(b) - 1), len(b), "my_reward")
                    if kind == "nan":
                        reward_column([float("nan")] * len(b), len(b), "my_reward")
                return Scored(torch.ones(len(b), 1))

            t0 = time.monotonic()
            try:
                compute_rewards(batch, score, group=group, placement=placement, num_generations=G, timeout=TIMEOUT)
                data["raised"] = None
            except Exception as exc:
                data["raised"] = f"{type(exc).__name__}: {exc}"
                data["seconds"] = time.monotonic() - t0
                code = 3
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(data, f)
        sys.stdout.flush()
    if code == 0:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(code)  # torch 2.13 + gloo can abort or hang at interpreter exit


if __name__ == "__main__":
    main()
