"""The version matrix's check: every invariant, upstream first, against the installed TRL release.

``nox -s trl-<release>`` runs this module in an environment with that release's pinned dependency
set; the main suite runs it against the newest release. One 2-rank launch
(tests/matrix/worker.py) carries every scenario; each test below reads one invariant off it:

* I1 a shape stock accepts splits groups over the ranks; the kit refuses it at construction; every
  reward call holds whole groups with equal ``group_ids`` inside a group and distinct ones across;
* I2 a dataset that leaves rows over, 3 epochs: upstream loses rows (shown), the kit uses every row,
  none twice in an epoch, each equally often +-1;
* I3 for every ``scale_rewards`` / aggregation mode the release's GRPOConfig has, patched advantages
  equal stock's (1e-6) on the same completions, under both placements;
* I4 ``reward_chunk_size`` smaller than a rank's batch (calls counted and sized); under ``"main"``
  reward functions run, and reward models (an ``nn.Module`` and a path, TRL's hub-id branch) are
  loaded and run, on rank 0 only, where stock does all of it on every rank; unequal per-rank counts;
* I5 raise, wrong length, NaN, and a sleep past ``reward_timeout``: upstream first (the peer loses the
  cause or hangs, bounded by the worker; NaN passes silently), then every rank raises
  ``RemoteFailureError`` naming the function, the rank and the original error, within the bound;
* I6 ``revert()`` leaves every attribute of every patched class the identical object it was; every
  attribute the adapter declares was wrapped (read from the adapter, not listed here); applying again
  changes nothing.

``GRPO_PATCHES_INVARIANT_WORLD_SIZES=2,4`` adds launches of other sizes. A release without an adapter
must be refused clearly (I6); TRL 0.14 must be left alone.

``GRPO_PATCHES_MATRIX_MODE=fork`` (``nox -s fork-<release>``, tests/test_patches_fork.py) runs the same
checks against a patched TRL in an environment without grpo_patches (tests/matrix/kit.py says how the
kit is switched there); the ranks then start through tests/fork/drive.py's ``launch``, and
``GRPO_PATCHES_MATRIX_SAVE=FILE`` writes what every rank saw to FILE (JSON). Nothing here imports
grpo_patches: everything of the kit goes through tests/matrix/kit.py.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from importlib.metadata import version

import pytest
from packaging.version import Version

from tests.launch import describe, run_ranks, world_sizes
from tests.matrix import kit

TRL = Version(version("trl"))
SIZES = world_sizes(*(int(n) for n in os.environ.get("GRPO_PATCHES_INVARIANT_WORLD_SIZES", "2").split(",")))
SUPPORTED = kit.release_is_supported(TRL)
G, PBS, CHUNK, REWARD_TIMEOUT = 2, 8, 4, 2.0  # as in tests/matrix/worker.py
FAULT_BOUND = REWARD_TIMEOUT + 7.0  # "within reward_timeout + a few seconds": worker.py's HANG_BOUND, which says why
N_ROWS = 6  # the I2 dataset: 4 prompts per generation round, so 2 rows are left over every epoch

needs_adapter = pytest.mark.skipif(not SUPPORTED, reason="no adapter for this release: see the refusal test")


@pytest.mark.skipif(SUPPORTED, reason="covered by the invariant tests")
def test_release_without_adapter_is_refused_or_left_alone():
    kit.refusal_check(TRL)


_LAUNCHED: dict[int, list] = {}


def launched(world_size: int) -> list:
    """The records of one launch of tests/matrix/worker.py per world size and test process: the main suite's
    tests/test_patches_fork.py compares the fork's run with these same records instead of launching again."""
    if world_size not in _LAUNCHED:
        if kit.FORK:  # from a scratch folder, PYTHONPATH cleared: only the patched TRL provides the kit's code
            from tests.fork import drive

            _LAUNCHED[world_size] = drive.launch("tests.matrix.worker", world_size, deadline=400, extra_ports=6)
        else:
            _LAUNCHED[world_size] = run_ranks("tests.matrix.worker", world_size=world_size, deadline=400,
                                              extra_ports=6)
    return _LAUNCHED[world_size]


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"world{n}")
def ranks(request):
    results = launched(request.param)
    if os.environ.get("GRPO_PATCHES_MATRIX_SAVE"):
        with open(os.environ["GRPO_PATCHES_MATRIX_SAVE"], "w") as f:
            json.dump([r.data for r in results], f)
    assert all(r.returncode == 0 for r in results), describe(results)
    return results


@needs_adapter
def test_the_ranks_ran_in_the_selected_mode(ranks):
    for r in ranks:
        assert r.data["mode"] == kit.MODE and r.data["trl"] == str(TRL)
        if kit.FORK:  # the patched fork ran without the kit: not importable, and no wrapt either
            assert r.data["kit_importable"] is False and r.data["wrapt_imported"] is False, r.data
    if kit.FORK:
        assert "grpo_patches" not in sys.modules, "the fork-mode checks imported grpo_patches"


def whole_groups(call: dict) -> list[str]:
    """What is wrong with one reward call's grouping (empty: whole groups, ids equal within a group
    and distinct across groups)."""
    rows, ids, problems = call["rows"], call["group_ids"], []
    counts = Counter(rows)
    runs = [rows[i:i + G] for i in range(0, len(rows), G)]
    if len(rows) % G or any(len(set(run)) != 1 for run in runs) or any(c != G for c in counts.values()):
        problems.append(f"rows {rows} are not whole consecutive groups of {G}")
    if ids is None or len(ids) != len(rows):
        problems.append(f"group_ids {ids} for {len(rows)} completions")
    else:
        id_runs = [ids[i:i + G] for i in range(0, len(ids), G)]
        if any(len(set(run)) != 1 for run in id_runs):
            problems.append(f"group_ids {ids} differ inside a group")
        if len({run[0] for run in id_runs}) != len(id_runs):
            problems.append(f"group_ids {ids} repeat across groups")
    if call["num_generations"] != G:
        problems.append(f"num_generations={call['num_generations']}")
    return problems


# --- I1 -----------------------------------------------------------------------------------------

@needs_adapter
def test_i1_upstream_splits_the_shape_the_kit_refuses(ranks):
    rows = [{row for call in r.data["stock_split"] for row in call["rows"]} for r in ranks]
    assert set.intersection(*rows), "upstream should split each group of 4 over the ranks (2 completions per rank)"
    for r in ranks:
        for placement in ("local", "main"):
            refusal = r.data[placement]["refusal"]
            assert refusal and "Nearest valid settings" in refusal and "per_device_train_batch_size=2" in refusal


@needs_adapter
def test_i1_every_reward_call_holds_whole_groups_with_distinct_ids(ranks):
    for placement in ("local", "main"):
        per_rank_rows = []
        for r in ranks:
            rows = set()
            for mode in r.data[placement]["modes"]:
                for call in mode["calls"]:
                    assert not whole_groups(call), (placement, whole_groups(call))
                    rows |= set(call["rows"])
            per_rank_rows.append(rows)
        if placement == "local":  # no prompt's group reached two ranks
            assert not set.intersection(*per_rank_rows)
    # the checker itself sees upstream's split calls as broken
    assert any(whole_groups(call) for r in ranks for call in r.data["stock_split"])


# --- I2 -----------------------------------------------------------------------------------------

def coverage_defects(run: dict, ranks) -> list[str]:
    """Every way the rows of 3 epochs break "each row once per epoch, all rows used equally often"."""
    epochs: dict[int, list[int]] = {}
    for r in ranks:
        for call in run(r)["calls"]:
            epochs.setdefault(call["epoch"], []).extend(call["rows"][::G])
    defects = []
    for e, rows in sorted(epochs.items()):
        if len(set(rows)) != len(rows):
            defects.append(f"epoch {e} uses a row twice: {sorted(rows)}")
    for e in sorted(epochs)[:-1]:
        missing = set(range(N_ROWS)) - set(epochs[e]) - set(epochs[e + 1])
        if missing:
            defects.append(f"rows {sorted(missing)} left out of epochs {e} and {e + 1}")
    counts = Counter(row for rows in epochs.values() for row in rows)
    spread = [counts.get(row, 0) for row in range(N_ROWS)]
    if max(spread) - min(spread) > 1:
        defects.append(f"rows used unequally: {dict(sorted(counts.items()))}")
    return defects


@needs_adapter
def test_i2_no_row_lost_or_repeated_where_upstream_drops_rows(ranks):
    untrainable = [r.data[k].get("untrainable") for r in ranks for k in ("stock_epochs", "patched_epochs")]
    if any(untrainable):  # TRL 1.15.0 without Triton: stock and patched fail the same way (worker.py)
        assert all(u and "_ChunkedLogProbFunction" not in u and "'apply'" in u for u in untrainable), untrainable
        pytest.skip(f"TRL {TRL} cannot run a training step without Triton (upstream defect, fixed in 1.16): "
                    f"{untrainable[0]}")
    assert sorted({c["epoch"] for r in ranks for c in r.data["stock_epochs"]["calls"]}) == [0, 1, 2]
    stock = coverage_defects(lambda r: r.data["stock_epochs"], ranks)
    assert stock, "upstream should lose rows on this dataset (2 of 6 left over every epoch)"
    patched = coverage_defects(lambda r: r.data["patched_epochs"], ranks)
    assert not patched, patched
    # the first generation round is upstream's (nothing left over yet): same seed, same permutation
    first = [[c["rows"] for c in r.data[k]["calls"] if c["epoch"] == 0][0] for r in ranks for k in
             ("stock_epochs", "patched_epochs")]
    assert first[0::2] == first[1::2]


# --- I3 -----------------------------------------------------------------------------------------

@needs_adapter
def test_i3_advantages_equal_stock_in_every_mode(ranks):
    modes = ranks[0].data["modes"]
    assert len(modes) >= 1
    for r in ranks:
        for placement in ("local", "main"):
            for mode, stock, got in zip(modes, r.data["stock"], r.data[placement]["modes"], strict=True):
                assert got["rows"] == stock["rows"] and got["completion_ids"] == stock["completion_ids"], mode
                assert got["advantages"] == pytest.approx(stock["advantages"], abs=1e-6), (placement, mode)
                assert any(abs(a) > 1e-3 for a in stock["advantages"]), "a vacuous comparison"


@needs_adapter
def test_i3_default_settings_give_stocks_samples_and_advantages(ranks):
    """The kit with no options (a fork with its GRPOConfig defaults) on a shape whose groups do not split:
    stock's prompts, completions and advantages, one reward call per rank holding its whole batch."""
    for r in ranks:
        got, stock = r.data["default"], r.data["stock"][0]
        assert got["rows"] == stock["rows"] and got["completion_ids"] == stock["completion_ids"]
        assert got["advantages"] == pytest.approx(stock["advantages"], abs=1e-6)
        assert [len(c["rows"]) for c in got["calls"]] == [PBS] and not whole_groups(got["calls"][0])
        assert Counter(got["rm_forwards"]) == {"module": 1, "path": 1}


# --- I4 -----------------------------------------------------------------------------------------

@needs_adapter
def test_lean_lora_switches_every_lora_layer_or_is_refused_on_an_old_peft(ranks):
    for r in ranks:
        lean = r.data["lean"]
        if Version(lean["peft"]) >= Version("0.15"):
            assert "refusal" not in lean, lean
            assert lean["switched"] == lean["lora_layers"] == 14, lean  # 2 layers x 7 projections
        else:  # the LoRA layer casts unconditionally there: the option would change nothing
            assert "lean_lora=True needs peft >= 0.15" in lean["refusal"], lean


@needs_adapter
def test_i4_chunks_smaller_than_a_ranks_batch(ranks):
    world = len(ranks)
    for r in ranks:  # upstream: one call per rank holding the rank's whole batch
        for stock in r.data["stock"]:
            assert [len(c["rows"]) for c in stock["calls"]] == [PBS]
    for r in ranks:
        for got in r.data["local"]["modes"]:
            assert [len(c["rows"]) for c in got["calls"]] == [CHUNK] * (PBS // CHUNK)
    for got in ranks[0].data["main"]["modes"]:
        assert [len(c["rows"]) for c in got["calls"]] == [CHUNK] * (world * PBS // CHUNK)


@needs_adapter
def test_i4_a_chunk_size_that_cuts_a_group_is_refused_with_the_nearest_values(ranks):
    for r in ranks:
        refusal = r.data["chunk_refusal"] or ""
        assert f"reward_chunk_size={CHUNK + 1}" in refusal and f"{CHUNK}" in refusal and f"{CHUNK + 2}" in refusal, refusal


@needs_adapter
def test_i4_main_placement_loads_and_runs_reward_models_on_rank0_only(ranks):
    n_modes = len(ranks[0].data["modes"])
    for r in ranks:  # upstream: every rank loads the path model, holds both models and runs them
        assert len(r.data["stock_loads"]) == n_modes
        assert all(Counter(s["rm_forwards"]) == {"module": 1, "path": 1} for s in r.data["stock"])
        assert all(s["holds_model"] == [False, False, True, True] for s in r.data["stock"])
    r0, others = ranks[0].data["main"], [r.data["main"] for r in ranks[1:]]
    assert len(r0["loads"]) == n_modes
    assert all(m["holds_model"] == [False, False, True, True] for m in r0["modes"])
    calls = len(ranks) * PBS // CHUNK  # one forward per chunk and model, every rank's completions
    assert all(Counter(m["rm_forwards"]) == {"module": calls, "path": calls} for m in r0["modes"])
    for i in range(n_modes):  # rank 0 scored every rank's completions, each once
        scored = sorted(row for call in r0["modes"][i]["calls"] for row in call["rows"])
        assert scored == sorted(row for r in ranks for row in r.data["main"]["modes"][i]["rows"]), i
    for got in others:
        assert got["loads"] == [], "a reward model given by path was loaded on a non-main rank"
        assert all(m["holds_model"] == [False, False, False, False] for m in got["modes"])
        assert all(m["rm_forwards"] == [] and m["calls"] == [] for m in got["modes"])


@needs_adapter
def test_i4_each_rank_gets_its_own_rewards_with_unequal_counts(ranks):
    if "unequal" not in ranks[0].data["local"]:
        pytest.skip("TRL < 0.19 has no reward method to call with unequal per-rank counts (upstream's inline "
                    "all-gather needs equal counts); tests/test_rewards_distributed.py covers the core")
    for placement in ("local", "main"):
        for r in ranks:
            got = r.data[placement]["unequal"]
            assert len(got["own"]) == CHUNK * (r.rank + 1)
            assert got["own"] == pytest.approx(got["expected"], abs=1e-6), (placement, r.rank)
        sizes = [[len(c["rows"]) for c in r.data[placement]["unequal"]["calls"]] for r in ranks]
        if placement == "main":
            assert sizes[0] == [CHUNK] * sum(range(1, len(ranks) + 1)) and not any(sizes[1:])
        else:
            assert sizes == [[CHUNK] * (rank + 1) for rank in range(len(ranks))]


# --- I5 -----------------------------------------------------------------------------------------

ORIGINAL = {"raise": r"ZeroDivisionError: injected in recording_reward", "wronglen": r"returned 3\b",
            "nan": r"(?i)\bnan\b", "sleep": r"(?i)timeout|timed out|did not finish"}


def assert_failed_everywhere(outcomes: list[dict], kind: str) -> None:
    for out in outcomes:
        assert "error" not in out, f"the child failed before its fault: {out['error']}"
        msg = out["raised"] or ""
        assert out.get("remote"), f"not the kit's RemoteFailureError: {out}"
        assert "recording_reward" in msg and f"rank {out['bad_rank']}" in msg, msg
        assert re.search(ORIGINAL[kind], msg), (kind, msg)
        assert out["seconds"] < FAULT_BOUND, out


@needs_adapter
def test_i5_upstream_loses_the_cause_or_hangs(ranks):
    for kind in ("raise", "wronglen"):
        name = f"upstream_{kind}"
        bad = ranks[1].data["children"][name]
        assert bad["raised"] and not bad.get("remote"), bad  # the failing rank dies alone ...
        peer = ranks[0].data["children"][name]
        assert peer["hung"] or "recording_reward" not in (peer["raised"] or ""), peer  # ... its peer learns nothing
    for r in ranks:  # a stuck reward function: every rank still stuck when the worker gives up
        assert r.data["children"]["upstream_sleep"]["hung"], r.data["children"]["upstream_sleep"]
        nan = r.data["children"]["upstream_nan"]  # a NaN reward: no rank says so (most releases: no error)
        assert nan["hung"] or "recording_reward" not in (nan.get("raised") or ""), nan


@needs_adapter
@pytest.mark.parametrize("kind", ["raise", "wronglen", "nan"])
def test_i5_every_rank_raises_with_the_cause(ranks, kind):
    for placement in ("local", "main"):
        assert_failed_everywhere([r.data[placement]["faults"][kind] for r in ranks], kind)
        assert all(r.data[placement]["after_faults"] for r in ranks)  # and the job can go on


@needs_adapter
@pytest.mark.parametrize("placement", ["local", "main"])
def test_i5_a_reward_past_the_timeout_fails_every_rank_in_time(ranks, placement):
    outcomes = [r.data["children"][f"patched_sleep_{placement}"] for r in ranks]
    assert not any(o["hung"] for o in outcomes), outcomes
    assert_failed_everywhere(outcomes, "sleep")


# --- I6 -----------------------------------------------------------------------------------------

@needs_adapter
def test_i6_every_declared_attribute_is_wrapped_and_applying_twice_changes_nothing(ranks):
    for r in ranks:
        i6 = r.data["i6"]
        assert i6["declared"]["GRPOTrainer"]
        if not kit.FORK:  # the vendored trainer's patch is a file of its own (tests/test_patches_fork.py)
            assert i6["declared"]["DSMGRPOTrainer"]
        assert i6["not_wrapped"] == [], "declared but not wrapped (around the original, where known)"
        assert i6["changed_by_second_apply"] == [], "applying again changed a patched attribute"


@needs_adapter
def test_i6_revert_restores_every_attribute_the_adapter_declares(ranks):
    if not kit.CAN_REVERT:
        pytest.skip("a patched fork has no revert(); its off switch (GRPOConfig(grpo_patches=False)) is the "
                    "upstream half of every check, shown equal to pristine TRL by tests/test_patches_fork.py")
    for r in ranks:
        assert r.data["i6"]["changed_after_revert"] == [], "not the identical original after revert()"
