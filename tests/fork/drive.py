"""Fork-mode driver: apply a patch to THIS interpreter's TRL, run a scenario on 2 ranks, check it.

    python tests/fork/drive.py --patch patches/trl-1.16.0.patch        # fork mode (no grpo_patches here)
    python tests/fork/drive.py --mode monkeypatch                       # same scenario through apply()

Standard library only in this process; the ranks run tests/fork/worker.py with this interpreter, from
a scratch folder, with PYTHONPATH cleared, so that only the patched TRL can provide the kit's code.
Exit status 0 when every invariant held. Used by tests/test_patches_fork.py and ``nox -s fork-<release>``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: launch.py (stdlib only)
sys.path.insert(0, str(HERE))

import checks  # noqa: E402
from launch import RankResult, collect, describe, free_port  # noqa: E402


def apply_patch(patch: Path) -> str:
    """``git apply`` the patch in this interpreter's site-packages (once: a second run finds it applied)."""
    site = Path(sysconfig.get_paths()["purelib"])
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(site.parent))
    git = ["git", "apply", "-p1", str(patch.resolve())]
    if subprocess.run([*git, "--reverse", "--check"], cwd=site, env=env, capture_output=True).returncode == 0:
        return f"{patch.name} already applied in {site}"
    done = subprocess.run([*git, "--check"], cwd=site, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{patch} does not apply to {site}: {done.stderr}")
    subprocess.run(git, cwd=site, env=env, check=True)
    return f"applied {patch.name} in {site}"


def launch(scenario: str, mode: str, world_size: int, deadline: float, *, python: str | Path = sys.executable,
           module: str | None = None, args: tuple[str, ...] = (), env: dict[str, str] | None = None,
           ) -> list[RankResult]:
    """Start ``world_size`` ranks and collect what each wrote (``OUTDIR/rank<r>.json``) and its log.

    The ranks run ``python tests/fork/worker.py OUTDIR SCENARIO`` or, with ``module``, ``python -m
    MODULE OUTDIR ARGS`` (tests/launch.py's convention, e.g. ``tests.matrix.worker``), from OUTDIR,
    which holds a ``tests`` link to this checkout's tests/: ``import tests.helpers`` works, and in
    fork mode nothing else of the checkout is on sys.path (grpo_patches is not importable).
    ``python``: the interpreter of the environment under test (default: this one); ``env``: more
    environment variables for every rank.
    """
    outdir = Path(tempfile.mkdtemp(prefix="grpo_fork_"))
    (outdir / "tests").symlink_to(HERE.parent, target_is_directory=True)
    port = str(free_port())
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(world_size):
        rank_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        rank_env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                         "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                         "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                         "GRPO_PATCHES_KIT_MODE": mode})
        if mode == "monkeypatch":
            rank_env["PYTHONPATH"] = str(HERE.parents[1])  # the kit from this checkout
        rank_env.update(env or {})
        log = open(outdir / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed below
        logs.append(log)
        cmd = ([str(python), "-m", module, str(outdir), *args] if module
               else [str(python), str(HERE / "worker.py"), str(outdir), scenario])
        procs.append(subprocess.Popen(cmd, cwd=outdir, env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    return collect(procs, logs, outdir, start, deadline)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patch", type=Path, help="the fork patch to apply first (fork mode)")
    parser.add_argument("--mode", choices=("fork", "monkeypatch"), default="fork")
    parser.add_argument("--scenario", default="invariants",
                        help="a scenario of worker.py, or module:function under tests/ (checks: the same spec)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--deadline", type=float, default=400.0)
    parser.add_argument("--apply-only", action="store_true", help="apply --patch and stop")
    parser.add_argument("--module", help="run the ranks as python -m MODULE OUTDIR ARGS... instead of worker.py")
    parser.add_argument("--save", type=Path, help="write every rank's data as JSON to this file")
    parser.add_argument("args", nargs="*", help="arguments after OUTDIR for --module")
    args = parser.parse_args(argv)
    if args.mode == "fork" and args.patch is not None:  # without --patch: patched already (env.py patched)
        print(apply_patch(args.patch), flush=True)
        if args.apply_only:
            return 0
    t0 = time.monotonic()
    results = launch(args.scenario, args.mode, args.world_size, args.deadline, module=args.module,
                     args=tuple(args.args))
    if args.save is not None:
        args.save.write_text(json.dumps([r.data for r in results]))
    failures = checks.failures_of(args.scenario, results)
    trl = results[0].data.get("trl", "?")
    print(f"{args.mode} mode, trl {trl}, {args.world_size} ranks, {time.monotonic() - t0:.0f} s: "
          + ("every invariant held" if not failures else f"{len(failures)} failure(s)"))
    if failures:
        print("\n".join(failures))
        print(describe(results))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
