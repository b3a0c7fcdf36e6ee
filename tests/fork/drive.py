"""Fork-mode driver: apply a patch to THIS interpreter's TRL; start a worker's ranks where only the
patched TRL can provide the kit's code.

    python tests/fork/drive.py --patch patches/grpo_rank_local.patch --patch patches/trl-1.16.0.patch --apply-only
                                                    # patch this venv's TRL: the kit's bundle and the release's edits
    python tests/fork/drive.py --module tests.matrix.worker [ARGS]               # 2 ranks, fork environment
    python tests/fork/drive.py --plant scatter-order      # a tests/mutations.toml bug, in the BUNDLED copy

Standard library only in this process. The ranks run ``python -m MODULE OUTDIR ARGS`` (tests/launch.py's
convention) with this interpreter (or ``python``), from a scratch folder that holds a ``tests`` link to
this checkout's tests/, with PYTHONPATH cleared: ``import tests.helpers`` works and grpo_patches is not
importable. What the fork CI checks runs through :func:`launch`: ``GRPO_PATCHES_MATRIX_MODE=fork pytest
tests/matrix`` (tests/matrix/test_invariants.py's ``ranks`` fixture), in ``nox -s fork-<release>`` and
tests/test_patches_fork.py. From the command line: exit status 0 when every rank exited with 0.
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
if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))  # the checkout: tests.launch (stdlib only), never grpo_patches

from tests.launch import RankResult, collect, describe, free_port  # noqa: E402


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


def plant(mutation_ids: list[str]) -> list[str]:
    """Plant ``tests/mutations.toml`` bugs in the bundled copy (``trl/trainer/grpo_rank_local/``) of this
    interpreter's patched TRL, for good: only in a throwaway venv (a ``nox -s fork-<release>`` session's),
    to see the fork-mode matrix fail, e.g. ``nox -s fork-1.16.0 -- sh -c "python tests/fork/drive.py
    --plant scatter-order && python -m pytest -q tests/matrix"`` (must fail)."""
    import tomllib

    bundle = Path(sysconfig.get_paths()["purelib"]) / "trl" / "trainer" / "grpo_rank_local"
    known = {m["id"]: m for m in tomllib.loads((HERE.parent / "mutations.toml").read_text())["mutation"]}
    done = []
    for mutation_id in mutation_ids:
        m = known[mutation_id]
        target = bundle / m["file"].removeprefix("grpo_patches/")
        if not target.exists():
            raise SystemExit(f"{mutation_id}: {m['file']} is not bundled in this release's patch")
        text = target.read_text()
        if text.count(m["find"]) != 1:
            raise SystemExit(f"{mutation_id}: its text does not occur exactly once in {target}")
        target.write_text(text.replace(m["find"], m["replace"]))
        for cached in (target.parent / "__pycache__").glob(f"{target.stem}.*.pyc"):
            cached.unlink()
        done.append(f"planted {mutation_id} in {target}")
    return done


def launch(module: str, world_size: int = 2, deadline: float = 400.0, *, args: tuple[str, ...] = (),
           python: str | Path = sys.executable, env: dict[str, str] | None = None, extra_ports: int = 0,
           ) -> list[RankResult]:
    """Start ``world_size`` ranks of ``python -m MODULE OUTDIR ARGS`` in the fork environment and collect
    what each wrote (``OUTDIR/rank<r>.json``), its exit code and log (tests/launch.py's ``collect``: a rank
    still running at ``deadline`` s is killed and reported hung).

    OUTDIR is the ranks' working directory and holds a ``tests`` link to this checkout's tests/; nothing
    else of the checkout is on sys.path. ``python``: the interpreter of the environment under test;
    ``env``: more environment variables for every rank; ``extra_ports``: that many more free ports in
    ``GRPO_PATCHES_TEST_PORTS``, as tests/launch.py's ``run_ranks`` gives them.
    """
    outdir = Path(tempfile.mkdtemp(prefix="grpo_fork_"))
    (outdir / "tests").symlink_to(HERE.parent, target_is_directory=True)
    port = str(free_port())
    more = ",".join(str(free_port()) for _ in range(extra_ports))
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(world_size):
        rank_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        rank_env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                         "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                         "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                         "GRPO_PATCHES_TEST_PORTS": more})
        rank_env.update(env or {})
        log = open(outdir / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed by collect()
        logs.append(log)
        procs.append(subprocess.Popen([str(python), "-m", module, str(outdir), *args], cwd=outdir, env=rank_env,
                                      stdout=log, stderr=subprocess.STDOUT))
    return collect(procs, logs, outdir, start, deadline)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patch", type=Path, action="append", default=[],
                        help="a fork patch to apply to this interpreter's TRL first (repeatable: the bundle, then "
                        "the release's edit patch)")
    parser.add_argument("--apply-only", action="store_true", help="apply --patch and stop")
    parser.add_argument("--plant", help="plant these tests/mutations.toml bugs (comma-separated) in the "
                        "bundled copy of this venv's patched TRL, then stop")
    parser.add_argument("--module", help="run the ranks as python -m MODULE OUTDIR ARGS...")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--deadline", type=float, default=400.0)
    parser.add_argument("--extra-ports", type=int, default=0)
    parser.add_argument("--save", type=Path, help="write every rank's data as JSON to this file")
    parser.add_argument("args", nargs="*", help="arguments after OUTDIR for --module")
    args = parser.parse_args(argv)
    for patch in args.patch:
        print(apply_patch(patch), flush=True)
    if args.plant:
        print("\n".join(plant(args.plant.split(","))), flush=True)
    if args.apply_only or not args.module:
        return 0
    t0 = time.monotonic()
    results = launch(args.module, args.world_size, args.deadline, args=tuple(args.args),
                     extra_ports=args.extra_ports)
    if args.save is not None:
        args.save.write_text(json.dumps([r.data for r in results]))
    ok = all(r.returncode == 0 for r in results)
    print(f"{args.module}: {args.world_size} ranks, {time.monotonic() - t0:.0f} s: "
          + ("every rank exited with 0" if ok else "a rank failed or hung"))
    if not ok:
        print(describe(results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
