"""What ProbeX adds in the API server process on a request's way to its first token, in µs.

One process, no engine: vLLM's side is a stand-in ASGI app that answers a streamed completion
with one chunk in vLLM's compact form, and the worker's side is the score formatter whose
frames the hub files, as the score ring would bring them. Timed, per request (medians over
`--requests`):

- the middleware's request path: from the request's arrival to the stand-in app being called
  (reading the body, the fast path's rewrite, the relay set up);
- the first chunk: from the app sending it to it leaving the middleware, the prompt's scores
  spliced in (they are in by then: `probex worker` reports how many first chunks waited for
  them in `/probex/health` `score_waits.prompt`);
- the hub filing one prompt step of `--prompt-tokens` rows (the API server's share of
  delivering the scores; the formatter's layout of them runs in its own process and is
  timed apart).

    .venv/bin/python -m bench.first_chunk_cost --out out/first-chunk-cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from engine_worker.api_server.hub import ScoreHub
from engine_worker.scores.bookkeeping import ProbeTable, StepView, step_message
from engine_worker.scores.formatter import ScoreFormatter
from engine_worker.scores.wire import BROADCAST
from engine_worker.tap.config import TapConfig
from engine_worker.tap.layer import ProbeSlot
from engine_worker.vllm.api_server import VllmMiddleware


class _Deliver:
    """The formatter's frames for one hub, as its subscription filters them; times both halves."""

    def __init__(self, hub: ScoreHub) -> None:
        self.hub, self.formatter = hub, ScoreFormatter(api_server_count=1)
        self.formatter_us: list[float] = []
        self.hub_us: list[float] = []

    def step(self, message: dict) -> None:
        t0 = time.perf_counter()
        frames = self.formatter.take(message)
        t1 = time.perf_counter()
        for topic, payload in frames:
            if topic in (self.hub._topic, BROADCAST):
                self.hub.take_formatted(topic, payload)
        self.formatter_us.append((t1 - t0) * 1e6)
        self.hub_us.append((time.perf_counter() - t1) * 1e6)


class _EngineStandIn:
    """Answers like vLLM's completion stream: the prompt's step is delivered, then one chunk."""

    def __init__(self, deliver: _Deliver | None, table: ProbeTable, prompt_tokens: int) -> None:
        self.deliver, self.table, self.prompt_tokens = deliver, table, prompt_tokens
        self.entered = self.sent = 0.0

    async def __call__(self, scope, receive, send) -> None:
        self.entered = time.perf_counter()
        await receive()
        headers = dict(scope["headers"])
        engine_id = f"cmpl-{headers.get(b'x-request-id', b'plain').decode()}-0-0123abcd"
        if self.deliver is not None:
            n, columns = self.prompt_tokens, len(self.table.slots)
            self.deliver.step(step_message(self.table, StepView([engine_id], np.array([n]), np.array([0]), np.array([n])),
                                           np.random.rand(n, columns).astype(np.float32), []))
            self.deliver.step(step_message(self.table, StepView([engine_id], np.array([1]), np.array([n]), np.array([n])),
                                           np.random.rand(1, columns).astype(np.float32), []))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        choice = {"index": 0, "text": " w", "logprobs": None, "finish_reason": None, "stop_reason": None, "token_ids": [7]}
        chunk = {"id": engine_id, "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
        self.sent = time.perf_counter()
        await send({"type": "http.response.body", "more_body": True,
                    "body": b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"})


async def _one(entry, app: _EngineStandIn, body: bytes) -> tuple[float, float, bytes]:
    queue = [{"type": "http.request", "body": body, "more_body": False}]
    first: list[float] = []
    chunk: list[bytes] = []

    async def receive():
        return queue.pop(0)

    async def send(message):
        if message["type"] == "http.response.body" and not first:
            first.append(time.perf_counter())
            chunk.append(message["body"])

    scope = {"type": "http", "path": "/v1/completions", "method": "POST", "query_string": b"", "app": None,
             "headers": [(b"content-type", b"application/json")]}
    arrived = time.perf_counter()
    await entry(scope, receive, send)
    return (app.entered - arrived) * 1e6, (first[0] - app.sent) * 1e6, chunk[0]


async def measure(requests: int, prompt_tokens: int, probes: int) -> dict:
    table = ProbeTable(version=1, slots=tuple(ProbeSlot(f"probe-{i}", 10 if i < probes // 2 else 20, i % max(1, probes // 2),
                                                        "last_prompt_token", 1.0, 0.0) for i in range(probes)))
    rng = random.Random(0)
    body = json.dumps({"model": "m", "prompt": " ".join(f"w{rng.randrange(5000)}" for _ in range(prompt_tokens)),
                       "max_tokens": 256, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}}).encode()
    hub = ScoreHub("inproc://unused")
    hub.start = lambda: None  # frames are filed by `_Deliver`, not a socket
    deliver = _Deliver(hub)
    monitored = _EngineStandIn(deliver, table, prompt_tokens)
    middleware = VllmMiddleware(monitored, hub=hub, tap_config=TapConfig(layers=(10, 20)))
    plain = _EngineStandIn(None, table, prompt_tokens)
    result: dict = {}
    for label, entry, app in (("plain", plain, plain), ("middleware", middleware, monitored)):
        for _ in range(20):  # warm-up
            await _one(entry, app, body)
        timings = [await _one(entry, app, body) for _ in range(requests)]
        if label == "middleware" and not all(b'"probex":{"scores":{"probe-0":{' in t[2] and b'"prompt":' in t[2]
                                             for t in timings):
            raise RuntimeError("a first chunk left without its prompt's scores: the timing would not be the spliced path's")
        result[label] = {"request_path_us": statistics.median(t[0] for t in timings),
                         "first_chunk_us": statistics.median(t[1] for t in timings)}
    result["hub_filing_us"] = statistics.median(deliver.hub_us[::2])  # the prompt steps
    result["formatter_layout_us"] = statistics.median(deliver.formatter_us[::2])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.first_chunk_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--probes", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.requests, args.prompt_tokens, args.probes))
    result = {"benchmark": "python -m bench.first_chunk_cost", "command": [sys.executable, "-m", "bench.first_chunk_cost",
                                                                          *(argv if argv is not None else sys.argv[1:])],
              "requests": args.requests, "prompt_tokens": args.prompt_tokens, "probes": args.probes, **result}
    added = (result["middleware"]["request_path_us"] - result["plain"]["request_path_us"]
             + result["middleware"]["first_chunk_us"] - result["plain"]["first_chunk_us"] + result["hub_filing_us"])
    result["added_before_first_token_us"] = added
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
