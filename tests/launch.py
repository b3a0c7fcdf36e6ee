"""Start N ranks of a worker script over torch.distributed (gloo), each a real process, with a deadline.

Ranks are started by hand with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (accelerate and
torch.distributed pick them up), not through a launcher that kills the others when one fails:
the fault tests need to see what every rank does on its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.kitfree import testing

free_port = testing.free_port  # grpo_patches/testing.py, without importing the kit (fork mode)

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the deadline (a hang)
    output: str
    seconds: float
    data: dict

    @property
    def hung(self) -> bool:
        return self.returncode is None


def world_sizes(*sizes: int) -> list[int]:
    """The world sizes a multi-process test runs with: all of them on CPU (gloo); on GPUs
    (GRPO_PATCHES_TEST_DEVICE=cuda, one rank per GPU under NCCL) those that fit the visible GPUs."""
    if os.environ.get("GRPO_PATCHES_TEST_DEVICE", "cpu") != "cuda":
        return list(sizes)
    import torch

    return [n for n in sizes if n <= torch.cuda.device_count()]


def run_ranks(module: str, *args: str, world_size: int = 2, deadline: float = 120.0,
              env: dict[str, str] | None = None, extra_ports: int = 0) -> list[RankResult]:
    """Run ``python -m <module> <outdir> <args>`` as ``world_size`` ranks; collect exit codes and JSON.

    ``extra_ports``: that many more free ports, the same for every rank, in ``GRPO_PATCHES_TEST_PORTS``
    (comma-separated), for workers that form further process groups of their own.
    """
    outdir = Path(tempfile.mkdtemp(prefix="grpo_dist_"))
    port = str(free_port())
    more = ",".join(str(free_port()) for _ in range(extra_ports))
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(world_size):
        rank_env = dict(os.environ)
        rank_env.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT) + os.pathsep + rank_env.get("PYTHONPATH", ""),
            "GRPO_PATCHES_TEST_PORTS": more,
        })
        rank_env.update(env or {})
        log = open(outdir / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed after the ranks end
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", module, str(outdir), *args], cwd=ROOT,
                                      env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    return collect(procs, logs, outdir, start, deadline)


def collect(procs: list, logs: list, outdir: Path, start: float, deadline: float) -> list[RankResult]:
    """Wait for the ranks until ``deadline`` s after ``start``, kill the ones still running (a hang),
    and read each rank's exit code, log and ``OUTDIR/rank<r>.json``."""
    world_size = len(procs)
    ended: dict[int, float] = {}
    while len(ended) < world_size and time.monotonic() - start < deadline:
        for rank, p in enumerate(procs):
            if rank not in ended and p.poll() is not None:
                ended[rank] = time.monotonic() - start
        time.sleep(0.1)
    results = []
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        code: int | None = p.returncode if rank in ended else None
        if code is None:
            p.kill()
            p.wait()
        log.seek(0)
        data_file = outdir / f"rank{rank}.json"
        data = json.loads(data_file.read_text()) if data_file.exists() else {}
        results.append(RankResult(rank, code, log.read(), ended.get(rank, deadline), data))
        log.close()
    return results


def end_rank(outdir: str, rank: int, data: dict, code: int) -> None:
    """A rank worker's last step: the JSON ``run_ranks`` reads, then an exit that cannot block.

    torch 2.13 + gloo at process exit can abort (group alive) or hang (group destroyed, normal
    return); barrier, ``destroy_process_group()`` and ``os._exit`` fixed both.
    """
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(data, f)
    sys.stdout.flush()
    sys.stderr.flush()
    import torch.distributed as dist

    if code == 0 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(code)


def describe(results: list[RankResult]) -> str:
    return "\n".join(f"--- rank {r.rank} rc={r.returncode} t={r.seconds:.1f}s\n{r.output[-3000:]}" for r in results)
