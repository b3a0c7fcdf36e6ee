"""Rank liveness while ``trainer.train()`` runs: a rank that vanishes is named, within a bound. No TRL import.

Why: a rank killed by SIGKILL (the out-of-memory killer) leaves no message. Its peers, under gloo,
fail at once in whatever collective they are in with "Connection closed by peer [addr]:port",
naming no rank; under NCCL (or when the peer's host froze) they wait in the collective for the
process group's timeout, 10-30 minutes (both seen with stock TRL 1.16).

How: while a rank is inside ``train()`` a daemon thread adds 1 to its counter in the job's
rendezvous store every ``interval`` s and reads its peers' counters, over its own TCP connection to
the store (never waiting behind the main thread's store calls). A peer inside ``train()`` whose
counter has not moved for ``timeout`` s (``GRPO_PATCHES_PEER_TIMEOUT``, default 60) is named on
stderr and this process ends with exit status 75: the case where the main thread hangs in a
collective and could not raise. When the main thread does raise (gloo's "Connection closed by
peer", the kit's own side-group errors), :func:`watching` waits for the verdict (a peer silent for
a few intervals, or one that posted its error on the way out) and raises :class:`RankLostError`
naming the rank. A rank leaving ``train()`` posts how it left (returned, or the error), so a peer
that exits normally is never reported, and one that failed with an exception is reported with it.

The thread costs the training step nothing: the main thread does no per-step work, and the thread
does ``2 * world_size - 1`` small store operations per interval. A busy rank keeps beating (the
thread needs only the GIL for a moment each interval); a rank whose whole process is stopped
(SIGSTOP, a debugger) or that holds the GIL in one C call for longer than ``timeout`` looks dead.
Rank 0 usually hosts the store (``torchrun`` hosts it in its launcher): when the store stops
answering for ``timeout`` s, that host is named.

A rank's main thread also writes down, before its reward step and each reward function starts,
what it runs and under which ``reward_timeout`` (the watchdog's announcer). A peer reads that
record when the rank's counter stops moving, while the rank (and a store it hosts) still answers:
so when code that holds the GIL is ended by the watchdog's hard stop (no Python runs there to
say why), its peers name the rank, the reward function and the timeout. A rank silent in its reward
step counts as gone after ``timeout`` s like any other (its own hard stop may come later: a peer
need not wait for it), and is named with the function it was in.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator

import torch.distributed as dist

from . import watchdog
from .collectives import CollectiveTimeoutError, RemoteFailureError

__all__ = ["EXIT_CODE", "PEER_TIMEOUT_ENV", "RankLostError", "peer_timeout", "watching"]

PEER_TIMEOUT_ENV = "GRPO_PATCHES_PEER_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
EXIT_CODE = 75  # EX_TEMPFAIL: the job failed through no fault of this rank; restart from a checkpoint
# What torch / gloo / NCCL / the kit say when a peer went away under a collective.
_LOST_PEER_TEXT = ("connection closed by peer", "connection reset by peer", "broken pipe", "lost its peers",
                   "did not arrive", "remote worker", "communicator was aborted", "socket closed")


class RankLostError(RuntimeError):
    """A peer rank vanished (or left ``train()`` with an error) while this rank was training."""

    def __init__(self, message: str, *, rank: int):
        self.rank = rank
        super().__init__(message)


def peer_timeout() -> float | None:
    """Seconds of silence after which a peer counts as gone; ``None``: monitoring off (``0``)."""
    raw = os.environ.get(PEER_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value == 0 or 1.0 <= value <= 86400.0):
        raise ValueError(
            f"grpo_patches: {PEER_TIMEOUT_ENV}={raw!r} must be a number of seconds between 1 and 86400 (how long "
            f"a peer rank may stay silent before it is reported as gone), or 0 to turn rank monitoring off."
        )
    return value or None


def _store_address() -> tuple[str, int] | None:
    """Host and port of the default group's TCPStore (None for a FileStore / HashStore)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return None


class _Monitor:
    """One per process: the heartbeat thread, and what it has seen of its peers."""

    def __init__(self, rank: int, world_size: int, address: tuple[str, int], timeout: float) -> None:
        self.rank, self.world_size, self.address = rank, world_size, address
        self.prefix = "grpo_patches/liveness/{}/{}/".format(os.environ.get("TORCHELASTIC_RUN_ID", ""),
                                                           os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.set_timeout(timeout)
        self.armed = self.judging = False
        self.lock = threading.Lock()
        self.seen: dict[int, tuple[int, int, float]] = {}  # peer -> (phase, beats, when they last moved)
        self.doing: dict[int, tuple[int, str, float]] = {}  # peer -> (beats when read, what it ran, its timeout)
        self.store_lost_since: float | None = None
        self.store_error = ""
        self._thread_store = self._main_store = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="grpo_patches-liveness", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        """End the thread and wait for a store call in flight (at most three store timeouts and an interval: a
        reconnect to a dead store blocks ~2.5 timeouts). At interpreter exit, a daemon thread still inside a
        TCPStore call aborts the process ("terminate called without an active exception", exit status -6) when
        it returns into the finalizing interpreter: so at exit this runs first (``atexit``)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=3 * self._op_timeout().total_seconds() + self.interval)

    def set_timeout(self, timeout: float) -> None:
        self.timeout = timeout
        self.interval = min(1.0, timeout / 10)
        # Silence that names a peer once a connection error has said that one is gone.
        self.confirm = min(timeout, max(3 * self.interval, 1.5))

    def _op_timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=max(2.0, min(10.0, self.timeout / 4)))

    def _connect(self):
        host, port = self.address
        client = dist.TCPStore(host, port, is_master=False, timeout=self._op_timeout(), wait_for_workers=False)
        return dist.PrefixStore(self.prefix, client)

    # --- the main thread: entering and leaving train() -------------------------------------------
    def arm(self) -> None:
        try:
            if self._main_store is None:
                self._main_store = self._connect()
            self._main_store.set(f"doing/{self.rank}", "")
            self._main_store.add(f"beat/{self.rank}", 1)
            self._main_store.add(f"phase/{self.rank}", 1)  # odd: inside train()
        except Exception:
            self._main_store = None  # connect afresh next time
            raise
        with self.lock:
            self.seen.clear()
            self.doing.clear()
            self.store_lost_since = None
            self.armed, self.judging = True, False
        watchdog.set_announcer(self.announce)

    def announce(self, what: str, timeout: float) -> None:
        """The watchdog's announcer: what this rank's main thread is about to run (``""``: nothing)."""
        with contextlib.suppress(Exception):  # the store's host is gone: the peers will say so
            self._main_store.set(f"doing/{self.rank}", json.dumps([what, timeout]) if what else "")

    def disarm(self, failure: str | None) -> None:
        with self.lock:
            self.armed = False
        watchdog.set_announcer(None)
        try:
            if failure is not None:
                phase = self._main_store.add(f"phase/{self.rank}", 0)
                self._main_store.set(f"failure/{self.rank}/{phase}", failure[:2000])
            self._main_store.add(f"phase/{self.rank}", 1)  # even: out of train()
        except Exception:  # noqa: BLE001 - the store's host is gone; nobody is left to tell
            pass

    # --- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            with self.lock:
                if not self.armed:
                    continue
            self._tick()
            with self.lock:
                verdict = None if (self.judging or not self.armed) else self.verdict(self.timeout)
            if verdict is not None:
                self._end(verdict[1])

    def _tick(self) -> None:
        attempt = time.monotonic()  # a failing reconnect blocks ~5 s: the store was lost when it began
        try:
            if self._thread_store is None:
                self._thread_store = self._connect()
            store = self._thread_store
            store.add(f"beat/{self.rank}", 1)
            readings = [(p, store.add(f"phase/{p}", 0), store.add(f"beat/{p}", 0))
                        for p in range(self.world_size) if p != self.rank]
            records = {p: self._read_doing(store, p) for p, phase, beats in readings if self._stalled(p, phase, beats)}
        except Exception as exc:  # noqa: BLE001 - a store that does not answer is itself the signal
            self._thread_store = None  # a fresh connection next time (a failed one may be out of step)
            with self.lock:
                if self.store_lost_since is None:
                    self.store_lost_since = attempt
                self.store_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            return
        now = time.monotonic()
        with self.lock:
            self.store_lost_since = None
            for peer, phase, beats in readings:
                before = self.seen.get(peer)
                if before is None or before[:2] != (phase, beats):
                    self.seen[peer] = (phase, beats, now)
            for peer, record in records.items():
                self.doing[peer] = (self.seen[peer][1], *record)

    def _stalled(self, peer: int, phase: int, beats: int) -> bool:
        """A peer whose counter has not moved since the last reading, and whose record is not read yet."""
        with self.lock:
            before, read = self.seen.get(peer), self.doing.get(peer)
        return before is not None and before[:2] == (phase, beats) and (read is None or read[0] != beats)

    @staticmethod
    def _read_doing(store, peer: int) -> tuple[str, float]:
        key = f"doing/{peer}"
        raw = store.get(key).decode(errors="replace") if store.check([key]) else ""
        if not raw:
            return "", 0.0
        what, timeout = json.loads(raw)
        return str(what), float(timeout)

    def _in_reward_step(self, peer: int, beats: int) -> tuple[str, float] | None:
        """What ``peer`` wrote down before its counter stopped at ``beats`` (under the lock)."""
        read = self.doing.get(peer)
        if read is None or read[0] != beats or not read[1]:
            return None
        return read[1], read[2]

    def _cause(self, peer: int, stalled: float, record: tuple[str, float]) -> str:
        what, timeout = record
        if stalled >= timeout:
            return (f"rank {peer} timed out in its reward step: {what} did not finish within reward_timeout={timeout:g} s "
                    f"and rank {peer} stopped answering: it holds the GIL in code that nothing can interrupt, so the "
                    f"kit's hard stop ends that rank {watchdog.HARD_STOP_GRACE:g} s after its deadline (its stack is in "
                    f"that rank's log)")
        return (f"rank {peer} vanished during its reward step: no heartbeat for {stalled:.0f} s while in {what}, "
                f"within its reward_timeout={timeout:g} s (code holding the GIL, a frozen process, or one killed "
                f"by SIGKILL, e.g. by the out-of-memory killer, which leaves no message: see that rank's log, "
                f"`dmesg` or the job scheduler)")

    def verdict(self, silence: float) -> tuple[int, str] | None:
        """A peer inside train() whose counter has not moved for ``silence`` s, or a lost store; a peer that
        wrote down a reward step before it went silent is named with it."""
        now = time.monotonic()
        if self.store_lost_since is not None:  # no readings of anyone: only the store's host can be named
            if now - self.store_lost_since < silence:
                return None
            host, port = self.address
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            who = "the launcher hosting it on the first node (torchrun)" if agent else "rank 0, which hosts it,"
            lost = (f"the job's rendezvous store at {host}:{port} has not answered for "
                    f"{now - self.store_lost_since:.0f} s ({self.store_error})")
            phase, beats, moved = self.seen.get(0, (0, -1, now))
            record = None if agent or self.rank == 0 else self._in_reward_step(0, beats)
            if record is not None:
                return 0, f"{self._cause(0, now - moved, record)}; {lost}: rank 0 hosted it"
            return 0, f"{lost}: {who} has vanished"
        for peer, (phase, beats, moved) in sorted(self.seen.items()):
            record = self._in_reward_step(peer, beats)
            if phase % 2 == 1 and now - moved >= silence:
                if record is not None:
                    return peer, self._cause(peer, now - moved, record)
                return peer, (f"rank {peer} vanished: no heartbeat for {now - moved:.0f} s while in trainer.train() "
                              f"(a process killed by SIGKILL, e.g. by the out-of-memory killer, leaves no message: "
                              f"see that rank's log, `dmesg` or the job scheduler)")
        return None

    def _end(self, why: str) -> None:
        message = (f"grpo_patches: rank {self.rank} stops: {why}. Otherwise it would wait in a collective for "
                   f"the process group's timeout. Bound: {PEER_TIMEOUT_ENV}={self.timeout:g} s; exit status "
                   f"{EXIT_CODE}.")
        try:
            sys.stdout.flush()
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
            if self._thread_store is not None:
                phase = self._thread_store.add(f"phase/{self.rank}", 0)
                self._thread_store.set(f"failure/{self.rank}/{phase}", f"RankLostError: {why}")
                self._thread_store.add(f"phase/{self.rank}", 1)
        finally:
            os._exit(EXIT_CODE)

    # --- the main thread: after train() raised a lost-peer error --------------------------------------
    def name_the_lost(self) -> tuple[int, str] | None:
        """Wait at most ``timeout`` s (30 s at most) for the peer that is gone: silent, or out with a
        posted error. A dead peer is silent within ``confirm`` s; the margin is for a loaded host."""
        with self.lock:
            self.judging = True
        deadline = time.monotonic() + min(self.timeout, 30.0)
        while True:
            with self.lock:
                silent = self.verdict(self.confirm)
                store_lost = self.store_lost_since is not None
            if silent is not None:
                return silent
            # Reading a dead store blocks for its reconnect timeout (~5 s for 2 s asked, torch 2.13):
            # once the thread has seen the store go, only its verdict can come, so do not ask again.
            failed = None if store_lost else self._posted_failure()
            if failed is not None:
                return failed
            if time.monotonic() >= deadline:
                # A read of a store whose host just died blocks for its reconnect timeout (~5 s), often past
                # the deadline, while the thread sees the store go: its verdict gets one last look.
                with self.lock:
                    return self.verdict(self.confirm)
            time.sleep(self.interval)

    def _posted_failure(self) -> tuple[int, str] | None:
        try:
            for peer in range(self.world_size):
                if peer == self.rank:
                    continue
                phase = self._main_store.add(f"phase/{peer}", 0)
                key = f"failure/{peer}/{phase - 1}"
                if phase > 0 and phase % 2 == 0 and self._main_store.check([key]):
                    text = self._main_store.get(key).decode(errors="replace")
                    return peer, f"rank {peer} left trainer.train() with {text}"
        except Exception:  # noqa: BLE001 - store gone: the thread's verdict will say so
            pass
        return None


_monitor: _Monitor | None = None


def _lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is torch.distributed (or the kit's side group) saying that a peer went away.

    Only errors of the collectives count: a reward function's own "Connection reset by peer" (an
    HTTP reward service) arrives as the kit's RemoteFailureError, whose cause is already known.
    """
    seen = set()
    while exc is not None and id(exc) not in seen and not isinstance(exc, RemoteFailureError):
        seen.add(id(exc))
        text = str(exc).lower()
        if isinstance(exc, CollectiveTimeoutError):
            return True
        collective = isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and ("gloo" in text or "nccl" in text))
        if collective and any(phrase in text for phrase in _LOST_PEER_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _monitor_for_this_job() -> _Monitor | None:
    global _monitor
    timeout = peer_timeout()
    if timeout is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    address = _store_address()
    if address is None:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    if _monitor is None or (_monitor.address, _monitor.rank, _monitor.world_size) != (address, rank, world):
        if _monitor is not None:
            # a re-initialized job: the old thread ends at its next wake, not waited for here (a heartbeat in
            # flight to the old store may take its timeout); atexit joins it
            _monitor.armed = False
            _monitor._stopped.set()
        _monitor = _Monitor(rank, world, address, timeout)
    _monitor.set_timeout(timeout)
    return _monitor


@contextlib.contextmanager
def watching() -> Iterator[None]:
    """Run the body (``trainer.train()``) with this rank's heartbeat on and its peers watched.

    A lost-peer error from the body becomes a :class:`RankLostError` naming the rank that is gone;
    any other error is posted for the peers and re-raised unchanged.
    """
    monitor = _monitor_for_this_job()
    if monitor is not None:
        try:
            monitor.arm()
        except Exception as exc:  # noqa: BLE001 - monitoring is a safety net, never a reason not to train
            warnings.warn(f"grpo_patches: rank liveness monitoring is off for this train() call: the store at "
                          f"{monitor.address[0]}:{monitor.address[1]} did not answer ({exc}).", stacklevel=3)
            monitor = None
    if monitor is None:
        yield
        return
    try:
        yield
    except BaseException as exc:
        named = monitor.name_the_lost() if _lost_peer(exc) else None
        if named is None:
            monitor.disarm(f"{type(exc).__name__}: {exc}")
            raise
        rank, why = named
        error = RankLostError(f"grpo_patches: {why}. This rank ({monitor.rank}) stops; what it saw: "
                              f"{type(exc).__name__}: {exc}", rank=rank)
        monitor.disarm(f"RankLostError: {why}")
        raise error from exc
    monitor.disarm(None)
