"""The planted-bug list (tests/mutations.toml) stays runnable: CI runs it last, so an anchor that a
refactor moved, a replacement that no longer parses, or a guard test that was renamed, must fail here, in
the suite, not 40 minutes later."""

from __future__ import annotations

import re

import pytest

from tests import mutations

ENTRIES = mutations.load()


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["id"] for e in ENTRIES])
def test_each_anchor_occurs_once_and_each_guard_exists(entry):
    text = mutations.check_anchor(entry)  # SystemExit naming the entry otherwise
    assert entry["replace"] != entry["find"], entry["id"]
    if entry["file"].endswith(".py"):  # a planted bug, not a syntax error (the copy would not even import)
        compile(text.replace(entry["find"], entry["replace"]), entry["file"], "exec")
    for guard in entry["guards"]:
        path, _, name = guard.partition("::")
        source = (mutations.ROOT / path).read_text()
        test = name.split("[", 1)[0]
        if test:
            assert re.search(rf"^def {re.escape(test)}\(", source, re.M), f"{entry['id']}: no test {guard}"


def test_every_mutation_has_a_fresh_record():
    """CI re-runs only a sample of the planted bugs: the rest rest on tests/mutations.lock.json, so a change
    to a target, a guard or an entry must come with a fresh record (`python tests/mutations.py --stale`)."""
    behind = mutations.stale(ENTRIES, mutations.read_record())
    assert not behind, (f"missing or stale mutation records: {behind}; run `python tests/mutations.py --stale` "
                        "(or `nox -s mutations -- --stale`) and commit tests/mutations.lock.json")


def test_the_key_follows_the_target_the_guards_and_the_entry(tmp_path):
    entry = next(e for e in ENTRIES if e["guards"][0].startswith("tests/matrix/"))
    files = mutations.key_files(entry)
    assert entry["file"] in files and "tests/matrix/test_invariants.py" in files and "tests/matrix/worker.py" in files
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes((mutations.ROOT / name).read_bytes())
    before = mutations.key(entry, tmp_path)
    for name in (entry["file"], "tests/matrix/worker.py"):
        original = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(original + b"\n# changed\n")
        assert mutations.key(entry, tmp_path) != before, name
        (tmp_path / name).write_bytes(original)
    assert mutations.key(entry, tmp_path) == before
    assert mutations.key({**entry, "replace": entry["replace"] + " "}, tmp_path) != before


def _windows(n: int, **budget) -> list[tuple[str, ...]]:
    """Each day's sample until it repeats the first day's."""
    out: list[tuple[str, ...]] = []
    for day in range(10 * len(ENTRIES)):
        window = tuple(e["id"] for e in mutations.rotating_sample(ENTRIES, n, day, **budget))
        if out and window == out[0]:
            return out
        out.append(window)
    raise AssertionError("the sample never came back to its first window")


def test_the_rotating_sample_comes_round_to_every_entry():
    windows = _windows(3)
    assert [i for w in windows for i in w] == sorted(e["id"] for e in ENTRIES), "each entry once, in order"
    assert all(len(w) == 3 for w in windows[:-1])


def test_the_samples_recorded_time_stays_in_its_budget_and_every_entry_still_comes_round():
    seconds = {name: r["seconds"] for name, r in mutations.read_record().items()}
    windows = _windows(3, seconds=seconds, budget=60.0)
    assert [i for w in windows for i in w] == sorted(e["id"] for e in ENTRIES), "each entry once, in order"
    for w, after in zip(windows, windows[1:], strict=False):
        assert 1 <= len(w) <= 3 and (len(w) == 1 or sum(seconds[i] for i in w) <= 60.0), w
        assert len(w) == 3 or sum(seconds[i] for i in (*w, after[0])) > 60.0, f"{w} could have taken {after[0]}"
    assert len(windows) > -(-len(ENTRIES) // 3), "the budget cut no window: the lock's slowest guards take minutes"
