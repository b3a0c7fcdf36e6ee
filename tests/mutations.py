"""Planted bugs: apply each curated single-line mutation to a copy of the package, run the tests that
guard it, and fail if any mutation survives.

    python tests/mutations.py                 # every mutation in tests/mutations.toml
    python tests/mutations.py --only chunk-size-ignored,group-ids-zero
    python tests/mutations.py --list
    python tests/mutations.py --stale         # only those whose record is missing or stale; updates it
    python tests/mutations.py --ci --sample 3 --sample-seconds 60   # CI: every record fresh, a rotating sample again
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

Incremental, as Stryker's incremental mode and mutmut's cache do: every killed mutation is recorded in
``tests/mutations.lock.json`` under a key, the hash of what decides its outcome (the entry itself, its target
file, its guard test files and the modules of tests/ they use, and the TRL release and pins it ran against).
The record is committed. ``--stale`` runs only the entries whose record is missing or whose key changed and
writes the new records; the suite (``tests/test_mutation_list.py``) fails while any record is missing or stale,
so a change to a target or a guard is re-proven before it lands. ``--ci`` runs nothing stale (it fails on a
missing or stale record) and re-runs a rotating sample (``--sample N``, by the UTC day; ``--sample-seconds S``
bounds its recorded guard time) so that a record that no longer holds is caught within weeks; the full run stays
one command.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "tests" / "mutations.toml"
RECORD = ROOT / "tests" / "mutations.lock.json"
COMPAT = ROOT / "grpo_patches" / "compat.json"
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


def _newest_release() -> tuple[str, dict]:
    supported = json.loads(COMPAT.read_text())["supported"]
    newest = max(supported, key=lambda v: tuple(int(p) for p in v.split(".")))
    return newest, supported[newest]


def _test_modules(path: Path, root: Path) -> set[str]:
    """The modules of tests/ that a test file uses: its ``tests.*`` imports and the ``"tests.X"`` worker
    modules it names (``run_ranks("tests.workers.dist_trl", ...)``), followed transitively."""
    seen: set[str] = set()
    todo = [path]
    while todo:
        current = todo.pop()
        rel = current.relative_to(root).as_posix()
        if rel in seen or not current.is_file():
            continue
        seen.add(rel)
        names: set[str] = set()
        for node in ast.walk(ast.parse(current.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and re.fullmatch(r"tests(\.\w+)+", node.value)):
                names.add(node.value)
        for name in names:
            if name.startswith("tests."):
                base = root / Path(*name.split("."))
                todo += [base.with_suffix(".py"), base / "__init__.py"]
    return seen


def key_files(entry: dict, root: Path = ROOT) -> list[str]:
    """What decides the entry's outcome besides the entry: its target, its guard test files, and the modules
    of tests/ those use (imports and named worker modules, transitively; tests/kitfree.py loads
    grpo_patches/testing.py by its path)."""
    files = {entry["file"]}
    for guard in entry["guards"]:
        files |= _test_modules(root / guard.partition("::")[0], root)
    if "tests/kitfree.py" in files:
        files.add("grpo_patches/testing.py")
    return sorted(f for f in files if (root / f).is_file())


def key(entry: dict, root: Path = ROOT) -> str:
    """The record key: a hash of the entry, the files it depends on and the release it runs against."""
    release, row = _newest_release()
    trl = os.environ.get("GRPO_PATCHES_TRL_VERSION", release)
    h = hashlib.sha256(json.dumps({k: entry[k] for k in ("id", "file", "find", "replace", "guards")},
                                  sort_keys=True).encode())
    h.update(json.dumps({"trl": trl, "pins": row if trl == release else None}, sort_keys=True).encode())
    for name in key_files(entry, root):
        h.update(b"\0" + name.encode() + b"\0" + (root / name).read_bytes())
    return h.hexdigest()[:16]


def read_record(path: Path = RECORD) -> dict[str, dict]:
    return json.loads(path.read_text()) if path.exists() else {}


def stale(entries: list[dict], record: dict[str, dict]) -> list[str]:
    """Ids whose record is missing, or was made for other files, another entry text or another release."""
    return [e["id"] for e in entries if record.get(e["id"], {}).get("key") != key(e)]


def rotating_sample(entries: list[dict], n: int, day: int | None = None,
                    seconds: dict[str, float] | None = None, budget: float | None = None) -> list[dict]:
    """One window of the sorted list a UTC day, in turn, so every entry comes round: windows of at most ``n``
    entries, cut before their recorded guard time (``seconds`` by id) would pass ``budget`` seconds, a window's
    first entry taken whatever its time. The budget keeps CI's step near its mean: the slowest guards take a
    minute or more, three of them together several."""
    if n <= 0 or not entries:
        return []
    windows: list[list[dict]] = [[]]
    spent = 0.0
    for entry in sorted(entries, key=lambda e: e["id"]):
        cost = (seconds or {}).get(entry["id"], 0.0)
        if windows[-1] and (len(windows[-1]) == n or (budget is not None and spent + cost > budget)):
            windows.append([])
            spent = 0.0
        windows[-1].append(entry)
        spent += cost
    day = datetime.datetime.now(datetime.timezone.utc).toordinal() if day is None else day
    return windows[day % len(windows)]


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
    # cached bytecode: each guard run's processes import TRL, which a fresh uv venv (nox) would compile anew
    env.pop("PYTHONDONTWRITEBYTECODE", None)
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
    parser.add_argument("--stale", action="store_true",
                        help=f"run only the entries whose record in {RECORD.name} is missing or stale")
    parser.add_argument("--ci", action="store_true",
                        help="fail on any missing or stale record; run only the rotating sample (--sample)")
    parser.add_argument("--sample", type=int, default=0, metavar="N",
                        help="also run N entries whose record is fresh, a different window each UTC day")
    parser.add_argument("--sample-seconds", type=float, default=None, metavar="S",
                        help="cut the sample's window before the guards' recorded seconds pass S (its first entry "
                        "always runs)")
    parser.add_argument("--no-record", action="store_true", help=f"leave {RECORD.name} as it is")
    args = parser.parse_args(argv)
    entries = load()
    for e in entries:  # every anchor first: a moved anchor stops the run before any test runs
        check_anchor(e)
    record = read_record()
    behind = stale(entries, record)
    if args.ci and behind:
        print(f"{len(behind)} mutation record(s) missing or stale in {RECORD.relative_to(ROOT)}: {', '.join(behind)}\n"
              "run `python tests/mutations.py --stale` (or `nox -s mutations -- --stale`) and commit the record")
        return 1
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {e["id"] for e in entries}
        if unknown:
            raise SystemExit(f"unknown mutation ids: {sorted(unknown)}")
        chosen = [e for e in entries if e["id"] in wanted]
    elif args.stale or args.ci:
        chosen = [e for e in entries if e["id"] in behind]
        fresh = [e for e in entries if e["id"] not in behind]
        seconds = {name: r.get("seconds", 0.0) for name, r in record.items()}
        chosen += rotating_sample(fresh, args.sample, seconds=seconds, budget=args.sample_seconds)
    else:
        chosen = entries
    if args.list:
        for e in chosen:
            mark = "stale" if e["id"] in behind else "fresh"
            print(f"{e['id']:32} {e['file']:36} [{mark}] {e['bug']}\n{'':32} guards: {' '.join(e['guards'])}")
        return 0
    if args.ci or args.stale:
        print(f"{len(behind)} stale, running {len(chosen)}: {', '.join(e['id'] for e in chosen) or 'none'}", flush=True)
    results = []
    if not args.no_baseline and chosen:
        guards = list(dict.fromkeys(g for e in chosen for g in e["guards"]))
        copy = make_copy(None)
        imports_the_copy(copy)
        outcome, seconds, tail = run_guards(copy, guards)
        shutil.rmtree(copy, ignore_errors=True)
        print(f"baseline (unmutated, {len(guards)} guards): {outcome} in {seconds:.0f} s", flush=True)
        if outcome != "passed":
            print(tail)
            return 2
    total = time.monotonic()
    for e in chosen:
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
            record.pop(e["id"], None)
        else:
            record[e["id"]] = {"key": key(e), "seconds": round(seconds, 1),
                               "trl": os.environ.get("GRPO_PATCHES_TRL_VERSION", _newest_release()[0])}
    killed = sum(r["status"] == "killed" for r in results)
    print(f"\n{killed}/{len(results)} mutations killed in {time.monotonic() - total:.0f} s")
    if not args.no_record and not args.ci and results:
        known = {e["id"] for e in entries}
        RECORD.write_text(json.dumps({k: record[k] for k in sorted(record) if k in known}, indent=1) + "\n")
        print(f"record: {RECORD.relative_to(ROOT)} ({sum(k in known for k in record)} of {len(entries)} entries)")
    if args.report:
        args.report.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
