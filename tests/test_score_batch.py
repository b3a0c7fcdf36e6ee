"""The kit's reward loop (targets/trl_glue.score_batch) per chunk: what each call of a function receives.

Upstream scores a rank's completions in one call per function; with ``reward_chunk_size`` the kit
makes several, and everything per-completion must be cut to the chunk. An earlier version gave
every chunk the rank's whole ``environments`` list (TRL's ``environment_factory``), so a function
returned 8 rewards for 4 completions. A stub trainer stands in for TRL's here: environments need a
tool-calling chat template that a tiny local tokenizer does not have.
"""

from __future__ import annotations

import types

import pytest
import torch

from grpo_patches.rewards import RewardBatch
from grpo_patches.targets.trl_glue import score_batch


def stub_trainer(reward_funcs, environments=None):
    return types.SimpleNamespace(accelerator=types.SimpleNamespace(device=torch.device("cpu")),
                                 reward_funcs=reward_funcs, reward_processing_classes=[None] * len(reward_funcs),
                                 reward_func_names=[f.__name__ for f in reward_funcs], state=None,
                                 environments=environments)


def batch(n, **columns):
    return RewardBatch([f"p{i // 2}" for i in range(n)], [f"c{i}" for i in range(n)], [[i] for i in range(n)],
                       {k: list(v) for k, v in columns.items()})


def test_each_chunk_gets_its_own_environments_and_group_ids():
    calls = []

    def env_reward(completions, environments, group_ids, row, **kwargs):
        calls.append((list(completions), list(environments), list(group_ids), list(row)))
        return [float(e) for e in environments]  # one reward per environment: a length mismatch shows

    envs = [10, 11, 12, 13, 14, 15, 16, 17]
    scored = score_batch(stub_trainer([env_reward], envs), batch(8, row=range(8)), [0, 0, 1, 1, 2, 2, 3, 3],
                         num_generations=2, with_environments=True, chunk_size=4)
    assert scored.rewards[:, 0].tolist() == [float(e) for e in envs]
    assert calls == [(["c0", "c1", "c2", "c3"], [10, 11, 12, 13], [0, 0, 1, 1], [0, 1, 2, 3]),
                     (["c4", "c5", "c6", "c7"], [14, 15, 16, 17], [2, 2, 3, 3], [4, 5, 6, 7])]


def test_a_function_without_kwargs_gets_only_what_it_names():
    def plain(prompts, completions, completion_ids, row):
        return [float(r) for r in row]

    scored = score_batch(stub_trainer([plain]), batch(4, row=[5, 5, 6, 6]), [0, 0, 1, 1], num_generations=2,
                         with_environments=False, chunk_size=2)
    assert scored.rewards[:, 0].tolist() == [5.0, 5.0, 6.0, 6.0]


@pytest.mark.parametrize("column", ["group_ids", "num_generations"])
def test_a_column_named_like_a_kit_kwarg_is_refused(column):
    def reward(completions, **kwargs):
        return [1.0] * len(completions)

    with pytest.raises(ValueError, match=f"dataset has a column named '{column}'"):
        score_batch(stub_trainer([reward]), batch(2, **{column: ["x", "y"]}), [0, 0], num_generations=2,
                    with_environments=False)


def test_a_chunk_that_is_not_whole_groups_is_refused():
    def reward(completions, **kwargs):
        return [1.0] * len(completions)

    with pytest.raises(ValueError, match="not whole groups of 2"):
        score_batch(stub_trainer([reward]), batch(3), [0, 0, 1], num_generations=2, with_environments=False)
