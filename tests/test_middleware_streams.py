"""Stream relay with a fake upstream: each chunk waits (bounded) for its tokens' scores and
carries them; token ids reach only clients that asked; a pause ends the waits."""

import asyncio
import json

import numpy as np
import pytest

from engine_worker.scores.bookkeeping import ProbeTable, StepView, step_message
from engine_worker.tap.config import TapConfig
from engine_worker.tap.layer import ProbeSlot
from engine_worker.vllm.api_server import VllmMiddleware as ProbexMiddleware
from probes.scoring import calibrate
from tests.middleware_fixtures import (idle_hub, ingest, post_through, relay_counts, response_body,
                                       ROLE_TWO_TEXT_CHUNKS_STOP, run_stream, step_feed)


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


def test_missing_scores_do_not_hang_the_stream(monkeypatch):
    monkeypatch.setenv("PROBEX_SCORE_WAIT_S", "0.2")
    chunks = [{"delta": {"content": "a"}, "token_ids": [7]}]
    out, last, _, waits = run_stream(chunks, lambda hub, engine_id, i: None)
    assert last == "[DONE]"
    assert out[0].get("probex", {}).get("scores", {}) == {}
    # the chunk waited once (its splice found nothing to write and the decoded path did not wait again)
    assert waits["prompt"]["waited"] == 1 and 0.15 < waits["prompt"]["waited_s"] < 0.4


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")], ids=["compact", "spaced"])
@pytest.mark.parametrize("client_asked", [False, True])
def test_token_ids_reach_only_clients_that_asked_for_them(separators, client_asked):
    """Compact chunks (vLLM's) lose their prompt ids unparsed, spaced ones once decoded; a
    client that asked for token ids gets both lists untouched."""
    request = {"return_token_ids": True} if client_asked else {}
    out, _, _, waits = run_stream(ROLE_TWO_TEXT_CHUNKS_STOP, step_feed([[0.0, 0.0], [1.0], [2.0]]), separators,
                                  **request)
    # this stand-in for vLLM writes the prompt's ids whoever asked: cut unparsed where compact
    compact = separators == (",", ":")
    assert waits["relay"]["prompt_ids_cut"] == int(compact and not client_asked)
    assert [c["choices"][0]["delta"] for c in out] == [c["delta"] for c in ROLE_TWO_TEXT_CHUNKS_STOP]
    assert out[1]["probex"]["scores"]["p"]["prompt"]["prompt_tokens"] == 2
    if client_asked:
        assert out[0]["prompt_token_ids"] == [1, 2] and [c["choices"][0]["token_ids"] for c in out] == [[], [7], [8, 9], []]
    else:
        assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c for c in out)


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
        with relay_counts() as counts:
            sent = await post_through(middleware, "/v1/completions", json.dumps(request).encode())
        events = [e[6:] for e in response_body(sent).decode().split("\n\n") if e.startswith("data: ")]
        return app.prompt_ids_built, [json.loads(e) for e in events if e != "[DONE]"], counts

    built, chunks, counts = asyncio.run(go())
    assert counts["prompt_ids_cut"] == 0  # nothing left to cut out
    assert counts["decoded"] == 0  # chunks as vLLM's classes write them take the splice, the first one too
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
        return b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body")

    reference = asyncio.run(go("event_per_message"))
    with relay_counts() as counts:
        got = asyncio.run(go(framing))
    assert got == reference
    chunks = [json.loads(e[6:]) for e in got.decode().split("\n\n") if e.startswith("data: {")]
    assert [c["probex"]["scores"]["p"]["generated"]["offset"] for c in chunks] == [0, 1, 2, 3]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == list(range(100, 140))
    assert "prompt" in chunks[0]["probex"]["scores"]["p"]
    assert counts["decoded"] == 0  # every chunk spliced, however it came
