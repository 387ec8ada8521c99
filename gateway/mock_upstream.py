"""A fast stand-in for `probex worker`, for gateway unit tests and the gateway benchmark.

It speaks the worker's HTTP surface (OpenAI endpoints with a `probex` field, `/probex/probes`,
`/probex/health`) and streams at a fixed token rate. Scores are a deterministic function
of the prompt text, so tests can steer decisions:
- a prompt containing "bomb" scores 0.95 on every probe, anything else 0.05;
- generated token j of a prompt containing "escalate" scores min(0.99, 0.1 + 0.1 j).
It proves nothing about monitoring (the engine tests do that); it isolates the gateway.

A request may set its own token rate with a `mock_tokens_per_s` field (the gateway forwards
the body as it is). Each token is due one interval after the previous one was due, so late
timer wake-ups do not slow a stream down; a stream that falls a whole interval behind starts
its schedule again instead of catching up in a burst (tests rely on tokens never arriving
back to back).

With `timestamps` (`--timestamps`) every stream chunk carries `"mock_ns": {"request": ..., "sent": ...}`:
CLOCK_MONOTONIC nanoseconds (system-wide on Linux) when the request reached the mock and when the
chunk was handed to the server. The gateway benchmark uses them to take the mock's own time out of
what it measures.

    python -m gateway.mock_upstream --port 8100 --tokens-per-s 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "mock-model"
WORDS = "The quick brown fox jumps over the lazy dog and keeps on running".split()


class MockState:
    def __init__(self, probes: list[str], tokens_per_s: float, max_tokens: int = 16,
                 admin_token: str | None = None, timestamps: bool = False) -> None:
        self.probes = probes
        self.tokens_per_s = tokens_per_s
        self.default_max_tokens = max_tokens
        self.admin_token = admin_token
        self.retention: dict[str, float] = {}
        self.requests_seen: list[dict] = []
        self.client_ports: list[int | None] = []  # per completion request: which connection it came on
        self.aborted = 0
        self.timestamps = timestamps


def _prompt_of(body: dict, chat: bool) -> str:
    """The text a request scores on: the chat messages for chat completions (a list, checked
    before), the prompt for completions, whatever else the body carries."""
    if chat:
        return " ".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    return str(body.get("prompt", ""))


def _prompt_score(text: str) -> float:
    return 0.95 if "bomb" in text.lower() else 0.05


def _token_score(text: str, j: int) -> float:
    return min(0.99, 0.1 + 0.1 * j) if "escalate" in text.lower() else 0.05


async def _hung_up_within(request: Request, seconds: float) -> bool:
    """Wait `seconds`, or less if the caller hangs up first: whether it did."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    try:
        await asyncio.wait_for(disconnected(), seconds)
    except asyncio.TimeoutError:
        return False
    return True


def create_mock_app(state: MockState) -> Starlette:
    async def health(request: Request):
        return Response(status_code=200)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def probes_route(request: Request):
        if request.method == "PUT":
            if state.admin_token and request.headers.get("authorization") != f"Bearer {state.admin_token}":
                return JSONResponse({"error": {"message": "admin token required"}}, status_code=401)
            body = await request.json()
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in body["probes"]]
            if any("reject" in n for n in names):
                return JSONResponse({"error": {"message": "probe rejected by mock"}}, status_code=400)
            state.probes = names
        return JSONResponse({"version": 1, "probes": [{"name": n} for n in state.probes]})

    async def probex_health(request: Request):
        return JSONResponse({"probes": state.probes, "retention": state.retention})

    async def completions(request: Request):
        received = time.monotonic_ns()
        body = await request.json()
        state.requests_seen.append(body)
        state.client_ports.append(request.client.port if request.client else None)
        chat = request.url.path.endswith("/chat/completions")
        if body.get("model") != MODEL:
            return JSONResponse({"error": {"message": "model not found", "type": "NotFoundError"}}, status_code=404)
        messages, max_tokens = body.get("messages"), body.get("max_tokens")
        if (chat and not isinstance(messages, list)) or (not chat and not isinstance(body.get("prompt"), (str, list))) \
                or not (max_tokens is None or (isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
                                               and 0 < max_tokens <= 4096)):
            return JSONResponse({"error": {"message": "invalid request", "type": "BadRequestError"}}, status_code=400)
        text = _prompt_of(body, chat)
        n = int(max_tokens or state.default_max_tokens)
        prompt_tokens = max(1, len(text.split()))
        prompt = {name: {"score": _prompt_score(text), "read": "last_prompt_token",
                         "prompt": {"last": _prompt_score(text), "last_raw": 0.0, "mean": _prompt_score(text),
                                    "max": _prompt_score(text), "tokens_scored": prompt_tokens,
                                    "prompt_tokens": prompt_tokens}} for name in state.probes}
        rid = f"{'chatcmpl' if chat else 'cmpl'}-mock-{uuid.uuid4().hex[:12]}"
        created = int(time.time())
        words = [WORDS[j % len(WORDS)] + " " for j in range(n)]
        rate = body.get("mock_tokens_per_s", state.tokens_per_s)
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not rate >= 0:  # NaN too
            return JSONResponse({"error": {"message": "invalid mock_tokens_per_s", "type": "BadRequestError"}},
                                status_code=400)
        if not body.get("stream"):
            if rate and await _hung_up_within(request, n / rate):
                state.aborted += 1  # as vLLM drops a request whose caller left
                return Response(status_code=499)
            scores = {name: {**prompt[name], "generated": {"scores": [_token_score(text, j) for j in range(n)],
                                                           "max": max(_token_score(text, j) for j in range(n))}}
                      for name in state.probes}
            content = "".join(words)
            choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": content, "finish_reason": "length"})
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "created": created, "model": MODEL, "choices": [choice],
                                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                           "total_tokens": prompt_tokens + n},
                                 "probex": {"scores": scores}})

        async def events():
            obj = "chat.completion.chunk" if chat else "text_completion"
            loop = asyncio.get_running_loop()
            due = loop.time()
            try:
                if chat:
                    first = {"id": rid, "object": obj, "created": created, "model": MODEL,
                             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "finish_reason": None}], "probex": {"scores": prompt}}
                    if state.timestamps:
                        first["mock_ns"] = {"request": received, "sent": time.monotonic_ns()}
                    yield b"data: " + json.dumps(first).encode() + b"\n\n"
                for j, word in enumerate(words):
                    if rate:
                        now = loop.time()
                        due = due + 1 / rate if due + 1 / rate > now else now + 1 / rate
                        await asyncio.sleep(due - now)
                    piece = {"delta": {"content": word}} if chat else {"text": word}
                    scores = {name: {"generated": {"offset": j, "scores": [_token_score(text, j)]}}
                              for name in state.probes}
                    if not chat and j == 0:
                        scores = {name: {**prompt[name], **scores[name]} for name in state.probes}
                    chunk = {"id": rid, "object": obj, "created": created, "model": MODEL,
                             "choices": [{"index": 0, **piece, "finish_reason": "length" if j == n - 1 else None}],
                             "probex": {"scores": scores}}
                    if state.timestamps:
                        chunk["mock_ns"] = {"request": received, "sent": time.monotonic_ns()}
                    yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            except asyncio.CancelledError:
                state.aborted += 1
                raise

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/probex/probes", probes_route, methods=["GET", "PUT"]),
        Route("/probex/health", probex_health),
    ]
    app = Starlette(routes=routes)
    app.state.mock = state
    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--tokens-per-s", type=float, default=200.0)
    parser.add_argument("--probe", action="append", default=["harmful-request"])
    parser.add_argument("--timestamps", action="store_true", help="stamp every stream chunk with mock_ns (see above)")
    parser.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                        help="event loop (uvloop's timers tick in whole milliseconds; asyncio's sleep as long "
                             "as asked or longer)")
    args = parser.parse_args()
    uvicorn.run(create_mock_app(MockState(args.probe, args.tokens_per_s, timestamps=args.timestamps)),
                host="127.0.0.1", port=args.port, log_level="warning", loop=args.loop)


if __name__ == "__main__":
    main()
