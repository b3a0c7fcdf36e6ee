"""The kit under DeepSpeed ZeRO-2 / ZeRO-3: real TRL GRPO runs on 2 ranks (DeepSpeed's CPU accelerator,
gloo). Needs deepspeed (extra ``layouts``): runs in ``nox -s layouts``."""

from __future__ import annotations

import importlib.util

import pytest

from tests.launch import describe, run_ranks

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed not installed: runs in `nox -s layouts`"),
]


@pytest.mark.parametrize("stage", [2, 3])
def test_local_placement_trains_with_whole_groups_per_rank(stage):
    results = run_ranks("tests.workers.ds_worker", str(stage), "local", world_size=2, deadline=420)
    assert all(r.returncode == 0 for r in results), describe(results)
    seen = []
    for r in results:
        assert r.data["distributed_type"] == "DistributedType.DEEPSPEED" and r.data["patched"]
        assert r.data["steps"] == 2
        for call in r.data["calls"]:
            assert call["rank"] == r.rank
            assert len(set(call["rows"])) == 1 and len(call["rows"]) == 4  # one whole group of 4 per call
            seen += call["rows"][:1]
    assert len(seen) == len(set(seen)) == 4  # 2 steps x 2 ranks, no prompt twice


def test_main_placement_with_rule_based_rewards_scores_on_rank_0_only():
    results = run_ranks("tests.workers.ds_worker", "3", "main", world_size=2, deadline=420)
    assert all(r.returncode == 0 for r in results), describe(results)
    rank0, rank1 = (r.data for r in results)
    assert rank1["calls"] == [] and rank0["calls"]
    assert all(call["rank"] == 0 for call in rank0["calls"])
    assert sum(len(c["rows"]) for c in rank0["calls"]) == 2 * 2 * 4  # both ranks' completions, 2 steps


def test_main_placement_with_a_reward_model_is_refused_on_every_rank_without_a_hang():
    results = run_ranks("tests.workers.ds_worker", "3", "main", "model", world_size=2, deadline=300)
    assert not any(r.hung for r in results), describe(results)
    for r in results:
        assert r.returncode == 3, describe(results)
        assert "cannot be used under DeepSpeed" in r.data["error"] and "reward_placement='local'" in r.data["error"]


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="needs math-verify (nox -s layouts has it)")
@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_the_example_runs_under_the_shipped_deepspeed_config(name, tmp_path):
    """examples/train_grpo_lora.py through ``accelerate launch --config_file`` with a CPU copy of the
    shipped zero2.yaml / zero3.yaml (its ``--no-ds3-gather`` too, as zero3.yaml's comment offers)."""
    from tests.test_examples import cpu_copy, launch

    out = tmp_path / "run"
    extra = ("--no-ds3-gather",) if name == "zero3" else ()
    done = launch(cpu_copy(name, tmp_path), out, "--max-steps", "2", "--report-to", "", *extra)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "done, 2 steps" in log and (out / "final" / "adapter_config.json").is_file()
    assert "has no field for" not in log
