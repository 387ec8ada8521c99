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

import msgspec

from engine_worker.scores.columns import ProbeColumns, RequestScores
from probes.scoring import calibrate

_json_encoder = msgspec.json.Encoder()
_HEADLINE = {"last_prompt_token": "last", "prompt_mean": "mean", "prompt_max": "max"}


def prompt_fields(summary: dict, probes: ProbeColumns) -> dict[str, dict]:
    """Each probe's prompt part, calibrated, from the summary the hub's books wrote
    (`bookkeeping._prompt_summary`) when the prompt's last step came in."""
    fields: dict[str, dict] = {}
    counts = {"tokens_scored": summary["tokens_scored"], "prompt_tokens": summary["prompt_tokens"]}
    for probe, last, mean, peak in zip(probes, summary["last_raw"], summary["mean_raw"], summary["max_raw"]):
        slope, intercept = probe.slope, probe.intercept
        prompt = {"last": calibrate(last, slope, intercept), "last_raw": last, "mean": calibrate(mean, slope, intercept),
                  "max": calibrate(peak, slope, intercept), **counts}
        fields[probe.name] = {"score": prompt[_HEADLINE.get(probe.read, "last")], "read": probe.read, "prompt": prompt}
    return fields


def prompt_scores(state: RequestScores) -> dict[str, dict]:
    """Each probe's prompt part, a dict of its own for the caller to add the generated part to."""
    if state.prompt_fields is None:
        return {}
    return {name: dict(fields) for name, fields in state.prompt_fields.items()}


def generated_scores(state: RequestScores, start: int, stop: int) -> dict[str, list[float | None]]:
    """Calibrated scores of generated tokens [start, stop) per probe; None where a token has none."""
    uniform = _scored_by_one_set(state, start, stop)
    if uniform is not None:  # the usual stream chunk: transpose
        probes, rows = uniform
        return {probe.name: list(column) for probe, column in zip(probes, zip(*rows))}
    names: dict[str, list[float | None]] = {}
    for index in range(start, stop):
        scores = state.tokens.get(index)
        if scores is None:
            for values in names.values():
                values.append(None)
            continue
        probes = state.probes_of(index)
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
    scores = prompt_scores(state) if include_prompt else {}
    for name, values in generated_scores(state, start, stop).items():
        scores.setdefault(name, {})["generated"] = {"offset": start, "scores": values}
    return {"scores": scores}


def generated_scores_json(state: RequestScores, start: int, stop: int) -> bytes:
    """`chunk_scores(state, start, stop, False)["scores"]` as compact JSON.

    A stream's later chunks, once per chunk of every stream on the API server's busiest
    thread: when every token [start, stop) is in and was scored by one probe set (the
    usual case), the JSON is its probe set's `generated_json_parts` filled in with one
    encoding of the floats, no dicts built; anything else goes through `chunk_scores`."""
    uniform = _scored_by_one_set(state, start, stop)
    if uniform is None:
        return _json_encoder.encode(chunk_scores(state, start, stop, False)["scores"])
    probes, rows = uniform
    return _filled_in(probes.generated_json_parts, start, rows)


def token_scores_json(index: int, scores: tuple[float, ...], probes: ProbeColumns) -> bytes:
    """`generated_scores_json` of a one-token chunk carrying token `index`, from the token's
    calibrated scores and the probe set that scored it: what the hub writes as each token of a
    stream comes in (`RequestScores.token_json`), ahead of the chunk that will carry it."""
    return _filled_in(probes.generated_json_parts, index, [scores])


def _filled_in(template: list[bytes | None], start: int, rows: list[tuple[float, ...]]) -> bytes:
    """`template` (`ProbeColumns.generated_json_parts`, `prompt_json_parts`) with each probe's
    offset and its scores over `rows` (one tuple per token) filled in."""
    parts = template.copy()
    parts[3::4] = _column_json(rows)
    parts[1::4] = [b"%d" % start] * (len(template) // 4)
    return b"".join(parts)


def prompt_json_parts(fields: dict[str, dict]) -> list[bytes | None]:
    """The JSON of a stream's first chunk's scores with the tokens' part left open, laid out as
    `ProbeColumns.generated_json_parts` is (each probe's offset at [1::4], its scores at
    [3::4]): `{"<name>":{<prompt part>,"generated":{"offset":` OFFSET `,"scores":[` SCORES
    `]}},...}`. Built by the hub as the prompt's scores come in, so the first chunk, on the way
    to the client's first token, only fills in its tokens (`first_chunk_scores_json`)."""
    parts: list[bytes | None] = []
    for number, (name, part) in enumerate(fields.items()):
        opening = b"{" if number == 0 else b"]}},"
        # a dict's JSON without its closing brace, then the member chunk_scores adds last
        parts += [opening + _json_encoder.encode(name) + b":" + _json_encoder.encode(part)[:-1]
                  + b',"generated":{"offset":', None, b',"scores":[', None]
    return parts + [b"]}}}"] if parts else [b"{}"]


def first_chunk_scores_json(state: RequestScores, start: int, stop: int) -> bytes | None:
    """`chunk_scores(state, start, stop, True)["scores"]` as compact JSON, for a stream's
    first chunk with tokens [start, stop): each probe's prompt part and its tokens' scores.
    None unless the prompt's part is in and every token is in, scored by the probe set that
    scored the prompt (the usual case; anything else goes through `chunk_scores`). Where the
    hub laid out the prompt's part already (`prompt_json_parts`), only the tokens' scores
    are written here."""
    fields = state.prompt_fields
    uniform = _scored_by_one_set(state, start, stop) if fields else None
    if uniform is None:
        return None
    probes, rows = uniform
    if probes is not state.prompt_probes:
        return None  # a probe swap between the prompt and these tokens
    written = state.first_chunk_json
    if (written is not None and start == 0 and stop == 1 and written[0] is rows[0]
            and written[1] is state.prompt_json_parts):
        return written[2]  # written as the prompt came in (`write_first_chunk_ahead`), and still its
    parts = state.prompt_json_parts
    if parts is None or len(parts) != 4 * len(fields) + 1:
        return _json_encoder.encode({name: {**part, "generated": {"offset": start, "scores": list(column)}}
                                     for (name, part), column in zip(fields.items(), zip(*rows))})
    return _filled_in(parts, start, rows)


def write_first_chunk_ahead(state: RequestScores) -> None:
    """Write a stream's usual first chunk's scores (the prompt's part and token 0's, offset 0)
    as the step that completed its prompt comes in: a completion's first chunk carries token
    0, which that step sampled, and reaches the API server some milliseconds later (the
    prompt's score copies are made mid-forward), so `first_chunk_scores_json` finds it
    written instead of writing it on the way to the client's first token. Kept with the
    objects it was written from: a token 0 or a prompt part that came again is written anew.
    Written for every prompt laid out (a few µs at intake): the hub does not know which
    requests are completion streams, whose first chunk carries token 0 with the prompt's
    scores (a chat stream's prompt scores ride on its role chunk, which carries no token)."""
    state.first_chunk_json = None  # (what was written before is not what to write from)
    parts = state.prompt_json_parts
    written = first_chunk_scores_json(state, 0, 1) if parts is not None else None
    if written is not None:
        state.first_chunk_json = (state.tokens[0], parts, written)


def _column_json(rows: list[tuple[float, ...]]) -> list[bytes]:
    """Each probe's scores over `rows` (one tuple per token), as the JSON between a list's brackets."""
    if len(rows) == 1:  # JSON numbers hold no commas: one encoded row splits into its values
        return _json_encoder.encode(rows[0])[1:-1].split(b",") if rows[0] else []
    return [_json_encoder.encode(column)[1:-1] for column in zip(*rows)]


def _scored_by_one_set(state: RequestScores,
                       start: int, stop: int) -> tuple[ProbeColumns, list[tuple[float, ...]]] | None:
    """(probe set, each token's scores) when every token [start, stop) is in and was scored by
    one probe set, the usual chunk; None otherwise (a gap, a swap between tokens, no token)."""
    tokens = state.tokens
    if stop == start + 1:  # a one-token chunk, most of them: no list to build
        scores = tokens.get(start)
        if scores is None:
            return None
        return (state.probes_of(start) if state.other_probes else state.token_probes), [scores]
    rows = [tokens.get(index) for index in range(start, stop)]
    if not rows or None in rows:
        return None
    probes = state.probes_of(start)
    if state.other_probes and any(state.probes_of(index) is not probes for index in range(start + 1, stop)):
        return None
    return probes, rows


def _missing(state: RequestScores, num_generated: int) -> dict:
    missing = [j for j in range(num_generated) if j not in state.tokens]
    out = {}
    if state.prompt is None:
        out["prompt_missing"] = True
    if missing:
        out["generated_missing"] = len(missing)
    return out
