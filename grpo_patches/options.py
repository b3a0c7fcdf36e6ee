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

#: The speed options that are plain switches: what ``True`` and ``False`` mean, for the refusal of another value.
_SWITCHES = {
    "lean_lora": ("LoRA layers skip PEFT's fp32 copy of their input under autocast", "PEFT's forward as it is"),
    "compile_training": ("the policy's decoder layers compiled for the training forward and backward",
                         "eager, as stock"),
    "compile_reward_models": ("the reward models' decoder layers compiled for scoring", "eager, as stock"),
    "freeze_gc": ("Python's collector frozen after the first step, unfrozen at the end of training", "as stock"),
    "overlap_micro_batches": ("the host queues the next micro-batch while the device runs this one (no read of the "
                              "loss or the padding mask between them)", "as stock"),
}
#: What ``apply(speed=True)`` turns on: the GPU path measured fastest at every batch tried (docs/performance.md).
SPEED_OPTIONS = ("fast_generation", *_SWITCHES)


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
    overlap_micro_batches: bool = False

    def __post_init__(self) -> None:
        for name in ("reward_chunk_size", "reward_timeout", "strict", *_SWITCHES):
            object.__setattr__(self, name, _plain(getattr(self, name)))
        # None: not given (a fork's config default), so off
        for name in _SWITCHES:
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
        for name, (on, off) in _SWITCHES.items():
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"grpo_patches.apply: {name}={value!r} must be True ({on}) or False ({off}).")
            if name == "lean_lora" and value:  # refused where it would change nothing, before the later switches
                from .lean_lora import check_supported

                check_supported()

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
