"""What the middleware tests share: a fake vLLM upstream, a hub fed as the worker feeds it
(through the score formatter), and one request through the middleware as an ASGI server sends it."""

import asyncio
import contextlib
import json
import weakref
from unittest import mock

import numpy as np

from engine_worker.api_server.hub import ScoreHub
from engine_worker.scores.bookkeeping import ProbeTable, StepView, step_message
from engine_worker.scores.formatter import ScoreFormatter
from engine_worker.scores.wire import BROADCAST
from engine_worker.tap.config import TapConfig
from engine_worker.tap.layer import ProbeSlot
from engine_worker.vllm.api_server import VllmMiddleware as ProbexMiddleware


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


@contextlib.contextmanager
def relay_counts():
    """While in the block: `decoded`, the stream chunks the relay decoded (those it did not
    splice), and `prompt_ids_cut`, the chunks it cut a prompt's token ids out of unparsed."""
    from engine_worker.api_server import relay

    counts = {"decoded": 0, "prompt_ids_cut": 0}
    decode, cut = relay._decode_json, relay._without_prompt_token_ids
    cut_from: set[bytes] = set()  # a chunk's bytes may be cut twice (the splice tried first): counted once

    def counting_decode(raw):
        counts["decoded"] += 1
        return decode(raw)

    def counting_cut(payload):
        out = cut(payload)
        if len(out) != len(payload):
            cut_from.add(bytes(payload))
            counts["prompt_ids_cut"] = len(cut_from)
        return out

    with mock.patch.object(relay, "_decode_json", counting_decode), \
            mock.patch.object(relay, "_without_prompt_token_ids", counting_cut):
        yield counts


def run_stream(chunks, feed, separators=(",", ":"), **request):
    """One chat stream of `chunks` through the middleware, `feed` sending the worker's messages:
    (the chunks the client got, its last event, the requests the hub still books, the hub's
    waits with `relay`: the relay's counts, see `relay_counts`)."""
    async def go():
        hub = idle_hub()
        app = FakeEngineApp(hub, chunks, lambda engine_id, i: feed(hub, engine_id, i), separators)
        middleware = ProbexMiddleware(app, hub=hub, tap_config=TapConfig(layers=(3,)))
        body = json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": True, **request}).encode()
        with relay_counts() as counts:
            sent = await post_through(middleware, "/v1/chat/completions", body)
        text = response_body(sent).decode()
        events = [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]
        waits = dict(hub.wait_stats(), relay=counts)
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


class RecordingApp:
    """An upstream that answers 200 {} and keeps what reached it."""

    def __init__(self):
        self.bodies, self.request_ids = [], []

    async def __call__(self, scope, receive, send):
        self.bodies.append((await receive())["body"])
        self.request_ids.append(dict(scope["headers"]).get(b"x-request-id"))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})


def post_raw(raw: bytes, headers=()):
    """`raw` posted to /v1/completions of a worker (its admin token, if any, from the
    environment): (the upstream, the status, the answer's body)."""
    async def go():
        app = RecordingApp()
        middleware = ProbexMiddleware(app, hub=idle_hub(), tap_config=TapConfig(layers=(3,)))
        sent = await post_through(middleware, "/v1/completions", raw, headers=headers)
        return app, sent[0]["status"], response_body(sent)

    return asyncio.run(go())


# The admin token the middleware tests start workers with, and the header that carries it.
ADMIN_TOKEN = "secret"
ADMIN = [(b"authorization", b"Bearer " + ADMIN_TOKEN.encode())]


def post_raw_paused(raw: bytes):
    async def go():
        app, hub = RecordingApp(), idle_hub()
        hub.set_paused(True)
        middleware = ProbexMiddleware(app, hub=hub, tap_config=TapConfig(layers=(3,)))
        sent = await post_through(middleware, "/v1/completions", raw)
        return app, sent[0]["status"]

    return asyncio.run(go())


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
