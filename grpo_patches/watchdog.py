"""A deadline for user code that runs on the caller's own thread. No TRL import.

Reward functions must run where stock TRL runs them: on the thread that called the reward step,
which is the main thread. Code there may rely on it: ``math_verify``'s ``parse`` / ``verify``
timeouts use ``SIGALRM``, which only the main thread can arm, and TRL's ``accuracy_reward`` turns
its timeouts off on any other thread (so one pathological sample would then stall the run).
So the kit does not move user code to a worker thread; a watchdog thread only *watches*:

* at the deadline it interrupts the watched thread: on the main thread with a wake-up signal
  (``SIGRTMAX - 2`` by default, never ``SIGALRM``), whose handler raises there, so a blocking
  ``time.sleep`` / socket read / lock wait is broken too; on any other thread with an
  asynchronous exception. Either surfaces as :class:`TimeoutError` in the caller, which the
  reward code turns into a failure every rank sees;
* the interrupt is a ``BaseException`` (like ``KeyboardInterrupt``), so a reward function's own
  ``except Exception`` does not swallow it;
* if the watched code cannot be interrupted (C code that never returns to the interpreter, and
  above all C code that holds the GIL, such as a catastrophically backtracking regular
  expression: then no Python thread, the watchdog included, runs at all), the process ends
  ``HARD_STOP_GRACE`` seconds after the deadline through :mod:`faulthandler`, whose watchdog is a
  C thread that needs no GIL, after dumping every thread's stack (the innermost frames name the
  reward function; a frame named after the watched call names the rank): a bounded failure,
  never a hang. That hard stop is armed on the calling thread *before* the user's code starts,
  since nothing can arm it once the GIL is held. Before that, :func:`set_announcer`'s hook (the
  liveness monitor's) is told what runs and under which deadline, and again at each
  :class:`Progress` step, so that the peers can name the cause when this process ends.

``GRPO_PATCHES_WATCHDOG_SIGNAL`` picks the wake-up signal (a name such as ``SIGUSR2``, or a number);
``none`` disables it (then only pure-Python code is interrupted before the hard stop).

:func:`faulthandler.dump_traceback_later` is one timer per process: while a watched call runs it
is the kit's (the earliest hard stop of the calls in progress), and it is cancelled after the last.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["HARD_STOP_GRACE", "SIGNAL_ENV", "Progress", "call_with_timeout", "set_announcer"]

SIGNAL_ENV = "GRPO_PATCHES_WATCHDOG_SIGNAL"
HARD_STOP_GRACE = 5.0  # seconds between the deadline and the hard stop of an uninterruptible call


class _Interrupt(BaseException):  # noqa: N818 - an interrupt, like KeyboardInterrupt
    """Raised inside the watched call at its deadline (a BaseException: not swallowed by user code)."""


class _Watch:
    """One watched call: the deadline has fired at most once, the interrupt delivered at most once."""

    def __init__(self, thread_id: int, use_signal: bool) -> None:
        self.thread_id = thread_id
        self.use_signal = use_signal
        self.lock = threading.Lock()
        self.done = self.fired = self.delivered = False
        self.running = ""
        self.timeout = 0.0

    def fire(self, what: str, timeout: float, running: Callable[[], str] | None) -> None:
        """The watchdog's side, at the deadline."""
        with self.lock:
            if self.done:
                return
            self.fired = True
            self.running = running() if running is not None else ""
            now = f" ({self.running})" if self.running else ""
            sys.stderr.write(
                f"grpo_patches: {what}{now} did not finish within reward_timeout={timeout:g} s; interrupting it. "
                f"If it cannot be interrupted, this process exits {HARD_STOP_GRACE:g} s after the deadline.\n"
            )
            sys.stderr.flush()
            if self.use_signal:
                signal.pthread_kill(self.thread_id, _wake_signal())
            else:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), ctypes.py_object(_Interrupt))

    def finish(self) -> None:
        """The watched thread's side, once the call has ended (idempotent)."""
        with self.lock:
            if self.done:
                return
            self.done = True
            _hard_stops.drop(self)
            if self.fired and not self.use_signal:  # clear an asynchronous exception not yet raised
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)


_watches: dict[int, _Watch] = {}
_handler_installed = False
_previous_handler = None


def _wake_signal() -> int | None:
    name = os.environ.get(SIGNAL_ENV, "").strip()
    if name.lower() == "none":
        return None
    if not name:
        return signal.SIGRTMAX - 2 if hasattr(signal, "SIGRTMAX") else getattr(signal, "SIGUSR2", None)
    value = int(name) if name.isdigit() else getattr(signal, name.upper(), None)
    if not isinstance(value, int) or value not in {int(s) for s in signal.valid_signals()} or value == signal.SIGALRM:
        raise ValueError(f"{SIGNAL_ENV}={name!r} is not a usable signal name (e.g. SIGUSR2, or 'none'); "
                         f"SIGALRM is left to reward functions (math_verify's timeouts)")
    return int(value)


def _on_wake(signum, frame) -> None:
    watch = _watches.get(threading.get_ident())
    if watch is not None and watch.fired and not watch.done and not watch.delivered:
        watch.delivered = True
        raise _Interrupt()
    if callable(_previous_handler):  # not ours: the signal was meant for a handler installed before us
        _previous_handler(signum, frame)


def _signal_ready() -> bool:
    """Install the wake-up handler once (main thread only); whether the current thread can use it."""
    global _handler_installed, _previous_handler
    if threading.current_thread() is not threading.main_thread():
        return False
    sig = _wake_signal()
    if sig is None:
        return False
    if not _handler_installed:
        _previous_handler = signal.signal(sig, _on_wake)
        _handler_installed = True
    return True


class _HardStops:
    """The hard stops of the watched calls in progress; faulthandler's one timer holds the earliest."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.at: dict[int, float] = {}  # id(watch) -> monotonic time of its hard stop

    def add(self, watch: _Watch, seconds: float) -> None:
        with self.lock:
            self.at[id(watch)] = time.monotonic() + seconds
            self._arm()

    def drop(self, watch: _Watch) -> None:
        with self.lock:
            if self.at.pop(id(watch), None) is not None:
                self._arm()

    def _arm(self) -> None:
        if not self.at:
            faulthandler.cancel_dump_traceback_later()
            return
        faulthandler.dump_traceback_later(max(min(self.at.values()) - time.monotonic(), 0.001), exit=True)


_hard_stops = _HardStops()

Announcer = Callable[[str, float], None]
_announcer: Announcer | None = None


def set_announcer(announcer: Announcer | None) -> Announcer | None:
    """Install ``announcer(what, timeout)``, told what a watched call runs (``""`` once it is over);
    returns the one it replaces. It must not raise, and should be quick (it runs on the watched thread)."""
    global _announcer
    previous, _announcer = _announcer, announcer
    return previous


def _announce(what: str) -> None:
    watch = _watches.get(threading.get_ident())
    if watch is not None and not watch.done and _announcer is not None:
        _announcer(what, watch.timeout)


class Progress(dict):
    """A ``dict`` whose ``"now"`` entry (what a watched call is doing, e.g. which reward function) is
    also announced as it is set: written down before the step starts, it survives the step holding the GIL."""

    def __setitem__(self, key: str, value: str) -> None:
        super().__setitem__(key, value)
        if key == "now":
            _announce(value)


def _in_a_frame_named(name: str, fn: Callable[[], T]) -> T:
    """``fn()`` called from a frame whose code is named ``name``: faulthandler's dump prints code
    names only, so this is how the hard stop's stack says which call it stopped."""
    return _CALLERS.setdefault(name, _caller(name))(fn)


def _call(fn):
    return fn()


def _caller(name: str) -> Callable:
    caller = type(_call)(_call.__code__.replace(co_name=name), globals(), name)
    if len(_CALLERS) > 64:
        _CALLERS.clear()
    return caller


_CALLERS: dict[str, Callable] = {}


def call_with_timeout(fn: Callable[[], T], timeout: float, *, what: str,
                      running: Callable[[], str] | None = None) -> T:
    """Run ``fn()`` on this thread; raise :class:`TimeoutError` naming ``what`` if it passes ``timeout`` s.

    ``running`` names what was in progress at the deadline (e.g. which reward function), for the
    message. A ``KeyboardInterrupt`` or any other exception of ``fn`` propagates unchanged, and
    nothing of this call outlives it: the next call starts clean. Code that never returns to the
    interpreter ends the process ``HARD_STOP_GRACE`` s after the deadline (module docstring).
    """
    thread_id = threading.get_ident()
    watch = _Watch(thread_id, use_signal=_signal_ready())
    watch.timeout = timeout
    timer = threading.Timer(timeout, watch.fire, args=(what, timeout, running))
    timer.daemon = True
    _watches[thread_id] = watch
    result = None
    try:
        try:  # the interrupt may come as soon as the timer starts: from there on, inside this try
            _hard_stops.add(watch, timeout + HARD_STOP_GRACE)
            _announce(what)
            timer.start()
            result = _in_a_frame_named(f"{what} [reward_timeout={timeout:g} s; hard stop {HARD_STOP_GRACE:g} s later]",
                                       fn)
        finally:
            timer.cancel()
            watch.finish()
    except _Interrupt:
        watch.finish()  # the interrupt may have landed inside the first finish()
    finally:
        if _announcer is not None:
            _announcer("", timeout)
        _watches.pop(thread_id, None)
    if watch.fired:
        now = f" (still running: {watch.running})" if watch.running else ""
        raise TimeoutError(f"{what} did not finish within reward_timeout={timeout:g} s{now}")
    return result  # type: ignore[return-value]
