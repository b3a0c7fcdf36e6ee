"""I4 through TRL: with reward_placement="main" reward functions and models run on rank 0 only, the
reward model is never held or run on the other ranks, and each rank gets exactly its own rewards.

On CPU every device is "cpu", so "never moved" cannot be read off a device: the user's model object
is counted instead (forward calls per rank, whether the trainer holds it). Upstream first, and the
reward model given by path (TRL's hub-id branch), are in tests/matrix/test_invariants.py (I4).
"""

from __future__ import annotations

import pytest

from tests.launch import describe, run_ranks, world_sizes

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world_size", world_sizes(4))  # 2 ranks: tests/matrix (I4)
def test_main_placement_scores_on_rank0_and_returns_each_ranks_rows(world_size):
    results = run_ranks("tests.workers.dist_trl", "main", world_size=world_size, deadline=400)
    assert all(r.returncode == 0 for r in results), describe(results)
    r0, others = results[0], results[1:]
    assert r0.data["holds_model"] and not any(r.data["holds_model"] for r in others)
    for r in results:
        assert r.data["reward_func_names"] == ["recording_reward", "tiny-reward-model"]
        own = r.data["own"]
        assert [x[0] for x in own] == pytest.approx(r.data["expected_func"], abs=1e-6)
        assert [x[1] for x in own] == pytest.approx(r.data["expected_model"], abs=1e-4)
        assert r.data["model_untouched"]
    assert r0.data["model_forwards"] > 0 and not any(r.data["model_forwards"] for r in others)
    assert all(r.data["others_nan"] for r in others)  # no rank holds another rank's rewards
    assert r0.data["train_calls"] and not any(r.data["train_calls"] for r in others)
    assert max(len(c["rows"]) for c in r0.data["train_calls"]) <= 4  # reward_chunk_size=4
    # every rank's prompts were scored on rank 0: 8 completions per rank per step, 2 steps
    assert sum(len(c["rows"]) for c in r0.data["train_calls"]) == world_size * 2 * 8
