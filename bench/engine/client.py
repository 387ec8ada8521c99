"""The engine benchmark's own small client: single streamed requests, one at a time.

The load at each concurrency goes through `vllm bench serve` (bench/vllm_bench.py). This
client does what vLLM's cannot:

- read each token chunk's `probex` scores, to check that every generated token of a worker's
  requests arrived with a finite score from every probe (`ScoreCheck`), and the steering
  check's prompt scores (`steering_effect`);
- the idle requests of tap-toggle, one at a time with the tap paused for one request and
  running for its neighbour (`idle_requests`, `idle_toggle_paused`): the pause is switched
  between two single requests on one start, which a load client run per phase cannot do.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from bench.engine.setups import ADMIN_TOKEN, SteerBench

# Token ids of the random prompts: below every tokenizer used here (SmolLM2: 49152), above the
# special tokens at the start of the vocabulary.
PROMPT_ID_RANGE = (100, 30000)
IDLE_TTFT_TOKENS = 2
IDLE_SEED = 749_993  # the idle requests' prompts: no load phase uses them
PROFILE_SEED = 999_979  # the profiled requests' prompts
CHECK_SEED = 999_983  # the score check's prompts
STEER_CHECK_SEED = 1_000_002
PROFILE_TOKENS = 64  # per profiled request: decode steps dominate its trace
STEER_CHECK_PROMPTS = 2


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    ttft_s: float = math.nan
    output_tokens: int = 0
    has_scores: bool = False
    scored_tokens: int = 0  # generated tokens with a finite score from every expected probe
    prompt_scored_probes: int = 0
    score_problems: list[str] = field(default_factory=list)
    prompt_last_raw: dict[str, float] = field(default_factory=dict)  # raw score at the last prompt token


class ScoreCheck:
    """Per request: did every generated token arrive with a finite score from every probe, in order?"""

    def __init__(self, probe_names: Sequence[str]) -> None:
        self.scored = dict.fromkeys(probe_names, 0)
        self.prompt_seen: set[str] = set()
        self.prompt_last_raw: dict[str, float] = {}
        self.problems: list[str] = []

    def chunk(self, probex: Any, start: int, count: int) -> None:
        scores = probex.get("scores") if isinstance(probex, dict) else None
        if not isinstance(scores, dict):
            self.problems.append("probex field without scores")
            return
        for name, entry in scores.items():
            if name not in self.scored:
                self.problems.append(f"unexpected probe {name}")
                continue
            if "prompt" in entry:
                self.prompt_seen.add(name)
                last_raw = (entry["prompt"] or {}).get("last_raw")
                if isinstance(last_raw, (int, float)):
                    self.prompt_last_raw[name] = float(last_raw)
            generated = entry.get("generated")
            if not generated:
                continue
            values = generated.get("scores") or []
            if generated.get("offset") != start or len(values) != count:
                self.problems.append("generated scores not aligned with the chunk's tokens")
                continue
            self.scored[name] += sum(1 for v in values if v is not None and math.isfinite(v))

    def finish(self, result: RequestResult) -> None:
        result.scored_tokens = min(self.scored.values()) if self.scored else 0
        result.prompt_scored_probes = len(self.prompt_seen)
        result.score_problems = self.problems[:3]
        result.prompt_last_raw = dict(self.prompt_last_raw)


def read_events(events: Sequence[tuple[float, bytes]], probe_names: Sequence[str] | None) -> RequestResult:
    """A request's result from its SSE events, each (seconds after the send, `data: ...` line)."""
    result, check = RequestResult(), ScoreCheck(probe_names) if probe_names else None
    done = False
    for now, event in events:
        if event == b"data: [DONE]":
            done = True
            continue
        try:
            chunk = json.loads(event[6:])
        except ValueError as exc:
            result.error = f"malformed chunk: {exc}"[:300]
            return result
        if "error" in chunk:
            result.error = f"stream error: {str(chunk['error'])[:200]}"
            return result
        choices = chunk.get("choices") or ()
        count = len((choices[0].get("token_ids") or ()) if choices else ())
        probex = chunk.get("probex")
        if probex is not None:
            result.has_scores = True
            if check is not None:
                check.chunk(probex, result.output_tokens, count)
        if count:
            if not result.output_tokens:
                result.ttft_s = now
            result.output_tokens += count
    if not done:
        result.error = "stream ended without [DONE]"
    elif not result.output_tokens:
        result.error = "no tokens"
    else:
        result.ok = True
    if check is not None:
        check.finish(result)
    return result


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(*PROMPT_ID_RANGE, size=(count, length)).tolist()


def completion_body(model: str, prompt: list[int], max_tokens: int,
                    xargs: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}  # token ids count each chunk's tokens exactly
    if xargs:
        body["vllm_xargs"] = dict(xargs)  # steered set-ups: probex_steer*
    return body


def one_request(client: Any, url: str, body: dict[str, Any], probe_names: Sequence[str] | None) -> RequestResult:
    """One streamed completion through an httpx.Client; a failure is a failed request, not a failed run."""
    events: list[tuple[float, bytes]] = []
    started = time.perf_counter()
    try:
        with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return RequestResult(error=f"HTTP {response.status_code}: {response.read()[:200]!r}")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append((time.perf_counter() - started, line.encode()))
    except Exception as exc:
        return RequestResult(error=f"{type(exc).__name__}: {exc}"[:300])
    return read_events(events, probe_names)


def idle_toggle_paused(number: int) -> bool:
    """Whether the tap is paused for the `number`-th of tap-toggle's idle requests: pairs of
    requests, running then paused, then paused then running (ABBA), so neither state comes
    first more often nor sits later in the run on average."""
    pair_starts_paused = (number // 2) % 2 == 1
    return pair_starts_paused if number % 2 == 0 else not pair_starts_paused


def idle_requests(url: str, model: str, prompts: Sequence[list[int]], pause_s: float,
                  probe_names: Sequence[str] | None, xargs: dict[str, Any] | None = None,
                  max_tokens: int = IDLE_TTFT_TOKENS, paused_for: Callable[[int], bool] | None = None,
                  lead_in: int = 0) -> list[RequestResult]:
    """One request at a time, each sent `pause_s` after the last ended, at an idle engine. The
    first `lead_in` are sent the same way (tap running) and left out: the series' first request
    also opens the connection. `paused_for` (a tap-toggle worker): whether the tap is paused for
    the n-th request, set before it is sent; a paused request is expected without scores. The tap
    runs again afterwards."""
    import httpx

    results = []
    try:
        # steering xargs are engine controls: the worker takes them with its admin token only
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"} if xargs else None
        with httpx.Client(timeout=httpx.Timeout(600, connect=30), headers=headers) as client:
            for number, prompt in enumerate(prompts, -lead_in):
                paused = paused_for is not None and number >= 0 and paused_for(number)
                if paused_for is not None:
                    set_tap_paused(url, paused)
                time.sleep(pause_s)
                result = one_request(client, url, completion_body(model, prompt, max_tokens, xargs),
                                     None if paused else probe_names)
                if number >= 0:
                    results.append(result)
    finally:
        if paused_for is not None:
            set_tap_paused(url, False)
    return results


def score_coverage(results: Sequence[RequestResult], expected_probes: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    generated = sum(r.output_tokens for r in ok)
    scored = sum(r.scored_tokens for r in ok)
    return {"expected_probes": expected_probes, "generated_tokens": generated, "scored_tokens": scored,
            "coverage": scored / generated if generated else math.nan,
            "requests_with_all_prompt_scores": sum(1 for r in ok if r.prompt_scored_probes == expected_probes),
            "requests": len(results), "failed": len(results) - len(ok),
            "problems": sorted({p for r in ok for p in r.score_problems})[:5]}


def set_tap_paused(url: str, paused: bool) -> None:
    """Pause or resume a tap-toggle worker's tap (PUT /probex/tap) and check it took."""
    import httpx

    answer = httpx.put(url + "/probex/tap", json={"paused": paused}, timeout=60,
                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    if answer.status_code != 200 or answer.json().get("paused") is not paused:
        raise RuntimeError(f"PUT /probex/tap {{'paused': {paused}}}: {answer.status_code} {answer.text[:300]}")


def steering_effect(url: str, model: str, input_len: int, seed: int, probe_layers: dict[str, int],
                    steer: SteerBench, kind: str) -> dict[str, Any]:
    """Did steered requests really get the write? The same prompts unsteered, then steered (2
    tokens each, one at a time); the raw last-prompt-token score of every probe after the
    steering layer must change, those at or before it read the stream before the write."""
    prompts = random_prompts(STEER_CHECK_PROMPTS, input_len, seed * 1_000_003 + STEER_CHECK_SEED)
    names = list(probe_layers)
    unsteered = idle_requests(url, model, prompts, 0.0, names)
    steered = idle_requests(url, model, prompts, 0.0, names, steer.xargs(kind))
    after = [n for n, layer in probe_layers.items() if layer > steer.layer]
    before = [n for n, layer in probe_layers.items() if layer <= steer.layer]

    def max_diff(group: Sequence[str]) -> float:
        diffs = [abs(u.prompt_last_raw[n] - s.prompt_last_raw[n])
                 if n in u.prompt_last_raw and n in s.prompt_last_raw else math.nan
                 for u, s in zip(unsteered, steered) for n in group]
        return float(np.max(diffs)) if diffs else math.nan

    return {"prompts": len(prompts), "layer": steer.layer, "xargs": steer.xargs(kind), "probes_after_write": after,
            "max_abs_raw_diff_after_write": max_diff(after),
            "max_abs_raw_diff_at_or_before_write": max_diff(before),
            "errors": sorted({r.error for r in (*unsteered, *steered) if r.error})[:3]}


def profile_phase(url: str, model: str, requests: int, input_len: int, seed: int,
                  probe_names: Sequence[str] | None, xargs: dict[str, Any] | None,
                  trace_dir: Path | None) -> dict[str, Any]:
    """`requests` requests of PROFILE_TOKENS tokens, one at a time, between vLLM's
    /start_profile and /stop_profile; the newest trace under `trace_dir`, summarised
    (bench/profile_trace.py)."""
    import httpx

    from bench.profile_trace import find_traces, summarize_trace

    prompts = random_prompts(requests, input_len, seed * 1_000_003 + PROFILE_SEED)
    before = set(find_traces(trace_dir)) if trace_dir is not None and trace_dir.exists() else set()
    httpx.post(url + "/start_profile", timeout=120).raise_for_status()
    try:
        results = idle_requests(url, model, prompts, 0.1, probe_names, xargs, max_tokens=PROFILE_TOKENS)
    finally:
        httpx.post(url + "/stop_profile", timeout=900).raise_for_status()
    entry: dict[str, Any] = {"requests": requests, "max_tokens": PROFILE_TOKENS,
                             "failed": sum(not r.ok for r in results)}
    traces = [p for p in find_traces(trace_dir) if p not in before] if trace_dir is not None else []
    if not traces:
        entry["error"] = f"no trace written under {trace_dir}"
        return entry
    newest = max(traces, key=lambda p: p.stat().st_mtime)
    entry.update(summarize_trace(newest), trace_path=str(newest.relative_to(trace_dir.parent)))
    return entry
