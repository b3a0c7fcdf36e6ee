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


def test_the_rotating_sample_comes_round_to_every_entry():
    n = 3
    days = -(-len(ENTRIES) // n)
    seen = [e["id"] for day in range(days) for e in mutations.rotating_sample(ENTRIES, n, day)]
    assert set(seen) == {e["id"] for e in ENTRIES}
    assert len(mutations.rotating_sample(ENTRIES, n)) == n
