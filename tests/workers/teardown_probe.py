"""Probe for blocking at process exit: run a 2-rank worker many times, optionally under CPU stress, and
when one rank has ended and the other has not within GRACE seconds, dump the live rank's stacks
(Python, through faulthandler on SIGUSR1; C, through gdb) before killing it.

    python -m tests.workers.teardown_probe --runs 10 --stress 2 -- tests.workers.dist_teardown 1 exit
    python -m tests.workers.teardown_probe --runs 3 --stress 2 -- tests.workers.dist_trl coverage 16 2

Not collected by pytest; the findings are in docs/faults.md ("Teardown") and tests/test_teardown.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.launch import ROOT, free_port

SITE = "import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"


def one_run(module_args: list[str], grace: float, deadline: float) -> dict:
    outdir = Path(tempfile.mkdtemp(prefix="grpo_teardown_"))
    site = outdir / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    port = str(free_port())
    procs, logs = [], []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONUNBUFFERED="1", PYTHONPATH=f"{site}{os.pathsep}{ROOT}")
        log = open(outdir / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", module_args[0], str(outdir), *module_args[1:]],
                                      cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    start, ended, stuck = time.monotonic(), {}, None
    while len(ended) < 2 and time.monotonic() - start < deadline:
        for rank, p in enumerate(procs):
            if rank not in ended and p.poll() is not None:
                ended[rank] = time.monotonic()
        if len(ended) == 1 and time.monotonic() - next(iter(ended.values())) > grace:
            stuck = 1 - next(iter(ended))
            break
        time.sleep(0.1)
    if stuck is None and len(ended) < 2:
        stuck = next(r for r in range(2) if r not in ended)  # both still running at the deadline
    dump = ""
    if stuck is not None:
        pid = procs[stuck].pid
        os.kill(pid, 10)  # SIGUSR1: faulthandler writes every thread's Python stack to the log
        time.sleep(1.0)
        if shutil.which("gdb"):
            dump = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 25"],
                                  capture_output=True, text=True, timeout=120).stdout
    result = {"ended": {r: round(t - start, 1) for r, t in ended.items()}, "stuck": stuck, "outdir": str(outdir)}
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        if p.poll() is None:
            p.kill()
            p.wait()
        result[f"rc{rank}"] = p.returncode
        log.seek(0)
        result[f"log{rank}"] = log.read()[-4000:]
        log.close()
    result["gdb"] = dump
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--stress", type=int, default=0, help="busy-loop processes to run alongside")
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("--deadline", type=float, default=400.0)
    parser.add_argument("module_args", nargs="+")
    opts = parser.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(opts.stress)]
    try:
        for i in range(opts.runs):
            r = one_run(opts.module_args, opts.grace, opts.deadline)
            print(f"run {i}: rc={r['rc0']},{r['rc1']} ended={r['ended']} stuck={r['stuck']}", flush=True)
            if r["stuck"] is not None or r["rc0"] != 0 or r["rc1"] != 0:
                print(f"--- rank0 log\n{r['log0']}\n--- rank1 log\n{r['log1']}\n--- gdb\n{r['gdb'][-8000:]}",
                      flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()


if __name__ == "__main__":
    main()
