"""Per ``overlap_mode``, the timed steps of ``BENCH_ALTERNATE_OVERLAP=1`` runs, pooled over their logs, and an exact
permutation test of "both pieces" against "neither" on each step's time outside sampling (sampling is the same
code in every mode, and its spread between steps would hide the rest).

    python benchmarks/overlap_modes.py benchmarks/results/2026-12-07-h100-overlap/call*/rows/*/grid/log-*.txt

A step's line in a log (``bench_grpo.py``): ``[both] step 10/12: 9.40 s (generate 2.44, ...``; the warm-up steps
are left out (``--warmup``, 2 by default: the first compiles, the second may recompile).
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import sys

STEP = re.compile(r"\[(\w+)\] step (\d+)/\d+: ([\d.]+) s \(generate ([\d.]+)")


def steps(paths: list[str], warmup: int) -> dict[str, list[tuple[float, float]]]:
    """mode -> [(step s, step s outside sampling)] over the logs' timed steps."""
    out: dict[str, list[tuple[float, float]]] = {}
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                m = STEP.search(line)
                if m and int(m.group(2)) > warmup:
                    step, generate = float(m.group(3)), float(m.group(4))
                    out.setdefault(m.group(1), []).append((step, step - generate))
    return out


def one_sided_p(a: list[float], b: list[float]) -> float:
    """Exact permutation p-value of mean(a) - mean(b) being this low or lower, over every split of the pooled
    values into groups of their sizes."""
    pooled, n = a + b, len(a)
    total, observed = sum(pooled), sum(a) / n - sum(b) / len(b)
    hits = count = 0
    for chosen in itertools.combinations(pooled, n):
        s = sum(chosen)
        hits += s / n - (total - s) / len(b) <= observed + 1e-12
        count += 1
    return hits / count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    modes = steps(args.logs, args.warmup)
    if not {"both", "none"} <= modes.keys():
        print(f"no 'both' and 'none' steps in {args.logs}", file=sys.stderr)
        return 1
    print("| mode | steps | step s: median (mean, sd) | outside sampling s: mean (sd) |")
    print("|---|---|---|---|")
    for mode, rows in modes.items():
        step, rest = [r[0] for r in rows], [r[1] for r in rows]
        print(f"| {mode} | {len(rows)} | {statistics.median(step):.3f} ({statistics.mean(step):.3f}, "
              f"{statistics.stdev(step):.3f}) | {statistics.mean(rest):.3f} ({statistics.stdev(rest):.3f}) |")
    both, none = ([r[1] for r in modes[m]] for m in ("both", "none"))
    print(f"\nboth against none, outside sampling: {statistics.mean(both) - statistics.mean(none):+.3f} s a step, "
          f"one-sided exact permutation p = {one_sided_p(both, none):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
