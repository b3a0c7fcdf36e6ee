"""A rank that dies mid-step (SIGKILL, as the out-of-memory killer does): every other rank exits within
the documented bound, naming the rank that vanished (grpo_patches/liveness.py).

Ranks are started by hand (tests/launch.py), so each survivor shows what it does on its own. The
victim's reward function kills (or freezes) its own process at step 2 (tests/workers/dist_rank_death.py).
Upstream first: stock TRL 1.16's survivor dies with gloo's "Connection closed by peer [addr]:port",
which names no rank; with a frozen peer (no connection error, as under NCCL or with a dead host)
it waits in the collective for as long as the peer is frozen (the group's timeout is 30 minutes).
"""

from __future__ import annotations

import time

import pytest

from grpo_patches.liveness import EXIT_CODE, PEER_TIMEOUT_ENV, peer_timeout
from tests.launch import describe, run_ranks

pytestmark = pytest.mark.distributed

BOUND = 6.0  # GRPO_PATCHES_PEER_TIMEOUT for these runs (default 60)
SLACK = 5.0  # process exit, the launcher's polling, a loaded machine


def launch(label, kind, victim, **env):
    env = {PEER_TIMEOUT_ENV: str(BOUND), **{k: str(v) for k, v in env.items()}}
    start = time.time()
    results = run_ranks("tests.workers.dist_rank_death", label, kind, str(victim), world_size=2, deadline=180, env=env)
    survivor = results[1 - victim]
    assert not survivor.hung, describe(results)
    down = [line for line in results[victim].output.splitlines() if line.startswith("VICTIM_DOWN ")]
    assert down, describe(results)
    return results, survivor, start, float(down[0].split()[1])


def test_upstream_survivor_names_no_rank():
    results, survivor, _, _ = launch("stock", "kill", 1)
    assert results[1].returncode == -9, describe(results)
    assert survivor.returncode == 3, describe(results)
    err = survivor.data["error"]
    assert "Connection closed by peer" in err or "Connection reset by peer" in err, err
    assert "rank 1" not in err


@pytest.mark.parametrize("victim", [1, 0])  # rank 0 also hosts the rendezvous store
def test_killed_rank_is_named_within_the_bound(victim):
    results, survivor, start, t_down = launch("patched", "kill", victim)
    assert results[victim].returncode == -9, describe(results)
    assert survivor.returncode == 3, describe(results)
    err = survivor.data["error"]
    assert survivor.data["error_type"] == "RankLostError", err
    assert f"rank {victim}" in err and "vanished" in err, err
    assert survivor.data["t_end"] - t_down < BOUND + SLACK, (survivor.data["t_end"] - t_down, err)


def test_upstream_survivor_of_a_raising_rank_gets_no_cause():
    results, survivor, _, _ = launch("stock", "raise", 1)
    assert [r.returncode for r in results] == [3, 3], describe(results)
    assert "injected" in results[1].data["error"]
    assert "injected" not in survivor.data["error"] and "rank 1" not in survivor.data["error"]


def test_raising_rank_is_named_with_its_error():
    """A rank that fails outside the reward path posts its error on the way out; its peer reports it."""
    results, survivor, _, t_down = launch("patched", "raise", 1)
    assert [r.returncode for r in results] == [3, 3], describe(results)
    assert results[1].data["error"] == "RuntimeError: injected: CUDA out of memory in the forward pass"
    err = survivor.data["error"]
    assert survivor.data["error_type"] == "RankLostError", err
    assert "rank 1 left trainer.train() with RuntimeError: injected: CUDA out of memory" in err, err
    assert survivor.data["t_end"] - t_down < BOUND + SLACK


def test_upstream_waits_for_a_frozen_rank():
    freeze = 15.0
    results, survivor, start, t_down = launch("stock", "stop", 1, GRPO_PATCHES_TEST_FREEZE=freeze)
    # no error at all: the survivor sat in the collective until the peer woke up, then trained on
    assert [r.returncode for r in results] == [0, 0], describe(results)
    assert survivor.data["t_end"] - t_down >= freeze


def test_frozen_rank_ends_its_peer_within_the_bound():
    """No connection error reaches the survivor: its liveness thread ends the process (exit 75)."""
    results, survivor, start, t_down = launch("patched", "stop", 1, GRPO_PATCHES_TEST_FREEZE=20)
    assert survivor.returncode == EXIT_CODE, describe(results)
    assert "rank 1 vanished" in survivor.output and "no heartbeat" in survivor.output, describe(results)
    ended = start + survivor.seconds
    assert BOUND - 1 <= ended - t_down < BOUND + SLACK, (ended - t_down, describe(results))


def test_a_busy_rank_is_not_reported():
    """A reward function that spins for 2x the bound on one rank: its heartbeat goes on, training ends."""
    results, _, _, _ = launch("patched", "busy", 1, GRPO_PATCHES_TEST_BUSY=2 * BOUND)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    assert [r.data["steps"] for r in results] == [4, 4]


@pytest.mark.parametrize("raw", ["soon", "0.5", "-3", "nan", "1e9"])
def test_bad_bound_is_refused(monkeypatch, raw):
    monkeypatch.setenv(PEER_TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=PEER_TIMEOUT_ENV) as info:
        peer_timeout()
    assert repr(raw) in str(info.value) and "0 to turn" in str(info.value)


def test_bound_default_and_off(monkeypatch):
    monkeypatch.delenv(PEER_TIMEOUT_ENV, raising=False)
    assert peer_timeout() == 60.0
    monkeypatch.setenv(PEER_TIMEOUT_ENV, "0")
    assert peer_timeout() is None
    monkeypatch.setenv(PEER_TIMEOUT_ENV, "90")
    assert peer_timeout() == 90.0


def test_only_collective_errors_wait_for_a_verdict():
    """Which errors from train() make a rank look for a vanished peer (and wait for it, up to 30 s)."""
    from grpo_patches.collectives import CollectiveTimeoutError, Failure, RemoteFailureError
    from grpo_patches.liveness import _lost_peer

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:34494")
    assert _lost_peer(gloo)
    assert _lost_peer(CollectiveTimeoutError("rank 0 lost its peers during 'gather'"))
    wrapped = ValueError("while logging")
    wrapped.__cause__ = gloo
    assert _lost_peer(wrapped)
    # a reward service's own network error: the kit already names the function and rank
    reset = RemoteFailureError([Failure(1, "reward function 'api'", "ConnectionResetError", "Connection reset by peer")],
                               on_rank=0)
    assert not _lost_peer(reset)
    assert not _lost_peer(ConnectionResetError("Connection reset by peer"))  # e.g. a logger's upload
    assert not _lost_peer(RuntimeError("CUDA out of memory"))


def test_a_store_read_that_outlasts_the_wait_still_gets_the_verdict():
    """Rank 0 (the store's host) killed: the survivor's read of the store blocks for its reconnect timeout,
    past the wait's end, while the liveness thread sees the store go; the verdict still names rank 0 (the
    survivor once re-raised the bare CollectiveTimeoutError here, on a loaded machine)."""
    import threading

    from grpo_patches.liveness import _Monitor

    monitor = _Monitor.__new__(_Monitor)  # no thread, no store: the main thread's wait alone
    monitor.rank, monitor.world_size, monitor.address = 1, 2, ("127.0.0.1", 29500)
    monitor.set_timeout(1.0)
    monitor.lock, monitor.seen, monitor.armed, monitor.judging = threading.Lock(), {}, True, False
    monitor.store_lost_since, monitor.store_error, monitor.doing = None, "", {}

    def blocked_read():  # as a read of the dead store does; meanwhile the thread's failed tick is recorded
        time.sleep(1.2)
        with monitor.lock:
            monitor.store_lost_since, monitor.store_error = time.monotonic() - 1.2, "DistNetworkError: reset"
        return None

    monitor._posted_failure = blocked_read
    named = monitor.name_the_lost()
    assert named is not None and named[0] == 0, named
    assert "rendezvous store" in named[1] and "vanished" in named[1], named
