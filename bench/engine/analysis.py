"""The engine benchmark's analysis of a run: per set-up kind and concurrency the means over
starts, every kind's overhead over plain (the steer kinds' over tap too), tap-toggle's tap
running over paused within each start, the run held against the tap's goals, and what makes
the numbers untrustworthy (`find_problems`) or less sharp (`find_warnings`)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from bench.engine.setups import KINDS, STEER_KINDS, TOGGLE_KIND, WORKER_KINDS
from bench.engine.stats import (overhead_pct, paired_overhead, pairs_to_clear, phase_pair_interval, ratio_interval,
                                t_half_width, toggled_pairs)

OVERHEAD_METRICS = {  # name -> (path in a result entry)
    "tpot_p50": ("tpot_ms", "p50"),
    "tpot_mean": ("tpot_ms", "mean"),
    "itl_p50": ("itl_ms", "p50"),
    "ttft_p50": ("ttft_ms", "p50"),
    "output_tokens_per_s": ("output_tokens_per_s",),
}


def _metric(entry: dict[str, Any], path: Sequence[str]) -> float:
    value: Any = entry
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else math.nan


def analyze(setups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per kind (mean over repeats) per concurrency, overheads (every set-up over plain, the steer
    set-ups over tap too), and problems."""
    per_kind: dict[str, dict[str, dict[str, float]]] = {}
    spread: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        runs = [s for s in setups if s["kind"] == kind]
        concurrencies = sorted({c for s in runs for c in s["results"]}, key=int)
        for c in concurrencies:
            entries = [s["results"][c] for s in runs if c in s["results"]]
            means = {name: float(np.mean([_metric(e, path) for e in entries]))
                     for name, path in OVERHEAD_METRICS.items()}
            means["tpot_p99"] = float(np.mean([_metric(e, ("tpot_ms", "p99")) for e in entries]))
            means["itl_p99"] = float(np.mean([_metric(e, ("itl_ms", "p99")) for e in entries]))
            means["ttft_p99"] = float(np.mean([_metric(e, ("ttft_ms", "p99")) for e in entries]))
            means["runs"] = len(entries)
            per_kind.setdefault(kind, {})[c] = means
            if len(entries) > 1:
                tpots = [_metric(e, ("tpot_ms", "p50")) for e in entries]
                spread.setdefault(kind, {})[c] = (max(tpots) - min(tpots)) / float(np.mean(tpots)) * 100
    overhead: dict[str, dict[str, dict[str, float]]] = {}
    pairs = [(kind, "plain") for kind in KINDS if kind != "plain"] + [(kind, "tap") for kind in STEER_KINDS]
    for kind, base_kind in pairs:
        if kind not in per_kind or base_kind not in per_kind:
            continue
        for c, values in per_kind[kind].items():
            base = per_kind[base_kind].get(c)
            if base is not None:
                overhead.setdefault(f"{kind}_vs_{base_kind}", {})[c] = {
                    name: overhead_pct(values[name], base[name]) for name in OVERHEAD_METRICS}
    analysis = {"summary": {"per_kind": per_kind, "tpot_p50_spread_over_repeats_pct": spread},
                "overhead_pct": overhead, "overhead_over_starts": overhead_over_starts(setups),
                "toggle_overhead_pct": toggle_overhead(toggled_of(setups)),
                "idle_toggle": toggled_idle_summary(toggled_of(setups)),
                "tpot_p50_overhead_pct_by_gpu": overhead_by_gpu(setups),
                "problems": find_problems(setups), "warnings": find_warnings(setups)}
    analysis["goals"] = goal_readings(analysis)
    return analysis


def toggled_of(setups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tap-toggle starts that toggled (phases under load, or idle pairs)."""
    return [s for s in setups if s.get("kind") == TOGGLE_KIND and (s.get("toggle") or s.get("idle_toggle"))]


# The tap's cost goals, percent over plain vLLM: TPOT p50 by concurrency (any
# concurrency not named: the default), TTFT p50 under load and at an idle engine.
TPOT_GOAL_PCT = {"1": 0.5}
TPOT_GOAL_DEFAULT_PCT = 1.0
TTFT_GOAL_PCT = 1.0


def goal_readings(analysis: dict[str, Any]) -> dict[str, Any]:
    """The run held against the tap's goals, one row per goal and concurrency. The tap's cost
    is read within one start where tap-toggle ran (running over paused, the mean over its
    starts: starts differ by more than the goals), otherwise as tap over plain across starts;
    the idle TTFT from tap-toggle's pairs. Goals are met on the point estimate; the 95%
    interval goes beside it where there is one (the idle pairs'; for the rows read within
    starts, the phase pairs', with two pairs or more), with whether it lies wholly under or
    over the goal and, for the phase pairs, about how many would make it do so. A reading
    that is missing (NaN) does not meet its goal. `all_met` is None
    where the run has nothing to hold to a goal. Forced eager's TPOT over plain goes beside
    the rows, with no goal of its own."""
    toggled = analysis.get("toggle_overhead_pct") or {}
    overheads = analysis.get("overhead_pct") or {}
    per_c = toggled or overheads.get("tap_vs_plain") or {}
    rows: list[dict[str, Any]] = []

    def add(measure: str, concurrency: str, value: float, goal: float, source: str, **extra: Any) -> None:
        rows.append({"measure": measure, "concurrency": concurrency, "pct": value, "goal_pct": goal,
                     "met": bool(math.isfinite(value) and value <= goal), "source": source, **extra})

    def phase_interval(o: dict[str, Any], metric: str, value: float, goal: float) -> dict[str, Any]:
        """The phase pairs' interval for a within-start row, where there are two pairs or more."""
        bounds = (o.get("ci95_pct") or {}).get(metric)
        if not bounds:
            return {}
        pairs = (o.get("phase_pairs") or {}).get(metric) or []
        counted = sum(math.isfinite(v) for v in pairs)  # the samples the interval was drawn from
        return {"ci95_pct": bounds, "pairs": counted, "pair_kind": "phase pairs",
                "interval_under_goal": bool(bounds[1] <= goal), "interval_over_goal": bool(bounds[0] > goal),
                "pairs_to_clear": pairs_to_clear(goal, value, pairs)}

    for c, o in sorted(per_c.items(), key=lambda kv: int(kv[0])):
        n = int(o.get("starts", 1))
        source = "tap over plain, across starts"
        if toggled:
            source = "within the start" if n == 1 else f"within each start, mean of {n}"
        for measure, metric, goal in (("TPOT p50", "tpot_p50", TPOT_GOAL_PCT.get(c, TPOT_GOAL_DEFAULT_PCT)),
                                      ("TTFT p50 under load", "ttft_p50", TTFT_GOAL_PCT)):
            value = float(o.get(metric, math.nan))
            add(measure, c, value, goal, source, **phase_interval(o, metric, value, goal))
    toggled_idle = analysis.get("idle_toggle") or {}
    idle = toggled_idle.get("all_starts") or {}
    if idle:
        interval = idle.get("ci95_pct") or [math.nan, math.nan]
        idle_starts = len(toggled_idle.get("per_start", []))
        add("TTFT at an idle engine", "idle", float(idle.get("pct", math.nan)), TTFT_GOAL_PCT,
            "pairs within the start" if idle_starts == 1 else f"pairs within each of {idle_starts} starts, pooled",
            pairs=idle.get("pairs", 0), pair_kind="pairs", ci95_pct=interval,
            interval_under_goal=bool(math.isfinite(interval[1]) and interval[1] <= TTFT_GOAL_PCT),
            interval_over_goal=bool(math.isfinite(interval[0]) and interval[0] > TTFT_GOAL_PCT))
    eager = overheads.get("eager_vs_plain") or {}
    return {"rows": rows, "all_met": all(r["met"] for r in rows) if rows else None,
            "eager_tpot_p50_pct": {c: o["tpot_p50"] for c, o in sorted(eager.items(), key=lambda kv: int(kv[0]))}}


def goal_lines(goals: dict[str, Any]) -> list[str]:
    """`goal_readings` as a markdown table, eager's penalty and the verdict after it."""
    rows = goals.get("rows") or []
    if not rows:
        return []
    lines = ["", "The tap's goals, read from the run (the runs merged, where several), percent over "
             "plain vLLM:", "",
             "| measure | concurrency | tap's cost | goal | met | read |", "|---|---:|---:|---:|---|---|"]
    for r in rows:
        cost = pct2(r["pct"])
        if "ci95_pct" in r:
            low, high = r["ci95_pct"]
            cost += f" (95% {pct2(low)} … {pct2(high)}, {r['pairs']} {r.get('pair_kind', 'pairs')})"
        lines.append(f"| {r['measure']} | {r['concurrency']} | {cost} | ≤ +{r['goal_pct']:g}% | "
                     f"{'yes' if r['met'] else '**no**'} | {r['source']} |")
    eager = goals.get("eager_tpot_p50_pct") or {}
    if eager:
        lines += ["", "Forced eager beside it, TPOT p50 over plain: "
                  + ", ".join(f"{pct(v)} at {c}" for c, v in eager.items()) + "."]
    # Readings whose interval straddles the goal: the run is too small to tell which side they are.
    open_rows = [r for r in rows if "ci95_pct" in r and not (r["interval_under_goal"] or r["interval_over_goal"])]
    if any(r.get("pairs_to_clear") for r in open_rows):
        lines += ["", "Phase pairs that would put the interval on one side of the goal, were the estimate and "
                  "the pairs' scatter to hold: "
                  + ", ".join(f"{_goal_row_name(r)} about {r['pairs_to_clear']}" for r in open_rows
                              if r.get("pairs_to_clear")) + "."]
    single = [r for r in rows if r["source"].startswith("within") and "ci95_pct" not in r]
    if single:
        lines += ["", f"{len(single)} of the rows read within starts rest on one phase pair each, with no scatter "
                  "to give an interval (--toggle-pairs 2 or more, or runs merged, give one)."]
    verdict = "every goal met" if goals["all_met"] else "not every goal met"
    if open_rows:
        names = [_goal_row_name(r) for r in open_rows]
        verdict += (f"; the 95% interval of {', '.join(names)} "
                    + ("reaches" if len(names) == 1 else "reach")
                    + " across the goal: more pairs or starts would show which side "
                    + ("it is" if len(names) == 1 else "they are"))
    return lines + ["", verdict[0].upper() + verdict[1:] + "."]


def _goal_row_name(row: dict[str, Any]) -> str:
    return "the idle TTFT" if row["concurrency"] == "idle" else f"{row['measure']} at {row['concurrency']}"


def overhead_over_starts(setups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every set-up kind over plain with each server start as one sample: the overhead of the
    mean over starts, and its 95% interval (Welch's t on the two kinds' start means, the
    ratio's error by the delta method), per concurrency, for `START_METRICS`. A start's own
    conditions (where the weights landed, the GPU's state) move TPOT by about a percent, more
    than the goal; the interval says whether a run had the starts to tell a 0.5% difference.
    Also without each run's first start ("steady"), which came out slow in two runs of two
    (runs merged by --reanalyze mark theirs; a single run's is its first set-up). Kinds need
    two starts each; side-by-side runs (--gpus) have no single first start."""
    out: dict[str, Any] = {}
    variants = [("all", list(setups))]
    if setups and not any(s.get("gpu") is not None for s in setups):
        marked = any("first_of_run" in s for s in setups)
        variants.append(("steady", [s for s in setups if not s.get("first_of_run")] if marked else list(setups[1:])))
    for variant, starts in variants:
        samples: dict[tuple[str, str, str], list[float]] = {}
        for s in starts:
            for c, entry in s.get("results", {}).items():
                for name, path in START_METRICS.items():
                    value = _metric(entry, path)
                    if math.isfinite(value):  # a start that lost the metric is left out, not made NaN
                        samples.setdefault((s["kind"], c, name), []).append(value)
        for (kind, c, name), values in sorted(samples.items()):
            base = samples.get(("plain", c, name))
            if kind == "plain" or not base or len(values) < 2 or len(base) < 2:
                continue
            row = out.setdefault(variant, {}).setdefault(kind, {}).setdefault(c, {"starts": len(values),
                                                                                  "plain_starts": len(base)})
            row[name] = ratio_interval(np.array(values, dtype=np.float64), np.array(base, dtype=np.float64))
    return out


def toggled_idle_summary(setups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """tap-toggle's idle requests, paused and running in turn: each start's running over
    paused, and all starts' pairs together (`paired_overhead`)."""
    per_start, pairs = [], []
    for s in setups:
        toggled = s.get("idle_toggle")
        if not toggled:
            continue
        own = toggled_pairs(toggled["per_request_ttft_ms"], toggled["paused"])
        per_start.append({"label": s["label"], **paired_overhead(own)})
        pairs += own
    if not per_start:
        return {}
    summary = {"per_start": per_start, "all_starts": paired_overhead(pairs)}
    # The pooled interval treats every pair as independent; should the tap's cost differ from
    # start to start, the starts' own spread is the honest interval.
    for key, figures in (("over_starts", [x["pct"] for x in per_start if "pct" in x]),
                         ("over_starts_by_rank", [x["hodges_lehmann"]["pct"] for x in per_start
                                                  if "hodges_lehmann" in x])):
        values = np.array([v for v in figures if math.isfinite(v)])
        if len(values) >= 2:
            half = t_half_width(values)
            summary[key] = {"starts": len(values), "pct": float(values.mean()),
                            "ci95_pct": [float(values.mean() - half), float(values.mean() + half)]}
    return summary


def toggled_phases(setup: dict[str, Any]) -> list[tuple[str, list[dict], list[dict]]]:
    """A tap-toggle start's (concurrency, running phases, paused phases), where it measured
    both states (a start stopped early may have one only)."""
    out = []
    for c, phases in (setup.get("toggle") or {}).items():
        running = [p for p in phases if not p["paused"]]
        paused = [p for p in phases if p["paused"]]
        if running and paused:
            out.append((c, running, paused))
    return out


PAIRED_METRICS = ("tpot_p50", "ttft_p50")  # the ones held to goals
START_METRICS = {"tpot_p50": ("tpot_ms", "p50"), "ttft_p50": ("ttft_ms", "p50")}


def toggle_overhead(setups: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """tap-toggle: per concurrency, the tap running over the tap paused within each start (the
    mean of that start's running phases over the mean of its paused ones), for
    `OVERHEAD_METRICS`; then the mean over starts, each start's TPOT and TTFT p50 figures kept,
    and the phase pairs (a running phase and its paused neighbour) with the interval they give."""
    per_c: dict[str, list[dict[str, Any]]] = {}
    for s in setups:
        for c, running, paused in toggled_phases(s):
            start: dict[str, Any] = {name: overhead_pct(float(np.mean([_metric(p, path) for p in running])),
                                                        float(np.mean([_metric(p, path) for p in paused])))
                                     for name, path in OVERHEAD_METRICS.items()}
            start["phase_pairs"] = {name: [overhead_pct(_metric(r, OVERHEAD_METRICS[name]),
                                                        _metric(q, OVERHEAD_METRICS[name]))
                                           for r, q in zip(running, paused)] for name in PAIRED_METRICS}
            per_c.setdefault(c, []).append(start)
    out = {}
    for c, starts in sorted(per_c.items(), key=lambda kv: int(kv[0])):
        out[c] = {"starts": len(starts), **{name: float(np.mean([x[name] for x in starts])) for name in OVERHEAD_METRICS},
                  "tpot_p50_per_start": [x["tpot_p50"] for x in starts],
                  "ttft_p50_per_start": [x["ttft_p50"] for x in starts]}
        out[c]["phase_pairs"] = {name: [v for x in starts for v in x["phase_pairs"][name]] for name in PAIRED_METRICS}
        out[c]["ci95_pct"] = {name: phase_pair_interval(out[c][name], out[c]["phase_pairs"][name])
                              for name in PAIRED_METRICS}
    return out


def overhead_by_gpu(setups: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """With set-ups side by side (--gpus): TPOT p50 of every kind over plain on the same GPU,
    {kind: {gpu: {concurrency: pct}}}. Two GPUs of one host can differ by more than the
    tap costs; compared on one GPU, that difference drops out, and the two GPUs' figures are
    two independent estimates."""
    by_gpu: dict[tuple[str, str, str], list[float]] = {}
    for s in setups:
        if s.get("gpu") is None:
            continue
        for c, entry in s["results"].items():
            by_gpu.setdefault((s["kind"], s["gpu"], c), []).append(_metric(entry, ("tpot_ms", "p50")))
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (kind, gpu, c), values in sorted(by_gpu.items()):
        base = by_gpu.get(("plain", gpu, c))
        if kind != "plain" and base:
            out.setdefault(kind, {}).setdefault(gpu, {})[c] = overhead_pct(float(np.mean(values)),
                                                                         float(np.mean(base)))
    return out


def find_problems(setups: Sequence[dict[str, Any]]) -> list[str]:
    """Everything that makes the numbers untrustworthy, loudly."""
    problems = []
    for s in setups:
        label, checks = s["label"], s.get("checks", {})
        if s.get("error"):
            problems.append(f"{label}: did not complete: {s['error'].splitlines()[0]}")
        if s["kind"] == "eager" and checks.get("enforce_eager") is False:
            problems.append(f"{label}: the engine did not run with enforce_eager=True")
        if s["kind"] != "eager" and checks.get("enforce_eager") is True:
            problems.append(f"{label}: the engine ran eager")
        if s["kind"] in WORKER_KINDS and checks.get("probex_probes_listed") != checks.get("probex_probes_expected"):
            problems.append(f"{label}: /probex/probes lists {checks.get('probex_probes_listed')} probes, not "
                            f"{checks.get('probex_probes_expected')}")
        if s["kind"] in STEER_KINDS:
            problems += steering_problems(s)
        for c, entry in s.get("results", {}).items():
            problems += phase_problems(f"{label} c={c}", entry)
        for c, phases in (s.get("toggle") or {}).items():
            for number, phase in enumerate(phases, 1):
                problems += phase_problems(f"{label} c={c} phase {number} ({'paused' if phase['paused'] else 'running'})",
                                           phase)
        scores = s.get("scores")
        if scores is not None:
            problems += score_problems(f"{label} score check", scores)
        toggled = s.get("idle_toggle")
        if toggled:
            where = f"{label} idle TTFT, paused and running in turn"
            if toggled.get("failed"):
                problems.append(f"{where}: {toggled['failed']} failed requests ({'; '.join(toggled.get('errors', []))})")
            problems += score_problems(where, toggled["scores"])
            if toggled.get("running_without_scores") or toggled.get("paused_with_scores"):
                problems.append(f"{where}: {toggled['running_without_scores']} requests without scores while the tap "
                                f"ran, {toggled['paused_with_scores']} with scores while it was paused")
    return problems


def phase_problems(where: str, entry: dict[str, Any]) -> list[str]:
    """One load phase: failed requests, or none completed."""
    problems = []
    if entry.get("failed"):
        problems.append(f"{where}: {entry['failed']} failed requests")
    if not entry.get("completed"):
        problems.append(f"{where}: no request completed")
    return problems


def score_problems(where: str, scores: dict[str, Any]) -> list[str]:
    """A worker's requests without every token scored by every probe, or without prompt scores."""
    ok = scores["requests"] - scores.get("failed", 0)
    if scores.get("failed"):
        return [f"{where}: {scores['failed']} of {scores['requests']} requests failed"]
    if scores["coverage"] != 1.0 or scores["requests_with_all_prompt_scores"] != ok or scores.get("problems"):
        return [f"{where}: SCORES NOT FULLY DELIVERED: {scores['scored_tokens']}/{scores['generated_tokens']} "
                f"generated tokens scored, prompt scores on {scores['requests_with_all_prompt_scores']}/{ok} "
                f"requests {scores.get('problems', [])}"]
    return []


def steering_problems(setup: dict[str, Any]) -> list[str]:
    """A steer set-up whose vector was not loaded, or whose steered requests were not steered."""
    label, checks = setup["label"], setup.get("checks", {})
    if setup.get("error") and "probex_steering_expected" not in checks:
        return []  # did not get as far as the checks; reported as not completed
    problems = []
    expected = checks.get("probex_steering_expected") or {}
    listed = [(v.get("name"), v.get("layer")) for v in checks.get("probex_steering_vectors") or []]
    if (expected.get("name"), expected.get("layer")) not in listed:
        problems.append(f"{label}: /probex/steering lists {listed}, not {expected.get('name')} at layer "
                        f"{expected.get('layer')}")
    if checks.get("probex_runs_unsteered_lines"):
        problems.append(f"{label}: the worker ran {checks['probex_runs_unsteered_lines']} request(s) unsteered "
                        "(see its log)")
    effect = checks.get("steering_effect")
    if setup["kind"] == "steer-active" and not setup.get("error"):
        if effect is None:
            problems.append(f"{label}: the steering check did not run")
        elif effect.get("errors"):
            problems.append(f"{label}: steering check requests failed: {'; '.join(effect['errors'])}")
        elif effect.get("probes_after_write") and not effect.get("max_abs_raw_diff_after_write", 0) > 0:
            problems.append(f"{label}: STEERING HAD NO EFFECT: prompt scores of the probes after layer "
                            f"{effect.get('layer')} are the same steered and unsteered "
                            f"(max |diff| {effect.get('max_abs_raw_diff_after_write')})")
    return problems


def find_warnings(setups: Sequence[dict[str, Any]]) -> list[str]:
    """What makes some numbers less sharp without invalidating the run."""
    warnings = []
    for s in setups:
        effect = s.get("checks", {}).get("steering_effect")
        if effect is not None and not effect.get("probes_after_write"):
            warnings.append(f"{s['label']}: no probe reads a layer after the steering layer {effect.get('layer')}: "
                            "whether steered requests were steered is not observable")
        elif (s["kind"] == "steer-gated" and effect is not None and not effect.get("errors")
              and not effect.get("max_abs_raw_diff_after_write", 0) > 0):
            warnings.append(f"{s['label']}: the gate never opened on the check prompts (prompt scores after the "
                            "write unchanged)")
    return warnings


def pct(value: float) -> str:
    return f"{value:+.1f}%" if math.isfinite(value) else "n/a"


def pct2(value: float) -> str:
    """Two decimals, for figures held to a 1% goal."""
    return f"{value:+.2f}%" if math.isfinite(value) else "n/a"
