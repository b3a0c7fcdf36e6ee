"""The one switch a scenario uses to turn the kit on or off, in either mode.

``GRPO_PATCHES_KIT_MODE=monkeypatch`` (default): ``enable(**options)`` is ``grpo_patches.apply(**options)``,
``disable()`` is ``grpo_patches.revert()``. ``GRPO_PATCHES_KIT_MODE=fork``: the installed TRL carries
``patches/trl-<release>.patch`` and grpo_patches is not importable; ``enable(**options)`` makes every
config built by :func:`grpo_args` carry the options as GRPOConfig fields (``grpo_patches=True``),
``disable()`` sets ``grpo_patches=False`` (the release's own code path). Options are read when a
trainer is built, in both modes, so a scenario written against ``apply()`` / ``revert()`` runs in
both by calling these instead (and ``kit.grpo_args`` instead of ``helpers.grpo_args``).
"""

from __future__ import annotations

import os
from typing import Any

import helpers

MODE = os.environ.get("GRPO_PATCHES_KIT_MODE", "monkeypatch")
if MODE not in ("monkeypatch", "fork"):
    raise SystemExit(f"GRPO_PATCHES_KIT_MODE={MODE!r}: expected 'monkeypatch' or 'fork'")

if MODE == "fork":
    import importlib.util

    if importlib.util.find_spec("grpo_patches") is not None:
        raise SystemExit("fork mode: grpo_patches is importable here; the fork must run without it")
    from trl.trainer.grpo_rank_local.collectives import RemoteFailureError
    from trl.trainer.grpo_rank_local.grouping import GroupShapeError
else:
    import grpo_patches
    from grpo_patches import GroupShapeError, RemoteFailureError

__all__ = ["MODE", "GroupShapeError", "RemoteFailureError", "disable", "enable", "grpo_args"]

_fork_settings: dict[str, Any] = {"grpo_patches": False}


def enable(**options: Any) -> None:
    """Turn the kit on for trainers built from now on, with these apply() options."""
    global _fork_settings
    if MODE == "fork":
        _fork_settings = {"grpo_patches": True, **options}
    else:
        grpo_patches.apply(**options)


def disable() -> None:
    """Trainers built from now on are upstream's."""
    global _fork_settings
    if MODE == "fork":
        _fork_settings = {"grpo_patches": False}
    else:
        grpo_patches.revert()


def grpo_args(**overrides: Any):
    """helpers.grpo_args, plus the kit's settings as GRPOConfig fields in fork mode."""
    if MODE == "fork":
        return helpers.grpo_args(**{**_fork_settings, **overrides})
    return helpers.grpo_args(**overrides)
