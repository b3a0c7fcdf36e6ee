"""I3: on identical completions, patched advantages equal stock TRL's (1e-6), per rank, and the
metrics the main process logs equal upstream's, for every scale_rewards / aggregation mode."""

from __future__ import annotations

import pytest

from tests.launch import describe, run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("placement", ["main"])  # advantages under both placements: tests/matrix (I3)
def test_patched_advantages_equal_stock(placement):
    results = run_ranks("tests.workers.dist_trl", "equivalence", placement, world_size=2, deadline=300)
    assert all(r.returncode == 0 for r in results), describe(results)
    for r in results:
        assert len(r.data["results"]) == 4
        for row in r.data["results"]:
            stock, patched = row["stock"], row["patched"]
            assert stock["rows"] == patched["rows"], "the two runs must see the same prompts"
            assert stock["completion_ids"] == patched["completion_ids"], "and sample the same completions"
            assert patched["advantages"] == pytest.approx(stock["advantages"], abs=1e-6), row["mode"]
            assert any(abs(a) > 1e-3 for a in stock["advantages"]), "a vacuous comparison"
            if r.rank == 0:
                assert patched["metrics"].keys() == stock["metrics"].keys()
                for key, value in stock["metrics"].items():
                    assert patched["metrics"][key] == pytest.approx(value, abs=1e-6, nan_ok=True), key
