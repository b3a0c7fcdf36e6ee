"""The rank-local shape rule and RankLocalGroupSampler: upstream equality, coverage, resume (I1, I2)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trl.trainer.utils import RepeatSampler

from grpo_patches.grouping import (
    GroupShapeError,
    RankLocalGroupSampler,
    check_group_shape,
    nearest_valid_settings,
)


@given(b=st.integers(1, 16), s=st.integers(1, 8), g=st.integers(2, 16))
def test_every_suggestion_is_valid(b, s, g):
    for fix in nearest_valid_settings(b, s, g):
        name, values = fix.split("=")
        for v in map(int, values.split(" or ")):
            bb, ss, gg = (v, s, g) if name.startswith("per_device") else (b, v, g) if name.startswith("steps") else (b, s, v)
            check_group_shape(per_device_batch_size=bb, steps_per_generation=ss, num_generations=gg, world_size=2)


def test_shape_error_names_values_and_fixes():
    with pytest.raises(GroupShapeError, match=r"per_device_train_batch_size=3 x steps_per_generation=1 = 3") as info:
        check_group_shape(per_device_batch_size=3, steps_per_generation=1, num_generations=4, world_size=4)
    assert "per_device_train_batch_size=4" in str(info.value)
    with pytest.raises(GroupShapeError, match="num_generations_eval=4"):
        check_group_shape(per_device_batch_size=6, steps_per_generation=1, num_generations=4, world_size=2, mode="eval")


@given(n_prompts=st.integers(1, 12), mult=st.integers(1, 5), g=st.integers(1, 6), rep=st.integers(1, 3),
       seed=st.integers(0, 10_000))
@settings(max_examples=60, deadline=None)
def test_same_stream_as_upstream_when_nothing_is_dropped(n_prompts, mult, g, rep, seed):
    data = list(range(n_prompts * mult))
    upstream = RepeatSampler(data, mini_repeat_count=g, batch_size=n_prompts, repeat_count=rep, seed=seed)
    ours = RankLocalGroupSampler(data, g, n_prompts, rep, seed=seed)
    for epoch in range(3):
        ours.set_epoch(epoch)
        assert list(ours) == list(upstream)


@given(n_rows=st.integers(1, 60), world=st.integers(1, 4), per_rank_groups=st.integers(1, 3), g=st.integers(1, 5),
       epochs=st.integers(1, 4), seed=st.integers(0, 999))
@settings(max_examples=80, deadline=None)
def test_whole_groups_per_rank_and_no_row_lost(n_rows, world, per_rank_groups, g, epochs, seed):
    prompts_per_batch = world * per_rank_groups
    if n_rows < prompts_per_batch:
        with pytest.raises(ValueError, match="rows"):
            RankLocalGroupSampler(list(range(n_rows)), g, prompts_per_batch, seed=seed)
        return
    sampler = RankLocalGroupSampler(list(range(n_rows)), g, prompts_per_batch, seed=seed)
    per_rank = per_rank_groups * g
    seen = Counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        stream = list(sampler)
        assert len(stream) == len(sampler)
        epoch_rows = stream[::g]
        assert len(set(epoch_rows)) == len(epoch_rows), "a row twice in one epoch"
        seen.update(epoch_rows)
        # accelerate hands rank r the r-th slice of per_rank indices of every global batch
        for start in range(0, len(stream), per_rank):
            shard = stream[start:start + per_rank]
            assert all(len(set(shard[i:i + g])) == 1 for i in range(0, per_rank, g))
    if n_rows % prompts_per_batch == 0:
        assert seen == Counter({r: epochs for r in range(n_rows)})
    else:
        assert max(seen.values()) - min(seen.get(r, 0) for r in range(n_rows)) <= 1


def test_resume_replays_the_same_epoch():
    run = RankLocalGroupSampler(list(range(10)), 2, 3, seed=5)
    epochs = []
    for e in range(3):
        run.set_epoch(e)
        epochs.append(list(run))
    resumed = RankLocalGroupSampler(list(range(10)), 2, 3, seed=5)
    resumed.set_epoch(2)  # what Trainer does when it resumes into epoch 2
    assert list(resumed) == epochs[2]


def test_the_refusal_says_where_steps_per_generation_comes_from():
    """A user who set only gradient_accumulation_steps reads steps_per_generation in the message: it says that
    TRL derives it from gradient_accumulation_steps."""
    with pytest.raises(GroupShapeError, match="steps_per_generation to gradient_accumulation_steps unless it is given"):
        check_group_shape(per_device_batch_size=2, steps_per_generation=1, num_generations=4, world_size=2)
