"""Fail-fast object collectives with a timeout. No TRL import.

Why not the default process group: under NCCL a stuck peer blocks a collective for the group's
timeout (30 minutes by default) and a peer that raised leaves the others with "Connection closed
by peer" and no word of the cause (both seen with stock TRL 1.16). The kit exchanges its
small Python objects (payloads, rewards, error reports) over a separate gloo group created with
the kit's own timeout, so every rank learns of a failure within that bound, with the original
message.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from .watchdog import call_with_timeout

T = TypeVar("T")

__all__ = [
    "CollectiveTimeoutError",
    "Failure",
    "FailFastGroup",
    "RemoteFailureError",
    "call_with_timeout",
    "setup_agreed",
]


@dataclass(frozen=True)
class Failure:
    """A picklable report of an exception raised on one rank."""

    rank: int
    where: str
    error_type: str
    message: str

    def describe(self) -> str:
        return f"{self.where} failed on rank {self.rank}: {self.error_type}: {self.message}"


class RemoteFailureError(RuntimeError):
    """Raised on every rank when any rank reported a :class:`Failure`."""

    def __init__(self, failures: list[Failure], *, on_rank: int):
        self.failures = failures
        self.on_rank = on_rank
        super().__init__("; ".join(f.describe() for f in failures))


class CollectiveTimeoutError(RuntimeError):
    """A peer did not reach a collective within the kit's timeout (it is stuck or has died)."""


def failure_from(exc: BaseException, *, rank: int, where: str) -> Failure:
    where = getattr(exc, "grpo_patches_where", where)
    return Failure(
        rank=rank,
        where=where,
        error_type=type(exc).__name__,
        message=str(exc),
    )


class FailFastGroup:
    """The ranks of the default process group, seen through a gloo group with a bounded timeout.

    Every method is a collective: all ranks call it, in the same order. With one process (or
    torch.distributed not initialized) every method works locally, so the same code serves both.
    """

    # timeout -> (the default process group it was made in, the side group)
    _cache: dict[float, tuple[Any, Any]] = {}

    def __init__(self, timeout: float):
        self.timeout = float(timeout)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
            self.group = self._side_group(self.timeout)
        else:
            self.rank, self.world_size, self.group = 0, 1, None

    @classmethod
    def _side_group(cls, timeout: float) -> Any:
        """One gloo group per timeout and default group.

        Creating a group is itself collective; caching it means building several trainers in one
        job (all ranks alike) does not leak groups. The cache entry is only good for the default
        group it was made in: after ``destroy_process_group()`` and a new ``init_process_group()``
        every old group is gone, and reusing one fails with a bare "not registered" error.
        """
        world = dist.group.WORLD
        made_in, group = cls._cache.get(timeout, (None, None))
        if made_in is not world:
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
            cls._cache[timeout] = (world, group)
        return group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _guard(self, op: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except RuntimeError as exc:  # gloo reports timeouts and dead peers as RuntimeError
            text = str(exc)
            if "imed out" in text or "timeout" in text.lower():
                raise CollectiveTimeoutError(
                    f"grpo_patches: rank {self.rank} waited {self.timeout:g} s in '{op}' and a peer did not "
                    f"arrive: another rank is stuck or has died (see its log). Underlying error: {text}"
                ) from exc
            raise CollectiveTimeoutError(
                f"grpo_patches: rank {self.rank} lost its peers during '{op}': another rank has died "
                f"(see its log). Underlying error: {text}"
            ) from exc

    def gather_to_main(self, obj: T) -> list[T] | None:
        """Every rank's ``obj`` on rank 0 (in rank order); ``None`` elsewhere."""
        if self.group is None:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        self._guard("gather", lambda: dist.gather_object(obj, out, dst=self._global(0), group=self.group))
        return out

    def scatter_from_main(self, objs: list[T] | None) -> T:
        """Rank r receives ``objs[r]`` from rank 0."""
        if self.group is None:
            assert objs is not None
            return objs[0]
        out: list[Any] = [None]
        self._guard(
            "scatter", lambda: dist.scatter_object_list(out, objs, src=self._global(0), group=self.group)
        )
        return out[0]

    def broadcast_from_main(self, obj: T | None) -> T:
        """Rank 0's ``obj`` on every rank."""
        if self.group is None:
            return obj  # type: ignore[return-value]
        box = [obj]
        self._guard("broadcast", lambda: dist.broadcast_object_list(box, src=self._global(0), group=self.group))
        return box[0]

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def raise_if_failed(self, failures: list[Failure]) -> None:
        if failures:
            raise RemoteFailureError(failures, on_rank=self.rank)


# --- a trainer's construction, agreed by every rank ----------------------------------------------------
SETUP_GRACE = 30.0  # most seconds a failed rank waits for its peers to read its error before raising it
_setups: list = [None, 0]  # [the default process group counted in, constructions so far]


def _default_store() -> Any | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


@contextlib.contextmanager
def setup_agreed(what: str) -> Iterator[None]:
    """Run the body (a trainer's construction) so that a failure on any rank reaches every rank.

    Why: the kit makes construction differ between ranks (under main placement only rank 0 loads
    reward models) and adds collective steps after it (the side group, the liveness monitor). A
    rank that fails there used to leave its peers with gloo's "Connection reset by peer" in the
    next collective, naming no rank and no cause (stock TRL fails on every rank alike, each with the
    real error). So each rank posts its outcome to the job's rendezvous store under
    ``grpo_patches/setup/<n>/<rank>`` (``n`` counting constructions in this process group): a rank
    that succeeded waits for every peer's outcome (bounded by the store's timeout, which bounds the
    collective setup it precedes) and raises :class:`RemoteFailureError` naming a failed rank and
    its error; a rank that failed waits until its peers have read its outcome (``SETUP_GRACE`` s at
    most: rank 0 usually hosts the store, which goes when it exits) and re-raises its own error.
    One process, or no store: the body alone.
    """
    store = _default_store() if dist.is_available() and dist.is_initialized() else None
    if store is None or dist.get_world_size() < 2:
        yield
        return
    world = dist.group.WORLD
    if _setups[0] is not world:
        _setups[:] = [world, 0]
    _setups[1] += 1
    rank, size = dist.get_rank(), dist.get_world_size()
    prefix = "grpo_patches/setup/{}/{}/{}/".format(os.environ.get("TORCHELASTIC_RUN_ID", ""),
                                                  os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), _setups[1])
    try:
        yield
    except BaseException as exc:
        failure = failure_from(exc, rank=rank, where=what)
        with contextlib.suppress(Exception):  # the store is gone: the peers will say so
            store.set(f"{prefix}{rank}", f"{failure.error_type}\n{failure.message}"[:4000])
            store.add(f"{prefix}read", 1)
            deadline = time.monotonic() + SETUP_GRACE
            while store.add(f"{prefix}read", 0) < size and time.monotonic() < deadline:
                time.sleep(0.05)
        raise
    store.set(f"{prefix}{rank}", "ok")
    _await_peers(store, prefix, rank, size, what)


def _await_peers(store: Any, prefix: str, rank: int, size: int, what: str) -> None:
    bound = store.timeout.total_seconds()
    deadline = time.monotonic() + bound
    keys = [f"{prefix}{peer}" for peer in range(size)]
    try:
        while True:
            posted = [peer for peer in range(size) if store.check([keys[peer]])]
            failures = []
            for peer in posted:
                raw = store.get(keys[peer]).decode(errors="replace")
                if raw != "ok":
                    error_type, _, message = raw.partition("\n")
                    failures.append(Failure(peer, what, error_type, message))
            if failures or len(posted) == size:
                store.add(f"{prefix}read", 1)
                if failures:
                    raise RemoteFailureError(failures, on_rank=rank)
                return
            if time.monotonic() >= deadline:
                missing = ", ".join(str(p) for p in range(size) if p not in posted)
                raise CollectiveTimeoutError(
                    f"grpo_patches: rank {rank} waited {bound:g} s (the store's timeout) after {what} for rank(s) "
                    f"{missing} to finish theirs: stuck or dead (see their log)."
                )
            time.sleep(0.05)
    except (RemoteFailureError, CollectiveTimeoutError):
        raise
    except Exception as exc:  # the store does not answer: its host (rank 0, or torchrun's launcher) is gone
        raise CollectiveTimeoutError(
            f"grpo_patches: rank {rank} lost the job's rendezvous store after {what}: rank 0 (which usually hosts it) "
            f"has died without a word (see its log). Underlying error: {type(exc).__name__}: {exc}"
        ) from exc
