"""Turning raw score events into the `probex` field of OpenAI responses and stream chunks.

Shape (per probe name):
    {"score": s, "read": r,
     "prompt": {"last": s, "last_raw": r, "mean": s, "max": s, "tokens_scored": n, "prompt_tokens": P},
     "generated": {"scores": [s, ...], "max": s}}
In a stream, a chunk carries `generated.scores` for the tokens it contains (with
`generated.offset`, the index of the first), and the prompt part arrives with the first
chunk that can carry it.
"""

from __future__ import annotations

from probes.scoring import calibrate
from engine_worker.delivery import RequestScores

_HEADLINE = {"last_prompt_token": "last", "prompt_mean": "mean", "prompt_max": "max"}


def prompt_scores(state: RequestScores) -> dict[str, dict]:
    if state.prompt is None:
        return {}
    out: dict[str, dict] = {}
    summary = state.prompt
    for column, probe in enumerate(state.prompt_probes or ()):
        cal = lambda raw: calibrate(raw, probe.slope, probe.intercept)  # noqa: E731
        prompt = {
            "last": cal(summary["last_raw"][column]),
            "last_raw": summary["last_raw"][column],
            "mean": cal(summary["mean_raw"][column]),
            "max": cal(summary["max_raw"][column]),
            "tokens_scored": summary["tokens_scored"],
            "prompt_tokens": summary["prompt_tokens"],
        }
        out[probe.name] = {"score": prompt[_HEADLINE.get(probe.read, "last")], "read": probe.read, "prompt": prompt}
    return out


def generated_scores(state: RequestScores, start: int, stop: int) -> dict[str, list[float | None]]:
    """Calibrated scores of generated tokens [start, stop) per probe; None where a token has none."""
    entries = [state.tokens.get(index) for index in range(start, stop)]
    if entries and all(e is not None and e[1] is entries[0][1] for e in entries):
        # The usual stream chunk: every token in, scored by one probe set — transpose.
        return {probe.name: list(column) for probe, column in zip(entries[0][1], zip(*(e[0] for e in entries)))}
    names: dict[str, list[float | None]] = {}
    for index in range(start, stop):
        entry = state.tokens.get(index)
        if entry is None:
            for values in names.values():
                values.append(None)
            continue
        scores, probes = entry
        for column, probe in enumerate(probes):
            values = names.setdefault(probe.name, [None] * (index - start))
            values.append(scores[column])
        for name, values in names.items():
            if len(values) < index - start + 1:
                values.append(None)
    return names


def full_scores(state: RequestScores, num_generated: int) -> dict:
    """The `probex` field of a non-streaming response."""
    scores = prompt_scores(state)
    for name, values in generated_scores(state, 0, num_generated).items():
        present = [v for v in values if v is not None]
        entry = scores.setdefault(name, {})
        entry["generated"] = {"scores": values, "max": max(present) if present else None}
    return {"scores": scores, **_missing(state, num_generated)}


def chunk_scores(state: RequestScores, start: int, stop: int, include_prompt: bool) -> dict:
    """The `probex` field of one stream chunk carrying generated tokens [start, stop)."""
    if stop == start + 1 and not include_prompt and (entry := state.tokens.get(start)) is not None:
        # A stream's chunks while the API server keeps up: one token, its scores in. Built
        # in one pass, half the time of the general path below, on the API server's
        # busiest thread (once per chunk of every stream).
        values, probes = entry
        return {"scores": {probe.name: {"generated": {"offset": start, "scores": [value]}}
                           for probe, value in zip(probes, values)}}
    scores = prompt_scores(state) if include_prompt else {}
    for name, values in generated_scores(state, start, stop).items():
        scores.setdefault(name, {})["generated"] = {"offset": start, "scores": values}
    return {"scores": scores}


def _missing(state: RequestScores, num_generated: int) -> dict:
    missing = [j for j in range(num_generated) if j not in state.tokens]
    out = {}
    if state.prompt is None:
        out["prompt_missing"] = True
    if missing:
        out["generated_missing"] = len(missing)
    return out
