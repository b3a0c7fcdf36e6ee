"""The watchdog runs user code on the caller's own thread and only watches it (grpo_patches/watchdog.py).

Upstream (stock TRL) runs reward functions on the thread that called the reward step, the main
thread; code there may arm SIGALRM (math_verify's timeouts) or be interrupted by Ctrl-C. The kit's
earlier design ran them on a worker thread: SIGALRM failed with "signal only works in main
thread", and after a Ctrl-C the next call timed out at once (the worker was still busy).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from grpo_patches.watchdog import call_with_timeout


def test_runs_on_the_calling_thread():
    seen = []
    assert call_with_timeout(lambda: seen.append(threading.current_thread()) or 7, 30, what="t") == 7
    assert seen == [threading.current_thread()]


def test_a_reward_function_may_arm_its_own_sigalrm_handler():
    """What math_verify's timeouts do: works on the main thread, keeps the user's handler alone."""
    def with_alarm():
        fired = []
        previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(True))
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        time.sleep(0.3)  # the alarm interrupts the sleep and runs the user's handler
        signal.signal(signal.SIGALRM, previous)
        return fired

    assert call_with_timeout(with_alarm, 30, what="t") == [True]
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None) or callable(
        signal.getsignal(signal.SIGALRM))


@pytest.mark.parametrize("body", ["sleep", "busy", "swallowing"])
def test_the_deadline_interrupts_the_call(body):
    def sleep():
        time.sleep(60)

    def busy():
        while True:
            pass

    def swallowing():  # user code that catches every Exception must still be interrupted
        while True:
            try:  # noqa: SIM105 - the point: user code that swallows errors
                time.sleep(60)
            except Exception:
                pass

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"my reward did not finish within reward_timeout=1 s \(still running: f\)"):
        call_with_timeout({"sleep": sleep, "busy": busy, "swallowing": swallowing}[body], 1.0, what="my reward",
                          running=lambda: "f")
    assert time.monotonic() - start < 5.0


def test_a_deadline_off_the_main_thread_interrupts_python_code():
    out = {}

    def worker():
        try:
            call_with_timeout(lambda: [None for _ in iter(int, 1)], 1.0, what="w")
        except TimeoutError as exc:
            out["error"] = str(exc)

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    t.join(10)
    assert "did not finish within reward_timeout=1 s" in out.get("error", ""), out


def test_keyboard_interrupt_propagates_and_the_next_call_is_clean():
    def interrupted():
        signal.raise_signal(signal.SIGINT)  # Ctrl-C while the reward function runs
        time.sleep(5)

    with pytest.raises(KeyboardInterrupt):
        call_with_timeout(interrupted, 30, what="t")
    start = time.monotonic()
    assert call_with_timeout(lambda: time.sleep(0.2) or "ok", 2.0, what="t") == "ok"
    assert time.monotonic() - start < 1.5


def test_after_a_timeout_the_next_call_is_clean_and_nothing_fires_later():
    with pytest.raises(TimeoutError):
        call_with_timeout(lambda: time.sleep(60), 0.5, what="t")
    assert call_with_timeout(lambda: "fast", 0.5, what="t") == "fast"
    time.sleep(1.0)  # a stray interrupt of a finished call would land here


def test_an_uninterruptible_call_ends_the_process_instead_of_hanging():
    """With the wake-up signal off, a C-level sleep cannot be interrupted: the hard stop ends it."""
    code = textwrap.dedent("""
        import time
        from grpo_patches import watchdog
        watchdog.HARD_STOP_GRACE = 1.0
        watchdog.call_with_timeout(lambda: time.sleep(60), 1.0, what="stuck reward")
        print("returned")
    """)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                          env={"GRPO_PATCHES_WATCHDOG_SIGNAL": "none", "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[1])})
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "returned" not in proc.stdout
    assert "stuck reward did not finish within reward_timeout=1 s" in proc.stderr
    assert "Timeout" in proc.stderr and "time.sleep" not in proc.stdout  # faulthandler's dump
    assert time.monotonic() - start < 30
