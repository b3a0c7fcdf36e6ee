"""Fail-fast object collectives with a timeout, and a watchdog for user code. No TRL import.

Why not the default process group: under NCCL a stuck peer blocks a collective for the group's
timeout (30 minutes by default) and a peer that raised leaves the others with "Connection closed
by peer" and no word of the cause (both seen with stock TRL, FACTS.md). The kit exchanges its
small Python objects (payloads, rewards, error reports) over a separate gloo group created with
the kit's own timeout, so every rank learns of a failure within that bound, with the original
message.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

__all__ = [
    "CollectiveTimeoutError",
    "Failure",
    "FailFastGroup",
    "RemoteFailureError",
    "call_with_timeout",
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


class _Worker:
    """One daemon thread that runs submitted calls in order.

    Not ``concurrent.futures``: its threads are joined at interpreter exit, so a stuck reward
    function would hang the very exit that fail-fast is meant to reach.

    The thread outlives every job, so it must not keep a finished job's objects: its loop variables
    are dropped before it waits for the next job. Otherwise the last job's callable (a closure over
    the trainer) and its result or exception (whose traceback holds the trainer's frames) would stay
    referenced from this thread's frame, which the garbage collector treats as a root: the trainer
    of the last reward computation, its model and optimizer would never be freed.
    """

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="grpo_patches-worker", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, box, done = self.jobs.get()
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = exc
            done.set()
            del fn, box, done  # the caller holds the box; keep nothing of this job while idle


_worker: _Worker | None = None


def call_with_timeout(fn: Callable[[], T], timeout: float, *, what: str,
                      running: Callable[[], str] | None = None) -> T:
    """Run ``fn`` on the kit's worker thread and wait at most ``timeout`` seconds.

    One long-lived worker thread, not a thread per call: CUDA keeps per-thread state (current
    device, library handles) that a fresh thread would set up again every step. A stuck call
    cannot be killed from Python; its thread is abandoned (daemon, so it does not keep the process
    alive), the next call gets a new worker, and a ``TimeoutError`` naming ``what`` is raised, which
    the callers turn into a :class:`Failure` that every rank sees. ``running`` names what was in
    progress.
    """
    global _worker
    if _worker is None:
        _worker = _Worker()
    box: dict[str, Any] = {}
    done = threading.Event()
    _worker.jobs.put((fn, box, done))
    if not done.wait(timeout):
        _worker = None
        now = running() if running is not None else ""
        raise TimeoutError(f"{what} did not finish within reward_timeout={timeout:g} s"
                           + (f" (still running: {now})" if now else ""))
    if "error" in box:
        raise box["error"]
    return box["value"]


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

    _cache: dict[float, Any] = {}

    def __init__(self, timeout: float):
        self.timeout = float(timeout)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
            # Creating a group is itself collective; cache by timeout so that building several
            # trainers in one job (all ranks alike) does not leak groups.
            if self.timeout not in self._cache:
                self._cache[self.timeout] = dist.new_group(
                    backend="gloo", timeout=datetime.timedelta(seconds=self.timeout)
                )
            self.group = self._cache[self.timeout]
        else:
            self.rank, self.world_size, self.group = 0, 1, None

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
