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
