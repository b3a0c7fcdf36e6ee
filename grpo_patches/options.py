"""The options of :func:`grpo_patches.apply`, checked once, where the user passes them."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from .generation import FastGenerationConfig
from .rewards import PLACEMENTS, REWARD_FAILURES

__all__ = ["MAX_REWARD_TIMEOUT", "SPEED_OPTIONS", "PatchOptions", "resolve_speed"]

MAX_REWARD_TIMEOUT = 86400.0  # one day: longer is a hang by any measure (and overflows timers past ~1e9 s)

#: What ``apply(speed=True)`` turns on: the GPU path measured fastest at every batch tried (docs/performance.md).
SPEED_OPTIONS = ("fast_generation", "lean_lora", "compile_training", "compile_reward_models", "freeze_gc")


def _plain(value: Any) -> Any:
    """A NumPy (or other ``numbers``) scalar as the Python ``bool`` / ``int`` / ``float`` it stands for, so
    ``np.int64(8)`` or ``np.True_`` from a config file means what it says; anything else unchanged."""
    if isinstance(value, bool | str | type(None)):
        return value
    if type(value).__name__ in ("bool_", "bool") and hasattr(value, "dtype"):  # numpy's bool scalar
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def resolve_speed(speed: bool, **given: Any) -> dict[str, Any]:
    """The speed options after the ``speed`` switch: one given (not ``None``) wins, ``None`` follows it.

    Refused here, naming the option, where the switch would turn on one that cannot apply, so a user
    learns which one to pass as ``False`` rather than getting a speed path with a piece silently missing.
    """
    speed = _plain(speed)
    given = {name: _plain(value) for name, value in given.items()}
    if not isinstance(speed, bool):
        raise TypeError(
            f"grpo_patches.apply: speed={speed!r} must be True ({', '.join(SPEED_OPTIONS)} on, each still "
            f"overridable) or False (each as given, off by default)."
        )
    out = {name: (speed if given.get(name) is None else given[name]) for name in SPEED_OPTIONS}
    if speed and given.get("lean_lora") is None:
        from .lean_lora import check_supported

        try:
            check_supported()
        except ValueError as exc:
            raise ValueError(f"grpo_patches.apply: speed=True turns on lean_lora, which cannot apply here: {exc} "
                             f"Pass lean_lora=False to keep the others.") from exc
    return out


@dataclass(frozen=True)
class PatchOptions:
    reward_placement: str = "local"
    reward_chunk_size: int | None = None
    reward_timeout: float = 600.0
    strict: bool = True
    fast_generation: FastGenerationConfig | None = None
    lean_lora: bool = False
    compile_training: bool = False
    reward_failure: str = "raise"
    compile_reward_models: bool = False
    freeze_gc: bool = False

    def __post_init__(self) -> None:
        for name in ("reward_chunk_size", "reward_timeout", "strict", "lean_lora", "compile_training",
                     "compile_reward_models", "freeze_gc"):
            object.__setattr__(self, name, _plain(getattr(self, name)))
        # None: not given (a fork's config default), so off
        for name in ("lean_lora", "compile_training", "compile_reward_models", "freeze_gc"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, False)
        if self.reward_placement not in PLACEMENTS:
            raise ValueError(
                f"grpo_patches.apply: reward_placement={self.reward_placement!r} is not one of {PLACEMENTS}: "
                f"'local' scores on every rank, 'main' on the main process only."
            )
        if not isinstance(self.reward_failure, str) or self.reward_failure not in REWARD_FAILURES:
            raise ValueError(
                f"grpo_patches.apply: reward_failure={self.reward_failure!r} is not one of {REWARD_FAILURES}: what a "
                f"reward call that fails or times out does: 'raise' (every rank raises, the default), 'no_reward' "
                f"(that function gives its rows no reward), 'drop_group' (its groups are left out of the step)."
            )
        chunk = self.reward_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(
                f"grpo_patches.apply: reward_chunk_size={chunk!r} must be None (one chunk) or a positive "
                f"multiple of num_generations."
            )
        timeout = self.reward_timeout
        if (isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout)
                or not 0 < timeout <= MAX_REWARD_TIMEOUT):
            raise ValueError(
                f"grpo_patches.apply: reward_timeout={timeout!r} must be a number of seconds in "
                f"(0, {MAX_REWARD_TIMEOUT:g}] (one day): the bound after which every rank raises when reward "
                f"computation hangs. Pass e.g. reward_timeout=600."
            )
        if not isinstance(self.strict, bool):
            raise TypeError(
                f"grpo_patches.apply: strict={self.strict!r} must be True (refuse an untested TRL release) or "
                f"False (warn and patch nothing)."
            )
        if not isinstance(self.lean_lora, bool):
            raise TypeError(
                f"grpo_patches.apply: lean_lora={self.lean_lora!r} must be True (LoRA layers skip PEFT's fp32 "
                f"copy of their input under autocast) or False (PEFT's forward as it is)."
            )
        if self.lean_lora:
            from .lean_lora import check_supported

            check_supported()
        if not isinstance(self.compile_training, bool):
            raise TypeError(
                f"grpo_patches.apply: compile_training={self.compile_training!r} must be True (the policy's decoder "
                f"layers compiled for the training forward and backward) or False (eager, as stock)."
            )
        if not isinstance(self.compile_reward_models, bool):
            raise TypeError(
                f"grpo_patches.apply: compile_reward_models={self.compile_reward_models!r} must be True (the reward "
                f"models' decoder layers compiled for scoring) or False (eager, as stock)."
            )
        if not isinstance(self.freeze_gc, bool):
            raise TypeError(
                f"grpo_patches.apply: freeze_gc={self.freeze_gc!r} must be True (Python's collector frozen after "
                f"the first step, unfrozen at the end of training) or False (as stock)."
            )

    @property
    def collective_timeout(self) -> float:
        """How long a rank waits for its peers in the kit's exchanges.

        Longer than ``reward_timeout`` (the main process may score for that long while the others
        wait) by a margin for skew between ranks; TRL gathers prompt lengths right before scoring,
        so ranks arrive nearly together.
        """
        return self.reward_timeout + 15.0 + 0.1 * self.reward_timeout


_active: PatchOptions | None = None


def active() -> PatchOptions | None:
    """The options of the current :func:`grpo_patches.apply`, read by trainers built after it."""
    return _active


def set_active(options: PatchOptions | None) -> None:
    global _active
    _active = options
