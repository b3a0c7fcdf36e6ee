"""What the liveness monitor costs a rank: CPU time of the process while ``watching()`` is on and the
main thread does nothing, with the monitor on and off, side by side in one job (2 ranks, gloo, CPU).

    python -m benchmarks.liveness_cost            # starts 2 ranks itself; prints one JSON line per rank

The training thread does no work for the monitor at all (it arms once per ``train()`` call); what
remains is the monitor thread's own CPU time and its share of the GIL, measured here.
"""

from __future__ import annotations

import json
import os
import sys
import time

SECONDS = 20.0


def rank_main() -> None:
    import torch.distributed as dist

    from grpo_patches import liveness

    dist.init_process_group("gloo")
    out = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "seconds": SECONDS}
    for label, bound in (("off", "0"), ("on", "60"), ("off_again", "0")):
        os.environ[liveness.PEER_TIMEOUT_ENV] = bound
        dist.barrier()
        with liveness.watching():
            cpu0, wall0 = time.process_time(), time.monotonic()
            time.sleep(SECONDS)
            cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        out[label] = {"cpu_ms_per_s": round(1000 * cpu / wall, 3)}
    print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    from tests.launch import run_ranks

    results = run_ranks("benchmarks.liveness_cost", "--rank", world_size=2, deadline=4 * SECONDS + 120)
    for r in results:
        print(r.output.strip().splitlines()[-1] if r.output.strip() else f"rank {r.rank}: no output")


if __name__ == "__main__":
    if "--rank" in sys.argv:
        rank_main()
    else:
        main()
