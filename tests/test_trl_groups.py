"""I1 group locality through the real TRL GRPOTrainer, 2 ranks over gloo.

First upstream: a per-rank batch of 2 with num_generations=4 is accepted and every group is split
over both ranks (TRL #3896, #5030). Then the patch: the same config is refused at construction with
the nearest valid settings, and with a valid config under main placement in chunks (rank 0 scores
both ranks' completions, two groups per call) every reward call holds whole groups, with
num_generations and group_ids (equal inside a group, distinct across groups) passed to the reward
function. The same checker flags upstream's calls on the split shape.
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


def grouping_problems(call, g):
    rows, ids = call["rows"], call["group_ids"] or [None] * len(call["rows"])
    runs = [(rows[i:i + g], ids[i:i + g]) for i in range(0, len(rows), g)]
    problems = []
    if len(rows) % g or any(len(set(r)) != 1 or len(r) != g for r, _ in runs):
        problems.append(f"rows {rows} are not whole groups of {g}")
    if any(len(set(i)) != 1 or i[0] is None for _, i in runs) or len({i[0] for _, i in runs}) != len(runs):
        problems.append(f"group_ids {call['group_ids']} do not mark the groups")
    return problems


def test_patched_reward_calls_hold_whole_groups(shape_run):
    assert all(grouping_problems(c, 4) for c in shape_run[0].data["stock_calls"]), "the checker must see the split"
    r0, r1 = shape_run
    assert not r1.data["patched_calls"], "main placement: rank 1 runs no reward function"
    calls = r0.data["patched_calls"]
    assert len(calls) == 2 * 2 and all(len(c["rows"]) == 4 for c in calls)  # 2 steps x 16 completions / chunk 4
    for call in calls:
        assert call["num_generations"] == 2
        assert not grouping_problems(call, 2), grouping_problems(call, 2)
