"""I2 across a checkpoint: a real ``trainer.train(resume_from_checkpoint=...)`` on 2 ranks uses, for the
rest of the epoch, exactly the rows the uninterrupted run used.

Config (tests/workers/dist_resume.py): 18 rows, 4 prompts per step (2 ranks x 4 completions, num_generations=2),
so 4 steps per epoch, 2 epochs; checkpoint at step 6 (epoch 1, 2nd step); the resumed trainer runs
steps 7-8. Each rank records the ``row`` column its reward function sees at each step (one call per
step). Upstream first: resumed in epoch 1, stock TRL replays epoch 0's rows at the same offset (its
sampler restarts its shuffle sequence, and ``set_epoch`` does not reach it). Stock's epoch length
differs by release (1.16 drops the 2 rows that do not fill a step: 4 steps; 0.15 pads the 5th step
with repeated rows: 5 steps; 0.19 runs 4 but counts 5, so its resumed run takes one step more), so
its checks take the lengths it ran.

The kit's sampler before the fix replayed epoch 0 the same way, on 1.16 and on 0.15.2: transformers
calls ``set_epoch`` on the loader that ``skip_first_batches`` wrapped, which never reaches it.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.launch import describe, run_ranks

pytestmark = pytest.mark.distributed

STEPS_PER_EPOCH, RESUME_AT, N_ROWS = 4, 6, 18


def launch(label):
    results = run_ranks("tests.workers.dist_resume", label, world_size=2, deadline=300)
    assert all(r.returncode == 0 for r in results), describe(results)
    for r in results:
        assert r.data["full_steps"] == len(r.data["full"]), describe(results)  # one reward call per step
        assert r.data["resumed_steps"] - RESUME_AT == len(r.data["resumed"]), describe(results)
    return results


def epoch_rows(results, epoch):
    """The rows of one epoch across ranks, one entry per group (num_generations=2)."""
    steps = slice(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH)
    return Counter(row for r in results for call in r.data["full"][steps] for row in call[::2])


def test_upstream_resume_replays_epoch_zero():
    results = launch("stock")
    for r in results:
        full, resumed = r.data["full"], r.data["resumed"]
        assert resumed != full[RESUME_AT:]
        # restarted shuffle sequence: the resumed steps are a stretch of epoch 0's (0.19-0.26 even run
        # one step more than the uninterrupted run: transformers counts 5 steps per epoch, 4 happen)
        starts = [k for k in range(len(full)) if full[k:k + len(resumed)] == resumed]
        assert starts and starts[0] + len(resumed) <= (len(full) + 1) // 2, (full, resumed)


def test_patched_resume_uses_the_uninterrupted_rows():
    results = launch("patched")
    assert all(r.data["full_steps"] == r.data["resumed_steps"] == 2 * STEPS_PER_EPOCH for r in results)
    # the uninterrupted run: no row lost; the 2 left over open epoch 1 (I2)
    assert set(epoch_rows(results, 0)) | set(epoch_rows(results, 1)) == set(range(N_ROWS))
    assert all(count == 1 for e in (0, 1) for count in epoch_rows(results, e).values())
    for r in results:
        assert r.data["resumed"] == r.data["full"][RESUME_AT:], describe(results)


def test_sampler_takes_its_epoch_from_the_trainer_state():
    """Unit level: with ``epoch_source`` the sampler iterates the trainer's epoch, whatever set_epoch said."""
    from types import SimpleNamespace

    from grpo_patches.grouping import RankLocalGroupSampler, epoch_of_state

    def reference(epoch):
        plain = RankLocalGroupSampler(list(range(10)), 2, 3, seed=5)
        plain.set_epoch(epoch)
        return list(plain)

    state = SimpleNamespace(epoch=None)  # before train(): TrainerState.epoch may be unset
    sampler = RankLocalGroupSampler(list(range(10)), 2, 3, seed=5, epoch_source=lambda: epoch_of_state(state))
    assert list(sampler) == list(sampler) == reference(0)  # iterating twice in one epoch: the same epoch
    for value, epoch in ((1.0, 1), (1.5, 1), (2 - 1e-12, 2), (3.0, 3)):
        state.epoch = value
        sampler.set_epoch(0)  # what accelerate might still forward: the trainer's count wins
        assert list(sampler) == reference(epoch), value
    assert reference(1) != reference(0)
