"""A patched trainer is freed like a stock one once the user drops it (world size 1, CPU).

A process that builds several trainers (a sweep, the benchmark's variants) must get each one's
model and optimizer memory back when it deletes the trainer. The kit's reward watchdog runs every
reward computation on one long-lived worker thread; that thread used to keep the last job's
callable (a closure over the trainer) in its frame, a root for the garbage collector, so the
trainer that scored last was never freed (on GPU its weights and optimizer state stayed allocated).
"""

from __future__ import annotations

import gc
import weakref

import pytest

import grpo_patches
from grpo_patches.collectives import call_with_timeout
from tests.helpers import grpo_args, lora, prompt_dataset, quiet, target_share, tiny_policy, tiny_tokenizer

quiet()


@pytest.fixture(autouse=True)
def clean():
    grpo_patches.revert()
    yield
    grpo_patches.revert()


def train_and_drop(**options) -> weakref.ref:
    """Build a GRPOTrainer (patched with ``options`` unless None), train one step, drop it."""
    from trl import GRPOTrainer

    if options.pop("stock", False):
        grpo_patches.revert()
    else:
        grpo_patches.apply(**options)
    trainer = GRPOTrainer(model=tiny_policy(), reward_funcs=[target_share], args=grpo_args(),
                          train_dataset=prompt_dataset(8), processing_class=tiny_tokenizer(), peft_config=lora())
    patched = hasattr(trainer, "_grpo_patches")
    trainer.train()
    assert trainer.state.global_step == 1
    trainer.accelerator.free_memory()  # as the benchmark does: accelerate's own references
    alive = weakref.ref(trainer)
    del trainer
    gc.collect()
    assert patched == grpo_patches.is_applied()
    return alive


def test_stock_trainer_is_collected():
    """The upstream baseline: stock TRL's trainer is freed after del + gc.collect()."""
    alive = train_and_drop(stock=True)
    assert alive() is None


@pytest.mark.parametrize("placement", ["local", "main"])
def test_patched_trainer_is_collected(placement):
    alive = train_and_drop(reward_placement=placement)
    assert alive() is None, "a patched trainer outlived del + gc.collect()"


@pytest.mark.parametrize("placement", ["local", "main"])
def test_trainer_with_fast_generation_is_collected(placement):
    """Default fast generation (on CPU: eager sampling, dropout off)."""
    alive = train_and_drop(reward_placement=placement, fast_generation=True)
    assert alive() is None


def test_trainer_with_compiled_fast_generation_is_collected():
    """The compiled path (static cache pool on the trainer's state, dynamo caches) frees it too."""
    import torch

    try:
        alive = train_and_drop(fast_generation={"force_compile": True, "backend": "aot_eager"})
        assert alive() is None
    finally:
        torch._dynamo.reset()


def test_apply_again_after_trainers_are_gone():
    alive = train_and_drop()
    assert alive() is None
    grpo_patches.revert()
    assert not grpo_patches.is_applied()
    again = train_and_drop(reward_placement="main")
    assert grpo_patches.is_applied()
    assert again() is None


def test_watchdog_thread_keeps_nothing_of_a_finished_call():
    """The worker thread drops the job's callable, its result and its exception once done."""

    class Payload:
        pass

    payload, result = Payload(), Payload()
    job = lambda p=payload, r=result: r  # noqa: E731 - holds payload, as the reward call holds the trainer
    assert call_with_timeout(job, 30, what="test") is result
    refs = [weakref.ref(payload), weakref.ref(result)]
    del payload, result, job
    gc.collect()
    assert [r() for r in refs] == [None, None]

    held = Payload()

    def failing(obj=held):
        raise ValueError(repr(obj))  # the exception's traceback holds this frame, which holds `held`

    try:
        call_with_timeout(failing, 30, what="test")
    except ValueError:
        pass
    else:
        raise AssertionError("the job's exception must reach the caller")
    ref = weakref.ref(held)
    del held, failing
    gc.collect()
    assert ref() is None
