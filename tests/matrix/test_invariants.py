"""The version matrix's check: every invariant once against the installed TRL release (one 2-rank launch).

``GRPO_PATCHES_INVARIANT_WORLD_SIZES=2,4`` adds launches of other sizes (the 4-GPU NCCL run; on CPU a
4-rank gloo launch on two cores costs the matrix too much time per release).

``nox -s trl-<release>`` runs this module in an environment with that release's pinned dependency
set. A release whose era has no adapter must be refused clearly (I6); TRL 0.14 must be left alone.
"""

from __future__ import annotations

import os
import warnings
from importlib.metadata import version

import pytest
from packaging.version import Version

import grpo_patches
from grpo_patches import registry
from tests.launch import describe, run_ranks, world_sizes

TRL = Version(version("trl"))
SIZES = world_sizes(*(int(n) for n in os.environ.get("GRPO_PATCHES_INVARIANT_WORLD_SIZES", "2").split(",")))
SUPPORTED = (any(v.release[:2] == TRL.release[:2] for v in registry.supported_releases())
             or os.environ.get(registry.ALLOW_UNKNOWN_ENV) == "1")  # the canary's opt-in mode


@pytest.mark.skipif(SUPPORTED, reason="covered by test_invariants_hold_across_ranks")
def test_release_without_adapter_is_refused_or_left_alone():
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            applied = grpo_patches.apply()
        assert applied is False and any("already rank-local" in str(w.message) for w in caught)
    except grpo_patches.UnsupportedVersionError as exc:
        assert str(TRL) in str(exc) and "supported: trl" in str(exc)
    assert not grpo_patches.is_applied()


@pytest.mark.skipif(not SUPPORTED, reason="no adapter for this release: see the refusal test")
@pytest.mark.parametrize("world_size", SIZES)
def test_invariants_hold_across_ranks(world_size):
    results = run_ranks("tests.dist_trl", "lean", world_size=world_size, deadline=400)
    assert all(r.returncode == 0 for r in results), describe(results)
    rows = [set(r.data["stock_split_rows"]) for r in results]
    assert rows[0] & rows[1], "upstream should split groups with 2 completions per rank and 4 per group"
    for r in results:
        d = r.data
        for placement in ("local", "main"):
            assert "Nearest valid settings" in d[f"{placement}_refusal"]  # I1
            got = d[placement]
            assert got["rows"] == d["stock"]["rows"] and got["completion_ids"] == d["stock"]["completion_ids"]
            assert got["advantages"] == pytest.approx(d["stock"]["advantages"], abs=1e-6)  # I3
            for call in got["calls"]:  # whole groups in every reward call; main: rank 0 only (I4)
                assert all(len(set(call["rows"][i:i + 4])) == 1 for i in range(0, len(call["rows"]), 4))
                assert placement == "local" or call["rank"] == 0
            fault = d[f"{placement}_fault"]  # I5
            bad = d[f"{placement}_bad_rank"]
            assert fault and "injected in flaky_reward" in fault and f"rank {bad}" in fault, fault
            assert d[f"{placement}_fault_s"] < 5.0 + 5.0
    assert results[0].data["main"]["calls"] and not any(r.data["main"]["calls"] for r in results[1:])
