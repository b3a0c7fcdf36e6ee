"""How the matrix scenario turns the kit on and off: the one place that knows which mode runs.

The scenario (``tests/matrix/worker.py``) and its checks (``tests/matrix/test_invariants.py``) never
import ``grpo_patches``; they call :func:`enable_kit` / :func:`disable_kit`, merge :func:`config_fields`
into every ``GRPOConfig`` they build, catch :data:`SHAPE_ERRORS`, ask :func:`is_remote_failure`, and
read the I6 facts through :func:`declared_patch_points` / :func:`wrapped_original` / :func:`apply_again`.
``GRPO_PATCHES_MATRIX_MODE`` selects the mode:

``monkeypatch`` (default; ``nox -s trl-<release>``, the main suite): ``enable_kit(**options)`` is
``grpo_patches.apply(**options)``, ``disable_kit()`` is ``grpo_patches.revert()`` (pristine TRL for
the upstream half of every check), ``CAN_REVERT = True``.

``fork`` (``nox -s fork-<release>``, ``tests/test_patches_fork.py``): the installed TRL carries
``patches/grpo_rank_local.patch`` and ``patches/trl-<release>.patch`` and grpo_patches is not importable in the ranks (they run from a
scratch folder through ``tests/fork/drive.py``'s ``launch``, and :func:`check_rank_environment`
refuses to go on where it is). ``enable_kit(**options)`` stores ``{"grpo_patches": True, **options}``,
which :func:`config_fields` hands to every ``GRPOConfig`` built from then on (an option the fork has no
``GRPOConfig`` field for is a ``TypeError`` naming it); ``disable_kit()`` stores ``grpo_patches=False``:
the fork's off switch runs the release's own code, which ``tests/test_patches_fork.py`` shows equal to
pristine TRL (the matrix's upstream halves, fork off against ``revert()``-ed TRL, same release).
:data:`SHAPE_ERRORS` / :func:`is_remote_failure` use the bundled modules' classes
(``trl.trainer.grpo_rank_local``). ``CAN_REVERT = False``: a patched fork has no ``revert()``, so I6's
revert check is skipped; what of I6 applies is kept: every method the bundled adapter declares is
wrapped, and installing it again (the import-time ``install()`` a second time) changes nothing.

This module is cheap to import in the pytest process (no TRL import at module level in either mode).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

MODE = os.environ.get("GRPO_PATCHES_MATRIX_MODE", "monkeypatch")
if MODE not in ("monkeypatch", "fork"):
    raise SystemExit(f"tests/matrix/kit.py: GRPO_PATCHES_MATRIX_MODE={MODE!r}: expected 'monkeypatch' or 'fork'")

FORK = MODE == "fork"
CAN_REVERT = not FORK  # a patched fork cannot be reverted: the I6 revert check is monkeypatch-only
SWITCH = "grpo_patches"  # the patch's GRPOConfig field that turns it on / off

_fork_settings: dict[str, Any] = {SWITCH: False}


def check_rank_environment() -> dict:
    """Called by each rank before TRL is imported; fork mode: grpo_patches must not be importable."""
    importable = importlib.util.find_spec("grpo_patches") is not None
    if FORK and importable:
        raise SystemExit("tests/matrix/kit.py fork mode: grpo_patches is importable in this rank; "
                         "the patched fork must run without it (launch the ranks through tests/fork/drive.py)")
    return {"mode": MODE, "kit_importable": importable}


def _grpo_config_fields() -> set[str]:
    from trl import GRPOConfig

    return {f.name for f in dataclasses.fields(GRPOConfig)}


def enable_kit(**options: Any) -> None:
    """Turn the kit on with ``options`` (the keyword arguments of ``grpo_patches.apply``) for
    trainers built from now on."""
    global _fork_settings
    if FORK:
        fields = _grpo_config_fields()
        missing = sorted(name for name in {SWITCH, *options} if name not in fields)
        if missing:
            raise TypeError(f"fork mode: apply() option(s) {missing} have no GRPOConfig field in this patched "
                            f"TRL; the patch offers {sorted(fields & {SWITCH, 'reward_placement', 'reward_chunk_size', 'reward_timeout', 'fast_generation', 'lean_lora'})}")
        _fork_settings = {SWITCH: True, **options}
    else:
        import grpo_patches

        assert grpo_patches.apply(**options) is True


def disable_kit() -> None:
    """Back to stock TRL for trainers built from now on (the upstream half of every check)."""
    global _fork_settings
    if FORK:
        _fork_settings = {SWITCH: False}
    else:
        import grpo_patches

        grpo_patches.revert()


def config_fields() -> dict[str, Any]:
    """What the scenario merges into every GRPOConfig it builds (fork: the patch's fields; else none)."""
    return dict(_fork_settings) if FORK else {}


def _errors() -> tuple[type[BaseException], type[BaseException]]:
    if FORK:
        from trl.trainer.grpo_rank_local.collectives import RemoteFailureError
        from trl.trainer.grpo_rank_local.grouping import GroupShapeError
    else:
        from grpo_patches import GroupShapeError, RemoteFailureError
    return GroupShapeError, RemoteFailureError


def __getattr__(name: str):  # SHAPE_ERRORS: resolved on first use, so that importing this module stays cheap
    if name == "SHAPE_ERRORS":
        return (_errors()[0],)
    raise AttributeError(name)


def is_remote_failure(exc: BaseException) -> bool:
    """The documented error every rank raises when reward computation failed on any rank."""
    return isinstance(exc, _errors()[1])


def declared_patch_points() -> dict[type, list[str]]:
    """Every class attribute the selected adapters declare they wrap, read from the adapters themselves.

    monkeypatch: ``registry.select(...).available()`` and the vendored trainer's adapter. fork: the
    bundled adapter's wrappers that the patched ``GRPOTrainer`` has (the vendored trainer's patch is a
    separate file, checked by tests/test_patches_fork.py)."""
    if FORK:
        from trl import GRPOTrainer
        from trl.trainer import grpo_rank_local

        adapter = grpo_rank_local._ADAPTER
        names = [n for n in adapter.wrappers if n not in adapter.optional or getattr(GRPOTrainer, n, None) is not None]
        return {GRPOTrainer: names}
    from grpo_patches import registry
    from grpo_patches.targets.dsm import ADAPTER as DSM

    out: dict[type, list[str]] = {}
    for adapter in (registry.select(registry.installed_trl_version()), DSM):
        out.setdefault(adapter.target_class(), []).extend(adapter.available())
    return out


def wrapped_original(attr: Any) -> Any:
    """The function the kit's wrapper ``attr`` calls through to; ``None`` where ``attr`` is no kit wrapper
    (monkeypatch: a ``wrapt.FunctionWrapper``; fork: the bundle's ``functools.wraps`` wrapper, which
    carries ``_self_wrapper`` as wrapt's does)."""
    if FORK:
        return attr.__wrapped__ if hasattr(attr, "_self_wrapper") and hasattr(attr, "__wrapped__") else None
    import wrapt

    return attr.__wrapped__ if isinstance(attr, wrapt.FunctionWrapper) else None


def apply_again() -> None:
    """The kit's install step a second time, which must change nothing (I6 idempotence): monkeypatch
    ``grpo_patches.apply()`` with the options in force; fork: the patch's import-time ``install()``."""
    if FORK:
        from trl import GRPOConfig, GRPOTrainer
        from trl.trainer import grpo_rank_local

        grpo_rank_local.install(GRPOTrainer, GRPOConfig)
    else:
        import grpo_patches

        assert grpo_patches.apply() is True


def release_is_supported(trl_version) -> bool:
    """Whether the matrix's invariant checks run for this release (else: the refusal check). Fork mode:
    a patch exists for it (patches/trl-<release>.patch, from compat.json)."""
    if FORK:
        from pathlib import Path

        return (Path(__file__).resolve().parents[2] / "patches" / f"trl-{trl_version}.patch").exists()
    from grpo_patches import registry

    return (any(v.release[:2] == trl_version.release[:2] for v in registry.supported_releases())
            or os.environ.get(registry.ALLOW_UNKNOWN_ENV) == "1")  # the canary's opt-in mode


def refusal_check(trl_version) -> None:
    """A release without an adapter: apply() refuses it clearly, or (0.14) leaves it alone. Monkeypatch only."""
    import warnings

    import grpo_patches

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            applied = grpo_patches.apply()
        assert applied is False and any("already rank-local" in str(w.message) for w in caught)
    except grpo_patches.UnsupportedVersionError as exc:
        assert str(trl_version) in str(exc) and "supported: trl" in str(exc)
    assert not grpo_patches.is_applied()
