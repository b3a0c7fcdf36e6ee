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
from .targets.trl_v019 import ADAPTER as TRL_V019

__all__ = ["ADAPTERS", "NothingToPatch", "UnsupportedVersionError", "installed_trl_version", "select"]

ADAPTERS: tuple[Adapter, ...] = (TRL_V019,)
ALLOW_UNKNOWN_ENV = "GRPO_PATCHES_ALLOW_UNKNOWN"


class UnsupportedVersionError(RuntimeError):
    """The installed TRL release is outside the tested range, or its internals moved."""


class NothingToPatch(Exception):  # noqa: N818 - a signal, not an error
    """The installed release already keeps groups rank-local (TRL 0.14)."""


def installed_trl_version() -> Version:
    try:
        return Version(dist_version("trl"))
    except PackageNotFoundError:
        raise UnsupportedVersionError("grpo_patches: TRL is not installed (pip install trl).") from None


def select(version: Version) -> Adapter:
    supported = compat.supported_range()
    if any(version.release[:2] == free.release[:2] for free in compat.grpo_free_releases()):
        raise NothingToPatch(
            f"TRL {version} generates each prompt's num_generations completions inside one process "
            f"(num_return_sequences), so groups are already rank-local; grpo_patches leaves it unpatched."
        )
    allow_unknown = os.environ.get(ALLOW_UNKNOWN_ENV) == "1"
    if compat.tested_release_for(version) is None and not allow_unknown:
        raise UnsupportedVersionError(
            f"grpo_patches: TRL {version} is not a tested release; supported: {supported}. "
            f"Install a supported release (pip install 'trl=={compat.tested_releases()[-1]}'), or set "
            f"{ALLOW_UNKNOWN_ENV}=1 to try the nearest adapter at your own risk."
        )
    candidates = [a for a in ADAPTERS if a.covers(version)]
    if not candidates and allow_unknown:
        earlier = [a for a in ADAPTERS if any(Version(s.version) <= version for s in a.releases if s.operator == ">=")]
        candidates = earlier[-1:]
    if not candidates:
        raise UnsupportedVersionError(
            f"grpo_patches: no adapter covers TRL {version}; supported: {supported}."
        )
    adapter = candidates[0]
    problems = adapter.check()
    if problems:
        raise UnsupportedVersionError(
            f"grpo_patches: TRL {version}'s GRPOTrainer differs from what adapter '{adapter.key}' was written "
            f"for, so it is not patched: " + "; ".join(problems) + f". Supported: {supported}."
        )
    return adapter
