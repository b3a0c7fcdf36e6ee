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
* if the watched code cannot be interrupted (C code that never returns to the interpreter), the
  process ends ``HARD_STOP_GRACE`` seconds later through :mod:`faulthandler`, whose watchdog is a
  C thread that needs no GIL, after dumping every thread's stack: a bounded failure, never a hang.
  Its peers then lose the connection and raise within their own bound.

``GRPO_PATCHES_WATCHDOG_SIGNAL`` picks the wake-up signal (a name such as ``SIGUSR2``, or a number);
``none`` disables it (then only pure-Python code is interrupted before the hard stop).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["HARD_STOP_GRACE", "SIGNAL_ENV", "call_with_timeout"]

SIGNAL_ENV = "GRPO_PATCHES_WATCHDOG_SIGNAL"
HARD_STOP_GRACE = 10.0  # seconds between the interrupt and the hard stop of an uninterruptible call


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
                f"If it cannot be interrupted, this process exits in {HARD_STOP_GRACE:g} s.\n"
            )
            sys.stderr.flush()
            faulthandler.dump_traceback_later(HARD_STOP_GRACE, exit=True)
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
            if self.fired:
                faulthandler.cancel_dump_traceback_later()
                if not self.use_signal:  # clear an asynchronous exception not yet raised
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
    if name.isdigit():
        return int(name)
    value = getattr(signal, name.upper(), None)
    if not isinstance(value, int) or name.upper() == "SIGALRM":
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


def call_with_timeout(fn: Callable[[], T], timeout: float, *, what: str,
                      running: Callable[[], str] | None = None) -> T:
    """Run ``fn()`` on this thread; raise :class:`TimeoutError` naming ``what`` if it passes ``timeout`` s.

    ``running`` names what was in progress at the deadline (e.g. which reward function), for the
    message. A ``KeyboardInterrupt`` or any other exception of ``fn`` propagates unchanged, and
    nothing of this call outlives it: the next call starts clean.
    """
    thread_id = threading.get_ident()
    watch = _Watch(thread_id, use_signal=_signal_ready())
    timer = threading.Timer(timeout, watch.fire, args=(what, timeout, running))
    timer.daemon = True
    _watches[thread_id] = watch
    timer.start()
    try:
        try:
            result = fn()
        finally:
            timer.cancel()
            watch.finish()
    except _Interrupt:
        watch.finish()  # the interrupt may have landed inside the first finish()
        result = None
    finally:
        _watches.pop(thread_id, None)
    if watch.fired:
        now = f" (still running: {watch.running})" if watch.running else ""
        raise TimeoutError(f"{what} did not finish within reward_timeout={timeout:g} s{now}")
    return result
