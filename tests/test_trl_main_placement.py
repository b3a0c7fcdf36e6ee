"""I4 through TRL: with reward_placement="main" reward functions and models run on rank 0 only, the
reward model is never loaded or moved on the other ranks, and each rank gets exactly its own rewards."""

from __future__ import annotations

import pytest

from tests.launch import describe, run_ranks

pytestmark = pytest.mark.distributed


def test_main_placement_scores_on_rank0_and_returns_each_ranks_rows():
    results = run_ranks("tests.dist_trl", "main", world_size=2, deadline=300)
    assert all(r.returncode == 0 for r in results), describe(results)
    r0, r1 = results
    assert r0.data["holds_model"] and not r1.data["holds_model"]
    assert r0.data["reward_func_names"] == r1.data["reward_func_names"] == ["recording_reward", "tiny-reward-model"]
    for r in results:
        own = r.data["own"]
        assert [x[0] for x in own] == pytest.approx(r.data["expected_func"], abs=1e-6)
        assert [x[1] for x in own] == pytest.approx(r.data["expected_model"], abs=1e-5)
        assert r.data["model_untouched"]
    assert r1.data["others_nan"]  # rank 1 holds no other rank's rewards
    assert r0.data["train_calls"] and not r1.data["train_calls"]
    assert max(len(c["rows"]) for c in r0.data["train_calls"]) <= 4  # reward_chunk_size=4
    # both ranks' prompts were scored on rank 0: 8 completions per rank per step, 2 steps
    assert sum(len(c["rows"]) for c in r0.data["train_calls"]) == 2 * 2 * 8
