"""What a device did during a few profiled requests: a summary of one torch-profiler trace.

`python -m bench.engine --profile-requests N` has each server record N requests with vLLM's
torch profiler (`--profiler-config`, `/start_profile`, `/stop_profile`), one at a time. The
TPOT difference between plain vLLM and the tap at one stream is either device time (the op's kernels, the score copies queued between
the forward and the sampling) or device idle time (the host launching the next step late).
Client timings cannot tell those apart; the trace can:

- `device_busy_us`: the union of the device's kernel, copy and set intervals;
- `idle_gaps_us`, the device idle between two of its activities, in three sizes: under
  `WAITING_GAP_US`, the gap from one kernel to the next (inside a CUDA graph too, ~1-2 µs
  each); up to `LONG_GAP_US`, the device waiting for work not launched yet (a step's host
  work not hidden behind the device, a copy's hand-off); longer, between requests (the
  client's pause, HTTP);
- per graph launch (`graph_launches`; one per decode step with full CUDA graphs, several
  per prefill with piecewise ones): busy time and waiting gaps, the whole trace's (its
  prefills included) divided by the launches;
- the kernels by total time, the copies by direction (and size), and which of them are
  ProbeX's, by the rows a call ran (one decode row, a whole prompt): its share of a
  prefill's time, the first token's, next to a decode step's.

Only the trace's own events are read (Chrome trace format, gzipped or not); nothing here
imports torch or vLLM. On a CPU build there are no device events: the summary then says so
(`device_events` 0) and counts the host events.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Iterable

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")
# Shorter gaps are the device going from one kernel to the next; longer ones, up to
# LONG_GAP_US, the device waiting for work; longer still, between requests.
WAITING_GAP_US = 10.0
LONG_GAP_US = 1000.0
# ProbeX's device kernels by name: the fused Triton tap kernel (engine_worker/tap/kernel.py).
# The torch fallback's matmuls cannot be told from the model's own.
PROBEX_KERNEL_MARKS = ("_tap_rows", "probex")
TOP_KERNELS = 12
# Every kernel name is kept whole with its count and time (a model's decode step runs a few
# dozen distinct ones; templated names share long prefixes), so two set-ups' traces compare
# kernel by kernel (`kernel_differences`).
MAX_KERNEL_NAMES = 300


def find_traces(directory: Path) -> list[Path]:
    """The worker traces vLLM wrote under `directory` (the API server's, if any, left out)."""
    traces = sorted(p for p in Path(directory).rglob("*.pt.trace.json*") if p.is_file())
    workers = [p for p in traces if "api" not in p.name.lower() and "frontend" not in p.name.lower()]
    return workers or traces


def load_events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data.get("traceEvents", []) if isinstance(data, dict) else list(data)


def _interval(event: dict[str, Any]) -> tuple[float, float]:
    start = float(event["ts"])
    return start, start + float(event.get("dur", 0.0))


def merged_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, overlapping or touching intervals joined (concurrent streams count once)."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def is_probex_kernel(name: str) -> bool:
    lowered = name.lower()
    return any(mark in lowered for mark in PROBEX_KERNEL_MARKS)


def _count(table: dict, key: Any, duration: float) -> None:
    """One more call of `key` taking `duration`: table[key] is [calls, total µs]."""
    entry = table.setdefault(key, [0, 0.0])
    entry[0] += 1
    entry[1] += duration


def summarize_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    device = [e for e in complete if e.get("cat") in DEVICE_CATEGORIES]
    host = [e for e in complete if e.get("cat") in HOST_CATEGORIES]
    launches = [e for e in host
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "GraphLaunch" in e.get("name", "")]
    summary: dict[str, Any] = {"device_events": len(device), "host_events": len(host),
                               "graph_launches": len(launches)}
    if not device:
        return summary
    busy = merged_intervals(_interval(e) for e in device)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:])]
    kernel_gaps = [g for g in gaps if g < WAITING_GAP_US]
    waiting = [g for g in gaps if WAITING_GAP_US <= g < LONG_GAP_US]
    between = [g for g in gaps if g >= LONG_GAP_US]
    busy_us = sum(e - s for s, e in busy)
    summary.update(
        span_us=busy[-1][1] - busy[0][0],
        device_busy_us=busy_us,
        idle_gaps_us={"kernel_to_kernel_total": sum(kernel_gaps), "kernel_to_kernel_count": len(kernel_gaps),
                      "waiting_total": sum(waiting), "waiting_count": len(waiting),
                      "waiting_max": max(waiting, default=0.0),
                      "between_requests_total": sum(between), "between_requests_count": len(between)},
    )
    kernels: dict[str, list[float]] = {}
    copies: dict[str, list[float]] = {}
    # ProbeX's kernel calls by the rows they ran (its grid's first dimension: one decode row, or
    # a whole prompt), and each copy kind by its size: a prefill's share next to a decode step's.
    probex_by_rows: dict[int, list[float]] = {}
    copies_by_bytes: dict[str, dict[int, list[float]]] = {}
    for e in device:
        name, duration, args = e.get("name", "?"), float(e.get("dur", 0.0)), e.get("args") or {}
        if e["cat"] == "kernel":
            _count(kernels, name, duration)
            if is_probex_kernel(name):
                _count(probex_by_rows, int((args.get("grid") or [0])[0]), duration)
        else:
            _count(copies, name, duration)
            _count(copies_by_bytes.setdefault(name, {}), int(args.get("bytes") or 0), duration)
    ranked = sorted(kernels.items(), key=lambda item: -item[1][1])
    summary["kernels"] = {"count": sum(n for n, _ in kernels.values()),
                          "total_us": sum(t for _, t in kernels.values()),
                          "top": [{"name": name, "count": n, "total_us": t} for name, (n, t) in ranked[:TOP_KERNELS]],
                          "by_name": {name: [n, t] for name, (n, t) in ranked[:MAX_KERNEL_NAMES]}}
    summary["probex_kernels"] = {"count": sum(n for n, _ in probex_by_rows.values()),
                                 "total_us": sum(t for _, t in probex_by_rows.values()),
                                 "by_rows": {str(rows): {"count": n, "mean_us": t / n}
                                             for rows, (n, t) in sorted(probex_by_rows.items())}}
    summary["copies"] = {name: {"count": n, "total_us": t,
                                "by_bytes": {str(size): {"count": k, "mean_us": u / k}
                                             for size, (k, u) in sorted(copies_by_bytes[name].items())}}
                         for name, (n, t) in sorted(copies.items())}
    if launches:
        steps = len(launches)
        summary["per_graph_launch_us"] = {
            "device_busy": busy_us / steps, "waiting_idle": sum(waiting) / steps,
            "kernel_to_kernel_idle": sum(kernel_gaps) / steps,
            "probex_kernels": summary["probex_kernels"]["total_us"] / steps,
            "copies": sum(t for _, t in copies.values()) / steps}
    return summary


def summarize_trace(path: Path) -> dict[str, Any]:
    return {"trace": Path(path).name, **summarize_events(load_events(path))}


def kernel_differences(base: dict[str, Any], other: dict[str, Any], limit: int = 10) -> list[dict[str, Any]]:
    """Kernels and copies whose device time per graph launch differs most between two
    summaries (`other` minus `base`), largest difference first: which kernels a set-up adds
    or slows down. Empty when either summary has no device events or no graph launches."""
    if not base.get("graph_launches") or not other.get("graph_launches"):
        return []

    def per_launch(summary: dict[str, Any]) -> dict[str, tuple[int, float]]:
        steps = summary["graph_launches"]
        table = {name: (n, t / steps) for name, (n, t) in summary.get("kernels", {}).get("by_name", {}).items()}
        table.update({name: (v["count"], v["total_us"] / steps) for name, v in summary.get("copies", {}).items()})
        return table

    a, b = per_launch(base), per_launch(other)
    rows = [{"name": name, "base_count": a.get(name, (0, 0.0))[0], "other_count": b.get(name, (0, 0.0))[0],
             "delta_us": b.get(name, (0, 0.0))[1] - a.get(name, (0, 0.0))[1]} for name in set(a) | set(b)]
    rows.sort(key=lambda row: -abs(row["delta_us"]))
    return rows[:limit]


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Summarise torch-profiler traces (device busy and idle time, "
                                                 "kernels); with two, the kernels that differ most.")
    parser.add_argument("traces", type=Path, nargs="+", metavar="TRACE")
    args = parser.parse_args()
    summaries = [summarize_trace(path) for path in args.traces]
    for path, summary in zip(args.traces, summaries):
        brief = {k: v for k, v in summary.items() if k not in ("kernels", "copies")}
        print(path, json.dumps(brief, indent=1))
    if len(summaries) == 2:
        print(f"kernels and copies that differ most, {args.traces[1].name} minus {args.traces[0].name}, "
              "µs per graph launch (counts over the whole trace):")
        for row in kernel_differences(*summaries, limit=20):
            print(f"{row['delta_us']:+9.2f}  {row['base_count']:6d} -> {row['other_count']:6d}  {row['name'][:100]}")


if __name__ == "__main__":
    main()
