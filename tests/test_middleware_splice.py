"""The splice: scores written into vLLM's compact chunks without decoding them, read at the
right points, equal to what the decoded path writes."""

import asyncio
import json

import numpy as np
import pytest

from engine_worker.api_server.splice import _without_prompt_token_ids
from engine_worker.scores.bookkeeping import ProbeTable, StepView, step_message
from engine_worker.tap.layer import ProbeSlot
from probes.scoring import calibrate
from tests.middleware_fixtures import idle_hub, ingest, relay_counts, run_stream


def _completion_event(token_ids: list[int], prompt_ids: list[int] | None = None) -> bytes:
    """One `/v1/completions` stream event in vLLM's compact form (with `return_token_ids`)."""
    choice = {"index": 0, "text": " a", "logprobs": None, "finish_reason": None, "stop_reason": None,
              "prompt_token_ids": prompt_ids, "token_ids": token_ids}
    return b"data: " + json.dumps({"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m",
                                   "choices": [choice]}, separators=(",", ":")).encode()


def _spaced(event: bytes) -> bytes:
    """The same event not in vLLM's compact form: the relay decodes it rather than splicing."""
    return b"data: " + json.dumps(json.loads(event[6:])).encode()


def test_a_spliced_streams_token_scores_are_written_as_they_come_in_and_taken_by_their_chunks():
    """After a stream's first chunk went out spliced, the hub writes each later token's
    one-token scores JSON as the token comes in; the chunk carrying it takes it (a chunk of
    several tokens takes all of theirs), and the chunks read as the decoded path writes them
(a second relay, given the same chunks in a form it cannot splice)."""
    from engine_worker.api_server.relay import StreamRelay
    from engine_worker.api_server.requests import MonitoredCall
    from engine_worker.scores.render import generated_scores_json

    async def discard(message):
        pass

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),
                                         ProbeSlot('q "2"', 3, 1, "prompt_mean", 2.0, -1.0)))
    call = MonitoredCall(key_prefix="cmpl-probex-0123456789abcdef", stream=True, wants_token_ids=False)
    engine_id = f"{call.key(0)}-0123abcd"

    def step(computed: int, scheduled: int, rows: list[list[float]]) -> None:
        layout = StepView([engine_id], np.array([scheduled]), np.array([computed]), np.array([2]))
        ingest(hub, step_message(table, layout, np.array(rows, np.float32), []))

    async def go():
        spliced, decoded = StreamRelay(hub, call, discard, 1.0), StreamRelay(hub, call, discard, 1.0)
        step(0, 2, [[0.1, 0.2], [0.3, 0.4]])  # the prompt, and token 0 from its last row
        step(2, 1, [[0.5, 0.6]])  # token 1, before the first chunk went out: not written
        state = hub.get(call.key(0))
        assert state.token_json is None
        first = _completion_event([42], [1, 2])
        out = [(await spliced._decorate_event(first), await decoded._decorate_event(_spaced(first)))]
        assert state.token_json == {}
        for computed, rows in ((3, [[0.7, 0.8]]), (4, [[0.9, 1.0]]), (5, [[1.1, 1.2]])):  # tokens 2, 3, 4
            step(computed, 1, rows)
        assert sorted(state.token_json) == [2, 3, 4]
        assert state.token_json[3] == generated_scores_json(state, 3, 4)
        for ids in ([43], [44], [45, 46]):  # token 1 (not written), 2, then 3 and 4 in one chunk
            event = _completion_event(ids)
            out.append((await spliced._decorate_event(event), await decoded._decorate_event(_spaced(event))))
        assert state.token_json == {}
        # a chunk in another form takes the decoded path, and takes its token's JSON out too
        step(6, 1, [[1.3, 1.4]])  # token 5
        assert b'"probex"' in await spliced._decorate_event(_spaced(_completion_event([47])))
        assert state.token_json == {}
        return out

    hub = idle_hub()
    with relay_counts() as counts:
        out = asyncio.run(go())
    assert counts["decoded"] == len(out) + 1  # the second relay's chunks and the spaced one: none spliced was decoded
    for spliced_event, decoded_event in out:
        assert json.loads(spliced_event[6:]) == json.loads(decoded_event[6:])
    assert [json.loads(e[6:])["probex"]["scores"]["p"]["generated"]["offset"] for e, _ in out] == [0, 1, 2, 3]
    assert json.loads(out[-1][0][6:])["probex"]["scores"]['q "2"']["generated"]["scores"] == [
        pytest.approx(calibrate(1.0, 2.0, -1.0)), pytest.approx(calibrate(1.2, 2.0, -1.0))]


def test_tokens_whose_chunk_went_out_are_not_written_and_a_chat_streams_role_chunk_starts_the_writing():
    """A token whose scores come in after its chunk went out (no wait, a pause, a loss) is not
    written: nothing would take it. A chat stream's first chunk, the role, carries the
    prompt's scores on the decoded path; the later tokens are written from there on."""
    from engine_worker.api_server.relay import StreamRelay
    from engine_worker.api_server.requests import MonitoredCall

    async def discard(message):
        pass

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    call = MonitoredCall(key_prefix="chatcmpl-probex-0123456789abcdef", stream=True, wants_token_ids=False)
    engine_id = f"{call.key(0)}-0123abcd"

    def step(computed: int, scheduled: int, rows: list[list[float]]) -> None:
        layout = StepView([engine_id], np.array([scheduled]), np.array([computed]), np.array([2]))
        ingest(hub, step_message(table, layout, np.array(rows, np.float32), []))

    def chat_event(delta: dict, token_ids: list[int], prompt_ids: list[int] | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, "token_ids": token_ids}
        payload = {"id": "chatcmpl-x", "choices": [choice], **({"prompt_token_ids": prompt_ids} if prompt_ids else {})}
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode()

    async def go():
        relay = StreamRelay(hub, call, discard, 0.0)  # no wait: a chunk whose scores are not in goes without
        step(0, 2, [[0.1], [0.3]])  # the prompt, token 0
        state = hub.get(call.key(0))
        role = json.loads((await relay._decorate_event(chat_event({"role": "assistant"}, [], [1, 2])))[6:])
        assert role["probex"]["scores"]["p"]["prompt"]["prompt_tokens"] == 2 and state.token_json == {}
        step(2, 1, [[0.5]])  # token 1 comes before token 0's chunk went out
        assert sorted(state.token_json) == [1]
        for ids in ([7], [8]):  # tokens 0 and 1: token 0's chunk takes the generated path
            await relay._decorate_event(chat_event({"content": "a"}, ids))
        assert state.token_json == {} and state.token_json_from == 2
        late = json.loads((await relay._decorate_event(chat_event({"content": "b"}, [9])))[6:])  # token 2, no scores
        assert "p" not in late["probex"]["scores"]  # went out without its scores
        step(3, 1, [[0.7]])  # token 2's scores, after its chunk: nothing will take them
        step(4, 1, [[0.9]])  # token 3's, ahead of its chunk: written
        assert sorted(state.token_json) == [3]
        taken = json.loads((await relay._decorate_event(chat_event({"content": "c"}, [10])))[6:])
        assert taken["probex"]["scores"]["p"]["generated"] == {"offset": 3, "scores": [pytest.approx(calibrate(0.9, 1.0, 0.0))]}
        assert state.token_json == {}

    hub = idle_hub()
    asyncio.run(go())


@pytest.mark.parametrize("payload, expected", [
    (b'{"id":"x","choices":[{"index":0,"delta":{"content":"a"},"logprobs":null,"finish_reason":null,"token_ids":[42]}]}',
     (0, 1)),
    (b'{"id":"x","choices":[{"index":3,"text":"ab","token_ids":[1,2,3]}],"usage":null}', (3, 3)),
    (b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop","token_ids":[]}]}', None),  # no token
    (b'{"choices":[{"index":0,"text":"a","prompt_token_ids":null,"token_ids":[4,5]}]}', (0, 2)),  # a completion's
    (b'{"choices":[{"index":12,"token_ids":[1]}]}', (12, 1)),  # nothing between the index and the ids
    (b'{"choices":[{"index":0,"text":"a","token_ids":[1]}],"prompt_token_ids":[5,6]}', None),  # a chat's first
    (b'{"choices":[{"index":0,"text":"a","prompt_token_ids":[5,6],"token_ids":[1]}]}', None),  # a completion's
    (b'{"choices":[{"index":0,"text":"a","token_ids":[1]}],"prompt_token_ids":null}', None),
    (b'{"choices":[{"index":0,"text":"a","token_ids":[1]},{"index":1,"text":"b","token_ids":[2]}]}', None),
    (b'{"choices":[{"index":0,"text":"a"},{"index":1,"text":"b","token_ids":[2]}]}', None),  # a later choice's
    (b'{"choices":[{"index":0,"delta":{"content":"\\",\\"token_ids\\":[9]"}}]}', None),  # only text
    (b'{"choices": [{"index": 0, "text": "a", "token_ids": [1]}]}', None),  # spaced
    (b'{"choices":[{"index":0,"text":"a","token_ids":[1,]}]}', None),
    (b'{"choices":[{"index":0,"text":"a","token_ids":[,1]}]}', None),
    (b'{"choices":[{"index":0,"text":"a","token_ids":null}]}', None),
    (b'{"choices":[{"index":0,"text":"a","token_ids":[1]}]} ', None),
    (b'{"choices":[{"index":-1,"text":"a","token_ids":[1]}]}', None),
])
def test_a_chunks_token_ids_are_read_from_compact_json_only(payload, expected):
    from engine_worker.api_server.splice import _splice_points

    event = b"data: " + payload
    found = _splice_points(event)
    if expected is None:
        assert found is None
        return
    index, tokens, cut_from, cut_to = found
    assert (index, tokens) == expected
    cut = json.loads(event[6:cut_from] + event[cut_to:])
    assert cut["choices"][0] == {k: v for k, v in json.loads(payload)["choices"][0].items()
                                 if k not in ("token_ids", "prompt_token_ids")}


# vLLM's chunks of every kind the splice must match the decoded path on: a chat stream (its
# role chunk carries the prompt's ids) with text holding quotes and backslashes, logprobs,
# several tokens, a finish that carries a token; a completion stream (its choices carry the
# prompt's ids, a list in the first chunk, null after).
CHAT_CASES = [
    {"delta": {"role": "assistant", "content": ""}, "token_ids": []},
    {"delta": {"content": 'say "token_ids":[1] \\ ü'}, "logprobs": None, "finish_reason": None, "token_ids": [7]},
    {"delta": {"content": "bc"}, "logprobs": {"content": [{"token": "b", "logprob": -0.25, "bytes": [98],
                                                           "top_logprobs": []}]}, "token_ids": [8, 9]},
    {"delta": {"content": "d"}, "logprobs": None, "finish_reason": None, "token_ids": [10]},
    {"delta": {"content": "e"}, "finish_reason": "length", "token_ids": [11]},
    {"delta": {}, "finish_reason": "stop", "token_ids": []},
]


COMPLETION_CASES = [
    {"text": "a", "logprobs": None, "finish_reason": None, "stop_reason": None, "prompt_token_ids": [1, 2],
     "token_ids": [7]},
    *({"text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None, "prompt_token_ids": None,
       "token_ids": ids} for text, finish, ids in (("bc", None, [8, 9]), ('"\\', None, [10]), ("e", "length", [11]))),
]


@pytest.mark.parametrize("cases", [CHAT_CASES, COMPLETION_CASES], ids=["chat", "completion"])
@pytest.mark.parametrize("client_asked", [False, True])
def test_spliced_chunks_equal_decoded_ones(monkeypatch, cases, client_asked):
    """The stream relay's splice (scores written into the chunk's bytes) against its decoded
    path, chunk by chunk, and the splice really taken for every chunk with tokens, the one
    that carries the prompt's scores (and, in a completion, the prompt's token ids) too."""
    from engine_worker.api_server import relay

    request = {"return_token_ids": True} if client_asked else {}
    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),
                                         ProbeSlot('q "2"', 3, 1, "prompt_mean", 2.0, -1.0)))
    generated = 0

    def feed(hub, engine_id, i):  # chunk i's tokens, one step each; token j scores (j, -j) raw
        nonlocal generated
        for _ in cases[i]["token_ids"]:
            scheduled, computed, rows = (2, 0, [[0.5, 0.5], [0.0, 0.0]]) if generated == 0 else (
                1, 1 + generated, [[generated, -generated]])
            layout = StepView([engine_id], np.array([scheduled]), np.array([computed]), np.array([2]))
            ingest(hub, step_message(table, layout, np.array(rows, np.float32), []))
            generated += 1

    spliced, last, _, waits = run_stream(cases, feed, **request)
    monkeypatch.setattr(relay, "_splice_points", lambda *args, **kwargs: None)  # no chunk can be spliced
    generated = 0
    decoded, *_, decoded_waits = run_stream(cases, feed, **request)
    assert decoded_waits["relay"]["decoded"] == len(cases)
    assert last == "[DONE]" and spliced == decoded
    # the prompt's scores ride on the first chunk with tokens (scores come 50 ms after each chunk here)
    first, two_tokens = (next(i for i, c in enumerate(cases) if c["token_ids"] == ids) for ids in ([7], [8, 9]))
    with_prompt = [i for i, c in enumerate(spliced) if "prompt" in c.get("probex", {}).get("scores", {}).get("p", {})]
    assert with_prompt == [first]
    assert spliced[first]["probex"]["scores"]['q "2"']["prompt"]["mean"] == pytest.approx(calibrate(0.25, 2.0, -1.0))
    assert spliced[two_tokens]["probex"]["scores"]["p"]["generated"] == {
        "offset": 1, "scores": [pytest.approx(calibrate(1.0, 1.0, 0.0)), pytest.approx(calibrate(2.0, 1.0, 0.0))]}
    assert [("token_ids" in c["choices"][0]) for c in spliced] == [client_asked] * len(cases)
    assert [("prompt_token_ids" in c["choices"][0] or "prompt_token_ids" in c) for c in spliced[:1]] == [client_asked]
    spliced_chunks = sum(1 for c in cases[first:] if c["token_ids"])
    assert spliced_chunks == 4 and waits["relay"]["decoded"] == len(cases) - spliced_chunks
    # the stand-in's first chunk holds the prompt's ids whoever asked: cut once for a client that did not
    assert waits["relay"]["prompt_ids_cut"] == decoded_waits["relay"]["prompt_ids_cut"] == int(not client_asked)


@pytest.mark.parametrize("payload, expected", [
    (b'{"id":"x","prompt_token_ids":[1,2,3]}', b'{"id":"x"}'),
    (b'{"prompt_token_ids":[1],"id":"x"}', b'{"id":"x"}'),
    (b'{"prompt_token_ids":[]}', b'{}'),
    (b'{"choices":[{"index":0,"prompt_token_ids":[5,6],"text":"a"},{"prompt_token_ids":[7]}],"prompt_token_ids":[1]}',
     b'{"choices":[{"index":0,"text":"a"},{}]}'),
    # inside a string the quotes are escaped: not a member, left alone; a null is left to the decoded path
    (b'{"text":"\\"prompt_token_ids\\":[1]","prompt_token_ids":null}', None),
    # spaced forms are left to the decoded path rather than risk a stray comma
    (b'{"id": "x", "prompt_token_ids": [1]}', None),
    (b'{"id":"x", "prompt_token_ids":[1]}', None),
    (b'{"prompt_token_ids":[1] ,"id":"x"}', None),
    # not vLLM's list of integers: nothing is cut rather than cutting at the first "]"
    (b'{"prompt_token_ids":[[1,2],[3]],"id":"x"}', None),
    (b'{"prompt_token_ids":[1,"]"],"id":"x"}', None),
    (b'{"id":"x","prompt_token_ids":[-1,2]}', b'{"id":"x"}'),
])
def test_prompt_token_ids_are_cut_out_of_compact_json_only(payload, expected):
    out = _without_prompt_token_ids(payload)
    assert out == (payload if expected is None else expected)
    json.loads(out)


def test_a_batched_completions_chunks_are_spliced_with_their_own_prompts_scores():
    """`/v1/completions` with two prompts: each choice's chunks carry its own request's scores
    (keys `<id>-<index>`), every chunk spliced, the first of each choice with its prompt's."""
    from engine_worker.api_server.relay import StreamRelay
    from engine_worker.api_server.requests import MonitoredCall

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    call = MonitoredCall(key_prefix="cmpl-probex-batch", stream=True, wants_token_ids=False, num_prompts=2)

    def chunk(index, ids, prompt_ids=None):
        choice = {"index": index, "text": "t", "logprobs": None, "finish_reason": None, "stop_reason": None,
                  "prompt_token_ids": prompt_ids, "token_ids": ids}
        return b"data: " + json.dumps({"id": "cmpl-probex-batch", "choices": [choice]}, separators=(",", ":")).encode()

    async def go():
        hub = idle_hub()
        engine_ids = [f"{call.key(i)}-deadbeef" for i in (0, 1)]
        # both prompts (2 tokens each) prefilled in one step, then two decode steps; prompt i's
        # rows score 10 * i, its generated token j scores 10 * i + j + 1 (raw)
        ingest(hub, step_message(table, StepView(engine_ids, np.array([2, 2]), np.zeros(2, np.int64), np.array([2, 2])),
                                np.array([[0.0], [0.0], [10.0], [10.0]], np.float32), []))
        for j in (1, 2):
            ingest(hub, step_message(table, StepView(engine_ids, np.ones(2, np.int64), np.full(2, 1 + j),
                                                      np.array([2, 2])),
                                    np.array([[j], [10.0 + j]], np.float32), []))
        relay = StreamRelay(hub, call, lambda message: None, 1.0)
        return [json.loads((await relay._decorate_event(event))[6:]) for event in (
            chunk(1, [5], [1, 2]), chunk(0, [7], [3, 4]), chunk(1, [6, 8]), chunk(0, [9]))]

    with relay_counts() as counts:
        out = asyncio.run(go())
    # every chunk spliced, each choice's first after its prompt's ids were cut out of its bytes
    assert counts == {"decoded": 0, "prompt_ids_cut": 2}
    scores = [c["probex"]["scores"]["p"] for c in out]
    assert scores[0]["prompt"]["last_raw"] == pytest.approx(10.0) and scores[1]["prompt"]["last_raw"] == 0.0
    assert scores[2]["generated"] == {"offset": 1, "scores": [pytest.approx(calibrate(11.0, 1.0, 0.0)),
                                                              pytest.approx(calibrate(12.0, 1.0, 0.0))]}
    assert scores[3]["generated"] == {"offset": 1, "scores": [pytest.approx(calibrate(1.0, 1.0, 0.0))]}
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c["choices"][0] for c in out)


@pytest.mark.parametrize("payload, expected", [
    # a completion's first chunk as a client that asked for token ids gets it: the prompt's ids stay
    (b'{"choices":[{"index":0,"text":"a","prompt_token_ids":[5,6],"token_ids":[1]}]}', (0, 1)),
    (b'{"choices":[{"index":2,"text":"a","prompt_token_ids":null,"token_ids":[1,2]}]}', (2, 2)),
    # a chat chunk with the prompt's ids (or null) after its choices
    (b'{"choices":[{"index":0,"text":"a","token_ids":[1]}],"prompt_token_ids":[5,6]}', (0, 1)),
    (b'{"choices":[{"index":0,"text":"a","token_ids":[1]}],"prompt_token_ids":null}', (0, 1)),
    # anything else still goes the decoded way
    (b'{"choices":[{"index":0,"prompt_token_ids":[5],"x":"y","token_ids":[1]}]}', None),  # a member between
    (b'{"choices":[{"index":0,"token_ids":[1]}],"prompt_token_ids":[5],"x":1}', None),  # a member after
    (b'{"prompt_token_ids":[4],"choices":[{"index":0,"token_ids":[1]}],"prompt_token_ids":[5]}', None),  # twice
    (b'{"choices":[{"index":0,"not_prompt_token_ids":[5],"token_ids":[1]}]}', None),
    (b'{"choices":[{"index":0,"token_ids":[5]},{"index":1,"token_ids":[1]}]}', None),  # two choices
    (b'{"choices":[{"index":0,"text":"a"},{"index":1,"token_ids":[1]}],"prompt_token_ids":[5]}', None),
    (b'{"choices":[{"index":0,"text":"a"},{"index":1,"prompt_token_ids":[5],"token_ids":[1]}]}', None),
])
def test_a_chunk_keeping_the_prompts_ids_is_read_around_them(payload, expected):
    from engine_worker.api_server.splice import _splice_points

    found = _splice_points(b"data: " + payload, prompt_ids_kept=True)
    assert (found[:2] if found else None) == expected
    if expected is not None and b"[5,6]" in payload:
        assert _splice_points(b"data: " + payload) is None  # cut for a client that did not ask: not this way
