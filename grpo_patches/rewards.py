"""Reward placement: score on each rank ("local") or on the main process ("main"). No TRL import.

A ``compute_rewards`` that gathers completions to the main process,
scores them there and sends each rank its share; as printed it cannot work (``gather`` takes no
strings, non-main ranks get ``None``, ``chunk`` assumes equal shares). This is the intent done
right, over :class:`~grpo_patches.collectives.FailFastGroup`:

* "main": every rank sends its :class:`RewardBatch` (pickled once, so an unpicklable column fails
  on its own rank, not inside the collective) to rank 0; rank 0 scores the concatenation in chunks
  of whole groups and scatters to each rank exactly its own rows, in order, whatever the per-rank
  counts.
* "local": every rank scores its own whole groups; only rank 0 collects the rewards (for the
  metrics it logs) unless a statistic every rank needs is global.

In both, each rank's scoring runs under a watchdog, and the outcome (rewards or the original
error with its rank) is exchanged before anyone goes on, so one failing or stuck rank makes every
rank raise within ``timeout`` plus a few seconds.
"""

from __future__ import annotations

import math
import pickle
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .collectives import FailFastGroup, Failure, call_with_timeout, failure_from

__all__ = [
    "PLACEMENTS",
    "REWARD_FAILURES",
    "REWARD_MODEL_ROWS",
    "SoftFailures",
    "RewardBatch",
    "RewardResult",
    "Scored",
    "compute_rewards",
    "reward_column",
    "chunk_slices",
    "model_chunk",
    "score_in_chunks",
    "validate_chunk_size",
]

PLACEMENTS = ("local", "main")
#: Most completions a reward model scores per forward (whole groups; ``reward_chunk_size`` may cut smaller):
#: the host tokenizes the next chunk while the device runs this one, and the forward's activations stay
#: bounded however large the generation batch. Stock TRL scores a rank's whole batch in one forward.
REWARD_MODEL_ROWS = 128
REWARD_FAILURES = ("raise", "no_reward", "drop_group")  # what a failed or timed-out reward call does


@dataclass
class RewardBatch:
    """One rank's completions and everything a reward function may be given for them."""

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[Any]
    columns: dict[str, list[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)

    def slice(self, start: int, stop: int) -> RewardBatch:
        return RewardBatch(
            self.prompts[start:stop],
            self.completions[start:stop],
            self.completion_ids[start:stop],
            {k: v[start:stop] for k, v in self.columns.items()},
        )

    @staticmethod
    def concat(batches: Sequence[RewardBatch]) -> RewardBatch:
        keys = list(batches[0].columns) if batches else []
        for b in batches:
            if list(b.columns) != keys:
                raise ValueError(f"ranks disagree on the dataset columns: {keys} vs {list(b.columns)}")
        return RewardBatch(
            [p for b in batches for p in b.prompts],
            [c for b in batches for c in b.completions],
            [i for b in batches for i in b.completion_ids],
            {k: [v for b in batches for v in b.columns[k]] for k in keys},
        )


@dataclass
class Scored:
    """What a scoring function returns for a batch: rewards ``[n, F]`` and per-sample side columns.

    ``extras`` holds per-sample values a reward function logged (TRL's ``log_extra``); they travel
    with the rewards so that each rank logs its own rows.
    """

    rewards: torch.Tensor
    extras: dict[str, list[Any]] = field(default_factory=dict)
    failed_calls: int = 0  # reward calls that failed and were absorbed by a fail-soft policy


class SoftFailures:
    """What one scoring does with a reward call that raises, under ``reward_failure``.

    ``"raise"`` (the default): the error propagates, naming the function, and every rank raises.
    ``"no_reward"``: the call's rows get no reward from that function (NaN, what stock TRL makes of
    ``None``: left out of its sums and group statistics). ``"drop_group"``: the call's rows (whole
    groups: a call scores whole groups) get no reward from any function, so the group carries no
    advantage (TRL zeroes the advantage of a row no function scored; where it sums such a row to
    0, the whole group is 0 and its advantage is 0 just the same). Each absorbed call is counted and
    said on stderr with its error.
    """

    def __init__(self, policy: str, rank: int = 0) -> None:
        self.policy, self.rank = policy, rank
        self.calls = 0
        self.dropped: list[slice] = []

    def absorb(self, exc: Exception, where: str, rows: slice) -> None:
        """Called in ``except``: re-raises under ``"raise"``, else records the failed call."""
        if self.policy == "raise":
            exc.grpo_patches_where = where  # type: ignore[attr-defined]
            raise exc
        self.calls += 1
        if self.policy == "drop_group":
            self.dropped.append(rows)
        sys.stderr.write(f"grpo_patches: {where} failed on rank {self.rank} for completions {rows.start}..{rows.stop - 1} "
                         f"({type(exc).__name__}: {exc}); reward_failure={self.policy!r}: "
                         f"{'no reward from it for them' if self.policy == 'no_reward' else 'their groups dropped'}.\n")

    def finish(self, rewards: torch.Tensor) -> torch.Tensor:
        """``rewards`` with the dropped groups' rows emptied (NaN in every column)."""
        for rows in self.dropped:
            rewards[rows] = math.nan
        return rewards


ScoreFn = Callable[[RewardBatch, list[int]], Scored]


@dataclass
class RewardResult:
    local: torch.Tensor  # this rank's rows, [n, F]
    all: torch.Tensor | None  # every rank's rows in rank order, [N, F]; on rank 0 always, elsewhere when asked
    counts: list[int] | None  # rows per rank, where ``all`` is known
    extras: dict[str, list[Any]]  # this rank's rows of the side columns
    failed_calls: int = 0  # reward calls absorbed by a fail-soft policy this step, on every rank together


def validate_chunk_size(chunk_size: int | None, num_generations: int, *, name: str = "num_generations") -> None:
    """A chunk must hold whole groups, so that listwise rewards and group statistics stay exact."""
    if chunk_size is None:
        return
    if chunk_size % num_generations:
        lower = (chunk_size // num_generations) * num_generations
        upper = lower + num_generations
        nearest = " or ".join(str(v) for v in (lower, upper) if v > 0)
        raise ValueError(
            f"grpo_patches: reward_chunk_size={chunk_size} is not a multiple of {name}={num_generations}, so a "
            f"chunk would cut a group in two. Nearest valid values: reward_chunk_size={nearest}."
        )


def reward_column(values: Iterable[Any], expected: int, func_name: str) -> list[float]:
    """Check one reward function's output: one value per completion, ``None`` or a finite number.

    Accepted as stock TRL accepts it: any iterable, ``None`` entries turned into NaN (no reward for
    that completion, left out of the group statistics), the rest converted as
    ``torch.tensor(column, dtype=torch.float32)`` converts them (Python and NumPy numbers, bools,
    0-d tensors; never strings). One check more than stock: a NaN or infinite number is a bug in the
    reward function, which stock lets poison the group's mean and std silently; here it is an
    error naming the function and the position.
    """
    try:
        column = [v if v is not None else math.nan for v in values]
    except TypeError:
        raise TypeError(
            f"reward function '{func_name}' returned {type(values).__name__}, expected a list of {expected} "
            f"floats (one per completion)"
        ) from None
    if len(column) != expected:
        raise ValueError(
            f"reward function '{func_name}' returned {len(column)} rewards for {expected} completions; it must return "
            f"exactly one reward (or None) per completion"
        )
    try:
        numbers = torch.tensor(column, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as exc:
        kinds = sorted({type(v).__name__ for v in column})
        raise TypeError(
            f"reward function '{func_name}' returned values of type {', '.join(kinds)} that are not numbers ({exc}); "
            f"return floats (or None), as stock TRL requires"
        ) from None
    if numbers.shape != (expected,):
        raise ValueError(
            f"reward function '{func_name}' returned rewards of shape {tuple(numbers.shape)} for {expected} "
            f"completions; it must return one number (or None) per completion"
        )
    out = numbers.tolist()
    for i, (x, given) in enumerate(zip(out, column, strict=True)):
        if given is math.nan:  # None: no reward
            continue
        if not math.isfinite(x):
            raise ValueError(
                f"reward function '{func_name}' returned {x} for completion {i}; rewards must be finite "
                f"(return None to give a completion no reward)"
            )
    return out


def _group_ids(n: int, num_generations: int, first: int = 0) -> list[int]:
    return [first + i // num_generations for i in range(n)]


def model_chunk(chunk_size: int | None, num_generations: int) -> int | None:
    """Completions per reward-model forward: ``chunk_size`` capped at :data:`REWARD_MODEL_ROWS`, whole groups
    (at least one); ``None`` (one forward for the batch) where the cap is off (0 or None)."""
    if not REWARD_MODEL_ROWS:
        return chunk_size
    cap = max(num_generations, REWARD_MODEL_ROWS // num_generations * num_generations)
    return min(chunk_size, cap) if chunk_size else cap


def chunk_slices(n: int, num_generations: int, chunk_size: int | None) -> list[slice]:
    """The chunks ``n`` completions are scored in: at most ``chunk_size`` each, whole groups each."""
    if n % num_generations:
        raise ValueError(
            f"grpo_patches: a reward batch of {n} completions is not whole groups of {num_generations}"
        )
    step = max(chunk_size or n, 1)
    return [slice(start, min(start + step, n)) for start in range(0, n, step)]


def score_in_chunks(
    batch: RewardBatch, score_fn: ScoreFn, *, num_generations: int, chunk_size: int | None
) -> Scored:
    """Score ``batch`` in chunks of at most ``chunk_size`` completions, each chunk whole groups."""
    parts: list[Scored] = []
    for rows in chunk_slices(len(batch), num_generations, chunk_size):
        size = rows.stop - rows.start
        part = score_fn(batch.slice(rows.start, rows.stop),
                        _group_ids(size, num_generations, rows.start // num_generations))
        if part.rewards.shape[0] != size:
            raise ValueError(f"scoring returned {part.rewards.shape[0]} rows for {size} completions")
        parts.append(part)
    if not parts:
        return Scored(torch.zeros(0, 0))
    extras: dict[str, list[Any]] = {k: [] for p in parts for k in p.extras}
    for part in parts:
        for key, values in extras.items():
            values.extend(part.extras.get(key, [None] * part.rewards.shape[0]))
    return Scored(torch.cat([p.rewards.float().cpu() for p in parts]), extras,
                  sum(p.failed_calls for p in parts))


def _whole_groups_failure(batch: RewardBatch, num_generations: int, rank: int, hint: str) -> Failure | None:
    """Each rank must hand in whole groups, under either placement: a group cut between two ranks
    (or two batches) would be normalized from a part of its completions."""
    if len(batch) % num_generations == 0:
        return None
    return Failure(rank, "reward computation", "GroupShapeError",
                   f"grpo_patches: rank {rank} was given {len(batch)} completions to score, which is not whole "
                   f"groups of num_generations={num_generations}: a group would be cut across ranks or batches."
                   + (f" {hint}" if hint else ""))


def compute_rewards(
    batch: RewardBatch,
    score_fn: ScoreFn,
    *,
    group: FailFastGroup,
    placement: str,
    num_generations: int,
    chunk_size: int | None = None,
    timeout: float = 600.0,
    everywhere: bool = False,
    running: Callable[[], str] | None = None,
    shape_hint: str = "",
    on_failure: str = "raise",
    num_funcs: int = 0,
) -> RewardResult:
    """Score this rank's ``batch`` where ``placement`` says; a collective over ``group``.

    ``everywhere=True`` also sends every rank the full rank-ordered tensor (for statistics that are
    global by definition, e.g. TRL's ``scale_rewards="batch"``); otherwise only rank 0 has it.
    Raises :class:`~grpo_patches.collectives.RemoteFailureError` on every rank if scoring failed or
    timed out on any rank; ``running`` names the reward function in progress for the timeout message.
    A rank whose ``batch`` is not whole groups is such a failure too; ``shape_hint`` says how to fix it.

    ``on_failure`` (one of :data:`REWARD_FAILURES`): a reward call that fails is absorbed by
    ``score_fn`` itself (:class:`SoftFailures`); here a step that times out under a fail-soft
    policy gives all of its rows no reward from any of the ``num_funcs`` functions (the stuck one
    cannot be told apart from those it kept from running), counted as one failed call. Every rank
    gets the step's total count. Code that holds the GIL past the deadline still ends its process
    (the watchdog's hard stop): no policy can absorb that.
    """
    if on_failure not in REWARD_FAILURES:
        raise ValueError(f"reward_failure={on_failure!r}; expected one of {REWARD_FAILURES}")
    if placement not in PLACEMENTS:
        raise ValueError(f"reward_placement={placement!r}; expected one of {PLACEMENTS}")
    run = lambda b: score_in_chunks(b, score_fn, num_generations=num_generations, chunk_size=chunk_size)  # noqa: E731
    score = _score_local if placement == "local" else _score_on_main
    failure = _whole_groups_failure(batch, num_generations, group.rank, shape_hint)
    soft_timeout = num_funcs if on_failure != "raise" else 0
    return score(batch, run, failure, group=group, timeout=timeout, everywhere=everywhere, running=running,
                 soft_timeout=soft_timeout)


def _timed_out(exc: Exception, rows: int, soft_timeout: int) -> Scored | None:
    """Under a fail-soft policy (``soft_timeout``: the number of functions), a timed-out step's rows, unscored."""
    if soft_timeout and isinstance(exc, TimeoutError):
        sys.stderr.write(f"grpo_patches: {exc}; its {rows} completions get no reward (reward_failure is fail-soft).\n")
        return Scored(torch.full((rows, soft_timeout), math.nan), failed_calls=1)
    return None


def _score_local(batch, run, failure: Failure | None, *, group: FailFastGroup, timeout: float, everywhere: bool,
                 running, soft_timeout: int = 0) -> RewardResult:
    scored: Scored | None = None
    if failure is None:
        try:
            scored = call_with_timeout(lambda: run(batch), timeout, what=f"reward computation on rank {group.rank}",
                                       running=running)
        except Exception as exc:
            scored = _timed_out(exc, len(batch), soft_timeout)
            if scored is None:
                failure = failure_from(exc, rank=group.rank, where="reward computation")
    if group.world_size == 1:
        group.raise_if_failed([failure] if failure else [])
        assert scored is not None
        return RewardResult(scored.rewards, scored.rewards, [len(batch)], scored.extras, scored.failed_calls)
    gathered = group.gather_to_main((failure, None if scored is None else scored.rewards,
                                     0 if scored is None else scored.failed_calls))
    verdict: tuple[list[Failure], torch.Tensor | None, list[int] | None, int] | None = None
    if group.is_main:
        assert gathered is not None
        failures = [f for f, _, _ in gathered if f is not None]
        full = counts = None
        if not failures:
            full = torch.cat([t for _, t, _ in gathered])
            counts = [t.shape[0] for _, t, _ in gathered]
        verdict = (failures, full, counts, sum(n for _, _, n in gathered))
    # Rank 0 has the verdict; the others need the full tensor only for global statistics.
    to_send = None
    if verdict is not None:
        to_send = verdict if everywhere else (verdict[0], None, None, verdict[3])
    failures, full, counts, failed_calls = group.broadcast_from_main(to_send)
    group.raise_if_failed(failures)
    assert scored is not None
    if group.is_main:
        assert verdict is not None
        full, counts = verdict[1], verdict[2]
    return RewardResult(scored.rewards, full, counts, scored.extras, failed_calls)


def _score_on_main(batch, run, failure: Failure | None, *, group: FailFastGroup, timeout: float, everywhere: bool,
                   running, soft_timeout: int = 0) -> RewardResult:
    payload: bytes | None = None
    if failure is None:
        try:
            payload = pickle.dumps(batch)
        except Exception as exc:
            failure = failure_from(exc, rank=group.rank, where="sending completions to the main process")
    gathered = group.gather_to_main((failure, payload))
    replies: list[Any] | None = None
    full: torch.Tensor | None = None
    counts: list[int] = []
    if group.is_main:
        assert gathered is not None
        failures = [f for f, _ in gathered if f is not None]
        scored = None
        if not failures:
            try:
                batches = [pickle.loads(p) for _, p in gathered]
                counts = [len(b) for b in batches]
                merged = RewardBatch.concat(batches)
                try:
                    scored = call_with_timeout(lambda: run(merged), timeout,
                                               what="reward computation on the main process", running=running)
                except Exception as exc:
                    scored = _timed_out(exc, len(merged), soft_timeout)
                    if scored is None:
                        raise
                full = scored.rewards
            except Exception as exc:
                failures.append(failure_from(exc, rank=group.rank, where="reward computation"))
        if failures:
            replies = [(failures, None, None, None, None, 0)] * group.world_size
        else:
            replies = []
            start = 0
            for count in counts:
                rows = slice(start, start + count)
                extras = {k: v[rows] for k, v in scored.extras.items()}
                replies.append(([], full[rows], extras, full if everywhere else None, counts if everywhere else None,
                                scored.failed_calls))
                start += count
    failures, local, extras, shared_full, shared_counts, failed_calls = group.scatter_from_main(replies)
    group.raise_if_failed(failures)
    if not group.is_main:
        full, counts = shared_full, shared_counts
    return RewardResult(local, full, counts or None, extras, failed_calls)
