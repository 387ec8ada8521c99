"""Delivery logic with a fake upstream app: ordering, waiting, stripping, refusals.

The worker's messages reach the hub as they do in the worker: through the score formatter
(`ingest`). The real engine path is covered by tests/test_engine_*.py; this file pins the
middleware's own rules, which are easier to break subtly than to see break.
"""

import asyncio
import gc
import json
import tempfile
import weakref

import msgspec
import numpy as np

import pytest

from engine_worker.api_server.hub import ScoreHub
from engine_worker.api_server.requests import RequestRefused, body_as_sent, inspect_request
from engine_worker.api_server.splice import _without_prompt_token_ids
from engine_worker.scores.bookkeeping import ProbeTable, StepView, step_message
from engine_worker.scores.formatter import ScoreFormatter
from engine_worker.scores.wire import BROADCAST, external_request_id
from engine_worker.tap.config import TapConfig
from engine_worker.tap.layer import ProbeSlot
from engine_worker.vllm.api_server import VllmMiddleware as ProbexMiddleware
from probes.scoring import calibrate

def test_engine_suffix_is_stripped():
    assert external_request_id("chatcmpl-probex-abc-0123abcd") == "chatcmpl-probex-abc"
    assert external_request_id("cmpl-probex-abc-1-0123abcd") == "cmpl-probex-abc-1"


@pytest.mark.parametrize(
    "body, message",
    [
        ({"vllm_xargs": {"probex_recompute": "maybe"}}, "must be true or false"),
        ({"vllm_xargs": {"probex_colour": 1}}, "unknown ProbeX option vllm_xargs.probex_colour"),
        ({"vllm_xargs": "x"}, "vllm_xargs must be an object"),
        ({"n": 2}, "n=2"),
        ({"use_beam_search": True}, "beam search"),
        # vLLM would leave out the token ids each chunk's scores are placed by
        ({"include_reasoning": False}, "include_reasoning: false"),
        # vLLM reads "false" as false; taken as true, its JSON answer would be relayed as a stream
        ({"stream": "false"}, "stream must be true or false"),
        ({"stream": 1}, "stream must be true or false"),
    ],
)
def test_bad_probex_requests_are_refused(body, message):
    with pytest.raises(RequestRefused, match=message):
        inspect_request("/v1/chat/completions", {"messages": [], **body})


def test_xargs_are_normalised_and_token_ids_requested():
    call = inspect_request("/v1/chat/completions", {"vllm_xargs": {"probex_recompute": "true", "other": 3}})
    assert call.body["vllm_xargs"] == {"probex_recompute": 1, "other": 3}
    assert call.body["return_token_ids"] is True and not call.wants_token_ids
    assert call.key(0).startswith("chatcmpl-probex-")
    completion = inspect_request("/v1/completions", {"prompt": ["a", "b"]})
    assert completion.num_prompts == 2 and completion.key(1).endswith("-1")


class FakeEngineApp:
    """Streams chunks like vLLM; the test feeds the hub as the worker would."""

    def __init__(self, hub, chunks, feed, separators=(",", ":")):
        self.hub, self.chunks, self.feed, self.separators = hub, chunks, feed, separators
        self.seen_request_id = None

    async def __call__(self, scope, receive, send):
        body = json.loads((await receive())["body"])
        self.seen_request_id = dict(scope["headers"])[b"x-request-id"].decode()
        engine_id = f"chatcmpl-{self.seen_request_id}-deadbeef"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i, chunk in enumerate(self.chunks):
            asyncio.get_running_loop().call_later(0.05, self.feed, engine_id, i)  # scores arrive *after* the chunk
            top_level_ids = i == 0 and "prompt_token_ids" not in chunk  # a chat stream's; a completion's are in its choice
            payload = {"choices": [{"index": 0, **chunk}], **({"prompt_token_ids": [1, 2]} if top_level_ids else {})}
            # compact, as vLLM's pydantic models write it (the form the middleware cuts unparsed)
            data = b"data: " + json.dumps(payload, separators=self.separators).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        assert body["return_token_ids"] is True


def idle_hub() -> ScoreHub:
    hub = ScoreHub("inproc://unused")
    hub.start = lambda: None
    return hub


_formatters: "weakref.WeakKeyDictionary[ScoreHub, ScoreFormatter]" = weakref.WeakKeyDictionary()


def formatter_of(hub: ScoreHub) -> ScoreFormatter:
    """The score formatter feeding `hub` (one per hub here, keeping its books across steps)."""
    formatter = _formatters.get(hub)
    if formatter is None:
        formatter = _formatters[hub] = ScoreFormatter(api_server_count=2 if hub.owner else 1)
    return formatter


def deliver(hub: ScoreHub, frames) -> None:
    """The formatter's frames that reach `hub`: its own topic's and BROADCAST, as its SUB socket filters them."""
    for topic, payload in frames:
        if topic in (hub._topic, BROADCAST):
            hub.take_formatted(topic, payload)


def ingest(hub: ScoreHub, message: dict) -> None:
    """A worker message (a step or a control message) the way it reaches an API server process:
    through the score formatter, whose frames the hub takes in."""
    deliver(hub, formatter_of(hub).take(message))


async def post_through(middleware, path: str, body: bytes, method: str = "POST", headers=(),
                       engine=None, query: bytes = b"") -> list[dict]:
    """One request through the middleware as an ASGI server would send it; the messages sent
    back. `engine`: what the admin routes reach as vLLM's engine client."""
    sent = []
    scope = {"type": "http", "path": path, "method": method, "headers": list(headers), "query_string": query,
             "app": type("App", (), {"state": type("State", (), {"engine_client": engine})()})()}
    queue = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return queue.pop(0) if queue else await asyncio.Event().wait()

    async def send(message):
        sent.append(message)

    await middleware(scope, receive, send)
    return sent


def response_body(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def run_stream(chunks, feed, separators=(",", ":"), **request):
    async def go():
        hub = idle_hub()
        app = FakeEngineApp(hub, chunks, lambda engine_id, i: feed(hub, engine_id, i), separators)
        middleware = ProbexMiddleware(app, hub=hub, tap_config=TapConfig(layers=(3,)))
        body = json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": True, **request}).encode()
        sent = await post_through(middleware, "/v1/chat/completions", body)
        text = response_body(sent).decode()
        events = [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]
        waits = dict(hub.wait_stats(), loop_time=hub.loop_time_stats())
        return [json.loads(e) for e in events if e != "[DONE]"], events[-1], len(hub), waits

    return asyncio.run(go())


def step_feed(raw_by_chunk: list[list[float]]):
    """A feed for `run_stream` sending what a worker sends: one step message per chunk, each
    with that step's layout and raw rows (one probe, p), for a 2-token prompt. Step 0
    prefills the prompt and samples token 0 from its last row; each later step samples one
    token; after the given steps, an idle step ends the request."""
    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))

    def feed(hub, engine_id, i):
        if i < len(raw_by_chunk):
            scheduled, computed = (2, 0) if i == 0 else (1, 1 + i)
            layout = StepView([engine_id], np.array([scheduled]), np.array([computed]), np.array([2]))
            finished = []
        else:
            layout, finished = StepView.empty(), [engine_id]
        raw = np.array(raw_by_chunk[i] if i < len(raw_by_chunk) else [], np.float32).reshape(-1, 1)
        ingest(hub, step_message(table, layout, raw, finished))

    return feed


# A chat stream as vLLM sends it: the role, one token, two tokens, then the finish.
ROLE_TWO_TEXT_CHUNKS_STOP = [
    {"delta": {"role": "assistant"}, "token_ids": []},
    {"delta": {"content": "a"}, "token_ids": [7]},
    {"delta": {"content": "bc"}, "token_ids": [8, 9]},
    {"delta": {}, "token_ids": [], "finish_reason": "stop"},
]


def test_each_chunk_waits_for_and_carries_its_own_token_scores():
    out, last, remaining, waits = run_stream(ROLE_TWO_TEXT_CHUNKS_STOP, step_feed([[0.0, 0.0], [1.0], [2.0]]))
    assert last == "[DONE]" and remaining == 0
    # The role chunk carries no token, so it does not wait; the prompt part must then ride
    # on the first content chunk at the latest.
    assert "probex" not in out[0]
    assert out[1]["probex"]["scores"]["p"]["prompt"]["prompt_tokens"] == 2
    assert out[1]["probex"]["scores"]["p"]["generated"] == {"offset": 0, "scores": [0.5]}
    assert out[2]["probex"]["scores"]["p"]["generated"]["offset"] == 1
    assert len(out[2]["probex"]["scores"]["p"]["generated"]["scores"]) == 2
    assert "probex" not in out[3]
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c for c in out)
    # Scores arrive 50 ms after their chunk here, so both content chunks were held back, and
    # the hub's account of it (what `probex bench engine` reads) says so.
    assert waits["prompt"]["calls"] == 1 and waits["prompt"]["waited"] == 1
    assert waits["tokens"]["calls"] == 1 and waits["tokens"]["waited"] == 1
    assert 0.04 < waits["prompt"]["waited_s"] and 0.04 < waits["tokens"]["max_s"] < 1.0
    # The event loop's time on the way to the first token: the hub took in the step messages
    # that came before the stream ended (the three token steps at least), one completing the
    # prompt, and the middleware decorated one first chunk (its 50 ms wait for the prompt's
    # scores included).
    loop = waits["loop_time"]
    assert loop["intake_steps"]["count"] >= 3 and loop["intake_prompt_steps"]["count"] == 1
    assert 0 < loop["intake_prompt_steps"]["total_s"] <= loop["intake_steps"]["total_s"]
    assert loop["first_chunks"]["count"] == 1 and 0.04 < loop["first_chunks"]["total_s"] < 1.0
    # the first chunk came before its prompt's scores: no gap after the intake to book
    assert loop["first_chunk_after_intake"]["count"] == 0 and loop["first_chunk_after_prompt_step"]["count"] == 0


def test_how_soon_after_its_prompts_step_a_first_chunk_comes_is_booked():
    """The gap between the intake of the step that completed a prompt and vLLM's first chunk
    reaching the relay: under 0.25 ms it is also counted as soon after (the chunk most likely
    waited behind the intake); a chunk that came before its prompt's scores is not booked."""
    import time

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    hub = idle_hub()
    for key in ("cmpl-probex-a-0", "cmpl-probex-b-0"):
        ingest(hub, step_message(table, StepView([f"{key}-0123abcd"], np.array([2]), np.array([0]), np.array([2])),
                                np.array([[0.1], [0.2]], np.float32), []))
    first, second = hub.get("cmpl-probex-a-0"), hub.get("cmpl-probex-b-0")
    assert 0 < first.prompt_step_in <= first.prompt_step_done <= second.prompt_step_in
    hub.first_chunk_came(first, first.prompt_step_done + 0.0001)
    hub.first_chunk_came(second, second.prompt_step_done + 0.003)
    hub.first_chunk_came(hub.get("cmpl-probex-c-0"), time.perf_counter())  # no prompt step yet
    stats = hub.loop_time_stats()
    assert stats["first_chunk_after_intake"]["count"] == 2
    assert stats["first_chunk_after_intake"]["total_s"] == pytest.approx(0.0031)
    assert stats["first_chunk_soon_after_intake"]["count"] == 1
    assert stats["first_chunk_after_prompt_step"]["total_s"] >= 0.0031


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


def _completion_event(token_ids: list[int], prompt_ids: list[int] | None = None) -> bytes:
    """One `/v1/completions` stream event in vLLM's compact form (with `return_token_ids`)."""
    choice = {"index": 0, "text": " a", "logprobs": None, "finish_reason": None, "stop_reason": None,
              "prompt_token_ids": prompt_ids, "token_ids": token_ids}
    return b"data: " + json.dumps({"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m",
                                   "choices": [choice]}, separators=(",", ":")).encode()


def test_a_spliced_streams_token_scores_are_written_as_they_come_in_and_taken_by_their_chunks():
    """After a stream's first chunk went out spliced, the hub writes each later token's
    one-token scores JSON as the token comes in; the chunk carrying it takes it (a chunk of
    several tokens takes all of theirs), and the chunks read as the decoded path writes them."""
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
        spliced, decoded = StreamRelay(hub, call, discard, 1.0), StreamRelay(hub, call, discard, 1.0, splice=False)
        step(0, 2, [[0.1, 0.2], [0.3, 0.4]])  # the prompt, and token 0 from its last row
        step(2, 1, [[0.5, 0.6]])  # token 1, before the first chunk went out: not written
        state = hub.get(call.key(0))
        assert state.token_json is None
        first = _completion_event([42], [1, 2])
        out = [(await spliced._decorate_event(first), await decoded._decorate_event(first))]
        assert state.token_json == {}
        for computed, rows in ((3, [[0.7, 0.8]]), (4, [[0.9, 1.0]]), (5, [[1.1, 1.2]])):  # tokens 2, 3, 4
            step(computed, 1, rows)
        assert sorted(state.token_json) == [2, 3, 4]
        assert state.token_json[3] == generated_scores_json(state, 3, 4)
        for ids in ([43], [44], [45, 46]):  # token 1 (not written), 2, then 3 and 4 in one chunk
            event = _completion_event(ids)
            out.append((await spliced._decorate_event(event), await decoded._decorate_event(event)))
        assert state.token_json == {}
        # a chunk in another form takes the decoded path, and takes its token's JSON out too
        step(6, 1, [[1.3, 1.4]])  # token 5
        loose = b"data: " + json.dumps(json.loads(_completion_event([47])[6:])).encode()
        assert b'"probex"' in await spliced._decorate_event(loose) and state.token_json == {}
        return out

    hub = idle_hub()
    out = asyncio.run(go())
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
    from engine_worker.api_server import middleware

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
    relay = middleware.StreamRelay
    monkeypatch.setattr(middleware, "StreamRelay", lambda *args: relay(*args, splice=False))
    generated = 0
    decoded, *_, decoded_waits = run_stream(cases, feed, **request)
    assert decoded_waits["loop_time"]["chunks_spliced"]["count"] == 0
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
    loop = waits["loop_time"]
    spliced_chunks = sum(1 for c in cases[first:] if c["token_ids"])
    assert loop["chunks_spliced"]["count"] == spliced_chunks == 4
    assert loop["chunks_decoded"]["count"] == len(cases) - spliced_chunks
    # the stand-in's first chunk holds the prompt's ids whoever asked: cut once for a client that did not
    assert loop["chunks_prompt_ids_cut"]["count"] == decoded_waits["loop_time"]["chunks_prompt_ids_cut"]["count"] \
        == int(not client_asked)


def test_missing_scores_do_not_hang_the_stream(monkeypatch):
    monkeypatch.setenv("PROBEX_SCORE_WAIT_S", "0.2")
    chunks = [{"delta": {"content": "a"}, "token_ids": [7]}]
    out, last, _, waits = run_stream(chunks, lambda hub, engine_id, i: None)
    assert last == "[DONE]"
    assert out[0].get("probex", {}).get("scores", {}) == {}
    # the chunk waited once (its splice found nothing to write and the decoded path did not wait again)
    assert waits["prompt"]["waited"] == 1 and 0.15 < waits["prompt"]["waited_s"] < 0.4


def test_a_swap_refused_by_any_rank_is_reported_as_refused():
    from engine_worker.api_server.middleware import _every_rank

    ok = {"ok": True, "version": 2}
    assert _every_rank([ok, ok]) is ok
    refused = {"ok": False, "error": "bad file", "version": 1}
    assert _every_rank([refused, refused])["error"] == "bad file"
    split = _every_rank([ok, refused])
    assert split["ok"] is False and "1 of 2 workers" in split["error"]


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")], ids=["compact", "spaced"])
@pytest.mark.parametrize("client_asked", [False, True])
def test_token_ids_reach_only_clients_that_asked_for_them(separators, client_asked):
    """Compact chunks (vLLM's) lose their prompt ids unparsed, spaced ones once decoded; a
    client that asked for token ids gets both lists untouched."""
    request = {"return_token_ids": True} if client_asked else {}
    out, _, _, waits = run_stream(ROLE_TWO_TEXT_CHUNKS_STOP, step_feed([[0.0, 0.0], [1.0], [2.0]]), separators,
                                  **request)
    # this stand-in for vLLM writes the prompt's ids whoever asked: cut unparsed where compact (counted)
    compact = separators == (",", ":")
    assert waits["loop_time"]["chunks_prompt_ids_cut"]["count"] == int(compact and not client_asked)
    assert [c["choices"][0]["delta"] for c in out] == [c["delta"] for c in ROLE_TWO_TEXT_CHUNKS_STOP]
    assert out[1]["probex"]["scores"]["p"]["prompt"]["prompt_tokens"] == 2
    if client_asked:
        assert out[0]["prompt_token_ids"] == [1, 2] and [c["choices"][0]["token_ids"] for c in out] == [[], [7], [8, 9], []]
    else:
        assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c for c in out)


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


def test_scores_sent_as_worker_step_messages_reach_their_chunks():
    """The wire as the worker sends it: each step's layout + raw block, booked by the hub."""
    out, last, remaining, _ = run_stream(ROLE_TWO_TEXT_CHUNKS_STOP, step_feed([[0.25, -1.0], [0.5], [2.0]]))
    assert last == "[DONE]" and remaining == 0
    scores = out[1]["probex"]["scores"]["p"]
    assert scores["prompt"]["last_raw"] == pytest.approx(-1.0) and scores["prompt"]["tokens_scored"] == 2
    assert scores["generated"] == {"offset": 0, "scores": [pytest.approx(calibrate(-1.0, 1.0, 0.0))]}
    later = out[2]["probex"]["scores"]["p"]["generated"]
    assert later["offset"] == 1 and later["scores"] == [pytest.approx(calibrate(0.5, 1.0, 0.0)),
                                                         pytest.approx(calibrate(2.0, 1.0, 0.0))]


class RecordingApp:
    """An upstream that answers 200 {} and keeps what reached it."""

    def __init__(self):
        self.bodies, self.request_ids = [], []

    async def __call__(self, scope, receive, send):
        self.bodies.append((await receive())["body"])
        self.request_ids.append(dict(scope["headers"]).get(b"x-request-id"))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})


def post_raw(raw: bytes):
    async def go():
        app = RecordingApp()
        middleware = ProbexMiddleware(app, hub=idle_hub(), tap_config=TapConfig(layers=(3,)))
        sent = await post_through(middleware, "/v1/completions", raw)
        return app, sent[0]["status"], response_body(sent)

    return asyncio.run(go())


def test_request_bodies_python_json_accepts_are_monitored_and_passed_on_unchanged():
    """vLLM's server reads bodies with Python's json, which takes NaN and Infinity; the
    middleware's faster parser does not. Such a body must still be checked (a bad probex
    option refused) and monitored, and reach vLLM with its NaN intact, not as null."""
    app, status, answer = post_raw(b'{"prompt": "x", "max_tokens": 2, "top_p": NaN, '
                                   b'"vllm_xargs": {"probex_colour": 1}}')
    assert status == 400 and b"probex_colour" in answer and app.bodies == []
    app, status, _ = post_raw(b'{"prompt": [1, 2, 3], "max_tokens": 2, "top_p": NaN, "name": "caf\\u00e9"}')
    assert status == 200 and app.request_ids[0] is not None  # monitored: the middleware's own id
    forwarded = json.loads(app.bodies[0])
    assert forwarded["top_p"] != forwarded["top_p"]  # NaN, still
    assert forwarded["prompt"] == [1, 2, 3] and forwarded["name"] == "café" and forwarded["return_token_ids"] is True
    # a plain body takes the fast path and arrives with the same content
    app, status, _ = post_raw(b'{"prompt": [1, 2, 3], "max_tokens": 2, "name": "caf\\u00e9"}')
    forwarded = json.loads(app.bodies[0])
    assert status == 200 and forwarded["name"] == "café" and forwarded["prompt"] == [1, 2, 3]
    # not JSON at all: vLLM answers with its own validation error, the body untouched
    app, status, _ = post_raw(b"{not json")
    assert app.bodies == [b"{not json"] and app.request_ids == [None]


def post_raw_paused(raw: bytes):
    async def go():
        app, hub = RecordingApp(), idle_hub()
        hub.set_paused(True)
        middleware = ProbexMiddleware(app, hub=hub, tap_config=TapConfig(layers=(3,)))
        sent = await post_through(middleware, "/v1/completions", raw)
        return app, sent[0]["status"]

    return asyncio.run(go())


def test_the_usual_request_reaches_vllm_as_the_client_sent_it():
    """A request with nothing for ProbeX to check or rewrite is not decoded and re-encoded:
    vLLM gets the client's bytes, under ProbeX's request id, with `return_token_ids` added
    where the client did not send it; paused, the bytes alone."""
    asked = b'{"prompt": [5, 6, 7], "max_tokens": 2, "stream": true, "return_token_ids": true, "top_p": 0.50}'
    app, status, _ = post_raw(asked)
    assert status == 200 and app.bodies == [asked] and app.request_ids[0].startswith(b"probex-")
    plain = b'{"prompt": "caf\\u00e9", "max_tokens": 2, "vllm_xargs": {"other": 1}}\n'
    app, status, _ = post_raw(plain)
    assert status == 200 and app.bodies == [plain.rstrip()[:-1] + b',"return_token_ids":true}']
    assert json.loads(app.bodies[0]) == {**json.loads(plain), "return_token_ids": True}
    app, status = post_raw_paused(plain)
    assert status == 200 and app.bodies == [plain] and app.request_ids == [None]
    call, body = body_as_sent("/v1/chat/completions", b'{"messages": [], "stream": true}', owner="ab12cd34")
    assert call.stream and not call.wants_token_ids and call.key(0).startswith("chatcmpl-probex-ab12cd34")


@pytest.mark.parametrize("raw", [
    b'{"prompt": "x", "n": 2}', b'{"prompt": "x", "best_of": 3}', b'{"prompt": "x", "use_beam_search": true}',
    b'{"prompt": "x", "echo": true}', b'{"prompt": "x", "include_reasoning": false}',
    b'{"prompt": "x", "vllm_xargs": {"probex_recompute": "true"}}', b'{"prompt": "x", "vllm_xargs": "x"}',
    b'{"prompt": ["a", "b"]}', b'{"prompt": [[1, 2], [3]]}', b'{"prompt": "x", "return_token_ids": false}',
    b'{"prompt": "x", "top_p": NaN}', b"{}", b"[1, 2]", b"{not json",
])
def test_requests_with_anything_to_check_or_rewrite_take_the_full_path(raw):
    assert body_as_sent("/v1/completions", raw) is None


def test_a_refused_field_is_still_refused_when_the_rest_is_usual():
    app, status, answer = post_raw(b'{"prompt": [1, 2], "max_tokens": 2, "n": 3}')
    assert status == 400 and b"n=3" in answer and app.bodies == []
    app, status, answer = post_raw(b'{"prompt": [1, 2], "max_tokens": 2, "stream": "false"}')
    assert status == 400 and b'"param":"stream"' in answer.replace(b" ", b"") and app.bodies == []


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
            chunk(1, [5], [1, 2]), chunk(0, [7], [3, 4]), chunk(1, [6, 8]), chunk(0, [9]))], hub

    out, hub = asyncio.run(go())
    assert hub.chunks["spliced"].count == 4 and hub.chunks["decoded"].count == 0
    scores = [c["probex"]["scores"]["p"] for c in out]
    assert scores[0]["prompt"]["last_raw"] == pytest.approx(10.0) and scores[1]["prompt"]["last_raw"] == 0.0
    assert scores[2]["generated"] == {"offset": 1, "scores": [pytest.approx(calibrate(11.0, 1.0, 0.0)),
                                                              pytest.approx(calibrate(12.0, 1.0, 0.0))]}
    assert scores[3]["generated"] == {"offset": 1, "scores": [pytest.approx(calibrate(1.0, 1.0, 0.0))]}
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c["choices"][0] for c in out)


class FakeEngineClient:
    """vLLM's engine client as the admin routes use it: one answer per worker rank."""

    def __init__(self, answer=None):
        self.calls = []
        self.answer = answer

    async def collective_rpc(self, method, args=()):
        self.calls.append((method, args))
        # the worker counts its pause changes for its API server processes; clients never see it
        return [dict(self.answer) if self.answer else {"ok": True, "paused": args[0], "sequence": len(self.calls)}]


async def call_route(middleware, method, path, body=b"", headers=(), engine=None, query=b""):
    """An admin route's answer: (status, decoded body)."""
    sent = await post_through(middleware, path, body, method, headers, engine, query)
    return sent[0]["status"], json.loads(response_body(sent) or b"null")


def test_the_tap_is_paused_and_resumed_by_an_admin_and_paused_requests_pass_unmonitored(monkeypatch):
    monkeypatch.setenv("PROBEX_ADMIN_TOKEN", "secret")
    admin = [(b"authorization", b"Bearer secret")]

    async def go():
        app, engine = RecordingApp(), FakeEngineClient()
        capturing = TapConfig(layers=(3,), capture_rows=16, capture_dir="/tmp/probex-test-captures")
        middleware = ProbexMiddleware(app, hub=idle_hub(), tap_config=capturing)
        put = lambda body, headers=admin: call_route(middleware, "PUT", "/probex/tap", body, headers, engine)  # noqa: E731
        assert (await put(b'{"paused": true}', []))[0] == 401 and engine.calls == []
        status, answer = await put(b'{"paused": "yes"}')
        assert status == 400 and answer["error"]["param"] == "paused"
        assert await put(b'{"paused": true}') == (200, {"ok": True, "paused": True})
        assert engine.calls == [("probex_set_paused", (True,))] and middleware.hub.paused
        assert await call_route(middleware, "GET", "/probex/tap") == (200, {"paused": True})
        # paused: a request reaches vLLM as the client sent it (no token ids asked for, no id of ours)
        body = json.dumps({"prompt": "x", "max_tokens": 2, "vllm_xargs": {"probex_recompute": "true"}}).encode()
        sent = await post_through(middleware, "/v1/completions", body)
        forwarded = json.loads(app.bodies[-1])
        assert sent[0]["status"] == 200 and "return_token_ids" not in forwarded and app.request_ids[-1] is None
        assert forwarded["vllm_xargs"] == {"probex_recompute": 1}  # still checked and normalised
        capture = json.dumps({"prompt": "x", "vllm_xargs": {"probex_capture": True}}).encode()
        refused = await post_through(middleware, "/v1/completions", capture)
        assert refused[0]["status"] == 409 and b"tap_paused" in response_body(refused) and len(app.bodies) == 1
        assert await put(b'{"paused": false}') == (200, {"ok": True, "paused": False})
        await post_through(middleware, "/v1/completions", body)
        assert json.loads(app.bodies[-1])["return_token_ids"] is True and app.request_ids[-1] is not None
        # a worker that refuses (it steers) leaves the API server's state as it was
        engine.answer = {"ok": False, "error": "steering gates read its scores", "paused": False}
        status, answer = await put(b'{"paused": true}')
        assert status == 400 and answer["error"]["code"] == "pause_refused" and not middleware.hub.paused

    asyncio.run(go())
    monkeypatch.delenv("PROBEX_ADMIN_TOKEN")

    async def without_token():
        middleware = ProbexMiddleware(RecordingApp(), hub=idle_hub(), tap_config=TapConfig(layers=(3,)))
        return await call_route(middleware, "PUT", "/probex/tap", b'{"paused": true}', engine=FakeEngineClient())

    assert asyncio.run(without_token())[0] == 403


def test_streams_in_flight_stop_waiting_for_scores_when_the_tap_is_paused():
    """A chunk waiting for scores when the tap is paused goes out at once; so do the later
    chunks of a stream that lived through a pause, after the tap runs again (the pause's
    tokens never get scores), instead of each waiting the full score wait."""
    from engine_worker.api_server.relay import StreamRelay
    from engine_worker.api_server.requests import MonitoredCall

    async def go():
        hub = idle_hub()
        relay = StreamRelay(hub, MonitoredCall(key_prefix="cmpl-probex-p", stream=True, wants_token_ids=False), None,
                            30.0)
        chunk = b'data: {"id":"x","choices":[{"index":0,"text":"a","token_ids":[5]}]}'
        waiting = asyncio.get_running_loop().create_task(relay._decorate_event(chunk))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # held for the prompt's and the token's scores
        started = asyncio.get_running_loop().time()
        hub.set_paused(True)
        first = json.loads((await waiting)[6:])
        hub.set_paused(False)
        later = json.loads((await relay._decorate_event(chunk))[6:])
        return first, later, asyncio.get_running_loop().time() - started, hub.pauses

    first, later, elapsed, pauses = asyncio.run(go())
    assert elapsed < 5 and pauses == 1
    assert first["probex"]["scores"] == {} and later["probex"]["scores"] == {}


def test_a_gap_in_the_workers_count_is_counted_and_no_chunk_waits_for_a_lost_token():
    """Messages the worker could not put in the score ring (the formatter far behind): the
    missing numbers tell the formatter, which tells every hub. A chunk whose token was in a
    lost step goes out once a later token is in (steps come in order, so the missing one never
    will), instead of each later chunk waiting the full score wait; tokens still to come are
    waited for as usual."""
    from engine_worker.scores.bookkeeping import SEQUENCE
    from engine_worker.api_server.relay import StreamRelay
    from engine_worker.api_server.requests import MonitoredCall

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    call = MonitoredCall(key_prefix="cmpl-probex-a", stream=True, wants_token_ids=False)

    def step(sequence, scheduled, computed, raw):
        layout = StepView([f"{call.key(0)}-0123abcd"], np.array([scheduled]), np.array([computed]), np.array([2]))
        return {**step_message(table, layout, np.array(raw, np.float32), []), SEQUENCE: sequence}

    def chunk(token):
        return b'data: {"id":"x","choices":[{"index":0,"text":"a","token_ids":[%d]}]}' % token

    async def go():
        hub = idle_hub()
        relay = StreamRelay(hub, call, None, 30.0)
        ingest(hub, step(7, 2, 0, [[0.5], [1.5]]))  # the first heard: prompt + token 0 (7: joined late, no loss)
        first = json.loads((await relay._decorate_event(chunk(5)))[6:])
        waiting = asyncio.get_running_loop().create_task(relay._decorate_event(chunk(6)))  # token 1
        await asyncio.sleep(0.05)
        assert not waiting.done() and hub.messages_lost == 0
        started = asyncio.get_running_loop().time()
        ingest(hub, step(10, 1, 3, [[2.5]]))  # token 2 arrives; 8 and 9 (token 1's step among them) never do
        second = json.loads((await waiting)[6:])
        third = json.loads((await relay._decorate_event(chunk(7)))[6:])  # token 2, in
        waiting = asyncio.get_running_loop().create_task(relay._decorate_event(chunk(8)))  # token 3, to come
        await asyncio.sleep(0.05)
        held = not waiting.done()
        ingest(hub, step(11, 1, 4, [[-1.0]]))
        fourth = json.loads((await waiting)[6:])
        elapsed = asyncio.get_running_loop().time() - started
        return first, second, third, fourth, held, elapsed, hub

    first, second, third, fourth, held, elapsed, hub = asyncio.run(go())
    assert elapsed < 5 and hub.messages_lost == 2 and hub.losses == 1 and hub.steps_lost == 0 and hub.swaps == 1
    assert first["probex"]["scores"]["p"]["generated"]["scores"] == [pytest.approx(calibrate(1.5, 1.0, 0.0))]
    assert second["probex"]["scores"] == {}  # token 1: never came
    assert third["probex"]["scores"]["p"]["generated"] == {"offset": 2, "scores": [pytest.approx(calibrate(2.5, 1.0, 0.0))]}
    assert held and fourth["probex"]["scores"]["p"]["generated"] == {"offset": 3, "scores": [pytest.approx(calibrate(-1.0, 1.0, 0.0))]}
    ingest(hub, step(3, 1, 4, [[0.0]]))  # a lower number is no gap: nothing more counted lost
    assert hub.messages_lost == 2 and hub.losses == 1


def test_an_idle_formatter_sends_heartbeats_so_a_lost_last_step_does_not_hold_its_chunk():
    """The last step of a burst lost on its way to this process (its queue was full) and
    nothing after it: the idle formatter's heartbeat carries its count of this process's
    messages, the hub finds the gap, and the chunk waiting for that step's scores goes out
    then, not after the whole wait."""
    from engine_worker.api_server.relay import StreamRelay
    from engine_worker.api_server.requests import MonitoredCall

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    call = MonitoredCall(key_prefix="cmpl-probex-a", stream=True, wants_token_ids=False)
    engine_id = f"{call.key(0)}-0123abcd"

    def chunk(token):
        return b'data: {"id":"x","choices":[{"index":0,"text":"a","token_ids":[%d]}]}' % token

    async def scenario():
        hub = idle_hub()
        formatter = formatter_of(hub)
        ingest(hub, step_message(table, StepView([engine_id], np.array([2]), np.array([0]), np.array([2])),
                                 np.array([[0.5], [1.5]], np.float32), []))
        relay = StreamRelay(hub, call, None, 30.0)
        first = json.loads((await relay._decorate_event(chunk(5)))[6:])
        # the request's last step (token 1, its end): formatted, lost on the way to this process
        lost = formatter.take(step_message(table, StepView([engine_id], np.array([1]), np.array([2]), np.array([2])),
                                           np.array([[2.5]], np.float32), [engine_id]))
        assert [topic for topic, _ in lost] == [hub._topic]
        started = asyncio.get_running_loop().time()
        waiting = asyncio.get_running_loop().create_task(relay._decorate_event(chunk(6)))
        await asyncio.sleep(0.05)
        held = not waiting.done()
        deliver(hub, [formatter.heartbeat()])
        last = json.loads((await waiting)[6:])
        return first, last, held, asyncio.get_running_loop().time() - started, hub.messages_lost

    first, last, held, elapsed, lost = asyncio.run(scenario())
    assert first["probex"]["scores"]["p"]["generated"]["scores"] == [pytest.approx(calibrate(1.5, 1.0, 0.0))]
    assert held and last["probex"]["scores"] == {} and lost == 1
    assert elapsed < 5  # the heartbeat told it; the score wait was 30 s


def test_a_wait_under_way_ends_when_messages_are_found_lost():
    """A chunk already waiting when a gap is found: the message that showed the gap is booked
    first (its tokens still count); what is missing after it is not waited for."""
    from engine_worker.scores.bookkeeping import SEQUENCE, heartbeat_message

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    a, b = "cmpl-probex-a-0-0123abcd", "cmpl-probex-b-0-0123abcd"

    def step(sequence, req, computed, raw):
        layout = StepView([req], np.array([1 if computed else 2]), np.array([computed]), np.array([2]))
        return {**step_message(table, layout, np.array(raw, np.float32), []), SEQUENCE: sequence}

    async def go():
        hub = idle_hub()
        ingest(hub, step(1, a, 0, [[0.5], [1.5]]))  # a: prompt + token 0
        ingest(hub, step(2, b, 0, [[0.5], [1.5]]))  # b: prompt + token 0
        waiting_a = asyncio.get_running_loop().create_task(
            hub.wait_for("cmpl-probex-a-0", prompt=False, tokens=2, timeout=30))
        waiting_b = asyncio.get_running_loop().create_task(
            hub.wait_for("cmpl-probex-b-0", prompt=False, tokens=2, timeout=30))
        await asyncio.sleep(0.05)
        assert not waiting_a.done() and not waiting_b.done()
        ingest(hub, step(4, b, 2, [[2.5]]))  # 3 lost (a's token 1); this one brings b's token 1
        results = await asyncio.wait_for(asyncio.gather(waiting_a, waiting_b), 5)
        received = hub.messages_received
        ingest(hub, {**heartbeat_message(), SEQUENCE: 5})  # the worker's heartbeat, in order: nothing lost
        deliver(hub, [formatter_of(hub).heartbeat()])  # the formatter's, with its count of this process's
        return results, hub.messages_lost, hub.losses, hub.messages_received - received

    (got_a, got_b), lost, losses, heartbeats_counted = asyncio.run(go())
    assert got_a is False and got_b is True and lost == 1 and losses == 1
    assert heartbeats_counted == 0  # score messages only (what tests of delivery count)


def test_a_lost_pause_message_is_made_good_by_the_next_step():
    """Each step carries the worker's pause state: a process that lost the pause (or the
    resume) message, on the formatter's way to it or the worker's way to the formatter, takes
    it from the next message it gets, instead of waiting for scores that will not come, or
    relaying unmonitored, until the tap is switched again."""
    from engine_worker.scores.bookkeeping import SEQUENCE, paused_message

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    hub = idle_hub()
    formatter = formatter_of(hub)
    req = "cmpl-probex-a-0-0123abcd"

    def step(sequence, computed, pause):
        layout = StepView([req], np.array([1 if computed else 2]), np.array([computed]), np.array([2]))
        rows = np.full((int(layout.num_rows), 1), 0.5, np.float32)
        return {**step_message(table, layout, rows, [], pause), SEQUENCE: sequence}

    ingest(hub, step(1, 0, (0, False)))
    formatter.take({**paused_message(True, 1), SEQUENCE: 2})  # its broadcast never reaches this process
    assert not hub.paused
    ingest(hub, step(3, 2, (1, True)))  # a step in flight as the tap paused carries the new state
    assert hub.paused and hub.pauses == 1 and hub.messages_lost == 0
    ingest(hub, step(4, 3, (1, True)))
    assert hub.pauses == 1  # the same state again changes nothing
    # the resume never reached the formatter (5 is missing): the loss it reports carries the state
    ingest(hub, {**step_message(table, StepView.empty(), np.zeros((0, 1), np.float32), [], (2, False)), SEQUENCE: 6})
    assert not hub.paused and hub.messages_lost == 1 and hub.pauses == 1


def test_the_hub_times_the_processs_garbage_collections_by_generation():
    async def started() -> ScoreHub:
        hub = ScoreHub(f"ipc://{tempfile.mkdtemp()}/scores")
        hub.start()
        hub._task.cancel()
        hub._socket.close()
        return hub

    hub = asyncio.run(started())
    hub.collections.attach()  # once only: a second start must not count each collection twice
    try:
        before = hub.loop_time_stats()["gc_generation_2"]["count"]
        gc.collect(2)
        gc.collect(0)
        stats = hub.loop_time_stats()
    finally:
        hub.collections.detach()
    assert stats["gc_generation_2"]["count"] == before + 1
    assert stats["gc_generation_0"]["count"] >= 1 and stats["gc_generation_2"]["total_s"] > 0


def test_every_api_server_process_hears_each_step_and_books_only_its_own_requests():
    """Several API server processes (vLLM's --api-server-count): the formatter takes each of
    the worker's messages once and sends on the real wire (ZMQ PUB, msgpack); each process's
    hub books the rows of the requests its middleware tagged, prefills and decodes alike, and
    every hub hears pauses and swaps."""
    import zmq

    from engine_worker.scores.bookkeeping import SEQUENCE, paused_message, swapped_message
    from engine_worker.scores.wire import FormattedStep, owner_tag

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    ours, theirs = owner_tag(), owner_tag()
    assert ours != theirs and len(ours) == 8
    mine = inspect_request("/v1/chat/completions", {"messages": []}, owner=ours).key_prefix
    other = inspect_request("/v1/chat/completions", {"messages": []}, owner=theirs).key_prefix
    assert mine.startswith(f"chatcmpl-probex-{ours}") and len(mine) == len(other) == len("chatcmpl-probex-") + 32
    untagged = inspect_request("/v1/chat/completions", {"messages": []}).key_prefix  # one API server process
    assert len(untagged) == len(mine)
    engine_ids = {"mine": f"{mine}-0123abcd", "other": f"{other}-4567ef01"}  # vLLM appends 8 hex

    async def scenario():
        address = f"ipc://{tempfile.mkdtemp()}/scores"
        hubs = {"mine": ScoreHub(address, owner=ours), "other": ScoreHub(address, owner=theirs)}
        swapped_in = {name: [] for name in hubs}
        for name, hub in hubs.items():
            hub.on_probes_swapped = lambda version, dirs, name=name: swapped_in[name].append((version, dirs))
        formatter = ScoreFormatter(api_server_count=2)
        wire = zmq.Context.instance().socket(zmq.PUB)
        wire.bind(address)
        for hub in hubs.values():
            hub.start()
        try:
            await asyncio.sleep(0.3)  # the subscriptions reach the formatter (messages before are not for them)
            messages = [
                # step 1: both prompts (2 and 3 rows) prefilled, each samples its first token
                step_message(table, StepView([engine_ids["mine"], engine_ids["other"]], np.array([2, 3]),
                                             np.array([0, 0]), np.array([2, 3])),
                             np.array([[0.5], [1.5], [-2.0], [-3.0], [-4.0]], np.float32), []),
                # step 2: both decode one token; then "other" ends
                step_message(table, StepView([engine_ids["mine"], engine_ids["other"]], np.array([1, 1]),
                                             np.array([2, 3]), np.array([2, 3])),
                             np.array([[0.25], [-5.0]], np.float32), [engine_ids["other"]]),
                swapped_message("probes", 2, ["/probes/new"]),
                paused_message(True, 1),
            ]
            for sequence, message in enumerate(messages, start=1):
                for frames in formatter.take({**message, SEQUENCE: sequence}):
                    wire.send_multipart(frames)
            for _ in range(100):
                if all(hub.messages_received == 4 for hub in hubs.values()):
                    break
                await asyncio.sleep(0.02)
            assert swapped_in == {"mine": [(2, ["/probes/new"])], "other": [(2, ["/probes/new"])]}
            return {name: (hub.messages_received, dict(hub._requests), hub.paused, hub.swaps, hub.messages_lost)
                    for name, hub in hubs.items()}
        finally:
            wire.close(linger=0)
            for hub in hubs.values():
                hub._task.cancel()
                hub._silence_task.cancel()
                hub._socket.close()
                hub.collections.detach()

    seen = asyncio.run(scenario())
    for name, key in (("mine", mine), ("other", other)):
        received, requests, paused, swaps, lost = seen[name]
        assert received == 4 and paused and swaps == 1 and lost == 0
        assert list(requests) == [key]  # nothing booked for the other process's request
    mine_scores, other_scores = seen["mine"][1][mine], seen["other"][1][other]
    assert mine_scores.prompt["req"] == engine_ids["mine"] and mine_scores.prompt_fields["p"]["prompt"]["last_raw"] == pytest.approx(1.5)
    assert other_scores.prompt_fields["p"]["prompt"]["last_raw"] == pytest.approx(-4.0)
    assert mine_scores.tokens == {0: (pytest.approx(calibrate(1.5, 1.0, 0.0)),), 1: (pytest.approx(calibrate(0.25, 1.0, 0.0)),)}
    assert other_scores.tokens == {0: (pytest.approx(calibrate(-4.0, 1.0, 0.0)),), 1: (pytest.approx(calibrate(-5.0, 1.0, 0.0)),)}
    assert other_scores.finished and not mine_scores.finished
    # batched completions' ids ("cmpl-<id>-<prompt index>-<8 hex>") are told apart the same way
    completion = inspect_request("/v1/completions", {"prompt": ["a", "b"]}, owner=ours)
    batch = [f"{completion.key(1)}-89abcdef", f"{other}-1-89abcdef"]
    frames = ScoreFormatter(api_server_count=2).take(step_message(
        table, StepView(batch, np.array([1, 1]), np.array([5, 5]), np.array([2, 2])), np.zeros((2, 1), np.float32), []))
    assert sorted(topic for topic, _ in frames) == sorted([ours.encode(), theirs.encode()])
    routed = {topic: msgspec.msgpack.decode(payload, type=FormattedStep).token_requests for topic, payload in frames}
    assert routed == {ours.encode(): [completion.key(1)], theirs.encode(): [f"{other}-1"]}


def test_a_pause_older_than_what_a_process_applied_is_ignored():
    """Two processes switch the tap at once: each applies its own reply and the worker's
    broadcasts in whatever order they arrive, and ends with the worker's last state."""
    from engine_worker.scores.bookkeeping import paused_message

    hub = idle_hub()
    ingest(hub, paused_message(True, 1))   # process A's pause, broadcast
    ingest(hub, paused_message(False, 2))  # process B's resume, broadcast
    hub.set_paused(True, 1)               # A's own reply, arriving late
    assert hub.paused is False and hub.pauses == 1
    hub.set_paused(True, 3)
    assert hub.paused is True
    hub.set_paused(False)  # no sequence (a reply from a worker that does not count): applied
    assert hub.paused is False


def test_several_api_server_processes_compute_a_probe_sets_retention_once(tmp_path):
    """Retention needs HF forward passes over every retention set: one process of the worker
    computes it, the others wait and read its result; a probe rewritten in place is computed
    again, and a result only counts for the model and probe files it was computed on."""
    import threading
    import time as clock

    from engine_worker.api_server.retention import computed_once

    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "probe.yaml").write_text("name: p\n")
    calls = []

    def compute(model_dir, probe_dirs):
        calls.append(threading.current_thread().name)
        clock.sleep(0.2)  # long enough for the other processes to be waiting on the lock
        return {"p": {"retention": 0.9, "calls": len(calls)}}

    shared = tmp_path / "shared"
    results = []
    threads = [threading.Thread(target=lambda: results.append(computed_once(shared, "/m", [str(probe)], compute)),
                                name=f"api-server-{i}") for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and results == [{"p": {"retention": 0.9, "calls": 1}}] * 3
    (probe / "probe.yaml").write_text("name: p\nchanged: true\n")
    assert computed_once(shared, "/m", [str(probe)], compute)["p"]["calls"] == 2
    assert computed_once(shared, "/other-model", [str(probe)], compute)["p"]["calls"] == 3
    assert computed_once(shared, "/m", [str(probe)], compute)["p"]["calls"] == 2  # still on file
    # a computation that fails fails once: the others read the failure instead of repeating it
    failures = []

    def failing(model_dir, probe_dirs):
        failures.append(1)
        raise ValueError("no retention set offline")

    for _ in range(2):
        with pytest.raises(RuntimeError, match="ValueError: no retention set offline"):
            computed_once(shared, "/third-model", [str(probe)], failing)
    assert len(failures) == 1


def test_the_shared_retention_directory_goes_when_its_process_exits(tmp_path):
    """It lives beside the score socket in the temporary directory, one per worker start."""
    import subprocess
    import sys
    from pathlib import Path

    shared = tmp_path / "probex-scores-x.sock.shared"
    code = (f"from pathlib import Path; from engine_worker.api_server.retention import RetentionTracker, computed_once\n"
            f"tracker = RetentionTracker(None, Path({str(shared)!r}))\n"
            f"computed_once(tracker.shared_dir, '/m', [], lambda model, dirs: {{'p': {{'retention': 1.0}}}})\n"
            f"assert any(Path({str(shared)!r}).iterdir())\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
    assert not shared.exists()


def test_a_probe_set_whose_swap_message_was_lost_still_gets_its_retention_check():
    """The swap message can be lost with others (a process far behind); the next step carries
    the new set's version: the process then reads the set from the worker's listing and
    schedules its retention check, once, and drops its cached listings."""
    from engine_worker.scores.bookkeeping import swapped_message

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    swapped = ProbeTable(version=3, slots=table.slots)

    class ListingEngine:
        def __init__(self):
            self.calls = []

        async def collective_rpc(self, method, args=()):
            self.calls.append(method)
            return [{"version": 3, "probes": [{"name": "p", "source": "/probes/new"}, {"name": "q", "source": None}]}]

    def step(table, req):
        layout = StepView([req], np.array([1]), np.array([5]), np.array([4]))
        return step_message(table, layout, np.array([[0.5]], np.float32), [])

    async def go():
        hub = idle_hub()
        middleware = ProbexMiddleware(RecordingApp(), hub=hub)
        scheduled = []
        middleware.retention.schedule = scheduled.append
        engine = ListingEngine()
        await post_through(middleware, "/v1/models", b"", "GET", engine=engine)  # the server's app is known
        ingest(hub, step(table, "cmpl-probex-a-0-0123abcd"))
        await asyncio.sleep(0.01)
        assert engine.calls == [] and hub.swaps == 0  # the startup set: nothing missed
        ingest(hub, step(swapped, "cmpl-probex-a-0-0123abcd"))  # version 3; its swap message never came
        ingest(hub, step(swapped, "cmpl-probex-a-0-0123abcd"))
        for _ in range(100):
            if scheduled:
                break
            await asyncio.sleep(0.01)
        swaps_after_gap = hub.swaps
        ingest(hub, swapped_message("probes", 3, ["/probes/new"]))  # arriving after all: no second check
        middleware._schedule_retention(3, ["/probes/new"])
        return engine.calls, scheduled, swaps_after_gap

    calls, scheduled, swaps = asyncio.run(go())
    assert calls == ["probex_list_probes"] and scheduled == [["/probes/new"]] and swaps == 1


def test_listings_are_read_again_after_a_swap_another_api_server_process_took():
    """The steering and probe listings a steered request is checked against are cached until a
    swap: this process's own, or another's, which reaches this one as the worker's control
    message (ScoreHub.swaps)."""
    from engine_worker.scores.bookkeeping import swapped_message

    class ListingEngine:
        def __init__(self):
            self.calls = 0

        async def collective_rpc(self, method, args=()):
            self.calls += 1
            return [{"method": method, "version": self.calls}]

    hub = idle_hub()
    middleware = ProbexMiddleware(RecordingApp(), hub=hub)
    engine = ListingEngine()
    scope = {"app": type("App", (), {"state": type("State", (), {"engine_client": engine})()})()}

    async def listings():
        return await middleware._current_listings(scope)

    first = asyncio.run(listings())
    assert asyncio.run(listings()) is first and engine.calls == 2  # cached: steering + probes, read once
    middleware._retention_enabled = False  # a swap also schedules the retention check; not this test's
    ingest(hub, swapped_message("probes", 2, ["/probes/new"]))
    second = asyncio.run(listings())
    assert second is not first and engine.calls == 4
    assert asyncio.run(listings()) is second and engine.calls == 4


def test_each_probe_set_swapped_in_gets_its_retention_check_once_in_every_process():
    """A swap reaches a process as its own request's reply or as the worker's broadcast,
    whichever comes first: the retention check is scheduled once per probe-set version."""
    from engine_worker.scores.bookkeeping import swapped_message

    hub = idle_hub()
    middleware = ProbexMiddleware(RecordingApp(), hub=hub)
    scheduled = []
    middleware.retention.schedule = scheduled.append
    ingest(hub, swapped_message("probes", 2, ["/probes/a"]))  # another process's swap
    middleware._schedule_retention(2, ["/probes/a"])         # or this one's reply, after it
    ingest(hub, swapped_message("steering", 4))                # steering has no retention check
    middleware._schedule_retention(3, ["/probes/b"])          # this process's next swap
    ingest(hub, swapped_message("probes", 3, ["/probes/b"]))  # and its broadcast, after it
    assert scheduled == [["/probes/a"], ["/probes/b"]] and hub.swaps == 3


def test_a_streamed_requests_way_through_the_process_is_timed_running_and_paused():
    """Into the hub's loop-time stats (so /probex/health and the benchmark's phases have them),
    for the tap running and paused alike, and apart for the running one (`*_running`): the way in (the middleware's look at the request),
    vLLM's time to its first chunk (a data event; a chat stream's role chunk here), and that
    chunk's way out (decorated, where the tap runs), once per request."""
    _, last, _, waits = run_stream(ROLE_TWO_TEXT_CHUNKS_STOP, step_feed([[0.0, 0.0], [1.0], [2.0]]))
    loop = waits["loop_time"]
    assert last == "[DONE]"
    parts = ("request_way_in", "vllm_to_first_chunk", "first_chunk_out")
    assert all(loop[kind]["count"] == loop[kind + "_running"]["count"] == 1 for kind in parts)
    assert loop["request_way_in"]["total_s"] < 0.04 and loop["first_chunk_out"]["total_s"] < 0.04

    class SlowStream:
        async def __call__(self, scope, receive, send):
            await receive()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await asyncio.sleep(0.03)  # vLLM's prefill
            await send({"type": "http.response.body", "body": b'data: {"choices":[]}\n\n', "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def paused():
        hub = idle_hub()
        hub.paused = True
        middleware = ProbexMiddleware(SlowStream(), hub=hub, tap_config=TapConfig(layers=(3,)))
        body = json.dumps({"prompt": "x", "max_tokens": 2, "stream": True}).encode()
        sent = await post_through(middleware, "/v1/completions", body)
        assert response_body(sent).endswith(b"data: [DONE]\n\n")
        # a response that is not a stream is not timed
        await post_through(middleware, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2}).encode())
        return hub.loop_time_stats()

    loop = asyncio.run(paused())
    assert all(loop[kind]["count"] == 1 and loop[kind + "_running"]["count"] == 0 for kind in parts)
    assert 0.025 <= loop["vllm_to_first_chunk"]["total_s"] < 1.0 and loop["first_chunk_out"]["total_s"] < 0.025


def test_odd_requests_to_the_worker_get_4xx_openai_errors(monkeypatch):
    """What a fuzzing review of the worker found: bodies nested too deeply for Python's parsers
    (500s), vLLM's other generating routes (served unscored), capture asked of a worker without
    capture mode (silently not captured), a non-UTF-8 admin token and wrong methods on
    ProbeX's routes."""
    monkeypatch.setenv("PROBEX_ADMIN_TOKEN", "secret")
    admin = [(b"authorization", b"Bearer secret")]
    deep = "[" * 1000 + "]" * 1000

    async def go():
        app, engine = RecordingApp(), FakeEngineClient()
        middleware = ProbexMiddleware(app, hub=idle_hub(), tap_config=TapConfig(layers=(3,)))
        for raw in ('{"prompt": "hi", "x": %s}' % deep, '{"prompt": "hi", "top_p": NaN, "x": %s}' % deep):
            status, answer = await call_route(middleware, "POST", "/v1/completions", raw.encode())
            assert status == 400 and answer["error"]["message"] == "request body is nested too deeply"
        for path in ("/invocations", "/v1/responses", "/v1/messages", "/v1/chat/completions/batch"):
            status, answer = await call_route(middleware, "POST", path, b'{"model": "m", "messages": []}')
            assert status == 404 and answer["error"]["code"] == "unmonitored_route"
        capture = json.dumps({"prompt": "x", "vllm_xargs": {"probex_capture": True}}).encode()
        status, answer = await call_route(middleware, "POST", "/v1/completions", capture)
        assert status == 400 and answer["error"]["code"] == "capture_off"
        assert app.bodies == []  # none of these reached vLLM
        status, answer = await call_route(middleware, "PUT", "/probex/tap", ('{"paused": %s}' % deep).encode(), admin,
                                          engine)
        assert status == 400 and engine.calls == []
        status, answer = await call_route(middleware, "PUT", "/probex/tap", b'{"paused": true}',
                                          [(b"authorization", b"Bearer caf\xe9")], engine)
        assert status == 401 and engine.calls == []
        status, answer = await call_route(middleware, "POST", "/probex/tap", b"{}", admin, engine)
        assert status == 405 and answer["error"]["type"] == "invalid_request_error"
        status, answer = await call_route(middleware, "POST", "/probex/health")
        assert status == 405 and "error" in answer

    asyncio.run(go())


class VllmChunksApp:
    """Streams a completion's chunks built with vLLM's own response classes, as its server
    builds them, the prompt's ids passed whenever the request asked for token ids."""

    def __init__(self, feed):
        self.feed = feed
        self.prompt_ids_built: list = []  # what the first chunk's choice was built holding

    async def __call__(self, scope, receive, send):
        from vllm.entrypoints.openai.completion.protocol import (CompletionResponseStreamChoice,
                                                                 CompletionStreamResponse)

        body = json.loads((await receive())["body"])
        request_id = dict(scope["headers"])[b"x-request-id"].decode()
        engine_id = f"cmpl-{request_id}-0-deadbeef"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i, token in enumerate((7, 8)):
            asyncio.get_running_loop().call_later(0.02, self.feed, engine_id, i)
            choice = CompletionResponseStreamChoice(
                index=0, text=f"t{i}", logprobs=None, finish_reason=None, stop_reason=None,
                prompt_token_ids=list(range(100, 130)) if i == 0 and body["return_token_ids"] else None,
                token_ids=[token])
            if i == 0:
                self.prompt_ids_built.append(choice.prompt_token_ids)
            chunk = CompletionStreamResponse(id="cmpl-x", created=1, model="m", choices=[choice])
            data = b"data: " + chunk.model_dump_json(exclude_unset=True).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
        asyncio.get_running_loop().call_later(0.02, self.feed, engine_id, 2)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


@pytest.mark.parametrize("client_asked", [False, True])
def test_vllm_leaves_the_prompts_ids_out_unless_the_client_asked_for_token_ids(client_asked):
    """The middleware asks vLLM for token ids on every request; for a client that did not ask,
    vLLM's response classes are built without the prompt's ids (vllm_openai.py), which would
    only be written into the first chunk to be cut out again. The chunks reach the client the
    same either way; a client that asked gets the prompt's ids."""
    feed = step_feed([[0.0, 0.0], [1.0]])

    async def go():
        hub = idle_hub()
        app = VllmChunksApp(lambda engine_id, i: feed(hub, engine_id, i))
        middleware = ProbexMiddleware(app, hub=hub, tap_config=TapConfig(layers=(3,)))
        request = {"model": "m", "prompt": "x", "stream": True, **({"return_token_ids": True} if client_asked else {})}
        sent = await post_through(middleware, "/v1/completions", json.dumps(request).encode())
        events = [e[6:] for e in response_body(sent).decode().split("\n\n") if e.startswith("data: ")]
        return app.prompt_ids_built, [json.loads(e) for e in events if e != "[DONE]"], hub

    built, chunks, hub = asyncio.run(go())
    assert hub.chunks["prompt_ids_cut"].count == 0  # nothing left to cut out
    assert built == [list(range(100, 130)) if client_asked else None]
    assert [c["choices"][0]["text"] for c in chunks] == ["t0", "t1"]
    assert chunks[0]["probex"]["scores"]["p"]["prompt"]["prompt_tokens"] == 2
    assert [len(c["probex"]["scores"]["p"]["generated"]["scores"]) for c in chunks] == [1, 1]
    if client_asked:
        assert chunks[0]["choices"][0]["prompt_token_ids"] == list(range(100, 130))
        assert [c["choices"][0]["token_ids"] for c in chunks] == [[7], [8]]
    else:
        assert all("prompt_token_ids" not in c["choices"][0] and "token_ids" not in c["choices"][0] for c in chunks)
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice

    outside = CompletionResponseStreamChoice(index=0, text="", prompt_token_ids=[1, 2], token_ids=[3])
    assert outside.prompt_token_ids == [1, 2]  # outside a monitored request vLLM's classes are as they were


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


def _completion_events(request_id: str, count: int) -> list[bytes]:
    """A completion stream's events as vLLM writes them for a client that asked for token ids."""
    events = []
    for i in range(count):
        choice = {"index": 0, "text": f"t{i}", "logprobs": None, "finish_reason": None, "stop_reason": None,
                  "prompt_token_ids": list(range(100, 140)) if i == 0 else None, "token_ids": [7 + i]}
        events.append(b"data: " + json.dumps({"id": request_id, "object": "text_completion", "choices": [choice]},
                                             separators=(",", ":")).encode() + b"\n\n")
    return events + [b"data: [DONE]\n\n"]


@pytest.mark.parametrize("framing", ["event_per_message", "all_in_one", "split_anywhere"])
def test_a_stream_is_decorated_alike_however_its_events_are_framed(framing):
    """vLLM sends one event per body message (the relay's quick path); events several to a
    message, or cut across messages, must come out the same."""
    from engine_worker.api_server.relay import StreamRelay
    from engine_worker.api_server.requests import MonitoredCall

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))

    async def go(framing):
        hub = idle_hub()
        call = MonitoredCall(key_prefix="cmpl-probex-frame", stream=True, wants_token_ids=True)
        engine_id = call.key(0) + "-0123abcd"
        ingest(hub, step_message(table, StepView([engine_id], np.array([2]), np.array([0]), np.array([2])),
                                np.array([[0.0], [0.5]], np.float32), []))
        for i in range(1, 4):
            ingest(hub, step_message(table, StepView([engine_id], np.array([1]), np.array([1 + i]), np.array([2])),
                                    np.array([[float(i)]], np.float32), []))
        out = []

        async def send(message):
            out.append(message)

        relay = StreamRelay(hub, call, send, 1.0)
        await relay.send({"type": "http.response.start", "status": 200,
                          "headers": [(b"content-type", b"text/event-stream")]})
        events = _completion_events(call.key_prefix, 4)
        whole = b"".join(events)
        bodies = {"event_per_message": events, "all_in_one": [whole],
                  "split_anywhere": [whole[i:i + 97] for i in range(0, len(whole), 97)]}[framing]
        for number, body in enumerate(bodies):
            await relay.send({"type": "http.response.body", "body": body, "more_body": number < len(bodies) - 1})
        return b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body"), hub

    reference, _ = asyncio.run(go("event_per_message"))
    got, hub = asyncio.run(go(framing))
    assert got == reference
    chunks = [json.loads(e[6:]) for e in got.decode().split("\n\n") if e.startswith("data: {")]
    assert [c["probex"]["scores"]["p"]["generated"]["offset"] for c in chunks] == [0, 1, 2, 3]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == list(range(100, 140))
    assert "prompt" in chunks[0]["probex"]["scores"]["p"]
    assert hub.chunks["spliced"].count == 4


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
