"""Rank-local GRPO groups: the shape rule, its error message, and the sampler.

A GRPO group is the G completions of one prompt. Upstream TRL (0.15+) repeats each prompt G times
in its sampler and lets accelerate cut the index stream into per-rank batches, so a group lands on
one rank only when each rank's batch is a multiple of G; TRL checks divisibility of the *global*
batch only and silently splits groups otherwise (TRL issues #3896, #5030). This module states the
per-rank rule, suggests the nearest valid settings, and provides a sampler that keeps whole groups
together, uses every dataset row exactly once per pass and is a pure function of (seed, epoch), so a
resumed run sees the same order. No TRL import here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = [
    "GroupShapeError",
    "RankLocalGroupSampler",
    "check_group_shape",
    "epoch_of_state",
    "nearest_valid_settings",
    "resolve_steps_per_generation",
]


class GroupShapeError(ValueError):
    """A batch shape with which some group of G completions would straddle two ranks."""


def _nearest_multiples(value: int, step: int) -> list[int]:
    """The multiples of ``step`` just below and above ``value`` (positive, other than ``value``)."""
    below, above = (value // step) * step, math.ceil(value / step) * step
    return sorted({v for v in (below, above) if v >= 1 and v != value}, key=lambda v: (abs(v - value), v))


def nearest_valid_settings(per_device_batch_size: int, steps_per_generation: int, num_generations: int) -> list[str]:
    """Ways to make ``per_device_batch_size * steps_per_generation`` a multiple of ``num_generations``.

    Each suggestion changes one setting and is the closest value to the current one.
    """
    b, s, g = per_device_batch_size, steps_per_generation, num_generations
    out: list[str] = []
    # b*s % g == 0 holds when b is a multiple of g / gcd(s, g), or s a multiple of g / gcd(b, g).
    for name, value, step in (("per_device_train_batch_size", b, g // math.gcd(s, g)),
                              ("steps_per_generation", s, g // math.gcd(b, g))):
        candidates = _nearest_multiples(value, step)
        if candidates:
            out.append(f"{name}=" + " or ".join(str(v) for v in candidates))
    # num_generations: a divisor of b*s that is >= 2, nearest to g.
    divisors = [d for d in range(2, b * s + 1) if (b * s) % d == 0]
    if divisors:
        best = sorted(divisors, key=lambda d: (abs(d - g), -d))[:2]
        out.append("num_generations=" + " or ".join(str(v) for v in sorted(best)))
    return out


def resolve_steps_per_generation(settings: Any, *, world_size: int) -> int:
    """Micro-batches per generation round, derived as TRL's ``GRPOConfig.__post_init__`` (0.19+) does.

    ``settings``: a mapping of GRPO settings or a config object. ``steps_per_generation`` when set;
    else ``generation_batch_size / (per_device_train_batch_size * world_size)``; else
    ``gradient_accumulation_steps`` (default 1). A mapping that sets both, or a generation batch that
    is not a whole number of global batches, is refused as TRL refuses it. A built ``GRPOConfig`` has
    both filled in by TRL: there ``steps_per_generation`` is read. The one place the kit derives it
    (preflight, ``grpo-patches doctor``, defaults and the TRL adapters' shape readers).
    """
    def get(name: str) -> Any:
        value = settings.get(name) if isinstance(settings, Mapping) else getattr(settings, name, None)
        return None if value is None else int(value)

    steps, gen_batch = get("steps_per_generation"), get("generation_batch_size")
    if steps is not None and gen_batch is not None and isinstance(settings, Mapping):
        raise ValueError(
            f"grpo_patches: steps_per_generation={steps} and generation_batch_size={gen_batch} are both set; TRL "
            f"accepts one of them (generation_batch_size = per_device_train_batch_size x world_size x "
            f"steps_per_generation). Drop one."
        )
    if steps is not None:
        if steps < 1:
            raise ValueError(f"grpo_patches: steps_per_generation={steps} must be >= 1.")
        return steps
    if gen_batch is not None:
        per_step = (get("per_device_train_batch_size") or 1) * world_size
        if gen_batch < 1 or gen_batch % per_step:
            raise ValueError(
                f"grpo_patches: generation_batch_size={gen_batch} must be a positive multiple of the global batch "
                f"per_device_train_batch_size x world_size = {per_step} (as TRL requires); nearest: "
                f"{max(per_step, gen_batch // per_step * per_step)} or {-(-gen_batch // per_step) * per_step}."
            )
        return gen_batch // per_step
    return get("gradient_accumulation_steps") or 1


def check_group_shape(
    *,
    per_device_batch_size: int,
    steps_per_generation: int,
    num_generations: int,
    world_size: int,
    mode: str = "train",
) -> None:
    """Raise :class:`GroupShapeError` unless each rank generates whole groups.

    The rule (the corrected form of the common advice "group size divisible by the number of GPUs", which
    says nothing about how a rank's completions are cut):
    the completions one rank generates per generation round, ``per_device_batch_size *
    steps_per_generation``, must be a multiple of ``num_generations``.
    """
    if num_generations < 1:
        raise GroupShapeError(f"num_generations={num_generations} must be >= 1.")
    per_rank = per_device_batch_size * steps_per_generation
    if per_rank % num_generations == 0:
        return
    batch_name = "per_device_train_batch_size" if mode == "train" else "per_device_eval_batch_size"
    gen_name = "num_generations" if mode == "train" else "num_generations_eval"
    fixes = nearest_valid_settings(per_device_batch_size, steps_per_generation, num_generations)
    if mode != "train":
        fixes = [f.replace("per_device_train_batch_size", batch_name).replace("num_generations", gen_name) for f in fixes
                 if not f.startswith("steps_per_generation")]
    if world_size > 1:
        consequence = (f"with world_size={world_size} some groups would be split across ranks (stock TRL "
                       f"accepts this and splits them silently)")
    else:  # one process: nothing is split across ranks, but a group is cut across two batches
        consequence = (f"some groups would be cut across two {mode} batches (stock TRL then fails reshaping "
                       f"the rewards into groups, or normalizes partial groups)")
    raise GroupShapeError(
        f"grpo_patches: each rank generates {batch_name}={per_device_batch_size} x "
        f"steps_per_generation={steps_per_generation} = {per_rank} completions per round ({mode}), "
        f"which is not a multiple of {gen_name}={num_generations}; {consequence}. "
        f"Nearest valid settings: {'; '.join(fixes)}."
        + (" (TRL sets steps_per_generation to gradient_accumulation_steps unless it is given.)"
           if mode == "train" else "")
    )


class RankLocalGroupSampler(Sampler[int]):
    """Index stream of whole groups, cut so that every rank's share holds whole groups.

    The stream has the layout of TRL's ``RepeatSampler``: prompts are taken ``prompts_per_batch``
    at a time; each such chunk is emitted ``repeat_count`` times, each prompt ``num_generations``
    times in a row. accelerate hands rank r the r-th consecutive slice of every global batch, so
    with the per-rank shape checked by :func:`check_group_shape` no group crosses a rank boundary.

    Two differences from upstream, both about I2 (coverage). Upstream drops the rows of each
    epoch's last, incomplete generation batch (a different set every epoch, never reported); here
    they open the next epoch instead (see :meth:`epoch_prompts`), so no row is lost. And the order
    of epoch ``e`` depends only on ``(seed, e)`` (upstream advances one generator per ``__iter__``,
    so a resumed run restarts the sequence), so resuming from a checkpoint replays the same
    prompts. When ``len(data_source)`` is a multiple of ``prompts_per_batch`` every epoch is one
    permutation, the same indices in the same order as upstream.

    Which epoch is being iterated: ``epoch_source`` when given (the trainer's own count, see
    :func:`epoch_of_state`), else the last :meth:`set_epoch`, else one more than the previous pass.
    The trainer must be asked because ``set_epoch`` does not reliably arrive: accelerate 1.4
    forwards it to no sampler under its ``BatchSamplerShard``, and on resume every release wraps
    the loader once more (``skip_first_batches``), out of reach of transformers' own forwarding; a
    fresh sampler then replays epoch 0 in the middle of epoch 1 (seen on TRL 1.16 and 0.15).
    """

    def __init__(
        self,
        data_source: Sized,
        num_generations: int,
        prompts_per_batch: int,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        epoch_source: Callable[[], int] | None = None,
    ) -> None:
        self.num_rows = len(data_source)
        if prompts_per_batch < 1 or num_generations < 1 or repeat_count < 1:
            raise ValueError(
                f"prompts_per_batch={prompts_per_batch}, num_generations={num_generations} and "
                f"repeat_count={repeat_count} must all be >= 1."
            )
        if self.num_rows < prompts_per_batch:
            raise ValueError(
                f"grpo_patches: the dataset has {self.num_rows} rows but one generation round takes "
                f"{prompts_per_batch} prompts; use a larger dataset or a smaller generation batch."
            )
        self.num_generations = num_generations
        self.prompts_per_batch = prompts_per_batch
        self.repeat_count = repeat_count
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.epoch_source = epoch_source
        self._perms: list[list[int]] = []
        self._epochs: list[list[int]] = []
        self._deferred: list[int] = []
        self._pass = self._pos = 0
        self._generator: torch.Generator | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.num_rows // self.prompts_per_batch

    def set_epoch(self, epoch: int) -> None:
        """Called by accelerate / transformers at the start of every epoch (also when resuming)."""
        self.epoch = epoch

    def _permutation(self, j: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        if self._generator is None:
            self._generator = torch.Generator()
            self._generator.manual_seed(self.seed)
        while len(self._perms) <= j:
            self._perms.append(torch.randperm(self.num_rows, generator=self._generator).tolist())
        return self._perms[j]

    def epoch_prompts(self, epoch: int) -> list[int]:
        """The dataset rows of one epoch, in order: ``batches_per_epoch * prompts_per_batch`` distinct rows.

        Rows come from a stream of whole permutations (the ones upstream draws). Epoch ``e`` takes
        the next rows of the stream; where the stream crosses into the next permutation, a row that
        the epoch already holds is deferred to the start of the next epoch instead of repeated. So
        no row is dropped or repeated within an epoch, and over any run every row is used equally
        often, +-1.
        """
        n = self.batches_per_epoch * self.prompts_per_batch
        while len(self._epochs) <= epoch:
            rows: list[int] = []
            seen: set[int] = set()
            deferred: list[int] = []
            pending = self._deferred
            while len(rows) < n:
                row = pending.pop(0) if pending else self._next_in_stream()
                (deferred if row in seen else rows).append(row)
                seen.add(row)
            self._deferred = pending + deferred
            self._epochs.append(rows)
        return self._epochs[epoch]

    def _next_in_stream(self) -> int:
        perm = self._permutation(self._pass)
        row = perm[self._pos]
        self._pos += 1
        if self._pos == len(perm):
            self._pass, self._pos = self._pass + 1, 0
        return row

    def __iter__(self) -> Iterator[int]:
        if self.epoch_source is not None:
            self.epoch = self.epoch_source()
        rows = self.epoch_prompts(self.epoch)
        self.epoch += 1  # a plain DataLoader never calls set_epoch: move on by itself
        p, g = self.prompts_per_batch, self.num_generations
        for start in range(0, len(rows), p):
            chunk = rows[start : start + p]
            for _ in range(self.repeat_count):
                for index in chunk:
                    for _ in range(g):
                        yield index

    def __len__(self) -> int:
        return self.batches_per_epoch * self.prompts_per_batch * self.num_generations * self.repeat_count


def epoch_of_state(state: Any) -> int:
    """The epoch a ``transformers.TrainerState`` is in: the number of whole epochs done.

    ``state.epoch`` is a float, ``e + steps done / steps in epoch``: exactly ``e`` at an epoch
    boundary (the last step adds ``n / n``), and the value saved in a checkpoint, so a resumed run
    reads the epoch it resumes into. The tiny margin keeps ``e - 1e-12`` from a float sum at ``e``.
    """
    return math.floor((getattr(state, "epoch", None) or 0.0) + 1e-9)
