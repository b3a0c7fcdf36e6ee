"""What the invariants scenario must show on every rank; shared by pytest and the nox driver."""

from __future__ import annotations

import math


def _close(a, b, tol=1e-6) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=tol) for x, y in zip(a, b, strict=True))


def invariant_failures(results: list) -> list[str]:
    """Human-readable failures (empty: everything held). ``results``: launch.RankResult list."""
    bad: list[str] = []
    for r in results:
        if r.returncode != 0:
            bad.append(f"rank {r.rank} exited with {r.returncode}: {r.data.get('error')}\n{r.data.get('traceback', '')}")
    if bad:
        return bad
    rows = [set(r.data["stock_split_rows"]) for r in results]
    if not rows[0] & rows[1]:
        bad.append("upstream (kit off) should split groups with 2 completions per rank and 4 per group")
    for r in results:
        d, who = r.data, f"rank {r.rank}"
        for label in ("default", "local", "main"):
            refusal = d[f"{label}_refusal"]
            if not refusal or "Nearest valid settings" not in refusal:  # I1
                bad.append(f"{who} {label}: the split shape was not refused: {refusal!r}")
            got = d[label]
            if got["rows"] != d["stock"]["rows"] or got["completion_ids"] != d["stock"]["completion_ids"]:
                bad.append(f"{who} {label}: different prompts or completions than upstream on the same seed")
            elif not _close(got["advantages"], d["stock"]["advantages"]):  # I3
                bad.append(f"{who} {label}: advantages {got['advantages']} != upstream {d['stock']['advantages']}")
            for call in got["calls"]:  # whole groups in every call; main: rank 0 only, chunks of <= 4 (I4)
                rows_ = call["rows"]
                if any(len(set(rows_[i:i + 4])) != 1 for i in range(0, len(rows_), 4)):
                    bad.append(f"{who} {label}: a reward call held part of a group: {rows_}")
                if label == "main" and (call["rank"] != 0 or len(rows_) > 4):
                    bad.append(f"{who} main: reward call on rank {call['rank']} with {len(rows_)} completions")
            if label == "default":
                continue
            fault, culprit = d[f"{label}_fault"], d[f"{label}_bad_rank"]  # I5
            if not fault or "injected in flaky_reward" not in fault or f"rank {culprit}" not in fault:
                bad.append(f"{who} {label}: the injected reward error did not surface here with its rank: {fault!r}")
            elif d[f"{label}_fault_s"] >= 10.0:
                bad.append(f"{who} {label}: the error took {d[f'{label}_fault_s']:.1f} s to surface (timeout 5 s)")
        if d["mode"] == "fork" and d["wrapt_imported"]:
            bad.append(f"{who}: wrapt was imported in fork mode")
    main_rows = [row for r in results for call in r.data["main"]["calls"] for row in call["rows"]]
    own_rows = [row for r in results for row in r.data["main"]["rows"]]
    if sorted(main_rows) != sorted(own_rows):  # rank 0 scored every rank's completions, each once
        bad.append(f"main: rank 0 scored rows {sorted(main_rows)}, the ranks hold {sorted(own_rows)}")
    return bad


def failures_of(scenario: str, results: list) -> list[str]:
    """The check for a scenario: ``invariants`` here, or for ``module:function`` the module's
    ``check_<function>(results) -> list[str]``."""
    if ":" not in scenario:
        return {"invariants": invariant_failures}[scenario](results)
    import importlib

    module, name = scenario.split(":")
    return getattr(importlib.import_module(module), f"check_{name}")(results)
