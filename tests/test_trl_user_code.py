"""I7b: reward functions run where and how stock TRL runs them, through the real GRPOTrainer.

Each test runs the same config on stock TRL first, then patched, and asserts the same behaviour:
the main thread (so SIGALRM timeouts work), async functions run concurrently, TRL's profiling
timings and its all-None warning; and that no fault poisons the next step (Ctrl-C, a timeout, two
trainers in one process).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

import grpo_patches
from tests.helpers import ctrl_c_raises, grpo_args, lora, prompt_dataset, quiet, tiny_policy, tiny_tokenizer

quiet()


@pytest.fixture(autouse=True)
def _unpatched_after():
    yield
    grpo_patches.revert()


def build(reward_funcs, n_rows=8, **overrides):
    from trl import GRPOTrainer

    args = grpo_args(per_device_train_batch_size=4, num_generations=2, **overrides)
    return GRPOTrainer(model=tiny_policy(), reward_funcs=reward_funcs, args=args, train_dataset=prompt_dataset(n_rows),
                       processing_class=tiny_tokenizer(), peft_config=lora())


def both(run, **apply_options):
    """``run()`` on stock TRL, then with the kit applied: the two results."""
    grpo_patches.revert()
    stock = run()
    grpo_patches.apply(**apply_options)
    return stock, run()


def test_reward_functions_run_on_the_main_thread_and_may_use_sigalrm():
    def alarm_reward(completions, **kwargs):
        fired = []
        previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(True))  # main thread only
        signal.setitimer(signal.ITIMER_REAL, 0.01)
        time.sleep(0.1)
        signal.signal(signal.SIGALRM, previous)
        seen.append((threading.current_thread() is threading.main_thread(), fired == [True]))
        return [1.0] * len(completions)

    def run():
        seen.clear()
        build([alarm_reward]).train()
        return list(seen)

    seen: list = []
    stock, patched = both(run, reward_chunk_size=2)
    assert stock and all(s == (True, True) for s in stock)
    assert patched and all(s == (True, True) for s in patched), patched


def test_async_reward_functions_run_concurrently():
    spans: dict[str, list] = {}

    def timed(name):
        async def reward(completions, **kwargs):
            start = time.monotonic()
            await asyncio.sleep(0.5)
            spans.setdefault(name, []).append((start, time.monotonic()))
            return [1.0] * len(completions)
        reward.__name__ = name
        return reward

    def run():
        spans.clear()
        build([timed("first"), timed("second")]).train()
        (a0, a1), (b0, b1) = spans["first"][0], spans["second"][0]
        return max(a0, b0) < min(a1, b1)  # the two calls overlap in time

    stock, patched = both(run)
    assert stock and patched


def test_profiling_timings_are_stock_ones(monkeypatch):
    from trl.extras.profiling import ProfilingContext

    names: list[str] = []
    monkeypatch.setattr(ProfilingContext, "_log_metrics", lambda self, duration: names.append(self.name))

    def r1(completions, **kwargs):
        return [1.0] * len(completions)

    def r2(completions, **kwargs):
        return [0.5] * len(completions)

    def run():
        names.clear()
        build([r1, r2], max_steps=2).train()
        return sorted(n for n in names if n.endswith((".r1", ".r2")))

    stock, patched = both(run, reward_chunk_size=2)  # 2 chunks per step: still one timing per function
    assert stock == ["GRPOTrainer.r1"] * 2 + ["GRPOTrainer.r2"] * 2
    assert patched == stock


def test_all_none_rewards_warn_like_stock(caplog):
    """TRL's own test_warning_raised_all_rewards_none, stock then patched."""
    def always_none(completions, **kwargs):
        return [None] * len(completions)

    def run():
        caplog.clear()
        with caplog.at_level("WARNING", logger="trl.trainer.grpo_trainer"):
            build([always_none]).train()
        return [r.getMessage() for r in caplog.records if r.name == "trl.trainer.grpo_trainer"]

    stock, patched = both(run)
    expected = "All reward functions returned None for the following kwargs:"
    assert any(expected in m for m in stock)
    assert any(expected in m and "'prompt': 'say the letter" in m for m in patched), patched


def test_ctrl_c_during_scoring_then_another_step():
    calls = {"n": 0}

    def reward(completions, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while the reward function runs
        return [1.0] * len(completions)

    grpo_patches.apply(reward_timeout=5.0)
    trainer = build([reward])
    with ctrl_c_raises(), pytest.raises(KeyboardInterrupt):
        trainer.train()
    start = time.monotonic()
    trainer.train()  # the next step scores normally, not timed out at once
    assert calls["n"] >= 2 and time.monotonic() - start < 60


def test_a_timed_out_call_does_not_poison_the_next():
    calls = {"n": 0}

    def reward(completions, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            time.sleep(60)
        return [1.0] * len(completions)

    grpo_patches.apply(reward_timeout=2.0)
    trainer = build([reward])
    start = time.monotonic()
    with pytest.raises(grpo_patches.RemoteFailureError, match="did not finish within reward_timeout=2 s"):
        trainer.train()
    assert time.monotonic() - start < 30
    trainer.train()
    assert calls["n"] >= 2


def test_two_trainers_in_one_process():
    seen = []

    def reward(completions, row, **kwargs):
        seen.append(len(completions))
        return [1.0] * len(completions)

    grpo_patches.apply(reward_chunk_size=2)
    first, second = build([reward]), build([reward])
    first.train()
    second.train()
    first.train()
    assert seen == [2] * 6  # 3 steps, each 2 chunks of 2


def test_a_dataset_column_named_like_a_kit_kwarg_is_refused():
    from datasets import Dataset
    from trl import GRPOTrainer

    got = []

    def reward(completions, group_ids=None, **kwargs):
        got.append(list(group_ids))
        return [1.0] * len(completions)

    rows = [{"prompt": f"say the letter {c} please", "group_ids": f"user-{i}"} for i, c in enumerate("abcdefgh")]

    def make():
        return GRPOTrainer(model=tiny_policy(), reward_funcs=[reward], train_dataset=Dataset.from_list(rows),
                           args=grpo_args(per_device_train_batch_size=4, num_generations=2),
                           processing_class=tiny_tokenizer(), peft_config=lora())

    make().train()  # stock: the reward function gets the dataset's own column
    assert all(str(v).startswith("user-") for v in got[0])
    grpo_patches.apply()
    with pytest.raises(ValueError, match="train_dataset has a column named 'group_ids'"):
        make()


def test_bad_options_are_refused_at_apply():
    with pytest.raises(ValueError, match=r"reward_timeout=1000000000000000.0 must be a number of seconds in \(0, 86400\]"):
        grpo_patches.apply(reward_timeout=1e15)
    with pytest.raises(TypeError, match="strict='yes' must be True"):
        grpo_patches.apply(strict="yes")
    assert not grpo_patches.is_applied()


def test_reward_values_accepted_and_refused_as_stock_does():
    """Stock TRL builds each function's column with ``torch.tensor(values, dtype=float32)`` (None -> NaN):
    what that refuses (strings, nested lists) the kit refuses; what it accepts the kit accepts, equal."""
    import numpy as np
    import torch

    cases = {
        "floats": [0.5, 0.25, 1.0, 0.0], "ints": [1, 0, 2, 3], "bools": [True, False, True, True],
        "with None": [0.5, None, 1.0, None], "numpy scalars": [np.float32(0.5), np.int64(2), np.float64(1), 0.0],
        "numpy array": np.array([0.5, 0.25, 1.0, 0.0]), "tensor": torch.tensor([0.5, 0.25, 1.0, 0.0]),
        "0-d tensors": [torch.tensor(0.5)] * 4, "generator": [0.5, 0.25, 1.0, 0.0],  # handed out as a generator
        "strings": ["0.5", "0.25", "1.0", "0.0"], "one string": [0.5, "1", 1.0, 0.0], "nested": [[0.5]] * 4,
        "bytes": [b"1"] * 4,
    }
    inputs = [{"prompt": "say a", "row": 0, "target": "a"}] * 4
    current = {}

    def case_reward(completions, **kwargs):
        values = cases[current["case"]]
        return (x for x in values) if current["case"] == "generator" else values

    def outcome(trainer, case):
        current["case"] = case
        try:
            rewards = trainer._calculate_rewards(inputs, ["say a"] * 4, ["a b"] * 4, [[0]] * 4)
        except Exception as exc:  # noqa: BLE001 - what each refuses is the point
            return "refused", f"{type(exc).__name__}: {exc}"
        return "accepted", [None if x != x else x for x in rewards[:, 0].tolist()]

    def run():
        trainer = build([case_reward])
        return {case: outcome(trainer, case) for case in cases}

    stock, patched = both(run)
    assert stock["strings"][0] == "refused" and stock["floats"][0] == "accepted", stock  # upstream first
    for case in cases:
        assert patched[case][0] == stock[case][0], (case, stock[case], patched[case])
        if stock[case][0] == "accepted":
            assert patched[case][1] == stock[case][1], (case, stock[case], patched[case])
        else:
            assert "case_reward" in patched[case][1], patched[case]


def test_a_trainer_built_before_apply_warns_that_it_trains_unpatched():
    """Upstream (no kit) trains without a word; after apply(), a trainer built before it says so."""
    import warnings

    grpo_patches.revert()
    trainer = build([lambda completions, **kw: [1.0] * len(completions)])
    with warnings.catch_warnings(record=True) as stock:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in stock if "grpo_patches" in str(w.message)]
    grpo_patches.apply()
    with pytest.warns(UserWarning, match=r"GRPOTrainer was built before grpo_patches.apply\(\), so it trains unpatched"):
        trainer.train()
