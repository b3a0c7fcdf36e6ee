"""Planted bugs: apply each curated single-line mutation to a copy of the package, run the tests that
guard it, and fail if any mutation survives.

    python tests/mutations.py                 # every mutation in tests/mutations.toml
    python tests/mutations.py --only chunk-size-ignored,group-ids-zero
    python tests/mutations.py --list
    nox -s mutations                          # the same, in the newest release's pinned environment

Why a small script and not mutmut: the bugs worth planting here are specific (a chunk size ignored,
local-only batch statistics, a revert that leaves one attribute wrapped, ...), and the tests that
catch them are multi-process launches of 20-30 s each, so random operator mutations over every
line would cost hours and mostly plant bugs no one would write. Each entry in the list is an anchored
text replacement: the anchor must occur exactly once in its file, or the run stops and names the
entry to re-anchor (an anchor that moved must never turn into a silently skipped mutation). The list
is data (tests/mutations.toml), so re-anchoring after a refactor touches no code.

Each mutation runs in a fresh copy of ``grpo_patches/`` + ``tests/`` (the copy's package is the one
imported: checked), with ``pytest -x`` on the entry's guard tests. Outcomes: ``killed`` (a guard
failed), ``survived`` (all guards passed: the suite misses the bug), ``error`` (pytest could not run
the guards: collection error, no tests, timeout). Any outcome but ``killed`` fails the run. A baseline
run of every guard on the unmutated copy comes first (``--no-baseline`` skips it): a guard that fails
without a mutation would "kill" everything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "tests" / "mutations.toml"
COPIED = ("grpo_patches", "tests", "pyproject.toml")
TIMEOUT_S = 600


def load(path: Path = LIST) -> list[dict]:
    entries = tomllib.loads(path.read_text())["mutation"]
    ids = [e["id"] for e in entries]
    dupes = {i for i in ids if ids.count(i) > 1}
    if dupes:
        raise SystemExit(f"duplicate mutation ids in {path}: {sorted(dupes)}")
    for e in entries:
        missing = {"id", "file", "find", "replace", "guards", "bug"} - set(e)
        if missing:
            raise SystemExit(f"mutation {e.get('id')!r} lacks {sorted(missing)}")
    return entries


def check_anchor(entry: dict, root: Path = ROOT) -> str:
    """The file's text, after checking the anchor occurs exactly once (else: stop, naming the entry)."""
    text = (root / entry["file"]).read_text()
    found = text.count(entry["find"])
    if found != 1:
        raise SystemExit(
            f"mutation {entry['id']!r}: its anchor occurs {found} times in {entry['file']} (must be exactly once); "
            f"re-anchor it in {LIST.relative_to(ROOT)}:\n{entry['find']!r}"
        )
    return text


def make_copy(entry: dict | None) -> Path:
    where = Path(tempfile.mkdtemp(prefix="grpo_mutant_"))
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, where / name, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
        else:
            shutil.copy2(src, where / name)
    if entry is not None:
        text = check_anchor(entry, where)
        (where / entry["file"]).write_text(text.replace(entry["find"], entry["replace"], 1))
    return where


def env_for(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def imports_the_copy(copy: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "import grpo_patches, tests.launch as l; print(grpo_patches.__file__, "
                          "l.__file__)"], cwd=copy, env=env_for(copy), capture_output=True, text=True, timeout=120)
    paths = out.stdout.split()
    if out.returncode or len(paths) != 2 or not all(Path(p).resolve().is_relative_to(copy.resolve()) for p in paths):
        raise SystemExit(f"the copy at {copy} does not import its own package: {out.stdout}{out.stderr}")


def run_guards(copy: Path, guards: list[str]) -> tuple[str, float, str]:
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *guards]
    try:
        out = subprocess.run(cmd, cwd=copy, env=env_for(copy), capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "error", time.monotonic() - start, f"timed out after {TIMEOUT_S} s"
    seconds = time.monotonic() - start
    tail = (out.stdout + out.stderr)[-1500:]
    if out.returncode == 0:
        return "passed", seconds, tail
    if out.returncode == 1:
        return "failed", seconds, tail
    return "error", seconds, f"pytest exit {out.returncode}: {tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated mutation ids")
    parser.add_argument("--list", action="store_true", help="list the mutations and their guards, run nothing")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of every guard")
    parser.add_argument("--report", type=Path, help="write the outcomes as JSON here")
    args = parser.parse_args(argv)
    entries = load()
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {e["id"] for e in entries}
        if unknown:
            raise SystemExit(f"unknown mutation ids: {sorted(unknown)}")
        entries = [e for e in entries if e["id"] in wanted]
    for e in entries:  # every anchor first: a moved anchor stops the run before any test runs
        check_anchor(e)
    if args.list:
        for e in entries:
            print(f"{e['id']:32} {e['file']:36} {e['bug']}\n{'':32} guards: {' '.join(e['guards'])}")
        return 0
    results = []
    if not args.no_baseline:
        guards = list(dict.fromkeys(g for e in entries for g in e["guards"]))
        copy = make_copy(None)
        imports_the_copy(copy)
        outcome, seconds, tail = run_guards(copy, guards)
        shutil.rmtree(copy, ignore_errors=True)
        print(f"baseline (unmutated, {len(guards)} guards): {outcome} in {seconds:.0f} s", flush=True)
        if outcome != "passed":
            print(tail)
            return 2
    total = time.monotonic()
    for e in entries:
        copy = make_copy(e)
        imports_the_copy(copy)
        outcome, seconds, tail = run_guards(copy, e["guards"])
        shutil.rmtree(copy, ignore_errors=True)
        status = {"failed": "killed", "passed": "survived"}.get(outcome, "error")
        results.append({"id": e["id"], "file": e["file"], "status": status, "seconds": round(seconds, 1),
                        "guards": e["guards"]})
        print(f"{status:8} {seconds:5.0f} s  {e['id']}: {e['bug']}", flush=True)
        if status != "killed":
            print(tail)
    killed = sum(r["status"] == "killed" for r in results)
    print(f"\n{killed}/{len(results)} mutations killed in {time.monotonic() - total:.0f} s")
    if args.report:
        args.report.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
