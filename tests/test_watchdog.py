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

from grpo_patches import watchdog
from grpo_patches.watchdog import Progress, call_with_timeout
from tests.helpers import ctrl_c_raises


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

    with ctrl_c_raises(), pytest.raises(KeyboardInterrupt):
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


def _run_child(code: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", **env,
                               "PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[1])})
    return proc, time.monotonic() - start


def test_code_that_holds_the_gil_is_ended_by_the_hard_stop_armed_before_it_started():
    """A catastrophically backtracking regular expression holds the GIL inside C: no Python thread runs
    (the watchdog thread included) until it returns, in centuries. Only a stop armed before it began, in C,
    can end it; its stack names the reward function and, in a frame named after the call, the rank."""
    proc, seconds = _run_child("""
        import re, time
        from grpo_patches import watchdog
        watchdog.HARD_STOP_GRACE = 1.0
        # a call that ended long ago leaves no hard stop behind
        watchdog.call_with_timeout(lambda: "fast", 0.2, what="an earlier step")
        time.sleep(2.0)
        print("alive after the earlier step's hard stop would have come", flush=True)
        def regex_reward():
            return re.match(r"(a+)+$", "a" * 40 + "b")
        watchdog.call_with_timeout(regex_reward, 1.0, what="reward computation on rank 1")
        print("returned", flush=True)
    """)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "alive after" in proc.stdout and "returned" not in proc.stdout, proc.stdout
    assert "Timeout (0:00:0" in proc.stderr, proc.stderr  # faulthandler's dump, from C
    assert "in regex_reward" in proc.stderr and "reward computation on rank 1 [reward_timeout=1 s" in proc.stderr
    assert seconds < 2.0 + 2.0 + 15.0, seconds  # start-up + the earlier step's wait + the bound (2 s), loaded host


def test_the_interrupt_never_escapes_even_when_the_deadline_comes_at_once():
    """With a tiny timeout the interrupt can land anywhere around the timer's start: always TimeoutError."""
    seen: dict[str, int] = {}
    for i in range(2000):  # the timer thread gets the GIL mostly while the caller waits in the timer's start
        try:
            call_with_timeout(lambda: sum(range(30000)), (1e-9, 1e-6, 1e-5)[i % 3], what="t")
            seen["returned"] = seen.get("returned", 0) + 1
        except TimeoutError:
            seen["timeout"] = seen.get("timeout", 0) + 1
    assert set(seen) <= {"returned", "timeout"}, seen
    assert call_with_timeout(lambda: time.sleep(0.05) or "ok", 5.0, what="t") == "ok"


def test_the_announcer_hears_what_runs_before_it_runs_and_when_it_is_over():
    heard: list[tuple[str, float]] = []
    previous = watchdog.set_announcer(lambda what, timeout: heard.append((what, timeout)))
    try:
        progress = Progress()

        def step():
            progress["now"] = "reward function 'a'"
            progress["now"] = "reward function 'b'"
            return len(heard)

        assert call_with_timeout(step, 30, what="reward computation on rank 0") == 3
        progress["now"] = "outside any watched call"  # not announced
    finally:
        watchdog.set_announcer(previous)
    assert heard == [("reward computation on rank 0", 30), ("reward function 'a'", 30),
                     ("reward function 'b'", 30), ("", 30)]
