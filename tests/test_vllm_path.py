"""The kit through TRL's vLLM generation path (``use_vllm=True``), server and colocate mode, on CPU.

vLLM itself is not installed: as TRL's own tests do, the worker (tests/workers/dist_vllm.py) replaces
``trl.generation.vllm_generation.is_vllm_available`` and ``VLLMClient`` (server mode), and ``LLM`` /
``SamplingParams`` there (colocate mode), with stand-ins whose completions are a function of the prompt and
the completion's index in its group. The rest is TRL's code: the prompts gathered to the main process and
one request per unique prompt with ``n=G``, the broadcast and each rank's slice (server), each rank
generating for its own prompts (colocate), the weight sync after each optimizer step.

One 2-rank launch carries every scenario, upstream first:
* grouping: a per-rank batch that splits groups is accepted by stock TRL, whose reward calls then hold a
  group's completions on both ranks; the kit refuses the shape at construction;
* with a valid shape, every reward call holds whole groups, and the advantages equal stock's on the same
  completions, under reward placement "local" and "main" (rank 0 scores every rank's rows);
* training steps through the server path: the weights reach the client at every step, the LoRA adapter
  is unmerged afterwards, rewards scored on rank 0 only;
* ``fast_generation=True`` leaves vLLM's generation alone (the fast path never runs);
* a reward function raising on the rank that scores: every rank raises ``RemoteFailureError`` naming it.

Not covered: a real vLLM server or engine (its sampling, its NCCL weight transfer), and memory.
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest

from tests.launch import describe, run_ranks, world_sizes


def _has_vllm_generation() -> bool:
    """Whether the installed TRL keeps vLLM generation in ``trl.generation.vllm_generation`` (1.16's layout)."""
    try:
        return importlib.util.find_spec("trl.generation.vllm_generation") is not None
    except ModuleNotFoundError:  # an older release: no trl.generation package
        return False


pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not _has_vllm_generation(), reason="the stand-in replaces names in TRL 1.16's "
                       "trl.generation.vllm_generation, which this release does not have"),
]

G, PBS, CHUNK = 4, 8, 4  # as in tests/workers/dist_vllm.py
MODES = ("server", "colocate")


@pytest.fixture(scope="module")
def ranks():
    if not world_sizes(2):
        pytest.skip("needs 2 ranks")
    results = run_ranks("tests.workers.dist_vllm", world_size=2, deadline=200)
    assert all(r.returncode == 0 for r in results), describe(results)
    return [r.data for r in results]


def call_rows(seen: dict) -> list[list[int]]:
    return [c["rows"] for c in seen["calls"]]


def whole_groups(rows: list[int]) -> bool:
    """The rows of one reward call are runs of G equal rows (whole groups, nothing else)."""
    return len(rows) % G == 0 and all(len(set(rows[i:i + G])) == 1 for i in range(0, len(rows), G))


@pytest.mark.parametrize("mode", MODES)
def test_stock_splits_groups_over_ranks_and_the_kit_refuses_the_shape(ranks, mode):
    # 2 completions per rank with G=4: stock scores each group half on rank 0, half on rank 1
    rows = [Counter(r for call in call_rows(d[mode]["stock_split"]) for r in call) for d in ranks]
    shared = set(rows[0]) & set(rows[1])
    assert shared and all(rows[0][r] < G and rows[1][r] < G for r in shared), rows
    for d in ranks:
        refusal = d[mode]["refusal"]
        assert refusal and "num_generations=4" in refusal and "split" in refusal, refusal
    if mode == "server":  # the server generated the group whole; TRL's slicing cut it in two
        assert ranks[0]["server_requests"][0] == {"prompts": 1, "n": G}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("placement", ["local", "main"])
def test_reward_calls_hold_whole_groups_and_advantages_equal_stock(ranks, mode, placement):
    for d in ranks:
        stock, kit = d[mode]["stock"], d[mode][placement]
        assert kit["rows"] == stock["rows"]
        assert kit["completion_ids"] == stock["completion_ids"]  # the same stand-in completions, through TRL's path
        assert kit["advantages"] == pytest.approx(stock["advantages"], abs=1e-6)
        assert all(whole_groups(rows) and len(rows) <= CHUNK for rows in call_rows(kit)), call_rows(kit)
    assert any(len({round(a, 6) for a in d[mode]["stock"]["advantages"]}) > 2 for d in ranks)  # not a trivial match
    scored = [sorted(r for rows in call_rows(d[mode][placement]) for r in rows) for d in ranks]
    if placement == "local":  # each rank scores its own rows
        assert scored == [sorted(d[mode]["stock"]["rows"]) for d in ranks]
    else:  # rank 0 scores every rank's rows, rank 1 none
        assert scored[0] == sorted(r for d in ranks for r in d[mode]["stock"]["rows"]) and scored[1] == []


def test_server_mode_gets_one_request_per_group(ranks):
    # the kit's rounds (valid shape: stock, local, main): 2 ranks x 2 groups = 4 prompts, n=G each
    assert ranks[0]["server_requests"][1:] == [{"prompts": 2 * PBS // G, "n": G}] * 3
    assert ranks[1]["server_requests"] == []  # only the main process talks to the server


def test_training_through_the_server_path_syncs_weights_every_step(ranks):
    r0, r1 = ranks
    assert r0["train"]["steps"] == r1["train"]["steps"] == 2
    assert r0["train"]["weight_syncs"] == 2 and r0["train"]["tensors"] > 0  # the client received every step's weights
    assert r0["train"]["merged_after"] == r1["train"]["merged_after"] == 0  # TRL's sync unmerged the adapter
    calls = call_rows(r0["train"])
    assert calls and all(whole_groups(rows) and len(rows) <= CHUNK for rows in calls)
    assert sum(map(len, calls)) == 2 * 2 * PBS and call_rows(r1["train"]) == []  # main placement: 2 steps, 2 ranks


def test_fast_generation_leaves_vllm_generation_alone(ranks):
    for d in ranks:
        fast = d["fast"]
        assert "refusal" not in fast, fast
        assert fast["state"] == 0  # the kit's fast path was never entered
        assert fast["completion_ids"] == d["server"]["stock"]["completion_ids"]
    assert ranks[0]["fast"]["server_requests"] == 1


@pytest.mark.parametrize(("placement", "bad_rank"), [("local", 1), ("main", 0)])
def test_a_reward_function_failing_on_one_rank_raises_on_every_rank(ranks, placement, bad_rank):
    for d in ranks:
        got = d["faults"][placement]
        assert got["remote"], got
        assert f"'recording_reward' failed on rank {bad_rank}" in got["raised"]
        assert "ZeroDivisionError: injected in recording_reward" in got["raised"]
        assert got["seconds"] < 30
