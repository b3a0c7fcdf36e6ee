"""The vendored trainer's group dealing, without processes: the naive ``create_groups`` and the
kit's replacement, seen from every rank of a simulated world (I1, I2), for any shape."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_patches.targets.dsm import _rank_local_groups
from grpo_patches.vendored.dsm_grpo import DSMGRPOConfig, DSMGRPOTrainer


def deal(create_groups, *, world, b, g, n, steps, seed=0):
    """``dealt[step][rank]``: the rows each rank of ``world`` gets, from the same function on every rank."""
    config = DSMGRPOConfig(num_generations=g, per_device_batch_size=b, seed=seed)
    streams = [create_groups(SimpleNamespace(config=config, accelerator=SimpleNamespace(
        process_index=rank, num_processes=world)), n) for rank in range(world)]
    return [[next(s) for s in streams] for _ in range(steps)]


shapes = dict(world=st.integers(1, 4), groups_per_rank=st.integers(1, 3), g=st.integers(2, 5),
              extra_rows=st.integers(0, 7), seed=st.integers(0, 1000))


@given(**shapes)
@settings(max_examples=40, deadline=None)
def test_patched_deal_is_whole_groups_per_rank_and_every_row_once_per_epoch(world, groups_per_rank, g, extra_rows,
                                                                             seed):
    b = groups_per_rank * g
    prompts_per_step = b * world // g
    n = prompts_per_step * 2 + extra_rows  # some rows may be left over
    per_epoch, epochs = n // prompts_per_step, 3
    dealt = deal(_rank_local_groups, world=world, b=b, g=g, n=n, steps=per_epoch * epochs, seed=seed)
    for step in dealt:
        owners = {}
        for rank, rows in enumerate(step):
            assert len(rows) == b and all(len(set(rows[i:i + g])) == 1 for i in range(0, b, g))
            for row in rows:
                owners.setdefault(row, set()).add(rank)
        assert all(len(ranks) == 1 for ranks in owners.values()), "a group on two ranks"
    for epoch in range(epochs):
        rows = [r for step in dealt[per_epoch * epoch:per_epoch * (epoch + 1)] for ranks in step for r in ranks[::g]]
        assert len(rows) == len(set(rows)) == per_epoch * prompts_per_step, "a row twice in one epoch"
    used = Counter(r for step in dealt for ranks in step for r in ranks[::g])
    assert max(used.values()) - min(used.get(row, 0) for row in range(n)) <= 1, "rows used unequally"


@given(**shapes)
@settings(max_examples=40, deadline=None)
def test_naive_deal_equals_the_patched_one_where_it_splits_nothing_and_drops_nothing(world, groups_per_rank, g,
                                                                                      extra_rows, seed):
    b = groups_per_rank * g
    n = (b * world // g) * 2  # no leftover rows: the naive trainer drops nothing
    naive = deal(DSMGRPOTrainer.create_groups, world=world, b=b, g=g, n=n, steps=6, seed=seed)
    assert naive == deal(_rank_local_groups, world=world, b=b, g=g, n=n, steps=6, seed=seed)


def test_naive_deal_splits_groups_when_the_rank_batch_is_not_whole_groups():
    dealt = deal(DSMGRPOTrainer.create_groups, world=2, b=6, g=4, n=12, steps=4)
    for r0, r1 in dealt:  # 3 prompts a step: the middle one has 2 completions on each rank
        assert r0[-2:] == r1[:2] and set(r0) & set(r1)
