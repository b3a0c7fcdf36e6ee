"""I1 group locality through the real TRL GRPOTrainer, 2 ranks over gloo.

First upstream: a per-rank batch of 2 with num_generations=4 is accepted and every group is split
over both ranks (TRL #3896, #5030). Then the patch: the same config is refused at construction with
the nearest valid settings, and with a valid config every reward call on every rank holds whole
groups, with num_generations and group_ids passed to the reward function.
"""

from __future__ import annotations

import pytest

from tests.launch import describe, run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def shape_run():
    results = run_ranks("tests.dist_trl", "shape", world_size=2, deadline=300)
    assert all(r.returncode == 0 for r in results), describe(results)
    return results


def test_stock_trl_splits_groups_across_ranks(shape_run):
    by_rank = [{row for call in r.data["stock_calls"] for row in call["rows"]} for r in shape_run]
    shared = by_rank[0] & by_rank[1]
    assert shared, "expected upstream to put completions of one prompt on both ranks"
    for call in shape_run[0].data["stock_calls"]:
        assert len(call["rows"]) == 2  # half a group of 4 on this rank


def test_patch_rejects_the_same_config_with_the_fix(shape_run):
    for r in shape_run:
        msg = r.data["patched_error"]
        assert msg is not None
        assert "per_device_train_batch_size=2" in msg and "num_generations=4" in msg
        assert "Nearest valid settings: per_device_train_batch_size=4; steps_per_generation=2; num_generations=2" in msg


def test_patched_reward_calls_hold_whole_groups(shape_run):
    rows_per_rank = []
    for r in shape_run:
        calls = r.data["patched_calls"]
        assert calls
        rows = set()
        for call in calls:
            assert call["num_generations"] == 4
            n = len(call["rows"])
            assert n % 4 == 0
            for g in range(0, n, 4):
                assert len(set(call["rows"][g:g + 4])) == 1
                assert len(set(call["group_ids"][g:g + 4])) == 1
            rows |= set(call["rows"])
        rows_per_rank.append(rows)
    assert not rows_per_rank[0] & rows_per_rank[1], "a prompt's group reached two ranks"
