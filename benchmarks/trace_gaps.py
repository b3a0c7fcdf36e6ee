"""Where a traced call leaves the GPU idle, and what the host was doing then.

Reads a Chrome trace written by ``torch.profiler`` (``bench_grpo.py``'s ``BENCH_TRACE``, gzipped or not) and
prints: the traced region's wall time, the device's busy time (the union of its kernels, copies and sets
over every stream) and idle time, and the largest idle gaps, each with the host events (``cpu_op``,
``python_function``, ``user_annotation``) that span its middle, innermost last. Then the host events that
cover the most idle time in all (an event's share: its overlap with the idle gaps, nested events counted
in each of their ancestors).

    python benchmarks/trace_gaps.py trace-_generate-patched-speed_0-rank0.json.gz --top 25 --out gaps.json

``--phases`` instead cuts the region at the ``bench/`` annotations inside it (a whole step's trace,
``BENCH_TRACE=step``, holds one per timed phase) and prints each piece's wall and device busy time, then the
totals per phase and for the time between them.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cpu_op", "python_function", "user_annotation"}


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def annotations(events: list[dict]) -> list[dict]:
    """The host's ``bench/<phase>`` annotations (not their copies on the device's timeline)."""
    return [e for e in events if str(e.get("name", "")).startswith("bench/") and e.get("cat") in HOST_CATS]


def device_busy(events: list[dict], t0: float, t1: float) -> list[tuple[float, float]]:
    """The device's busy intervals (kernels, copies, sets on every stream, merged) clipped to ``[t0, t1]``."""
    return union([(max(e["ts"], t0), min(e["ts"] + e["dur"], t1)) for e in events
                  if e.get("cat") in DEVICE_CATS and e["ts"] < t1 and e["ts"] + e["dur"] > t0])


def region(events: list[dict], name: str | None) -> tuple[float, float]:
    """The traced call: the ``bench/<name>`` annotation (the longest ``bench/`` one), else all host events."""
    marks = [e for e in annotations(events) if name is None or e["name"] == name]
    if marks:
        e = max(marks, key=lambda e: e["dur"])
        return e["ts"], e["ts"] + e["dur"]
    host = [e for e in events if e.get("cat") in HOST_CATS]
    return min(e["ts"] for e in host), max(e["ts"] + e["dur"] for e in host)


def summarize(events: list[dict], top: int = 25, min_gap_us: float = 200.0, name: str | None = None) -> dict:
    t0, t1 = region(events, name)
    device = device_busy(events, t0, t1)
    busy = sum(b - a for a, b in device)
    gaps, cursor = [], t0
    for a, b in device:
        if a > cursor:
            gaps.append((cursor, a))
        cursor = max(cursor, b)
    if cursor < t1:
        gaps.append((cursor, t1))
    host = sorted((e for e in events if e.get("cat") in HOST_CATS and e["ts"] < t1 and e["ts"] + e["dur"] > t0),
                  key=lambda e: (e["ts"], -e["dur"]))
    starts = [e["ts"] for e in host]

    def spanning(t: float) -> list[str]:
        hits = [e for e in host[:bisect.bisect_right(starts, t)] if e["ts"] + e["dur"] >= t]
        hits.sort(key=lambda e: -e["dur"])  # outermost first
        return [f"{e['name'][:90]} ({e['dur'] / 1e3:.1f} ms)" for e in hits if not e["name"].startswith("bench/")]

    big = sorted((g for g in gaps if g[1] - g[0] >= min_gap_us), key=lambda g: g[0] - g[1])[:top]
    cover: dict[str, float] = defaultdict(float)
    idle = [g for g in gaps if g[1] - g[0] >= min_gap_us]
    for e in host:
        a, b = e["ts"], e["ts"] + e["dur"]
        lo = bisect.bisect_left([g[1] for g in idle], a)
        for ga, gb in idle[lo:]:
            if ga >= b:
                break
            cover[e["name"][:120]] += max(0.0, min(b, gb) - max(a, ga))
    return {
        "wall_ms": (t1 - t0) / 1e3, "device_busy_ms": busy / 1e3, "device_idle_ms": (t1 - t0 - busy) / 1e3,
        "idle_gaps_over_min": len(idle), "idle_in_gaps_over_min_ms": sum(b - a for a, b in idle) / 1e3,
        "largest_gaps": [{"at_ms": (a - t0) / 1e3, "ms": (b - a) / 1e3, "host": spanning((a + b) / 2)[-6:]}
                         for a, b in big],
        "host_events_over_idle_ms": sorted(((k, v / 1e3) for k, v in cover.items()), key=lambda kv: -kv[1])[:top],
    }


def phases(events: list[dict], name: str | None = None) -> dict:
    """The region cut at every ``bench/`` annotation inside it (the phases ``bench_grpo.py`` labels), each piece
    named by its innermost annotation (``between`` where none: e.g. the Trainer's loop between two micro-batches'
    ``training_step`` calls), with its wall and device busy time; then the totals per name."""
    t0, t1 = region(events, name)
    device = device_busy(events, t0, t1)
    marks = [e for e in annotations(events)
             if t0 <= e["ts"] and e["ts"] + e["dur"] <= t1 and (e["ts"], e["ts"] + e["dur"]) != (t0, t1)]
    cuts = sorted({t0, t1, *(e["ts"] for e in marks), *(e["ts"] + e["dur"] for e in marks)})

    def busy(a: float, b: float) -> float:
        return sum(max(0.0, min(b, d1) - max(a, d0)) for d0, d1 in device if d1 > a and d0 < b)

    pieces: list[dict] = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        mid = (a + b) / 2
        inner = [e for e in marks if e["ts"] <= mid <= e["ts"] + e["dur"]]
        label = min(inner, key=lambda e: e["dur"])["name"][len("bench/"):] if inner else "between"
        if pieces and pieces[-1]["name"] == label and pieces[-1]["end"] == a:
            pieces[-1]["end"] = b
        else:
            pieces.append({"name": label, "start": a, "end": b})
    totals: dict[str, dict] = {}
    for piece in pieces:
        a, b = piece.pop("start"), piece.pop("end")
        piece.update(at_ms=(a - t0) / 1e3, ms=(b - a) / 1e3, busy_ms=busy(a, b) / 1e3)
        total = totals.setdefault(piece["name"], {"pieces": 0, "ms": 0.0, "busy_ms": 0.0})
        total["pieces"] += 1
        total["ms"] += piece["ms"]
        total["busy_ms"] += piece["busy_ms"]
    return {"wall_ms": (t1 - t0) / 1e3, "pieces": pieces, "totals": totals}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--min-gap-us", type=float, default=200.0, help="idle gaps shorter than this are not listed")
    p.add_argument("--region", default=None, help="the annotation to analyse (default: the longest bench/...)")
    p.add_argument("--out", type=Path)
    p.add_argument("--phases", action="store_true",
                   help="instead: the region's wall and device busy time per phase (bench/ annotation) and between them")
    args = p.parse_args()
    if args.phases:
        result = phases(load(args.trace), args.region)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
        print(f"{args.trace.name}: wall {result['wall_ms']:.1f} ms")
        for piece in result["pieces"]:
            print(f"  {piece['at_ms']:9.1f} ms  {piece['ms']:8.1f} ms, device busy {piece['busy_ms']:8.1f}  {piece['name']}")
        print("per phase: pieces, wall ms, device busy ms")
        for label, t in sorted(result["totals"].items(), key=lambda kv: -kv[1]["ms"]):
            print(f"  {label:40s} {t['pieces']:4d} {t['ms']:9.1f} {t['busy_ms']:9.1f}")
        return
    result = summarize(load(args.trace), args.top, args.min_gap_us, args.region)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(f"{args.trace.name}: wall {result['wall_ms']:.1f} ms, device busy {result['device_busy_ms']:.1f} ms, "
          f"idle {result['device_idle_ms']:.1f} ms ({result['idle_gaps_over_min']} gaps >= {args.min_gap_us:.0f} us: "
          f"{result['idle_in_gaps_over_min_ms']:.1f} ms)")
    for g in result["largest_gaps"]:
        print(f"  gap at {g['at_ms']:9.1f} ms: {g['ms']:7.2f} ms  <- " + " > ".join(g["host"][-3:]))
    print("host events over the idle gaps:")
    for name, ms in result["host_events_over_idle_ms"]:
        print(f"  {ms:8.1f} ms  {name}")


if __name__ == "__main__":
    main()
