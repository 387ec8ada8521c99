"""The SGLang middleware (engine_worker/sglang/api_server.py) against a stand-in of SGLang's
OpenAI app and tokenizer manager: request ids as rids, options as custom_params, tokens per
chunk from SGLang's usage, the engine RPC over the internal-state request."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from engine_worker.sglang import api_server as sgl_api
from engine_worker.sglang.runner import RPC_KEY


def run(coro):
    return asyncio.run(coro)


def call(app, path, body, headers=(), ids_unwanted=True):
    """One request through `app` as the middleware hands it on; (status, response body bytes)."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "path": path, "method": "POST",
             "headers": [(b"content-type", b"application/json"), *headers]}
    sent = []

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        sent.append(message)

    async def go():
        if ids_unwanted:
            with sgl_api._IdsUnwanted():
                await app(scope, receive, send)
        else:
            await app(scope, receive, send)

    run(go())
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


class FakeSglang:
    """Answers like SGLang 0.5.14's OpenAI server (serving_chat.py): the rid as the id; in a
    stream, a chunk per piece of new text with the usage so far when continuous usage is asked
    for, no chunk for a token without text (`silent`, e.g. the stop token), a closing
    finish_reason chunk without usage, then the usage chunk if include_usage."""

    def __init__(self, tokens=("He", "llo", " there"), silent=1):
        self.tokens = tokens
        self.silent = silent
        self.bodies = []

    async def __call__(self, scope, receive, send):
        body = json.loads((await receive())["body"])
        self.bodies.append(body)
        rid = body.get("rid") or "chatcmpl-sglang"
        generated = len(self.tokens) + self.silent
        if not body.get("stream"):
            payload = {"id": rid, "choices": [{"index": 0, "message": {"content": "".join(self.tokens)}}],
                       "usage": {"prompt_tokens": 4, "completion_tokens": generated}}
            data = json.dumps(payload).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data})
            return
        options = body.get("stream_options") or {}

        def chunk(delta, done=None, finish=None):
            out = {"id": rid, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if options.get("continuous_usage_stats") and done is not None:
                out["usage"] = {"prompt_tokens": 4, "completion_tokens": done}
            return b"data: " + json.dumps(out).encode() + b"\n\n"

        events = [chunk({"role": "assistant", "content": ""}), chunk({"content": self.tokens[0]}, 1),
                  chunk({"content": "".join(self.tokens[1:])}, len(self.tokens)),
                  chunk({}, finish="stop")]
        if options.get("include_usage"):
            events.append(b'data: {"id": "%s", "choices": [], "usage": {"completion_tokens": %d}}\n\n'
                          % (rid.encode(), generated))
        events.append(b"data: [DONE]\n\n")
        stream = b"".join(events)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(0, len(stream), 37):  # events split across body messages
            await send({"type": "http.response.body", "body": stream[i:i + 37], "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


PROBEX_ID = (b"x-request-id", b"probex-0123456789abcdef0123456789abcdef")


def test_a_monitored_chat_runs_under_the_middlewares_id_with_its_options_as_custom_params():
    engine = FakeSglang()
    app = sgl_api.SglangOpenAI(engine)
    status, body = call(app, "/v1/chat/completions",
                        {"messages": [], "return_token_ids": True, "custom_params": {"mine": 1},
                         "vllm_xargs": {"probex_recompute": 1}}, [PROBEX_ID])
    sent = engine.bodies[0]
    assert status == 200 and sent["rid"] == "chatcmpl-probex-0123456789abcdef0123456789abcdef"
    assert sent["custom_params"] == {"mine": 1, "probex_recompute": 1}
    assert "vllm_xargs" not in sent and "return_token_ids" not in sent
    payload = json.loads(body)
    assert payload["choices"][0]["token_ids"] == [0] * 4  # counted by the relay, then removed


def test_a_completions_rid_is_the_choice_key():
    assert sgl_api.engine_request_id("/v1/completions", "probex-ab") == "cmpl-probex-ab-0"
    assert sgl_api.engine_request_id("/v1/chat/completions", "probex-ab") == "chatcmpl-probex-ab"


def test_stream_chunks_carry_their_token_counts_and_only_the_usage_asked_for():
    engine = FakeSglang()
    app = sgl_api.SglangOpenAI(engine)
    status, body = call(app, "/v1/chat/completions", {"messages": [], "stream": True}, [PROBEX_ID])
    assert engine.bodies[0]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    # the stop token adds no text: the closing chunk carries it, counted from the usage chunk
    assert [len(c["choices"][0]["token_ids"]) for c in chunks] == [0, 1, 2, 1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks)  # neither per chunk nor the closing usage chunk


def test_a_stream_without_a_usage_chunk_still_sends_its_closing_chunk():
    counter = sgl_api.ChunkCounter({"usage": False, "continuous": False})
    closing = b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}\n\n'
    assert counter.stream(closing, more=True) == b""  # held for the usage chunk
    out = counter.stream(b"data: [DONE]\n\n", more=False)
    events = [e for e in out.split(b"\n\n") if e]
    assert json.loads(events[0][6:])["choices"][0]["token_ids"] == [] and events[1] == b"data: [DONE]"


def test_error_and_extension_chunks_without_choices_are_kept():
    counter = sgl_api.ChunkCounter({"usage": False, "continuous": False})
    error = b'data: {"error": {"object": "error", "message": "Generation aborted.", "code": 500}}'
    sglext = b'data: {"id": "x", "choices": [], "sglext": {"cached_tokens_details": {}}}'
    out = counter.stream(error + b"\n\n" + sglext + b"\n\n", more=False)
    assert out == error + b"\n\n" + sglext + b"\n\n"


def test_a_client_asking_for_usage_keeps_it():
    engine = FakeSglang()
    app = sgl_api.SglangOpenAI(engine)
    _, body = call(app, "/v1/chat/completions", {"messages": [], "stream": True,
                                                 "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                   [PROBEX_ID])
    chunks = [json.loads(e[6:]) for e in body.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert [("usage" in c) for c in chunks[:-1]] == [False, True, True, False]  # as SGLang sent them
    assert [len(c["choices"][0]["token_ids"]) for c in chunks[:-1]] == [0, 1, 2, 1]


def test_what_sglang_cannot_serve_monitored_is_refused():
    app = sgl_api.SglangOpenAI(FakeSglang())
    status, body = call(app, "/v1/chat/completions", {"messages": [], "return_token_ids": True}, [PROBEX_ID],
                        ids_unwanted=False)
    assert status == 400 and b"return_token_ids is not available on SGLang" in body
    status, body = call(app, "/v1/completions", {"prompt": ["a", "b"]}, [PROBEX_ID])
    assert status == 400 and b"several prompts" in body


def test_unmonitored_requests_pass_with_their_options_moved():
    engine = FakeSglang()
    app = sgl_api.SglangOpenAI(engine)
    status, body = call(app, "/v1/chat/completions", {"messages": [], "vllm_xargs": {"probex_recompute": 1}},
                        [(b"x-request-id", b"client-id")])
    assert status == 200 and "rid" not in engine.bodies[0]
    assert engine.bodies[0]["custom_params"] == {"probex_recompute": 1}
    assert "token_ids" not in json.loads(body)["choices"][0]


def test_engine_rpc_rides_on_the_internal_state_request():
    sent = []

    class Communicator:
        async def __call__(self, request):
            sent.append(request)
            return [SimpleNamespace(server_args={RPC_KEY: {"ok": True, "version": 2}})]

    manager = SimpleNamespace(auto_create_handle_loop=lambda: None, set_internal_state_communicator=Communicator())

    class Middleware(sgl_api.SglangMiddleware):
        def tokenizer_manager(self):
            return manager

        def rpc_request(self, server_args):
            return SimpleNamespace(server_args=server_args)

    middleware = Middleware(FakeSglang(), hub=SimpleNamespace(on_probes_swapped=None, on_probes_unannounced=None))
    answer = run(middleware.engine_rpc(None, "probex_load_probes", ["/p"]))
    assert answer == [{"ok": True, "version": 2}]
    assert sent[0].server_args == {RPC_KEY: {"method": "probex_load_probes", "args": [["/p"]]}}
