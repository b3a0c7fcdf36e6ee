"""The compatibility table: tested TRL releases and the dependency set each was tested with.

One data file (``compat.json``) feeds the version check in :func:`grpo_patches.apply`, the nox
matrix, the install commands (``python grpo_patches/compat.py pins [RELEASE]``, which runs before
anything is installed, so it imports nothing beyond the standard library) and the README's table,
so a release is listed once.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["grpo_free_releases", "newest", "pins", "table"]

DATA = Path(__file__).with_name("compat.json")
PINNED = ("transformers", "accelerate", "peft", "datasets")


@cache
def table() -> dict[str, Any]:
    return json.loads(DATA.read_text())


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.split(".")[:3])


def grpo_free_releases() -> list:
    """Releases that need no patch: each process already generates whole groups (TRL 0.14)."""
    from packaging.version import Version

    return sorted(Version(v) for v in table().get("grpo_free", []))


def newest() -> str:
    return max(table()["supported"], key=_key)


def pins(release: str | None = None) -> list[str]:
    """Requirement pins for one tested TRL release (the newest by default)."""
    release = release or newest()
    entry = table()["supported"][release]
    return [f"trl=={release}"] + [f"{name}=={entry[name]}" for name in PINNED]


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "pins":
        print(" ".join(pins(sys.argv[2] if len(sys.argv) > 2 else None)))
    elif len(sys.argv) >= 2 and sys.argv[1] == "releases":
        print(" ".join(sorted(table()["supported"], key=_key)))
    else:
        sys.exit("usage: python grpo_patches/compat.py pins [RELEASE] | releases")
