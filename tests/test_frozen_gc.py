"""``apply(freeze_gc=True)``: Python's collector frozen after a trainer's first step, unfrozen at its end."""

from __future__ import annotations

import gc
import weakref

import pytest

import grpo_patches
from grpo_patches.frozen_gc import _Freeze
from tests.helpers import grpo_args, patched_trl_trainer, patched_vendored_trainer


class Node:
    pass


@pytest.fixture(autouse=True)
def nothing_frozen():
    grpo_patches.revert()
    assert gc.get_freeze_count() == 0
    yield
    grpo_patches.revert()
    gc.unfreeze()


def tracked(obj: object) -> bool:
    """Whether the collector still walks ``obj`` (frozen objects are in none of its generations)."""
    return any(o is obj for o in gc.get_objects())


def test_the_freeze_collects_first_freezes_once_and_undoes_only_its_own():
    enabled = gc.isenabled()
    gc.disable()  # only the freeze's own collection may free the cycle below
    try:
        garbage = Node()
        garbage.me = garbage
        dead = weakref.ref(garbage)
        del garbage
        kept = Node()
        kept.me = kept
        freeze = _Freeze()
        freeze.step_done()
        assert dead() is None, "garbage at the freeze is collected, not frozen"
        assert gc.get_freeze_count() > 0 and not tracked(kept)
        later = Node()
        later.me = later
        freeze.step_done()
        assert tracked(later), "frozen once, after the first step only"
        freeze.train_done()
        assert gc.get_freeze_count() == 0 and tracked(kept)
        # a process that froze objects itself keeps them frozen: gc.unfreeze() would undo its freeze too
        gc.freeze()
        owner = gc.get_freeze_count()
        freeze.step_done()
        freeze.train_done()
        assert gc.get_freeze_count() >= owner > 0
    finally:
        if enabled:
            gc.enable()


def counting(seen: list[int]):
    def frozen_count(completions, **kwargs):
        seen.append(gc.get_freeze_count())
        return [float(len(text)) for text in completions]

    return frozen_count


def test_trl_trainer_stock_never_freezes_the_option_freezes_after_the_first_step_and_unfreezes_at_the_end():
    runs = {}
    for name, kw in {"stock": {}, "freeze_gc": {"freeze_gc": True}}.items():
        seen: list[int] = []
        patched_trl_trainer(grpo_args(max_steps=3), reward_funcs=counting(seen), **kw).train()
        runs[name] = (seen, gc.get_freeze_count())
    seen, after = runs["stock"]
    assert len(seen) == 3 and set(seen) == {0} and after == 0
    seen, after = runs["freeze_gc"]
    assert len(seen) == 3 and seen[0] == 0 and seen[1] > 0 and seen[2] <= seen[1], "frozen once, after step 1"
    assert after == 0, "unfrozen when training ends"


def test_a_training_that_raises_after_the_freeze_unfreezes_too():
    seen: list[int] = []
    count = counting(seen)

    def fails_at_step_two(completions, **kwargs):
        if len(seen) == 1:
            seen.append(gc.get_freeze_count())
            raise ValueError("reward service down")
        return count(completions, **kwargs)

    trainer = patched_trl_trainer(grpo_args(max_steps=3), reward_funcs=fails_at_step_two, freeze_gc=True)
    with pytest.raises(Exception, match="reward service down"):
        trainer.train()
    assert seen[0] == 0 and seen[1] > 0, "frozen after step 1, before the failure"
    assert gc.get_freeze_count() == 0


def test_vendored_trainer_freezes_after_its_first_step_and_train_unfreezes():
    seen: list[int] = []
    trainer = patched_vendored_trainer(reward_funcs=counting(seen), freeze_gc=True)
    trainer.train(["a b", "c d"], steps=2)
    assert len(seen) == 2 and seen[0] == 0 and seen[1] > 0 and gc.get_freeze_count() == 0
    # a second run of the same trainer freezes again after its first step
    trainer.train(["a b", "c d"], steps=2)
    assert len(seen) == 4 and seen[2] == 0 and seen[3] > 0 and gc.get_freeze_count() == 0
