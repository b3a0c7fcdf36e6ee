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



class _Scores(torch.Tensor):
    """A reward model's scores that log when the host reads them back (``.cpu()``, ``.tolist()``, ``.item()``)."""

    events: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item):
            cls.events.append("model scores read")
        return super().__torch_function__(func, types, args, kwargs or {})


class _LoggingRewardModel(torch.nn.Module):
    """A sequence classifier stand-in: score = number of tokens; logs its forward; ``nan_row`` scores NaN."""

    def __init__(self, events, nan_row=None):
        super().__init__()
        self.events, self.nan_row = events, nan_row

    def forward(self, input_ids, attention_mask, **kwargs):
        self.events.append("model forward")
        scores = attention_mask.sum(-1, keepdim=True).float()
        if self.nan_row is not None and self.nan_row < len(scores):
            scores[self.nan_row] = float("nan")
        return types.SimpleNamespace(logits=scores.as_subclass(_Scores))


def _reward_setup(nan_row=None, model_first=True):
    """A logging reward model "rm" and a rule function "rule" (in this order, or the rule listed first and a
    second rule "rule2" after the model), over one event list; a tokenizer."""
    from accelerate import PartialState
    from trl import GRPOTrainer

    from grpo_patches.testing import tiny_tokenizer

    events = []
    _Scores.events = events
    model = _LoggingRewardModel(events, nan_row)

    def rule(completions, **kwargs):
        events.append("rule")
        return [1.0] * len(completions)

    def rule2(completions, **kwargs):
        events.append("rule2")
        return [5.0] * len(completions)

    PartialState()  # accelerate's gather (upstream's last line) needs a state: one process
    trainer = GRPOTrainer.__new__(GRPOTrainer)  # only what scoring reads
    trainer.__dict__.update(
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        args=types.SimpleNamespace(device=torch.device("cpu"), report_to=[]), is_deepspeed_enabled=False,
        state=types.SimpleNamespace(global_step=0), environments=None,
        _log_completion_extra=lambda *a: None, _log_metric=lambda *a: None)
    if model_first:
        trainer.__dict__.update(reward_funcs=[model, rule], reward_processing_classes=[tiny_tokenizer(), None],
                                reward_func_names=["rm", "rule"])
    else:
        trainer.__dict__.update(reward_funcs=[rule, model, rule2],
                                reward_processing_classes=[None, tiny_tokenizer(), None],
                                reward_func_names=["rule", "rm", "rule2"])
    return events, trainer


def test_upstream_reads_the_reward_models_scores_after_the_later_functions():
    """TRL 1.16's ``_calculate_rewards`` leaves the model's scores on the device; the next function runs
    before anything reads them (on a GPU: while the forward runs)."""
    from trl import GRPOTrainer

    events, trainer = _reward_setup()
    rewards = GRPOTrainer._calculate_rewards(trainer, [{"prompt": "alpha"}] * 2, ["alpha"] * 2,
                                             [" beta", " beta gamma"], [[1], [1, 2]])
    events.append("scores used")
    assert rewards[:, 0].tolist() == [2.0, 3.0]
    assert events[:3] == ["model forward", "rule", "scores used"]


def test_the_kit_reads_the_reward_models_scores_after_the_later_functions_chunk_by_chunk():
    events, trainer = _reward_setup()
    texts = RewardBatch(["alpha"] * 4, [" beta", " beta gamma", " gamma", " beta beta beta"], [[1]] * 4, {})
    scored = score_batch(trainer, texts, [0, 0, 1, 1], num_generations=2, with_environments=False, chunk_size=2)
    assert scored.rewards.tolist() == [[2.0, 1.0], [3.0, 1.0], [2.0, 1.0], [4.0, 1.0]]
    # both chunks launched, the rule run on both, then the scores read back
    first_read = events.index("model scores read")
    assert events[:first_read] == ["model forward", "model forward", "rule", "rule"]
    assert set(events[first_read:]) == {"model scores read"}


def test_upstream_runs_the_functions_listed_before_a_reward_model_before_its_forward():
    from trl import GRPOTrainer

    events, trainer = _reward_setup(model_first=False)
    rewards = GRPOTrainer._calculate_rewards(trainer, [{"prompt": "alpha"}] * 2, ["alpha"] * 2,
                                             [" beta", " beta gamma"], [[1], [1, 2]])
    assert rewards.tolist() == [[1.0, 2.0, 5.0], [1.0, 3.0, 5.0]]
    assert events == ["rule", "model forward", "rule2"]


def test_the_kit_launches_the_reward_models_first_and_keeps_the_functions_order():
    """The model's forward (on a GPU: asynchronous) runs while the host runs every function, the
    functions in their listed order; the columns stay in the listed order."""
    events, trainer = _reward_setup(model_first=False)
    texts = RewardBatch(["alpha"] * 4, [" beta", " beta gamma", " gamma", " beta beta beta"], [[1]] * 4, {})
    scored = score_batch(trainer, texts, [0, 0, 1, 1], num_generations=2, with_environments=False, chunk_size=2)
    assert scored.rewards.tolist() == [[1.0, 2.0, 5.0], [1.0, 3.0, 5.0], [1.0, 2.0, 5.0], [1.0, 4.0, 5.0]]
    first_read = events.index("model scores read")
    assert events[:first_read] == ["model forward", "model forward", "rule", "rule", "rule2", "rule2"]
    assert set(events[first_read:]) == {"model scores read"}


@pytest.mark.parametrize("policy", ["raise", "no_reward"])
def test_a_reward_model_nan_is_still_caught_when_its_scores_are_read(policy, capsys):
    events, trainer = _reward_setup(nan_row=1)
    texts = RewardBatch(["alpha"] * 4, [" beta"] * 4, [[1]] * 4, {})
    run = lambda: score_batch(trainer, texts, [0, 0, 1, 1], num_generations=2,  # noqa: E731
                              with_environments=False, chunk_size=2, on_failure=policy)
    if policy == "raise":
        with pytest.raises(ValueError, match="reward model 'rm' gave nan for completion 1"):
            run()
        return
    scored = run()
    # row 1 of every chunk is NaN: both chunks lose the model's rewards, the rule's stay
    assert torch.isnan(scored.rewards[:, 0]).all() and scored.rewards[:, 1].tolist() == [1.0] * 4
    assert scored.failed_calls == 2
    assert "reward function 'rm' failed on rank 0 for completions 2..3" in capsys.readouterr().err


class _RowLoggingRewardModel(_LoggingRewardModel):
    def forward(self, input_ids, attention_mask, **kwargs):
        self.events.append(f"model forward of {len(input_ids)}")
        return types.SimpleNamespace(logits=attention_mask.sum(-1, keepdim=True).float().as_subclass(_Scores))


def test_upstream_scores_a_reward_models_whole_batch_in_one_forward():
    from trl import GRPOTrainer

    events, trainer = _reward_setup()
    trainer.reward_funcs[0] = _RowLoggingRewardModel(events)
    GRPOTrainer._calculate_rewards(trainer, [{"prompt": "alpha"}] * 8, ["alpha"] * 8, [" beta"] * 8, [[1]] * 8)
    assert events[:2] == ["model forward of 8", "rule"]


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_the_kit_scores_a_reward_model_in_forwards_of_at_most_reward_model_rows(monkeypatch, chunk_size):
    """Without ``reward_chunk_size`` a model still scores at most ``REWARD_MODEL_ROWS`` completions (whole
    groups) per forward, every forward launched before the functions run; a smaller chunk size wins.
    The functions keep one call per ``reward_chunk_size`` chunk (one call without it), as before."""
    from grpo_patches import rewards

    monkeypatch.setattr(rewards, "REWARD_MODEL_ROWS", 5)  # 2 groups of 2 fit, not 3
    events, trainer = _reward_setup()
    trainer.reward_funcs[0] = _RowLoggingRewardModel(events)
    completions = [" beta", " beta gamma", " gamma", " beta beta beta", " b", " b b", " c", " c c"]
    texts = RewardBatch(["alpha"] * 8, completions, [[1]] * 8, {})
    scored = score_batch(trainer, texts, [0, 0, 1, 1, 2, 2, 3, 3], num_generations=2, with_environments=False,
                         chunk_size=chunk_size)
    assert scored.rewards[:, 0].tolist() == [2.0, 3.0, 2.0, 4.0, 2.0, 3.0, 2.0, 3.0]
    first_read = events.index("model scores read")
    forwards = ["model forward of 4"] * 2 if chunk_size is None else ["model forward of 2"] * 4
    rules = ["rule"] * (1 if chunk_size is None else 4)
    assert events[:first_read] == forwards + rules
