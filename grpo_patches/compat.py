"""The compatibility table: tested TRL releases and the dependency set each was tested with.

One data file (``compat.json``) feeds the version check in :func:`grpo_patches.apply`, the nox
matrix and the README's table, so a release is listed once.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from packaging.version import Version

__all__ = ["grpo_free_releases", "supported_range", "table", "tested_release_for"]


@cache
def table() -> dict[str, Any]:
    return json.loads(resources.files(__package__).joinpath("compat.json").read_text())


def tested_releases() -> list[Version]:
    return sorted(Version(v) for v in table()["supported"])


def grpo_free_releases() -> list[Version]:
    """Releases that need no patch: each process already generates whole groups (TRL 0.14)."""
    return sorted(Version(v) for v in table().get("grpo_free", []))


def tested_release_for(version: Version) -> str | None:
    """The tested release of ``version``'s minor series (patch releases share a minor's code)."""
    for tested in table()["supported"]:
        if Version(tested).release[:2] == version.release[:2]:
            return tested
    return None


def supported_range() -> str:
    releases = tested_releases()
    return f"trl {releases[0].major}.{releases[0].minor}.x - {releases[-1].major}.{releases[-1].minor}.x"
