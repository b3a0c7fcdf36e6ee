"""Issue-12 behaviour on 2 ranks over gloo, each case stock first, then patched (tests/workers/dist_user_code.py)."""

from __future__ import annotations

import pytest

from tests.launch import describe, free_port, run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("placement", ["local", "main"])
def test_trl_accuracy_reward_scores_like_stock_with_its_timeout_active(placement):
    """math_verify's SIGALRM timeouts need the main thread: the sample that trips them is scored
    0.0 after 5 s, as stock scores it, instead of running unbounded into reward_timeout."""
    results = run_ranks("tests.workers.dist_user_code", "accuracy", placement, world_size=2, deadline=240)
    assert all(r.returncode == 0 for r in results), describe(results)
    expected = {0: [1.0, 0.0, 0.0, 0.0], 1: [1.0, 1.0, 1.0, 0.0]}
    for r in results:
        assert r.data["stock"]["rewards"] == [[v] for v in expected[r.rank]], r.data
        assert r.data["patched"]["rewards"] == r.data["stock"]["rewards"], r.data
        assert r.data["stock"]["seconds"] >= 5.0  # the slow sample did trip the timeout in stock
    scorer = results[0] if placement == "main" else results[1]
    assert 5.0 <= scorer.data["patched"]["seconds"] < 40.0, scorer.data  # timed out by math_verify, not by the kit


def test_main_placement_refuses_a_rank_batch_that_is_not_whole_groups():
    results = run_ranks("tests.workers.dist_user_code", "partial_groups", world_size=2, deadline=120)
    assert all(r.returncode == 0 for r in results), describe(results)
    for r in results:
        assert r.data["stock"] == {"rows": 6, "calls": [3]}  # stock scores the split groups silently
        err = r.data["patched"]["error"]
        assert err.startswith("RemoteFailureError") and "rank 0 was given 3 completions" in err, err
        assert "rank 1 was given 3 completions" in err and "num_generations=2" in err, err


def test_eval_shape_is_enforced_however_the_eval_set_arrives():
    results = run_ranks("tests.workers.dist_user_code", "eval", world_size=2, deadline=240)
    assert all(r.returncode == 0 for r in results), describe(results)
    r0, r1 = results[0].data, results[1].data
    # stock: every eval group of 4 is split 2 + 2 over the ranks
    assert r0["stock_eval_calls"] and all(len(c) == 2 for c in r0["stock_eval_calls"])
    assert {c[0] for c in r0["stock_eval_calls"]} == {c[0] for c in r1["stock_eval_calls"]}
    for data in (r0, r1):
        assert "per_device_eval_batch_size=2" in data["scheduled"] and "split across ranks" in data["scheduled"]
        assert data["late_eval"] and "was given 2 completions" in data["late_eval"], data["late_eval"]
        assert "per_device_eval_batch_size a multiple of num_generations_eval=4" in data["late_eval"]
        assert data["patched_eval_calls"] == []  # refused before any reward function ran


def test_side_group_survives_a_new_default_group():
    results = run_ranks("tests.workers.dist_user_code", "reinit", str(free_port()), world_size=2, deadline=60)
    assert all(r.returncode == 0 for r in results), describe(results)
    assert results[0].data["first"] == [0, 1]
    assert results[0].data.get("second") == [0, 10], results[0].data
