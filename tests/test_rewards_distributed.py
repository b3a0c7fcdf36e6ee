"""I4 placement and I5 fail-fast on the core, across real processes (gloo), no TRL."""

from __future__ import annotations

import pytest

from tests.launch import describe, run_ranks, world_sizes

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world_size", world_sizes(2, 4))
@pytest.mark.parametrize("placement,chunk", [("main", 2), ("main", 4), ("main", 0), ("local", 2)])
def test_each_rank_gets_exactly_its_own_rewards(world_size, placement, chunk):
    results = run_ranks("tests.workers.dist_core", "scatter", placement, str(chunk), world_size=world_size, deadline=90)
    assert all(r.returncode == 0 for r in results), describe(results)
    for r in results:
        d = r.data
        assert d["local"] == pytest.approx(d["expected"], abs=1e-6)  # own rows, own order
        assert d["extras"] == d["completions"]  # side columns travel back to their rank, in order
    calls = [c for r in results for c in r.data["calls"]]
    if placement == "main":
        assert {c["rank"] for c in calls} == {0}, "reward function ran off the main process"
        total = sum((rank + 1) * 2 for rank in range(world_size))
        assert sum(c["n"] for c in calls) == total  # nothing lost or duplicated
        if chunk:
            assert max(c["n"] for c in calls) <= chunk
        assert results[0].data["counts"] == [(rank + 1) * 2 for rank in range(world_size)]
    else:
        assert {c["rank"] for c in calls} == set(range(world_size))
    for c in calls:  # every call holds whole groups with ids marking them
        assert c["n"] % 2 == 0
        assert all(c["group_ids"][i] == c["group_ids"][i + 1] for i in range(0, c["n"], 2))
        assert all(c["rows"][i] == c["rows"][i + 1] for i in range(0, c["n"], 2))
    assert results[0].data["has_all"] and not any(r.data["has_all"] for r in results[1:])


FAULTS = [
    ("raise", 0, "local", "KeyError: 'injected failure in my_reward'"),
    ("raise", 1, "local", "KeyError: 'injected failure in my_reward'"),
    ("raise", 0, "main", "KeyError: 'injected failure in my_reward'"),
    ("wronglen", 1, "local", "returned 3 rewards for 4 completions"),
    ("nan", 1, "local", "returned nan for completion 0"),
    ("nan", 0, "main", "returned nan for completion 0"),
    ("sleep", 1, "local", "did not finish within reward_timeout=3 s"),
    ("sleep", 0, "main", "did not finish within reward_timeout=3 s"),
]


@pytest.mark.parametrize("kind,bad_rank,placement,message", FAULTS)
def test_a_fault_on_any_rank_fails_every_rank_fast(kind, bad_rank, placement, message):
    results = run_ranks("tests.workers.dist_core", "fault", kind, str(bad_rank), placement, world_size=2, deadline=60)
    assert not any(r.hung for r in results), describe(results)
    for r in results:
        assert r.returncode == 3, describe(results)
        assert message in r.data["raised"], r.data
        assert f"rank {bad_rank}" in r.data["raised"], r.data
        assert r.data["seconds"] < 3.0 + 5.0  # reward_timeout + a few seconds
