"""Worker for the teardown tests (no TRL): ``python -m tests.workers.dist_teardown OUTDIR SIDE ENDING``.

The rank does what a patched trainer does with torch.distributed, without the trainer: over the
default gloo group a few collectives, and with SIDE=1 the kit's own pieces as well: the cached side
group (:class:`~grpo_patches.collectives.FailFastGroup`), reward scoring through
:func:`~grpo_patches.rewards.compute_rewards` (its watchdog thread), and the liveness monitor
around it (:func:`~grpo_patches.liveness.watching`). Then it ends the way ENDING says:

* ``exit``: barrier, ``destroy_process_group()``, ``os._exit(0)`` (what the tests' workers do);
* ``return``: barrier, ``destroy_process_group()``, then return from main (normal interpreter exit);
* ``alive``: return from main with the groups alive (what a user script that never tears down does).

Rank 1 can be made slow to end (TEARDOWN_SKEW seconds of sleep before it starts), so that the
ranks tear down at different times, as on a loaded machine.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from grpo_patches.collectives import FailFastGroup
from grpo_patches.liveness import watching
from grpo_patches.rewards import RewardBatch, Scored, compute_rewards

G = 2


def score(batch: RewardBatch, group_ids: list[int]) -> Scored:
    return Scored(torch.tensor([[float(len(c))] for c in batch.completions]), {})


def kit_work(rank: int) -> None:
    group = FailFastGroup(30.0)
    for step in range(4):
        n = 2 * G
        batch = RewardBatch([f"p{i // G}" for i in range(n)], [f"r{rank}s{step}c{i}" for i in range(n)],
                            [[i] for i in range(n)], {"row": [i // G for i in range(n)]})
        for placement in ("local", "main"):
            compute_rewards(batch, score, group=group, placement=placement, num_generations=G, chunk_size=None,
                            timeout=20.0)


def main() -> int:
    outdir, side, ending = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    t = torch.ones(4)
    if side:
        with watching():
            kit_work(rank)
            dist.all_reduce(t)
    else:
        dist.all_reduce(t)
    if rank == 1:
        time.sleep(float(os.environ.get("TEARDOWN_SKEW", "0")))
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "sum": t.tolist(), "t_done": time.time()}, f)
    sys.stdout.flush()
    if ending in ("exit", "return"):
        dist.barrier()
        dist.destroy_process_group()
    if ending == "exit":
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
