"""CPU benchmark of the worker's per-step hand-off: what ProbeX runs in the engine process per step.

No engine and no GPU: CPU `LayerTap`s (2 layers x 4 probes, like `probex bench engine`), a
`TapController` whose publisher encodes each message as the real one does (msgpack) and
drops it, and a loop standing in for the engine thread that calls `after_forward` once per
decode step of N requests. Reported per step:

- `inline_us`: hook + consume on one thread (`threaded=False`): the CPU the hand-off costs;
- `hook_us` with the transfer thread on, while between steps the engine thread runs
  Python for `--python-us` (vLLM's scheduling and output processing) and then waits with
  the GIL released for `--wait-us` (the GPU): what the engine thread pays once the two
  threads share the GIL;
- `step_us`: the whole stand-in step; against `baseline_step_us` (the same loop without
  ProbeX) it is the slowdown;
- `consume_us`: the transfer thread's wall time per step (waiting for the GIL included).

Then the same inline hook + consume by its parts (layout, gather, message, publish), in a tight
loop and right after a `--wait-us` sleep, for a decode step of each `--requests` and for a
`--prompt-tokens`-row prefill (`consume_parts_cold` in the JSON): a thread back from a wait
runs this code several times slower, which is the state the engine thread is in.

Then the host steps on a first token's way, for one request with a `--prompt-tokens`-token
prompt prefilled in one step (medians over `--repeats`; `first_token` in the JSON):

- `request_us`: the middleware's reading of the request body, `probex bench engine`'s
  (the prompt as token ids, `return_token_ids` asked for), on its way to vLLM
  (`middleware.body_as_sent`); `request_decoded_us` the same body decoded, checked and
  re-encoded (the path of a request with a ProbeX option), timed side by side;
- `prefill_step_us`: the worker's hook + consume of that step, inline (layout, gather, the
  step message built and msgpack-encoded);
- `decode_us`: the API server's msgpack decoding of that message (its receive loop's, before
  the intake; a 1024-token prompt's rows, where they go out, make it 32 KB);
- `intake_us`: the API server's `ScoreHub.ingest` of that message (the books, the prompt
  summary, the first token's calibrated scores);
- `formatter_prefill_step_us`: a score formatter's decoding and formatting of that message
  (`--score-formatter`; in its own process when served), and `formatted_received_us` the API
  server's decoding and filing of what it sends instead;
- `first_chunk_us`: vLLM's first stream chunk (compact JSON, as vLLM writes it) through the
  middleware as served, its relay (which splices the prompt's scores in) and the request's
  timer: the part `probex bench engine` reports as the first chunk's way out of the
  middleware; `first_chunk_ids_us` the same for a client that asked for the token ids
  (`probex bench engine`'s requests), whose first chunk carries the prompt's ids and keeps
  them (for any other client vLLM leaves them out, engine_worker/vllm_openai.py);
  `first_chunk_paused_us` that chunk with the tap paused, the timer alone passing it on;
- `vllm_first_chunk_us`, `vllm_first_chunk_ids_us`: vLLM's own building and writing of that
  first chunk without and with the prompt's ids (where vLLM is installed);
- `token_chunk_us`: a later one-token chunk the same way (its scores spliced into its
  bytes).

The chunks are `/v1/completions` ones, what `probex bench engine` streams, in vLLM 0.25's form.

And the API server's share of one decode step of N streaming requests (`api_decode_step`
in the JSON; medians over `--steps`), what grows with the number of streams:

- `intake_us`: `ScoreHub.ingest` of the step's message (N sampled tokens);
- `chunks_us`: the N one-token chunks that step produces, decorated one after another;
  `chunks_decoded_us` the same with every chunk decoded and re-encoded instead of spliced
  (`first_chunk_decoded_us` and `token_chunk_decoded_us` likewise on the first token's way),
  timed side by side with the spliced ones, step by step;
- and the same for one of `--api-server-count` processes (default 4; `processes` in the
  JSON): its hub takes in each step's whole message and books its own quarter of the rows,
  its relays decorate its quarter of the chunks, each process's load in `probex bench
  engine`'s four-process runs.

    python3 -m probex.bench_handoff --out out/bench-handoff.json
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

HIDDEN = 64


def _controller(threaded: bool, root: Path, ring: bool = False):
    """Eight probes over two tapped layers; `ring`: handing each step to a score ring
    (engine_worker/score_ring.py) instead of consuming it (`publish` only encodes: no socket)."""
    from engine_worker.tap.controller import TapController
    from engine_worker.tap.layer import LayerTap
    from probes.artifact import ProbeArtifact, ReadPoint, ServedModel, save_probe

    served = ServedModel.from_hf_config({"model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": 4,
                                         "architectures": ["LlamaForCausalLM"]}, name="bench")
    taps = {1: LayerTap(1, HIDDEN, capacity=4, max_rows=8192), 3: LayerTap(3, HIDDEN, capacity=4, max_rows=8192)}
    reads = [ReadPoint.LAST_PROMPT_TOKEN, ReadPoint.PROMPT_MEAN]
    rng = np.random.default_rng(0)
    probes = [save_probe(ProbeArtifact(name=f"p{i}", layer=1 if i < 4 else 3, read=reads[i % 2],
                                       weight=rng.standard_normal(HIDDEN).astype(np.float32), bias=0.0,
                                       model={"name": "bench"}), root / f"p{i}") for i in range(8)]
    encoder = msgspec.msgpack.Encoder()
    publisher = None
    if ring:
        from engine_worker.scores.ring import RingPublisher, ScoreRing

        publisher = RingPublisher(ScoreRing.create({layer: tuple(tap.scores.shape) for layer, tap in taps.items()}),
                                  heartbeat_s=0)
    controller = TapController(taps, served, lambda message: encoder.encode(message), threaded=threaded,
                               ring=publisher)
    controller.load([str(p) for p in probes])
    return controller


def engine_steps(steps: int, python_us: float, wait_us: float, hook=None) -> tuple[float, float]:
    """(mean step, mean hook) in seconds of the stand-in engine loop, with or without a per-step hook."""
    hook_s = 0.0
    began = time.perf_counter()
    for step in range(steps):
        if hook is not None:
            started = time.perf_counter()
            hook(step)
            hook_s += time.perf_counter() - started
        spin_until = time.perf_counter() + python_us * 1e-6
        while time.perf_counter() < spin_until:
            pass
        if wait_us:
            time.sleep(wait_us * 1e-6)  # releases the GIL, as a wait for the GPU does
    return (time.perf_counter() - began) / steps, hook_s / steps


def wake_cost_us(sleep_s: float, repeats: int = 300) -> float:
    """Mean time to build one 8-request StepLayout right after sleeping `sleep_s` (0: tight loop).

    On a VM a thread back from a few milliseconds of sleep runs its first microseconds of
    work several times slower (cold caches and clocks); the stand-in loop sleeps every
    step, so its hook times carry that cost, which a GPU host's engine thread may not."""
    from engine_worker.scores.bookkeeping import StepLayout

    ids = [f"req-{i}" for i in range(8)]
    total = 0.0
    for _ in range(repeats):
        if sleep_s:
            time.sleep(sleep_s)
        started = time.perf_counter()
        StepLayout(ids, np.ones(8, np.int64), np.full(8, 40), np.full(8, 32))
        total += time.perf_counter() - started
    return total / repeats * 1e6


def run(requests: int, steps: int, threaded: bool, python_us: float, wait_us: float) -> dict:
    from engine_worker.scores.bookkeeping import StepLayout

    with tempfile.TemporaryDirectory() as tmp:
        controller = _controller(threaded, Path(tmp))
        ids = [f"req-{i}" for i in range(requests)]
        prompt = 32
        controller.after_forward(StepLayout(ids, np.full(requests, prompt), np.zeros(requests, np.int64),
                                            np.full(requests, prompt)))
        controller.flush()
        consumed_before = controller.transfer.stats.consume_s
        step_s, hook_s = engine_steps(steps, python_us, wait_us, lambda step: controller.after_forward(
            StepLayout(ids, np.ones(requests, np.int64), np.full(requests, prompt + step), np.full(requests, prompt))))
        controller.flush()
        consumed = controller.transfer.stats.consume_s - consumed_before
        controller.transfer.close()
    return {"hook_us": hook_s * 1e6, "consume_us": consumed / steps * 1e6, "step_us": step_s * 1e6}


def consume_parts_cold(requests: int, prompt_tokens: int, sleep_s: float, repeats: int = 300,
                       ring: bool = False) -> dict:
    """The inline hook + consume of one step (`requests` decoding rows, or with `requests` 0 one
    `prompt_tokens`-row prefill), by the consume's parts (`TapController.consume_parts`: layout,
    gather, message, publish; means, µs), in a tight loop and right after sleeping `sleep_s`.

    The engine thread comes to its hooks after vLLM's own scheduling and output processing and
    after waiting for the device, with little of ProbeX's code or data still in the caches; the
    GPU hosts' per-step consumes (0.1-0.2 ms) read like this machine's after a sleep, not like its
    tight loop. Which parts grow most then is where trimming could pay.

    `ring`: the same hook handing each step to a score ring instead (the default since session
    42; its parts are not split: it builds the step's message and writes it to shared memory,
    the scores copied there synchronously on this CPU). A stand-in formatter empties the ring
    between steps, outside the timing."""
    from engine_worker.scores.bookkeeping import StepLayout

    if requests:
        ids = [f"cmpl-probex-{i:032x}-0-0123abcd" for i in range(requests)]

        def layout(step: int) -> StepLayout:
            return StepLayout(ids, np.ones(requests, np.int64), np.full(requests, 40 + step), np.full(requests, 32))
    else:
        def layout(step: int) -> StepLayout:
            return StepLayout([f"cmpl-probex-{step:032x}-0-0123abcd"], np.array([prompt_tokens]),
                              np.zeros(1, np.int64), np.array([prompt_tokens]))
    out: dict = {"requests": requests, "rows": requests or prompt_tokens, "sleep_us": round(sleep_s * 1e6),
                 "handoff": "score ring" if ring else "consumed inline"}
    with tempfile.TemporaryDirectory() as tmp:
        controller = _controller(False, Path(tmp), ring=ring)
        drain = _ring_drain(controller) if ring else (lambda: None)
        for step in range(50):
            controller.after_forward(layout(step))
            drain()
        for state, pause in (("tight", 0.0), ("after_sleep", sleep_s)):
            before = controller.consume_parts.as_dict()
            hooks = []
            for step in range(repeats):
                step_layout = layout(step)
                if pause:
                    time.sleep(pause)  # releases the GIL and lets the caches go cold, as a device wait does
                started = time.perf_counter()
                controller.after_forward(step_layout)
                hooks.append(time.perf_counter() - started)
                drain()
            after = controller.consume_parts.as_dict()
            count = after["count"] - before["count"]
            out[state] = {"hook_us": _median_us(hooks),
                          **{f"{part}_us": round((after[f"{part}_s"] - before[f"{part}_s"]) / count * 1e6, 1)
                             for part in controller.consume_parts.PARTS if count}}
        controller.transfer.close()
    return out


def _ring_drain(controller):
    """A stand-in score formatter: takes every ready entry off the controller's ring."""
    from engine_worker.scores.ring import RingReader

    reader = RingReader(controller.transfer.ring)

    def drain() -> None:
        while reader.poll() is not None:
            reader.done()
    return drain


_SSE_START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


async def _discard(message: dict) -> None:
    """The relays' ASGI send: what reaches the client is not part of what is timed."""


def _sse(chunk: dict) -> bytes:
    """A stream chunk as vLLM writes it: compact JSON in one server-sent event."""
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode()


def _completion_chunk(request_id: str, prompt_ids: list[int] | None = None) -> dict:
    """One token of a `/v1/completions` stream (what `probex bench engine` streams) as vLLM
    0.25 builds it with `return_token_ids`: the choice carries the prompt's ids in the first
    chunk and an explicit null after."""
    return {"id": request_id, "object": "text_completion", "created": 1, "model": "/models/llama-3.1-8b",
            "choices": [{"index": 0, "text": " a", "logprobs": None, "finish_reason": None, "stop_reason": None,
                         "prompt_token_ids": prompt_ids, "token_ids": [42]}]}


def vllm_first_chunk(prompt_tokens: int, repeats: int) -> dict:
    """vLLM's own writing of a completion stream's first chunk (its response classes, as its
    server builds and serializes them), with the prompt's ids (`vllm_first_chunk_ids_us`, a
    client that asked for token ids) and without (`vllm_first_chunk_us`, where the middleware
    has vLLM leave them out); empty where vLLM is not installed."""
    try:
        from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse
    except ImportError:
        return {}
    prompt_ids = list(range(1000, 1000 + prompt_tokens))
    times: dict[str, list[float]] = {"vllm_first_chunk": [], "vllm_first_chunk_ids": []}
    for number in range(2 * repeats):
        ids = number % 2 == 1
        started = time.perf_counter()
        choice = CompletionResponseStreamChoice(index=0, text=" a", logprobs=None, finish_reason=None,
                                                stop_reason=None, prompt_token_ids=prompt_ids if ids else None,
                                                token_ids=[42])
        CompletionStreamResponse(id="cmpl-bench", object="text_completion", created=1, model="/models/llama-3.1-8b",
                                 choices=[choice]).model_dump_json(exclude_unset=True)
        times["vllm_first_chunk_ids" if ids else "vllm_first_chunk"].append(time.perf_counter() - started)
    return {f"{name}_us": _median_us(values) for name, values in times.items()}


def first_token_path(prompt_tokens: int, repeats: int) -> dict:
    """Medians, in µs, of the host steps on a first token's way (see the module docstring).
    Each request's chunks are decorated by relays that splice and relays that decode, each
    in each place in turn: the two paths are timed side by side, under the same conditions
    (`*_decoded_us`)."""
    import asyncio
    import uuid

    from engine_worker.scores.bookkeeping import StepLayout
    from engine_worker.api_server.hub import ScoreHub
    from engine_worker.api_server.middleware import (FirstChunkTimer, MonitoredCall, StreamRelay, _decode_request, body_as_sent,
                                          inspect_request)
    from engine_worker.scores.formatter import ScoreFormatter

    messages: list[bytes] = []
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    prefill, decode, intake, request, request_decoded = [], [], [], [], []
    formatter_prefill, formatted_received = [], []
    chunk_times: dict[str, list[float]] = {name: [] for name in ("first_chunk", "token_chunk", "first_chunk_decoded",
                                                                  "token_chunk_decoded", "first_chunk_ids",
                                                                  "first_chunk_ids_decoded", "first_chunk_paused")}
    prompt_ids = list(range(1000, 1000 + prompt_tokens))
    with tempfile.TemporaryDirectory() as tmp:
        controller = _controller(False, Path(tmp))
        controller.publish = lambda message: messages.append(encoder.encode(message))
        hub = ScoreHub("inproc://unused")  # never started: fed directly, as its receive loop would
        formatter, formatted_hub = ScoreFormatter(api_server_count=1), ScoreHub("inproc://unused", formatted=True)

        request_body = json.dumps({"model": "bench", "prompt": prompt_ids, "max_tokens": 256, "temperature": 0.0,
                                   "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                                   "return_token_ids": True}).encode()

        def read_request_decoded(raw: bytes) -> bytes:
            body, encode = _decode_request(raw)
            return encode(inspect_request("/v1/completions", body).body)

        async def one_request(number: int) -> None:
            for read, times in ((lambda raw: body_as_sent("/v1/completions", raw), request),
                                (read_request_decoded, request_decoded))[:: 1 if number % 2 else -1]:
                started = time.perf_counter()
                read(request_body)
                times.append(time.perf_counter() - started)
            call = MonitoredCall(key_prefix=f"cmpl-probex-{uuid.uuid4().hex}", stream=True, wants_token_ids=False)
            started = time.perf_counter()
            controller.after_forward(StepLayout([f"{call.key(0)}-0123abcd"], np.array([prompt_tokens]),
                                                np.zeros(1, np.int64), np.array([prompt_tokens])))
            prefill.append(time.perf_counter() - started)
            frame = messages.pop()
            started = time.perf_counter()
            message = decoder.decode(frame)
            decode.append(time.perf_counter() - started)
            started = time.perf_counter()
            hub.ingest(message)
            intake.append(time.perf_counter() - started)
            # The same step through a score formatter (its own process when served): its time,
            # and the API server's receiving of what it sends.
            started = time.perf_counter()
            frames = formatter.take(decoder.decode(frame))
            formatter_prefill.append(time.perf_counter() - started)
            started = time.perf_counter()
            for topic, payload in frames:
                formatted_hub.take_formatted(topic, payload)
            formatted_received.append(time.perf_counter() - started)
            formatted_hub.release(call.key(0))
            # The next step samples token 1, which the later chunk carries (a completion's
            # first chunk carries token 0): its scores are in when that chunk is decorated.
            controller.after_forward(StepLayout([f"{call.key(0)}-0123abcd"], np.ones(1, np.int64),
                                                np.array([prompt_tokens]), np.array([prompt_tokens])))
            hub.ingest(decoder.decode(messages.pop()))
            # The same request as a client that asked for the token ids sees it (`probex bench
            # engine`'s): they stay in its chunks, the prompt's in the first.
            with_ids = MonitoredCall(key_prefix=call.key_prefix, stream=True, wants_token_ids=True)
            # Each relay as served: under the timer of the request's way through the process,
            # told that it is SSE by vLLM's response start (not timed)
            out: list[dict] = []

            async def keep(message: dict) -> None:
                out.append(message)

            relays = []
            for suffix, client_call, splice in (("", call, True), ("_decoded", call, False),
                                                ("_ids", with_ids, True), ("_ids_decoded", with_ids, False)):
                timer = FirstChunkTimer(hub, time.perf_counter(), keep, monitored=True)
                relay = timer.relay = StreamRelay(hub, client_call, timer.send, 1.0, splice=splice)
                await relay.send(_SSE_START)
                relays.append((suffix, relay))
            # vLLM writes the prompt's ids into the first chunk only for a client that asked for
            # token ids (engine_worker/vllm_openai.py); a later chunk has an explicit null
            later = _sse(_completion_chunk(call.key_prefix))
            first = {True: _sse(_completion_chunk(call.key_prefix, prompt_ids)), False: later}
            for name in ("first_chunk", "token_chunk"):
                # each relay in each place in turn: the first to touch a request's scores after
                # its step came in runs slower (cold caches), by as much as the paths differ
                turn = number % len(relays)
                for suffix, relay in relays[turn:] + relays[:turn]:
                    if name == "token_chunk" and suffix.startswith("_ids"):
                        continue
                    event = first[relay.call.wants_token_ids] if name == "first_chunk" else later
                    message = {"type": "http.response.body", "body": event + b"\n\n", "more_body": True}
                    started = time.perf_counter()
                    await relay.send(message)
                    chunk_times[name + suffix].append(time.perf_counter() - started)
                    decorated = out.pop()["body"]
                    if b'"probex"' not in decorated or (b"token_ids" in decorated) != relay.call.wants_token_ids:
                        raise RuntimeError(f"the chunk was not decorated as served: {decorated[:200]!r}")
            # The same first chunk with the tap paused: the timer alone passes it on (the client's
            # ids kept, as `probex bench engine`'s client asks)
            paused = FirstChunkTimer(hub, time.perf_counter(), keep)
            message = {"type": "http.response.body", "body": first[True] + b"\n\n", "more_body": True}
            started = time.perf_counter()
            await paused.send(message)
            chunk_times["first_chunk_paused"].append(time.perf_counter() - started)
            out.clear()
            hub.release(call.key(0))

        async def all_requests() -> None:
            for number in range(repeats):
                await one_request(number)

        asyncio.run(all_requests())
        controller.transfer.close()
    if hub.waits["tokens"].count or hub.waits["prompt"].count:
        raise RuntimeError("a chunk waited for scores that were already in: the measurement is off")
    if hub.chunks["spliced"].count != 3 * repeats:  # the first chunk twice (ids cut, ids kept), the later one
        raise RuntimeError("a chunk was decoded instead of spliced: not the path vLLM's chunks take")
    return {"prompt_tokens": prompt_tokens, "repeats": repeats, **vllm_first_chunk(prompt_tokens, repeats),
            "prefill_step_us": _median_us(prefill),
            "request_us": _median_us(request), "request_decoded_us": _median_us(request_decoded),
            "decode_us": _median_us(decode), "intake_us": _median_us(intake),
            "formatter_prefill_step_us": _median_us(formatter_prefill),
            "formatted_received_us": _median_us(formatted_received),
            **{f"{name}_us": _median_us(times) for name, times in chunk_times.items()}}


def api_decode_step(requests: int, steps: int, prompt_tokens: int = 1024, processes: int = 1,
                    formatted: bool = False) -> dict:
    """Medians, in µs, of the API server's work per decode step of `requests` streams (see the
    module docstring): the worker's real step messages (prompts prefilled four to a step
    first), fed to a `ScoreHub` and `StreamRelay`s as their receive loop and vLLM would. Each
    step's chunks are decorated by relays that splice and by relays that decode (which go
    first alternates), timed side by side (`chunks_decoded_us`).

    `processes` > 1: one of that many API server processes (`--api-server-count`), whose
    requests are every `processes`-th: its hub takes in every step's whole message and books
    its own rows, its relays decorate its own streams' chunks (what `probex bench engine`'s
    four-process runs load each process's event loop with).

    `formatted`: the steps go through a score formatter first (score_formatter.py, in a
    process of its own when served), and the hub files the frames for its own requests
    (`ScoreHub.take_formatted`); `formatter_us` is the formatter's time per step."""
    import asyncio
    import uuid

    from engine_worker.scores.bookkeeping import StepLayout
    from engine_worker.api_server.hub import BROADCAST, CollectionPauses, FormattedStep, ScoreHub, owner_tag
    from engine_worker.api_server.middleware import MonitoredCall, StreamRelay
    from engine_worker.scores.formatter import ScoreFormatter

    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    messages: list[bytes] = []
    tags = [owner_tag() for _ in range(processes)]  # as middleware.inspect_request writes ids
    calls = [MonitoredCall(key_prefix=f"cmpl-probex-{tags[i % processes]}{uuid.uuid4().hex[8:]}", stream=True,
                           wants_token_ids=False) for i in range(requests)]
    engine_ids = [f"{call.key(0)}-0123abcd" for call in calls]
    with tempfile.TemporaryDirectory() as tmp:
        controller = _controller(False, Path(tmp))
        controller.publish = lambda message: messages.append(encoder.encode(message))
        prefills = range(0, requests, 4)
        for first in prefills:
            ids = engine_ids[first:first + 4]
            controller.after_forward(StepLayout(ids, np.full(len(ids), prompt_tokens), np.zeros(len(ids), np.int64),
                                                np.full(len(ids), prompt_tokens)))
        for step in range(steps):
            controller.after_forward(StepLayout(engine_ids, np.ones(requests, np.int64),
                                                np.full(requests, prompt_tokens + step), np.full(requests, prompt_tokens)))
        controller.transfer.close()
    decoded = [decoder.decode(m) for m in messages]
    # never started: fed directly, as its receive loop would
    hub = ScoreHub("inproc://unused", owner=tags[0] if processes > 1 else None, formatted=formatted)
    # The decoding relays read a hub of their own, fed the same messages (untimed): a relay
    # takes the token JSON its hub wrote ahead, which the other set's would then not find.
    decoded_hub = ScoreHub("inproc://unused", owner=hub.owner, formatted=formatted)
    formatter_times: list[float] = []
    if formatted:  # each message as the formatter turns it into this process's frames (ahead: another process)
        formatter = ScoreFormatter(api_server_count=processes)
        inputs = []
        for message in decoded:
            started = time.perf_counter()
            frames = formatter.take(message)
            formatter_times.append(time.perf_counter() - started)
            inputs.append([(topic, frame) for topic, frame in frames if topic in (hub._topic, BROADCAST)])
        step_decoder = msgspec.msgpack.Decoder(FormattedStep)
    else:
        inputs = [[(None, frame)] for frame in messages]  # the worker's: one frame each, no topic
        step_decoder = decoder

    def take(into: ScoreHub, number: int, times: tuple[list[float], list[float]] | None = None) -> None:
        """Step `number` into a hub as its receive loop would take it: decoded, then filed (a
        broadcast, which the hub decodes itself, is timed whole as intake)."""
        for topic, payload in inputs[number]:
            started = read = time.perf_counter()
            if topic == BROADCAST:
                into.take_formatted(topic, payload)
            else:
                message = step_decoder.decode(payload)
                read = time.perf_counter()
                (into.ingest_formatted if formatted else into.ingest)(message)
            if times is not None:
                times[0].append(time.perf_counter() - read)
                times[1].append(time.perf_counter() - started)

    own_calls = calls[::processes]
    intake: list[float] = []
    received: list[float] = []
    chunk_times: dict[str, list[float]] = {"chunks": [], "chunks_decoded": []}

    collections = CollectionPauses()

    async def all_steps() -> None:
        for number in range(len(prefills)):
            take(hub, number)
            take(decoded_hub, number)
        # As vLLM's API server does once started: what exists now is left out of collections.
        gc.collect()
        gc.freeze()
        collections.attach()
        relay_sets = [("chunks", [StreamRelay(hub, call, _discard, 1.0) for call in own_calls]),
                      ("chunks_decoded", [StreamRelay(decoded_hub, call, _discard, 1.0, splice=False)
                                          for call in own_calls])]
        for _, relays in relay_sets:
            for relay, call in zip(relays, own_calls):  # each stream's first chunk (token 0, prompt scores)
                await relay._decorate_event(_sse(_completion_chunk(call.key_prefix, [1, 2, 3])))
        token_events = [_sse(_completion_chunk(call.key_prefix)) for call in own_calls]
        for number in range(steps):
            take(hub, len(prefills) + number, (intake, received))
            take(decoded_hub, len(prefills) + number)
            for name, relays in relay_sets[:: 1 if number % 2 else -1]:
                started = time.perf_counter()
                for relay, token in zip(relays, token_events):
                    await relay._decorate_event(token)
                chunk_times[name].append(time.perf_counter() - started)

    try:
        asyncio.run(all_steps())
    finally:
        collections.detach()
        gc.unfreeze()
    if hub.waits["tokens"].count or decoded_hub.waits["tokens"].count:
        raise RuntimeError("a chunk waited for scores that were already in: the measurement is off")
    if hub.chunks["spliced"].count != len(own_calls) * (steps + 1):  # each stream's first chunk too
        raise RuntimeError("a chunk was decoded instead of spliced: not the path vLLM's chunks take")
    if any(hub.get(call.key(0)).token_json != {} for call in own_calls):
        raise RuntimeError("the spliced chunks did not take the token JSON written ahead: not the path served")
    # The garbage collections these steps set off (both hubs' and both relay sets'), which stop the event loop.
    pauses = collections.by_generation
    return {"requests": requests, "processes": processes, "formatted": formatted, "steps": steps,
            "intake_us": _median_us(intake), "received_us": _median_us(received),
            "formatter_us": _median_us(formatter_times[len(prefills):]) if formatted else None,
            **{f"{name}_us": _median_us(times) for name, times in chunk_times.items()},
            "gc_us_per_step": round(sum(p.total_s for p in pauses) / steps * 1e6, 1),
            "gc_longest_ms": round(max(p.max_s for p in pauses) * 1e3, 2),
            "gc_collections": [p.count for p in pauses]}


def _median_us(seconds: list[float]) -> float:
    return round(float(np.median(seconds)) * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="8,64", help="decoding requests per step (comma-separated)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--python-us", type=float, default=1000.0,
                        help="engine-thread Python work per step (µs) in the threaded measurement")
    parser.add_argument("--wait-us", type=float, default=4000.0,
                        help="engine-thread wait with the GIL released per step (µs), standing in for the GPU")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length for the first-token path")
    parser.add_argument("--repeats", type=int, default=200, help="requests timed on the first-token path")
    parser.add_argument("--api-server-count", type=int, default=4,
                        help="also time one of this many API server processes' share of a decode step (1: not)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = []
    baseline_step_us = engine_steps(args.steps, args.python_us, args.wait_us)[0] * 1e6
    print(f"stand-in engine step without ProbeX: {baseline_step_us:.1f} µs", flush=True)
    for n in (int(x) for x in args.requests.split(",")):
        inline = run(n, args.steps, threaded=False, python_us=0.0, wait_us=0.0)
        threaded = run(n, args.steps, threaded=True, python_us=args.python_us, wait_us=args.wait_us)
        row = {"requests": n, "inline_us": round(inline["hook_us"], 1), "hook_us": round(threaded["hook_us"], 1),
               "step_us": round(threaded["step_us"], 1), "baseline_step_us": round(baseline_step_us, 1), "consume_us": round(threaded["consume_us"], 1),
               "python_us": args.python_us, "wait_us": args.wait_us}
        results.append(row)
        print(f"{n:3d} requests: inline (hook + consume, one thread) {row['inline_us']:7.1f} µs/step; "
              f"transfer thread on: engine-thread hook {row['hook_us']:7.1f} µs, step {row['step_us']:7.1f} µs"
              f" ({args.python_us:.0f} python + {args.wait_us:.0f} wait), consume {row['consume_us']:7.1f} µs wall",
              flush=True)
    wake = {"layout_us_tight_loop": round(wake_cost_us(0.0), 1),
            "layout_us_after_sleep": round(wake_cost_us(args.wait_us * 1e-6), 1)}
    print(f"one StepLayout: {wake['layout_us_tight_loop']} µs in a tight loop, {wake['layout_us_after_sleep']} µs"
          f" right after a {args.wait_us:.0f} µs sleep (how much of the hook is waking up)", flush=True)
    cold = [consume_parts_cold(n, args.prompt_tokens, args.wait_us * 1e-6, ring=ring)
            for n in [int(x) for x in args.requests.split(",")] + [0] for ring in (False, True)]
    for row in cold:
        what = f"{row['requests']}-request decode step" if row["requests"] else f"{row['rows']}-row prefill step"
        parts = ("layout", "gather", "message", "publish") if "layout_us" in row["tight"] else ()
        print(f"{what}, {row['handoff']}, tight loop / right after a {row['sleep_us']} µs sleep (µs; hook median"
              + (", consume parts' means" if parts else "") + f"): hook {row['tight']['hook_us']} / "
              f"{row['after_sleep']['hook_us']}" + ("; " if parts else "")
              + ", ".join(f"{part} {row['tight'][part + '_us']} / {row['after_sleep'][part + '_us']}"
                          for part in parts), flush=True)
    first = first_token_path(args.prompt_tokens, args.repeats)
    print(f"first token, {first['prompt_tokens']}-token prompt (medians of {first['repeats']}): request "
          f"{first['request_us']} µs in the API server (decoded and re-encoded: {first['request_decoded_us']} µs), prefill step "
          f"{first['prefill_step_us']} µs in the worker, decode {first['decode_us']} µs and intake "
          f"{first['intake_us']} µs (through a score formatter: {first['formatter_prefill_step_us']} µs there, "
          f"{first['formatted_received_us']} µs received), first chunk "
          f"{first['first_chunk_us']} µs and a later one-token chunk {first['token_chunk_us']} µs in the API server "
          f"(decoded and re-encoded instead: {first['first_chunk_decoded_us']} and {first['token_chunk_decoded_us']} µs); "
          f"with the token ids kept, the first chunk {first['first_chunk_ids_us']} µs (decoded and re-encoded: "
          f"{first['first_chunk_ids_decoded_us']} µs; the tap paused: {first['first_chunk_paused_us']} µs)"
          + (f"; vLLM writes that first chunk in {first['vllm_first_chunk_us']} µs, with the prompt's ids "
             f"{first['vllm_first_chunk_ids_us']} µs" if "vllm_first_chunk_us" in first else ""), flush=True)
    process_counts = [1] + ([args.api_server_count] if args.api_server_count > 1 else [])
    api_steps = [api_decode_step(int(x), args.steps, args.prompt_tokens, processes=count, formatted=formatted)
                 for count in process_counts for x in args.requests.split(",") for formatted in (False, True)]
    for row in api_steps:
        one_of = f", one of {row['processes']} API server processes" if row["processes"] > 1 else ""
        source = (f"from the score formatter ({row['formatter_us']} µs a step there)" if row["formatted"]
                  else "from the worker")
        print(f"API server{one_of}, one decode step of {row['requests']} streams {source} (medians of {row['steps']}):"
              f" received {row['received_us']} µs (intake {row['intake_us']} µs after decoding), its "
              f"{row['requests'] // row['processes']} one-token chunks {row['chunks_us']} µs spliced "
              f"({row['chunks_decoded_us']} µs decoded and re-encoded); garbage collection {row['gc_us_per_step']} "
              f"µs a step (intake and both relay sets), the longest {row['gc_longest_ms']} ms", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"benchmark": "handoff", "steps": args.steps, "results": results,
                                        "wake": wake, "consume_parts_cold": cold, "first_token": first, "api_decode_step": api_steps},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
