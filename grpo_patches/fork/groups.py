"""Which releases' edit patches make the same edits: equal once the preamble, context lines and hunk
positions are dropped (the same lines added and removed in the same files). A fork test of one release
of a group exercises the same patched code as any other (the bundle is shared by all).

Standard library only, importing nothing of the kit: noxfile.py loads this file by its path to tag the
fork sessions (``fork-edits-<n>``, and ``fork-groups`` for one release of each group plus the newest).
"""

from __future__ import annotations

import re

__all__ = ["edit_groups", "edits_only", "representatives"]

_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def edits_only(patch_text: str) -> tuple[str, ...]:
    """Each file's ``diff --git`` line and its added / removed lines, in order; nothing else."""
    out: list[str] = []
    lines = patch_text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith("diff --git "):
            out.append(line)
            continue
        m = _HUNK.match(line)
        if not m:
            continue  # the preamble, a file's --- / +++ / mode lines
        old_n, new_n = int(m.group(1) or "1"), int(m.group(2) or "1")
        while i < len(lines) and (old_n or new_n):  # the hunk's body, by its counts
            body = lines[i]
            i += 1
            kind = body[:1]
            if kind == "\\":
                continue
            old_n -= kind in (" ", "-")
            new_n -= kind in (" ", "+")
            if kind in ("+", "-"):
                out.append(body)
    return tuple(out)


def edit_groups(patches: dict[str, str]) -> list[list[str]]:
    """``patches`` (name -> text, oldest release first) grouped by :func:`edits_only`, each group in
    input order, groups by their first member."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, text in patches.items():
        groups.setdefault(edits_only(text), []).append(name)
    return list(groups.values())


def representatives(groups: list[list[str]], newest: str) -> list[str]:
    """The first member of each group, plus ``newest`` (the newest release) if it is not one of them."""
    picked = [g[0] for g in groups]
    return picked + ([newest] if newest not in picked else [])
