"""One set-up's measurements on its running server.

Each concurrency's load is one `vllm bench serve` call (bench/vllm_bench.py): a warm-up call
on prompts of its own seed, then the measured call on the prompts every set-up gets at that
concurrency. tap-toggle measures several phases per concurrency on one start, the tap running
for some and paused (PUT /probex/tap) for the others, one `vllm bench serve` call each with
fresh prompts (`toggle_phase_plan`). After the load, the bench's own client (client.py) checks
the scores of a worker's requests, sends tap-toggle's idle request pairs, the steering check
and the profiled requests.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from bench.engine.client import (CHECK_SEED, IDLE_SEED, IDLE_TTFT_TOKENS, idle_requests, idle_toggle_paused,
                                 profile_phase, random_prompts, score_coverage, set_tap_paused, steering_effect)
from bench.engine.setups import (ADMIN_TOKEN, STEER_KINDS, STEERED_KINDS, TOGGLE_KIND, WORKER_KINDS, Server,
                                 SetupPlan, SteerBench, safe_label)
from bench.engine.stats import paired_overhead, toggled_pairs
from bench.vllm_bench import Load, phase_line, run_load, served_model_name

TOGGLE_SEED = 499_979  # tap-toggle's phases' prompts beside the one every set-up gets (`toggle_phase_plan`)
TOGGLE_IDLE_LEAD_IN = 1  # idle pairs: this many requests sent first and left out (`idle_requests`)
SCORE_CHECK_REQUESTS = 4  # a worker's requests read token by token for their scores, after the load


class SetupCancelled(Exception):
    """The benchmark was interrupted while this set-up ran beside others (--gpus)."""


def say(*lines: str) -> None:
    print("\n".join(lines), flush=True)


def toggle_order(pairs: int, first_paused: bool = False) -> list[bool]:
    """tap-toggle's phases at one concurrency, paused or not: running, paused, paused, running,
    and again (ABBA), `pairs` of each; so neither state sits earlier in the run on average, and
    a drift over the phases (clocks, heat) falls on both alike. `first_paused`: the same
    beginning paused (paused, running, running, paused, ...)."""
    if pairs < 1:
        raise ValueError(f"--toggle-pairs must be at least 1, got {pairs}")
    return [paused != first_paused for paused in ([False, True, True, False] * pairs)[: 2 * pairs]]


def parse_toggle_pairs(text: str, concurrencies: Sequence[int] | None = None) -> dict[int | None, int]:
    """`--toggle-pairs`: one number for every concurrency ("3"), or that number followed by
    some concurrencies' own ("3,8:8,64:8"), as {concurrency or None (the rest): pairs}; a
    concurrency named must be one of `concurrencies` where given."""
    pairs: dict[int | None, int] = {}
    for part in (piece.strip() for piece in text.split(",")):
        concurrency, _, number = part.rpartition(":")
        try:
            key, count = (int(concurrency) if concurrency else None), int(number)
        except ValueError:
            raise ValueError(f"--toggle-pairs: {part!r} is neither N nor CONCURRENCY:N") from None
        if key in pairs:
            raise ValueError(f"--toggle-pairs names {'the default' if key is None else key} twice")
        if key is not None and concurrencies is not None and key not in concurrencies:
            raise ValueError(f"--toggle-pairs names concurrency {key}, which the run does not have "
                             f"(--concurrency {','.join(map(str, concurrencies))})")
        toggle_order(count)  # at least one pair
        pairs[key] = count
    if None not in pairs:
        raise ValueError("--toggle-pairs needs a number for the concurrencies it does not name, first: 3,64:8")
    return pairs


def toggle_phase_plan(order: Sequence[bool], own_seed: int, seed: int, concurrency: int) -> list[tuple[bool, int, bool]]:
    """tap-toggle's phases at one concurrency: (paused, prompt seed, whether it is the set-up's
    own phase) for each state of `order`. The first phase with the tap running is the set-up's
    own (`results`), on `own_seed`'s prompts, which every set-up gets; the others get fresh
    prompts each, so the prefix cache serves none of a measured phase."""
    plan, own_taken = [], False
    for number, paused in enumerate(order):
        if not paused and not own_taken:
            plan.append((paused, own_seed, True))
            own_taken = True
        else:
            sequence = np.random.SeedSequence([seed, TOGGLE_SEED, concurrency, number])
            plan.append((paused, int(sequence.generate_state(1, dtype=np.uint32)[0]), False))
    return plan


def phase_seed(seed: int, concurrency: int, warm: bool = False) -> int:
    """The prompts' seed of a concurrency's measured phase (the same for every set-up), or of its warm-up."""
    return seed * 1_000_003 + concurrency * 2 + (1 if warm else 0)


def measure_setup(server: Server, plan: SetupPlan, model_dir: Path, out: Path, concurrencies: Sequence[int],
                  num_prompts: dict[int, int], warmup: dict[int, int], input_len: int, output_len: int, seed: int,
                  probe_names: Sequence[str], record: dict[str, Any], save: Callable[[], None],
                  probe_layers: dict[str, int] | None = None, steer: SteerBench | None = None,
                  range_ratio: float = 0.0, cancelled: Callable[[], bool] = lambda: False,
                  idle_pairs: int = 0, idle_pause_s: float = 0.1, profile_requests: int = 0,
                  toggle_pairs: dict[int | None, int] | None = None) -> None:
    """Every measurement of one set-up into `record` (saved after each phase). `cancelled`:
    polled around every phase; once true, SetupCancelled is raised. `toggle_pairs`
    (tap-toggle): phases with the tap running and paused per concurrency (`toggle_order`),
    `record["toggle"]`; the first running one is also the set-up's `results` phase.
    `idle_pairs` (tap-toggle): pairs of single requests to the idle engine, the tap running for
    one and paused for the other (`record["idle_toggle"]`)."""
    import httpx

    model = served_model_name(server.url)
    worker = plan.kind in WORKER_KINDS
    if worker:
        listing = httpx.get(server.url + "/probex/probes", timeout=60).json()
        record["checks"]["probex_probes_listed"] = len(listing.get("probes", []))
        record["checks"]["probex_probes_expected"] = len(probe_names)
        record["checks"]["probex_tapped_layers"] = listing.get("tapped_layers")
    if plan.kind in STEER_KINDS and steer is not None:
        steering = httpx.get(server.url + "/probex/steering", timeout=60).json()
        record["checks"]["probex_steer_layers"] = steering.get("steer_layers")
        record["checks"]["probex_steering_vectors"] = [
            {k: v.get(k) for k in ("name", "layer", "norm", "digest")} for v in steering.get("vectors", [])]
        record["checks"]["probex_steering_expected"] = {"name": steer.name, "layer": steer.layer}
    xargs = steer.xargs(plan.kind) if steer is not None else None
    if xargs:
        record["request_xargs"] = xargs
    expect = list(probe_names) if worker else None
    results_dir = out / "vllm-bench" / safe_label(plan.label)

    def phase(c: int, prompts: int, prompt_seed: int, name: str) -> dict[str, Any]:
        load = Load(server.url, str(model_dir), model, c, prompts, input_len, output_len, prompt_seed,
                    range_ratio, {"vllm_xargs": xargs} if xargs else None, api_key=ADMIN_TOKEN if xargs else None)
        ran = run_load(load, results_dir, f"{name}.json", log_path=results_dir / f"{name}.log")
        if cancelled():
            raise SetupCancelled(f"during concurrency {c}")
        return {**ran["summary"], "command": ran["command"], "seed": prompt_seed,
                "result_file": str((results_dir / f"{name}.json").relative_to(out))}

    pairs_at = toggle_pairs or {None: 2}
    for c in concurrencies:
        if cancelled():
            raise SetupCancelled(f"before concurrency {c}")
        record.setdefault("warmup", {})[str(c)] = phase(c, warmup[c], phase_seed(seed, c, warm=True), f"c{c}-warmup")
        if plan.kind != TOGGLE_KIND:
            entry = record["results"][str(c)] = phase(c, num_prompts[c], phase_seed(seed, c), f"c{c}")
            say(phase_line(plan.label, c, entry))
            save()
            continue
        order = toggle_order(pairs_at.get(c, pairs_at[None]), plan.toggle_first_paused)
        phases = record.setdefault("toggle", {})[str(c)] = []
        try:
            for number, (paused, prompt_seed, own) in enumerate(toggle_phase_plan(order, phase_seed(seed, c), seed, c)):
                set_tap_paused(server.url, paused)
                entry = phase(c, num_prompts[c], prompt_seed, f"c{c}-{number}-{'paused' if paused else 'running'}")
                if own:
                    record["results"][str(c)] = entry
                phases.append({"paused": paused, **entry})
                label = plan.label if own else f"{plan.label} {'paused' if paused else 'running'}"
                say(phase_line(label, c, entry))
                save()
        finally:
            set_tap_paused(server.url, False)
    if expect:
        prompts = random_prompts(SCORE_CHECK_REQUESTS, input_len, seed * 1_000_003 + CHECK_SEED)
        checked = idle_requests(server.url, model, prompts, 0.0, expect, xargs, max_tokens=min(output_len, 32))
        record["scores"] = score_coverage(checked, len(expect))
        say(f"  {plan.label:14} scores: {record['scores']['coverage']:.1%} of {record['scores']['generated_tokens']} "
            f"generated tokens scored by all {len(expect)} probes over {len(checked)} requests")
        save()
    if idle_pairs and plan.kind == TOGGLE_KIND:
        record["idle_toggle"] = idle_toggle(server.url, model, input_len, seed, idle_pairs, idle_pause_s, expect, xargs)
        save()
        overhead = record["idle_toggle"]["running_over_paused"]
        if "pct" in overhead:
            say(f"  {plan.label:14} idle TTFT, tap running over paused request by request: {overhead['pct']:+.2f}% "
                f"(95% interval {overhead['ci95_pct'][0]:+.2f} … {overhead['ci95_pct'][1]:+.2f}%, "
                f"{overhead['pairs']} pairs)")
    if profile_requests:
        record["profile"] = profile_phase(server.url, model, profile_requests, input_len, seed, expect, xargs,
                                          plan.trace_dir)
        save()
    if plan.kind in STEERED_KINDS and steer is not None:
        effect = record["checks"]["steering_effect"] = steering_effect(
            server.url, model, input_len, seed, probe_layers or {}, steer, plan.kind)
        save()
        say(f"  {plan.label}: steered vs unsteered prompt scores, max |raw diff| after the write (layer "
            f"{steer.layer}) {effect['max_abs_raw_diff_after_write']:.3g}, at or before it "
            f"{effect['max_abs_raw_diff_at_or_before_write']:.3g}")


def idle_toggle(url: str, model: str, input_len: int, seed: int, pairs: int, pause_s: float,
                expect: Sequence[str] | None, xargs: dict[str, Any] | None) -> dict[str, Any]:
    """tap-toggle's idle pairs: TTFT of single requests to an idle engine, the tap paused for one
    of each neighbouring pair and running for the other (ABBA, `idle_toggle_paused`)."""
    prompts = random_prompts(2 * pairs + TOGGLE_IDLE_LEAD_IN, input_len, seed * 1_000_003 + IDLE_SEED)
    started = time.perf_counter()
    results = idle_requests(url, model, prompts, pause_s, expect, xargs, paused_for=idle_toggle_paused,
                            lead_in=TOGGLE_IDLE_LEAD_IN)
    paused_flags = [idle_toggle_paused(number) for number in range(len(results))]
    ttft_ms = [r.ttft_s * 1e3 if r.ok else math.nan for r in results]
    return {"requests": len(results), "lead_in_requests": TOGGLE_IDLE_LEAD_IN, "max_tokens": IDLE_TTFT_TOKENS,
            "pause_s": pause_s, "wall_s": round(time.perf_counter() - started, 2),
            "failed": sum(not r.ok for r in results),
            "errors": sorted({r.error for r in results if r.error})[:5],
            "paused": paused_flags, "per_request_ttft_ms": ttft_ms,
            "running_without_scores": sum(1 for p, r in zip(paused_flags, results) if not p and r.ok and not r.has_scores),
            "paused_with_scores": sum(1 for p, r in zip(paused_flags, results) if p and r.has_scores),
            "running_over_paused": paired_overhead(toggled_pairs(ttft_ms, paused_flags)),
            "scores": score_coverage([r for p, r in zip(paused_flags, results) if not p], len(expect or ()))}
