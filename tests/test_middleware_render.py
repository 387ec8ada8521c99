"""The scores JSON the hub and relay write: written directly, it equals the general path's;
what is written ahead is not served stale; the books stay out of the garbage collector's way."""

import gc
import json

import msgspec
import numpy as np
import pytest

from engine_worker.scores.bookkeeping import ProbeTable, StepView, step_message
from engine_worker.scores.wire import external_request_id
from engine_worker.tap.layer import ProbeSlot
from tests.middleware_fixtures import idle_hub, ingest, step_feed


def test_chunk_scores_written_as_json_directly_equal_the_general_path():
    """generated_scores_json's direct writing (every token in, one probe set) against
    chunk_scores encoded: one token, several, a gap (None), a second probe set, none."""
    from engine_worker.scores.columns import ProbeColumns, ProbeInfo, RequestScores
    from engine_worker.scores.render import chunk_scores, generated_scores_json

    probes = ProbeColumns([ProbeInfo('a "quoted" ü', "last_prompt_token", 1.0, 0.0, 3),
                         ProbeInfo("b", "prompt_mean", 1.0, 0.0, 3)])
    swapped = ProbeColumns([ProbeInfo("c", "last_prompt_token", 2.0, 0.0, 5)])
    state = RequestScores()
    for index in (0, 1, 2, 4):
        state.add_token(index, (0.1 * index + 1e-7, -2.5e-12 * index), probes)
    state.add_token(5, (0.75,), swapped)
    state.add_token(6, (float("nan"),), swapped)
    state.add_token(7, (), ProbeColumns([]))  # every probe unloaded
    state.add_token(8, (), state.probes_of(7))
    assert state.probes_of(4) is probes and state.probes_of(6) is swapped and state.probes_of(3) is None
    for start, stop in ((0, 1), (1, 2), (0, 3), (2, 5), (3, 4), (4, 6), (5, 6), (5, 7), (6, 7), (9, 10), (3, 3),
                        (7, 8), (7, 9)):
        written = generated_scores_json(state, start, stop)
        general = msgspec.json.encode(chunk_scores(state, start, stop, False)["scores"])  # NaN as null
        assert json.loads(written) == json.loads(general), (start, stop)
    assert json.loads(generated_scores_json(state, 0, 3))['a "quoted" ü']["generated"] == {
        "offset": 0, "scores": [pytest.approx(1e-7), pytest.approx(0.1 + 1e-7), pytest.approx(0.2 + 1e-7)]}
    assert json.loads(generated_scores_json(state, 3, 5))["b"]["generated"]["scores"] == [None, pytest.approx(-1e-11)]


def test_a_first_chunks_scores_written_directly_equal_the_general_path():
    """first_chunk_scores_json (prompt part and tokens, one probe set) against chunk_scores
    with the prompt encoded; None, for the decoded path, where the prompt's part is missing,
    a token is missing or a swap came between the prompt and the tokens."""
    from engine_worker.scores.columns import ProbeColumns, ProbeInfo, RequestScores
    from engine_worker.scores.render import chunk_scores, first_chunk_scores_json, prompt_fields, prompt_json_parts

    probes = ProbeColumns([ProbeInfo('a "q"', "last_prompt_token", 1.0, 0.0, 3), ProbeInfo("b", "prompt_mean", 2.0, -1.0, 3)])
    summary = {"req": "r", "prompt_tokens": 5, "tokens_scored": 5, "last_raw": [0.5, -1.0], "mean_raw": [0.25, 0.0],
               "max_raw": [1.0, 2.0]}
    state = RequestScores()
    assert first_chunk_scores_json(state, 0, 1) is None  # nothing in yet
    state.add_token(0, (0.6, 0.2), probes)
    state.add_token(1, (0.7, 0.3), probes)
    assert first_chunk_scores_json(state, 0, 1) is None  # the prompt's part is not in
    state.prompt, state.prompt_fields, state.prompt_probes = summary, prompt_fields(summary, probes), probes
    for start, stop in ((0, 1), (0, 2)):
        written = first_chunk_scores_json(state, start, stop)
        assert written == msgspec.json.encode(chunk_scores(state, start, stop, True)["scores"]), (start, stop)
    # as the hub leaves it: the prompt's part laid out already, the tokens filled in, the same bytes
    state.prompt_json_parts = prompt_json_parts(state.prompt_fields)
    for start, stop in ((0, 1), (0, 2)):
        written = first_chunk_scores_json(state, start, stop)
        assert written == msgspec.json.encode(chunk_scores(state, start, stop, True)["scores"]), (start, stop)
    assert prompt_json_parts({}) == [b"{}"]
    assert first_chunk_scores_json(state, 0, 3) is None  # token 2 not in
    swapped = ProbeColumns([ProbeInfo('a "q"', "last_prompt_token", 1.0, 0.0, 3), ProbeInfo("b", "prompt_mean", 2.0, -1.0, 3)])
    later = RequestScores(prompt=summary, prompt_fields=state.prompt_fields, prompt_probes=probes)
    later.add_token(0, (0.6, 0.2), swapped)  # the same names, another probe set (a swap): not written directly
    assert first_chunk_scores_json(later, 0, 1) is None


def test_a_streams_token_scores_leave_the_garbage_collectors_books():
    """A long stream's scores must not add to what every collection of the API server scans:
    each token's are a tuple of floats, which a collection stops tracking the first time."""
    hub = idle_hub()
    engine_id = "cmpl-gc-0-0123abcd"
    feed = step_feed([[0.0, 0.0]] + [[float(i)] for i in range(1, 40)])
    for step in range(41):  # the prompt's step, 39 token steps, the end
        feed(hub, engine_id, step)
    state = hub.get(external_request_id(engine_id))
    assert len(state.tokens) == 40
    gc.collect()
    assert not any(gc.is_tracked(scores) for scores in state.tokens.values())


def test_a_token_scored_again_by_the_first_probe_set_is_read_with_it():
    from engine_worker.scores.columns import ProbeColumns, ProbeInfo, RequestScores

    first = ProbeColumns([ProbeInfo("a", "last_prompt_token", 1.0, 0.0, 3)])
    swapped = ProbeColumns([ProbeInfo("b", "last_prompt_token", 1.0, 0.0, 3)])
    state = RequestScores()
    state.add_token(0, (0.1,), first)
    state.add_token(1, (0.2,), swapped)
    assert state.probes_of(1) is swapped
    state.add_token(1, (0.3,), first)
    assert state.probes_of(1) is first and state.tokens[1] == (0.3,)


def test_the_first_chunk_written_ahead_is_not_served_stale():
    """The hub writes a stream's first chunk's scores as the prompt's step comes in; a token 0
    that comes again (scored anew) must be what the first chunk carries."""
    from engine_worker.scores import render as responses

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    hub = idle_hub()
    engine_id = "cmpl-probex-ahead-0-0123abcd"
    layout = StepView([engine_id], np.array([2]), np.array([0]), np.array([2]))
    ingest(hub, step_message(table, layout, np.array([[0.0], [0.5]], np.float32), []))
    state = hub.get("cmpl-probex-ahead-0")
    written = state.first_chunk_json
    assert written is not None
    assert responses.first_chunk_scores_json(state, 0, 1) is written[2]
    state.first_chunk_json = None
    assert responses.first_chunk_scores_json(state, 0, 1) == written[2]  # the same bytes, written on the spot
    state.first_chunk_json = written
    parts = state.prompt_json_parts
    state.prompt_json_parts = list(parts)  # the prompt's part laid out again
    assert responses.first_chunk_scores_json(state, 0, 1) is not written[2]
    state.prompt_json_parts = parts  # (each case on its own: the part as written from again)
    state.add_token(0, (0.99,), state.token_probes)  # token 0 scored anew (a recomputed request)
    again = json.loads(responses.first_chunk_scores_json(state, 0, 1))
    assert again["p"]["generated"]["scores"] == [0.99]
