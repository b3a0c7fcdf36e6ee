"""apply(reward_failure=...): what a reward call that raises or times out does, on one rank.

The default ("raise") fails the step naming the function; "no_reward" gives the failed call's rows
no reward from that function (NaN: stock TRL's ``None``); "drop_group" gives them none from any
function, so their groups carry no advantage. A timed-out step (the watchdog's interrupt) gives
all of its rows no reward. The count is what every rank logs. The 2-rank behaviour, under both
placements, is in tests/test_trl_faults.py.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from grpo_patches.collectives import FailFastGroup, RemoteFailureError
from grpo_patches.options import PatchOptions
from grpo_patches.rewards import RewardBatch, Scored, compute_rewards
from grpo_patches.targets.trl_glue import score_batch
from tests.test_score_batch import batch, stub_trainer


def steady(completions, **kwargs):
    return [1.0] * len(completions)


def flaky(completions, group_ids, **kwargs):  # fails on the chunk that holds group 1
    if 1 in group_ids:
        raise ZeroDivisionError("injected")
    return [2.0] * len(completions)


def score(policy):
    # 6 completions, groups of 2, chunks of 2: flaky fails on rows 2..3 only
    return score_batch(stub_trainer([steady, flaky]), batch(6), [0, 0, 1, 1, 2, 2], num_generations=2,
                       with_environments=False, chunk_size=2, on_failure=policy)


def nan_rows(column):
    return [i for i, x in enumerate(column) if math.isnan(x)]


def test_raise_is_the_default_and_names_the_function():
    assert PatchOptions().reward_failure == "raise"
    with pytest.raises(ZeroDivisionError, match="injected") as info:
        score("raise")
    assert info.value.grpo_patches_where == "reward function 'flaky'"


def test_no_reward_empties_only_the_failed_calls_rows_of_that_function():
    scored = score("no_reward")
    assert scored.failed_calls == 1
    assert scored.rewards[:, 0].tolist() == [1.0] * 6  # the other function keeps every row
    assert nan_rows(scored.rewards[:, 1].tolist()) == [2, 3]
    assert [scored.rewards[i, 1].item() for i in (0, 1, 4, 5)] == [2.0] * 4


def test_drop_group_empties_the_failed_calls_groups_for_every_function():
    scored = score("drop_group")
    assert scored.failed_calls == 1
    assert nan_rows(scored.rewards[:, 0].tolist()) == [2, 3] == nan_rows(scored.rewards[:, 1].tolist())
    assert scored.rewards[[0, 1, 4, 5]].tolist() == [[1.0, 2.0]] * 4


@pytest.mark.parametrize("policy", ["no_reward", "drop_group"])
def test_a_timed_out_step_gives_all_its_rows_no_reward(policy):
    def stuck(b, ids):
        time.sleep(30)
        return Scored(torch.ones(len(b), 2))

    result = compute_rewards(RewardBatch(["p"] * 4, ["c"] * 4, [[0]] * 4), stuck, group=FailFastGroup(10.0),
                             placement="local", num_generations=2, timeout=0.5, on_failure=policy, num_funcs=2)
    assert result.failed_calls == 1 and result.local.shape == (4, 2) and torch.isnan(result.local).all()


def test_a_timed_out_step_raises_by_default():
    with pytest.raises(RemoteFailureError, match="did not finish within reward_timeout=0.5 s"):
        compute_rewards(RewardBatch(["p"] * 2, ["c"] * 2, [[0]] * 2), lambda b, ids: time.sleep(30),
                        group=FailFastGroup(10.0), placement="local", num_generations=2, timeout=0.5, num_funcs=1)


@pytest.mark.parametrize("value", ["skip", "drop", None, 0])
def test_bad_values_are_refused_naming_the_option_and_the_choices(value):
    import grpo_patches

    with pytest.raises(ValueError) as info:
        grpo_patches.apply(reward_failure=value, targets=("vendored",))
    text = str(info.value)
    assert f"reward_failure={value!r}" in text and "'raise', 'no_reward', 'drop_group'" in text
    assert not grpo_patches.is_applied()


def test_drop_group_with_normalize_then_sum_is_refused_where_trl_sums_unscored_rows_to_zero():
    """Before TRL 1.6 a row that no reward function scored sums to 0, and normalize_then_sum then normalizes
    those zeros against the batch: a dropped group would get an advantage. Refused there, named; allowed
    where TRL leaves such rows out (1.6+, this environment's release), and for every other combination."""
    from types import SimpleNamespace

    from trl.trainer.grpo_trainer import GRPOTrainer

    from grpo_patches.options import PatchOptions
    from grpo_patches.targets.trl_glue import check_drop_group, marks_unscorable

    assert marks_unscorable(GRPOTrainer.__init__)  # TRL 1.16
    config = SimpleNamespace(multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ValueError, match="reward_failure='drop_group' with multi_objective_aggregation"):
        check_drop_group(PatchOptions(reward_failure="drop_group"), config, unscorable_handled=False)
    check_drop_group(PatchOptions(reward_failure="drop_group"), config, unscorable_handled=True)
    check_drop_group(PatchOptions(reward_failure="no_reward"), config, unscorable_handled=False)
    summed = SimpleNamespace(multi_objective_aggregation="sum_then_normalize")
    check_drop_group(PatchOptions(reward_failure="drop_group"), summed, unscorable_handled=False)
    check_drop_group(PatchOptions(reward_failure="drop_group"), None, unscorable_handled=False)  # TRL's defaults
