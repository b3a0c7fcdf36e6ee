"""grpo-patches: multi-GPU GRPO + LoRA that keeps every group on one rank and fails fast.

Call :func:`apply` before building ``trl.GRPOTrainer``::

    import grpo_patches
    grpo_patches.apply(reward_placement="main", reward_chunk_size=64)
    trainer = trl.GRPOTrainer(...)

What the patch does to each trainer built afterwards:

* rejects, at construction, a batch shape that would split a group of ``num_generations``
  completions across ranks, naming the nearest valid settings;
* samples prompts so that every rank generates, scores and normalizes whole groups, using every
  dataset row (upstream drops each epoch's last partial batch) in a resume-stable order;
* computes rewards on each rank (``"local"``) or on the main process only (``"main"``: reward
  models are loaded there alone, scored in chunks of whole groups, each rank gets its own rows
  back), with ``num_generations`` and ``group_ids`` given to reward functions that accept them;
* turns an exception, a wrong-length or non-finite reward, or a reward call running past
  ``reward_timeout`` on any rank into an error on every rank, naming the function and the rank.
* on request, samples through compiled decoding (``fast_generation``), lets the policy's LoRA
  layers skip PEFT's fp32 copy of their inputs under autocast (``lean_lora``) and compiles its
  decoder layers for the training forward and backward (``compile_training``) and the reward
  models' decoder layers for scoring (``compile_reward_models``), keeps Python's collector off what
  the first step built (``freeze_gc``) and lets the host queue the next micro-batch while the device runs
  this one (``overlap_micro_batches``); ``speed=True`` turns all six on.

Besides the patch: :mod:`grpo_patches.defaults` (pinned LoRA / GRPO settings as real PEFT / TRL
config objects), :func:`preflight` (per-rank memory estimate on the meta device, before a step
runs) and :class:`GRPOMonitorCallback` (a GRPO run's health metrics through the Trainer's loggers).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from . import options as _options
from . import surface as _surface
from .collectives import CollectiveTimeoutError, RemoteFailureError
from .grouping import GroupShapeError
from .patching import AppliedPatch, patch, unpatch
from .registry import NothingToPatch, UnsupportedVersionError, installed_trl_version, select

__all__ = [
    "CollectiveTimeoutError",
    "GRPOMonitorCallback",
    "GroupShapeError",
    "RemoteFailureError",
    "UnsupportedVersionError",
    "apply",
    "defaults",
    "is_applied",
    "preflight",
    "revert",
]

_LAZY = {  # heavier imports (transformers, peft), loaded on first use
    "preflight": ("grpo_patches.preflight", None),  # the module, callable as preflight() (preflight/__init__.py)
    "GRPOMonitorCallback": ("grpo_patches.monitor", "GRPOMonitorCallback"),
    "defaults": ("grpo_patches.defaults", None),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        loaded = importlib.import_module(module)
        return loaded if attr is None else getattr(loaded, attr)
    raise AttributeError(f"module 'grpo_patches' has no attribute {name!r}")

__version__ = _surface.VERSION

_lock = threading.Lock()
TARGETS = ("trl", "vendored")
_applied: list[AppliedPatch] = []  # TRL's GRPOTrainer, then the vendored DeepSeekMath-style trainer


def apply(
    *,
    reward_placement: str = "local",
    reward_chunk_size: int | None = None,
    reward_timeout: float = 600.0,
    reward_failure: str = "raise",
    strict: bool = True,
    fast_generation: bool | dict | Any = None,
    lean_lora: bool | None = None,
    compile_training: bool | None = None,
    compile_reward_models: bool | None = None,
    freeze_gc: bool | None = None,
    overlap_micro_batches: bool | None = None,
    speed: bool = False,
    targets: tuple[str, ...] = TARGETS,
) -> bool:
    """Patch ``trl.GRPOTrainer`` in place; returns whether a patch is active afterwards.

    The vendored trainer (:mod:`grpo_patches.vendored.dsm_grpo`) is patched with it, with the
    same options. Each option's help (below) lives in :mod:`grpo_patches.surface`, which the fork
    patches' ``GRPOConfig`` fields read too.

    Calling ``apply()`` again never wraps twice; it replaces the options for trainers built
    afterwards. Trainers built before the first ``apply()`` stay unpatched.
    """
    from .generation import FastGenerationConfig

    fast = _options.resolve_speed(speed, fast_generation=fast_generation, lean_lora=lean_lora,
                                  compile_training=compile_training, compile_reward_models=compile_reward_models,
                                  freeze_gc=freeze_gc, overlap_micro_batches=overlap_micro_batches)
    opts = _options.PatchOptions(reward_placement, reward_chunk_size, reward_timeout, strict,
                                 FastGenerationConfig.coerce(fast["fast_generation"]), fast["lean_lora"],
                                 fast["compile_training"], reward_failure, fast["compile_reward_models"],
                                 fast["freeze_gc"], fast["overlap_micro_batches"])
    chosen = tuple(targets) if isinstance(targets, list | tuple) else (targets,)
    if not chosen or any(t not in TARGETS for t in chosen):
        raise ValueError(f"grpo_patches.apply: targets={targets!r}; expected a non-empty tuple of {TARGETS}.")
    with _lock:
        if _applied:
            if {"vendored" if a.adapter.key == "dsm" else "trl" for a in _applied} != set(chosen):
                raise ValueError(f"grpo_patches.apply: targets={targets!r} differ from the patched ones; call "
                                 f"grpo_patches.revert() first.")
            _options.set_active(opts)
            return True
        from .targets.dsm import ADAPTER as DSM

        if "trl" not in chosen:
            _applied.append(patch(DSM))
            _options.set_active(opts)
            return True
        version = installed_trl_version()
        try:
            adapter = select(version)
        except NothingToPatch as note:
            warnings.warn(f"grpo_patches: {note}", stacklevel=2)
            return False
        except UnsupportedVersionError as exc:
            if strict:
                raise
            warnings.warn(f"{exc} Nothing was patched (strict=False).", stacklevel=2)
            return False
        _applied.append(patch(adapter))
        if "vendored" in chosen:
            try:
                _applied.append(patch(DSM))
            except Exception:
                unpatch(_applied.pop())
                raise
        _options.set_active(opts)
        return True


if apply.__doc__:  # None under python -OO
    apply.__doc__ += "\n" + _surface.args_section()


def revert() -> None:
    """Restore every patched attribute to the identical original object. A no-op if not applied."""
    with _lock:
        while _applied:
            unpatch(_applied.pop())
        _options.set_active(None)


def is_applied() -> bool:
    """Whether :func:`apply` patched a trainer (TRL's, the vendored one) and :func:`revert` has not undone it."""
    return bool(_applied)
