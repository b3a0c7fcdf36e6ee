"""I5 through TRL: a reward function that raises, hangs, or is stuck in C code that holds the GIL on one
rank makes every rank end within reward_timeout + a few seconds, naming the function, the rank and the cause.

Upstream (TRL 1.16): the raising rank dies alone and its peer gets "Connection closed by
peer"; a hanging reward function hangs both ranks for the 30-minute collective timeout.

Several faults share one world (each raises on every rank and the world goes on); the GIL-holding one
ends its rank (the watchdog's hard stop), so it comes last. Under main placement only rank 0 scores.
"""

from __future__ import annotations

import time

import pytest

from tests.launch import describe, run_ranks

pytestmark = pytest.mark.distributed

TIMEOUT = 5.0  # reward_timeout in tests/workers/dist_trl.py
GRACE = 5.0  # grpo_patches.watchdog.HARD_STOP_GRACE
SLACK = 6.0  # process start and exit, a loaded 2-core machine

LOAD_ERROR = "OSError: We couldn't connect to 'https://huggingface.co' to load the files"  # offline, no such id
WORLDS = [  # kinds, bad rank, placement
    ("load,soft,raise,sleep,regex", 1, "local"),
    ("load,soft,raise,sleep,regex", 0, "main"),
    ("regex", 0, "local"),  # rank 0 also hosts the rendezvous store: the cause must be read before it goes
]
MESSAGES = {"raise": ["ZeroDivisionError: injected in flaky_reward"],
            "sleep": ["did not finish within reward_timeout=5 s"],
            "regex": ["timed out in its reward step", "did not finish within reward_timeout=5 s"]}


@pytest.mark.parametrize("kinds,bad_rank,placement", WORLDS)
def test_reward_faults_fail_every_rank(kinds, bad_rank, placement):
    launched = time.time()
    results = run_ranks("tests.workers.dist_trl", "faults", kinds, str(bad_rank), placement, world_size=2, deadline=240,
                        env={"HF_HUB_OFFLINE": "1"})
    assert not any(r.hung for r in results), describe(results)
    for kind in kinds.split(","):
        if kind == "load":
            check_misspelt_reward_model(results, bad_rank)
            continue
        if kind == "soft":
            check_soft_failures(results, bad_rank, placement)
            continue
        for r in results:
            if kind == "regex" and r.rank == bad_rank:
                continue  # below: no Python runs there to raise
            got = r.data["faults"][kind]
            err = got["error"] or ""
            assert all(m in err for m in MESSAGES[kind]), (kind, describe(results))
            assert f"rank {bad_rank}" in err and "flaky_reward" in err, (kind, err)
            bound = TIMEOUT + (GRACE if kind == "regex" else 0.0) + SLACK
            assert got["seconds"] < bound, (kind, got["seconds"], err, describe(results))
    if "regex" in kinds:
        stuck, peer = results[bad_rank], results[1 - bad_rank]
        assert peer.returncode == 3 and peer.data["faults"]["regex"]["error"].startswith("RankLostError"), describe(results)
        # the stuck rank: ended from C by faulthandler, its stack through the reward function and the named call
        assert stuck.returncode == 1, describe(results)
        assert "Timeout (0:00:" in stuck.output and "in flaky_reward" in stuck.output, stuck.output[-3000:]
        assert "reward computation on " in stuck.output and "[reward_timeout=5 s" in stuck.output, stuck.output[-3000:]
        t0 = stuck.data["faults"]["regex"]["t0"]
        assert launched + stuck.seconds - t0 < TIMEOUT + GRACE + SLACK, (launched + stuck.seconds - t0)


def check_misspelt_reward_model(results, bad_rank):
    """Stock TRL: every rank loads the misspelt reward model id and raises the load error. The kit: the rank
    that loads it raises that error; its peer raises too, naming that rank and the same error (before, the
    peer died in the kit's side-group setup with 'Connection reset by peer', naming no rank and no cause)."""
    for r in results:
        stock = r.data["faults"]["load/stock"]["error"] or ""
        assert stock.startswith(LOAD_ERROR), describe(results)
    load_error = results[bad_rank].data["faults"]["load/kit"]["error"] or ""
    assert load_error.startswith(LOAD_ERROR), describe(results)
    peer = results[1 - bad_rank].data["faults"]["load/kit"]
    assert peer["error"] == (f"RemoteFailureError: building GRPOTrainer failed on rank {bad_rank}: "
                             f"{load_error}"), describe(results)
    assert all(r.data["faults"]["load/kit"]["seconds"] < 30 for r in results), describe(results)


def check_soft_failures(results, bad_rank, placement):
    """apply(reward_failure="no_reward" | "drop_group"): a reward call that raises, or a step that times out,
    on one rank (under main placement: the main process, which scores every rank's rows) fails no rank; every
    rank logs the same count. "drop_group": the failed call's rows (all of them here: one call per step) have
    advantage 0. "no_reward": a raising call leaves the other function's rewards, so the advantages
    are not all 0; a timed-out step leaves no reward at all for its rows."""
    hit = range(2) if placement == "main" else [bad_rank]  # the ranks whose rows the failed call scored
    for policy in ("no_reward", "drop_group"):
        for fault in ("raise", "sleep"):
            key = f"soft/{policy}/{fault}"
            for r in results:
                got = r.data["faults"][key]
                assert got["error"] is None and got["failed_calls"] == [1.0], (key, r.rank, describe(results))
                assert got["seconds"] < TIMEOUT + SLACK + 20, (key, got["seconds"])  # one generation as well
                zero = all(a == 0 for a in got["advantages"])
                assert zero == (r.rank in hit and (policy == "drop_group" or fault == "sleep")), (key, r.rank, got)
