"""How the matrix scenario turns the kit on and off: the one place a fork mode replaces.

The scenario (``tests/matrix/worker.py``) never calls ``grpo_patches`` directly for the patch
itself; it calls :func:`enable_kit` / :func:`disable_kit` and catches :data:`SHAPE_ERRORS` /
reads :func:`is_remote_failure`. A mode that runs the same invariants against a *patched TRL
checkout* (``patches/trl-<release>.patch``, grpo_patches not importable) swaps this module's
functions for ones that set the fork's own switches; the scenario and its assertions stay as they are.

``GRPO_PATCHES_MATRIX_MODE`` selects the mode; only ``monkeypatch`` exists today. A fork mode also
needs stock TRL for the upstream half of every check (:func:`disable_kit`), e.g. by running the
upstream scenarios in an unpatched environment, and sets ``CAN_REVERT = False`` (I6 is then skipped).
"""

from __future__ import annotations

import os
from typing import Any

MODE = os.environ.get("GRPO_PATCHES_MATRIX_MODE", "monkeypatch")
if MODE != "monkeypatch":
    raise SystemExit(f"tests/matrix/kit.py: GRPO_PATCHES_MATRIX_MODE={MODE!r} is not implemented yet")

import grpo_patches  # noqa: E402

SHAPE_ERRORS: tuple[type[BaseException], ...] = (grpo_patches.GroupShapeError,)
CAN_REVERT = True  # a patched fork cannot be turned off: the I6 checks are monkeypatch-only


def enable_kit(**options: Any) -> None:
    """Turn the kit on with ``options`` (the keyword arguments of ``grpo_patches.apply``) for
    trainers built from now on."""
    assert grpo_patches.apply(**options) is True


def disable_kit() -> None:
    """Back to stock TRL for trainers built from now on (the upstream half of every check)."""
    grpo_patches.revert()


def is_remote_failure(exc: BaseException) -> bool:
    """The documented error every rank raises when reward computation failed on any rank."""
    return isinstance(exc, grpo_patches.RemoteFailureError)


def declared_patch_points() -> dict[type, list[str]]:
    """Every class attribute the selected adapters declare they wrap, read from the adapters
    themselves (``registry.select(...).available()`` and the vendored trainer's adapter)."""
    from grpo_patches import registry
    from grpo_patches.targets.dsm import ADAPTER as DSM

    out: dict[type, list[str]] = {}
    for adapter in (registry.select(registry.installed_trl_version()), DSM):
        out.setdefault(adapter.target_class(), []).extend(adapter.available())
    return out
