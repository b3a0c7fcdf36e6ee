"""Picks the adapter for the installed TRL release, or refuses it with the supported range.

Two gates, both before anything is patched: the release's minor series must be in the
compatibility table (tested), and the adapter's recorded signatures and anchors must match the
installed code. A release outside the table is refused even if an adapter's range would cover it:
an unknown future release is never patched silently wrong (``GRPO_PATCHES_ALLOW_UNKNOWN=1`` lets a
maintainer try one on purpose).
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

from packaging.version import Version

from . import compat
from .targets import Adapter
from .targets.trl_inline import V015, V016, V017, V018
from .targets.trl_v019 import ADAPTER as TRL_V019

__all__ = ["ADAPTERS", "NothingToPatch", "UnsupportedVersionError", "installed_trl_version", "select",
           "supported_range", "supported_releases"]

ADAPTERS: tuple[Adapter, ...] = (V015, V016, V017, V018, TRL_V019)
ALLOW_UNKNOWN_ENV = "GRPO_PATCHES_ALLOW_UNKNOWN"


def _env_flag(name: str) -> bool:
    """A yes/no environment variable as a shell user writes it; any other value is refused, naming it."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"grpo_patches: {name}={os.environ[name]!r} must be 1 (yes) or 0 (no).")


class UnsupportedVersionError(RuntimeError):
    """The installed TRL release is outside the tested range, or its internals moved."""


class NothingToPatch(Exception):  # noqa: N818 - a signal, not an error
    """The installed release already keeps groups rank-local (TRL 0.14)."""


def installed_trl_version() -> Version:
    try:
        return Version(dist_version("trl"))
    except PackageNotFoundError:
        raise UnsupportedVersionError("grpo_patches: TRL is not installed (pip install trl).") from None


def supported_releases() -> list[Version]:
    """Tested releases (compat.json) whose era has an adapter here."""
    keys = {a.key for a in ADAPTERS}
    rows = compat.table()["supported"]
    return sorted(Version(v) for v, row in rows.items() if row.get("era") in keys)


def supported_range() -> str:
    releases = supported_releases()
    first, last = releases[0], releases[-1]
    return f"trl {first.major}.{first.minor}.x - {last.major}.{last.minor}.x"


def _tested_row(version: Version) -> dict | None:
    """The compat.json row of ``version``'s minor series (patch releases share a minor's code)."""
    for release, row in compat.table()["supported"].items():
        if Version(release).release[:2] == version.release[:2]:
            return row
    return None


def select(version: Version) -> Adapter:
    supported = supported_range()
    if any(version.release[:2] == free.release[:2] for free in compat.grpo_free_releases()):
        raise NothingToPatch(
            f"TRL {version} generates each prompt's num_generations completions inside one process "
            f"(num_return_sequences), so groups are already rank-local; grpo_patches leaves it unpatched."
        )
    allow_unknown = _env_flag(ALLOW_UNKNOWN_ENV)
    row = _tested_row(version)
    by_key = {a.key: a for a in ADAPTERS}
    if row is not None and row.get("era") in by_key and by_key[row["era"]].covers(version):
        adapter = by_key[row["era"]]
    elif allow_unknown:
        # the adapter of the nearest supported release below this one
        below = [v for v in supported_releases() if v <= version]
        if not below:
            raise UnsupportedVersionError(f"grpo_patches: no adapter for TRL {version}; supported: {supported}.")
        adapter = by_key[compat.table()["supported"][str(below[-1])]["era"]]
    else:
        reason = ("is not a tested release" if row is None else
                  f"belongs to the '{row.get('era')}' era, which has no adapter yet")
        raise UnsupportedVersionError(
            f"grpo_patches: TRL {version} {reason}; supported: {supported}. Install a supported release "
            f"(pip install 'trl=={supported_releases()[-1]}'), or set {ALLOW_UNKNOWN_ENV}=1 to try the nearest "
            f"adapter at your own risk."
        )
    problems = adapter.check()
    if problems:
        raise UnsupportedVersionError(
            f"grpo_patches: TRL {version}'s GRPOTrainer differs from what adapter '{adapter.key}' was written "
            f"for, so it is not patched: " + "; ".join(problems) + f". Supported: {supported}."
        )
    return adapter
