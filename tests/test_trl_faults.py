"""I5 through TRL: a reward function that raises or hangs on one rank makes every rank exit non-zero
within reward_timeout + a few seconds, with the original message, the function's name and the rank.

Upstream (TRL 1.16): the raising rank dies alone and its peer gets "Connection closed by
peer"; a hanging reward function hangs both ranks for the 30-minute collective timeout.
"""

from __future__ import annotations

import pytest

from tests.launch import describe, run_ranks

pytestmark = pytest.mark.distributed

CASES = [
    ("raise", 1, "local", "ZeroDivisionError: injected in flaky_reward"),
    ("raise", 0, "main", "ZeroDivisionError: injected in flaky_reward"),
    ("sleep", 1, "local", "did not finish within reward_timeout=5 s"),
    ("sleep", 0, "main", "did not finish within reward_timeout=5 s"),
]


@pytest.mark.parametrize("kind,bad_rank,placement,message", CASES)
def test_reward_fault_fails_every_rank(kind, bad_rank, placement, message):
    results = run_ranks("tests.dist_trl", "fault", kind, str(bad_rank), placement, world_size=2, deadline=120)
    assert not any(r.hung for r in results), describe(results)
    for r in results:
        assert r.returncode == 3, describe(results)
        err = r.data["error"]
        assert message in err and f"rank {bad_rank}" in err and "flaky_reward" in err, err
        assert r.data["error_time"] - r.data["t0"] < 5.0 + 5.0, "not within reward_timeout + a few seconds"
