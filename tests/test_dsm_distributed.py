"""The vendored trainer on 2 real processes (gloo): first the faults of the unpatched, naive trainer,
then the patched one keeping I1-I6 on the same configs (worker: tests/workers/dist_dsm.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.launch import describe, run_ranks

pytestmark = pytest.mark.distributed

G = 4


def whole_groups(rows: list[int]) -> bool:
    """Rows in runs of G identical consecutive entries: each call holds whole groups."""
    return len(rows) % G == 0 and all(len(set(rows[i:i + G])) == 1 for i in range(0, len(rows), G))


@pytest.fixture(scope="module")
def shape_run():
    results = run_ranks("tests.workers.dist_dsm", "shape", world_size=2, deadline=300)
    assert all(r.returncode == 0 for r in results), describe(results)
    return [r.data for r in results]


def test_unpatched_splits_groups_and_replicates_the_reward_model(shape_run):
    r0, r1 = shape_run
    # per_device_batch_size=2, G=4: every step's groups are generated and scored half on each rank
    for c0, c1 in zip(r0["naive_split_calls"], r1["naive_split_calls"], strict=True):
        assert len(c0["rows"]) == len(c1["rows"]) == 2
        assert set(c0["rows"]) & set(c1["rows"]), "the same prompt's group is on both ranks"
        assert c0["num_generations"] is None  # and the reward function gets no word of the groups
    # the reward model is moved to every rank's device and run there
    for data in shape_run:
        assert data["naive_rm"] == {"to": 1, "forward": 2}
        assert data["naive"]["holds_model"] and data["naive"]["rm"]["forward"] == 1


def test_patched_refuses_the_splitting_shape_with_the_nearest_valid_settings(shape_run):
    for data in shape_run:
        err = data["patched_error"]
        assert err is not None, "the patched trainer accepted a shape that splits groups"
        assert "per_device_batch_size=2" in err and "num_generations=4" in err
        assert "Nearest valid settings: per_device_batch_size=4" in err
        assert data["refused_rm"] == {"to": 0, "forward": 0}, "refused before the reward model was placed"


@pytest.mark.parametrize("placement", ["local", "main"])
def test_patched_advantages_equal_the_unpatched_where_groups_do_not_split(shape_run, placement):
    for data in shape_run:
        naive, patched = data["naive"], data[placement]
        assert patched["rows"] == naive["rows"] and whole_groups(patched["rows"])
        assert patched["texts"] == naive["texts"], "same seeds, same completions"
        assert patched["rewards"] == pytest.approx(naive["rewards"], abs=1e-5)
        assert patched["advantages"] == pytest.approx(naive["advantages"], abs=1e-5)
        assert patched["loss"] == pytest.approx(naive["loss"], abs=1e-6)
        assert any(abs(a) > 0.1 for a in patched["advantages"]), "the comparison must have something to compare"


def test_patched_local_scores_whole_groups_on_their_own_rank(shape_run):
    for data in shape_run:
        calls = data["local"]["calls"]
        assert [c["rank"] for c in calls] == [data["rank"]]
        assert calls[0]["rows"] == data["local"]["rows"] and whole_groups(calls[0]["rows"])
        assert calls[0]["num_generations"] == G and calls[0]["group_ids"] == [0] * G


def test_patched_main_keeps_the_reward_model_on_rank0_and_returns_each_rank_its_rows(shape_run):
    r0, r1 = (data["main"] for data in shape_run)
    assert r1["calls"] == [] and r1["rm"] == {"to": 0, "forward": 0} and not r1["holds_model"]
    assert r0["holds_model"] and r0["rm"]["to"] == 1
    assert r0["names"] == r1["names"] == ["recording_reward", "tiny-reward-model"]
    # rank 0 scored both ranks' completions, in rank order, in chunks of reward_chunk_size=G
    assert [row for c in r0["calls"] for row in c["rows"]] == r0["rows"] + r1["rows"]
    assert all(len(c["rows"]) <= G and whole_groups(c["rows"]) for c in r0["calls"])
    assert r0["rm"]["forward"] == len(r0["calls"]) == 2
    assert [c["group_ids"] for c in r0["calls"]] == [[0] * G, [1] * G]
    for data in (r0, r1):  # each rank's rewards are its own completions' scores, in order
        assert data["rewards"] == pytest.approx(data["expected"], abs=1e-5)


def test_patched_sampler_uses_every_row_equally_and_the_unpatched_drops_rows(shape_run):
    # 11 rows, 2 prompts per step (4 completions per rank, G=4): 5 steps an epoch, 55 steps
    deals = {name: [data[f"{name}_deal"] for data in shape_run] for name in ("naive", "patched")}
    for name, (d0, d1) in deals.items():
        for s0, s1 in zip(d0, d1, strict=True):
            assert whole_groups(s0) and whole_groups(s1) and not set(s0) & set(s1), name
    patched = Counter(row for d in deals["patched"] for step in d for row in step)
    naive = Counter(row for d in deals["naive"] for step in d for row in step)
    assert sorted(patched) == list(range(11)) and set(patched.values()) == {10 * G}, patched
    assert len(set(naive.values())) > 1, "the unpatched sampler drops a different row every epoch"
    for epoch in range(11):  # patched: within an epoch, no row twice
        rows = [s[0] for d in deals["patched"] for s in d[epoch * 5:(epoch + 1) * 5]]
        assert len(rows) == len(set(rows)) == 10


def test_unpatched_reward_error_on_rank1_leaves_rank0_without_the_cause():
    results = run_ranks("tests.workers.dist_dsm", "naive_fault", world_size=2, deadline=90)
    r0, r1 = results
    assert "KeyError: 'injected failure in flaky_reward'" in r1.data.get("error", ""), describe(results)
    # rank 0 either hangs in the all-gather or dies with gloo's "Connection ... by peer"
    assert r0.hung or "injected failure" not in r0.data.get("error", "") + r0.output, describe(results)


# local: rank 1 fails in its own scoring, and finally dies in it; main: rank 0 (which scores every
# rank's completions) fails, and finally hangs in a reward function.
@pytest.mark.parametrize("placement,bad_rank,last", [("local", 1, "die"), ("main", 0, "hang")])
def test_patched_reward_faults_fail_every_rank_with_the_cause(placement, bad_rank, last):
    results = run_ranks("tests.workers.dist_dsm", "faults", placement, last, world_size=2, deadline=180)
    assert not any(r.hung for r in results), describe(results)
    expected = {
        "raise": "KeyError: 'injected failure in flaky_reward'",
        "wronglen": "returned 3 rewards for 4 completions" if placement == "local" else
                    "returned 7 rewards for 8 completions",
        "nan": "returned nan for completion 0",
    }
    for r in results:
        if last == "die" and r.rank == bad_rank:
            assert r.returncode == 17, describe(results)  # died inside its reward function
            continue
        cases = r.data["cases"]
        for kind, message in expected.items():
            err = cases[kind]["error"]
            assert err and err.startswith("RemoteFailureError") and message in err, (kind, err)
            assert f"reward function 'flaky_reward' failed on rank {bad_rank}" in err, err
        assert cases["None"]["error"] is None, "the same processes train on after the failures"
        # the last fault: a stuck reward function, or a rank that died, fails the others in bounded time
        assert r.returncode == 3, describe(results)
        if last == "die":
            assert "another rank" in r.data["error"], r.data["error"]
        else:
            assert "failed on rank 0" in r.data["error"] and "flaky_reward" in r.data["error"], r.data["error"]
            assert "did not finish within reward_timeout=3 s" in r.data["error"], r.data["error"]
        assert r.data["error_time"] - r.data["t0"] < 3.0 + 15.0, "not within reward_timeout + the margin"


def test_patched_trainer_learns_the_demo_task_on_two_ranks():
    results = run_ranks("tests.workers.dist_dsm", "learn", "15", world_size=2, deadline=240)
    assert all(r.returncode == 0 for r in results), describe(results)
    history = results[0].data["history"]
    assert results[1].data["history"] == history, "every rank logs the same all-gathered reward mean"
    first, last = sum(history[:3]) / 3, sum(history[-3:]) / 3
    assert last - first >= 0.4, history
