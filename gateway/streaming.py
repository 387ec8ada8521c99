"""Relaying a completion stream: judge the prompt from the head of the stream, then relay chunk by chunk,
blocking mid-stream when generated tokens cross a threshold."""

from __future__ import annotations

import asyncio
import logging
import time

from gateway.audit import AuditSink
from gateway.calls import Call, account, observe_overhead, record_generated, record_scores
from gateway.cascade import Cascade
from gateway.decisions import StreamJudge, Verdict, generated_scores, judge_prompt
from gateway.errors import UPSTREAM_ERRORS, ApiError, relay_upstream_error, respond, upstream_failure
from gateway.jsoncodec import dumps, loads
from gateway.metrics import GatewayMetrics
from gateway.policy import Decision
from gateway.upstream_http import UpstreamResponse
from gateway.upstreams import Upstream

log = logging.getLogger("probex.gateway")

SSE_TYPE = b"text/event-stream; charset=utf-8"
DONE = b"data: [DONE]\n\n"


class StreamResponder:
    """Answers a streaming request once the worker's response head is in."""

    def __init__(self, metrics: GatewayMetrics, audit: AuditSink, stall_s: float, cascade: Cascade) -> None:
        self.metrics, self.audit, self.stall_s, self.cascade = metrics, audit, stall_s, cascade

    async def __call__(self, path: str, response: UpstreamResponse, call: Call, upstream: Upstream, receive,
                     send) -> None:
        metrics = self.metrics
        status = response.status
        if status != 200:
            try:
                content = await response.read()
            except UPSTREAM_ERRORS as exc:
                raise upstream_failure(exc, upstream, metrics) from None
            finally:
                response.release()  # the connection may serve another request from here on
            await relay_upstream_error(send, status, content, upstream, call, metrics)
            return
        relay = Relay(call, response, path, metrics)
        # The caller hanging up closes the upstream response, which aborts the request in the worker.
        watch = asyncio.ensure_future(receive())
        watch.add_done_callback(relay.caller_gone)
        try:
            await self._relay(relay, upstream, send)
        finally:
            watch.cancel()
            if not relay.released:
                response.close()
            relay.record()
            await account(call, relay.verdict, metrics, self.audit)
            observe_overhead(call, metrics)
            if not relay.finished:
                log.info("probex: stream %s ended early (client or upstream closed)", call.request_id)

    async def _relay(self, relay: "Relay", upstream: Upstream, send) -> None:
        call, metrics = relay.call, self.metrics
        # Read up to the chunk carrying the prompt scores (or the first tokens), then decide on the prompt.
        try:
            lines = await relay.read_head()
        except (*UPSTREAM_ERRORS, ValueError, AttributeError, TypeError) as exc:
            if relay.gone:
                return
            if isinstance(exc, UPSTREAM_ERRORS):
                raise upstream_failure(exc, upstream, metrics) from None
            raise ApiError(502, "upstream sent a malformed stream", kind="server_error") from None
        if relay.gone:
            return
        fail_closed = call.policy.policy.missing_scores == "fail_closed"
        if relay.prompt_probex is None:
            metrics.child(metrics.scores_missing, call.tenant.name).inc()
        try:
            record_scores(relay.prompt_probex, metrics)
            verdict = judge_prompt(call.tenant, relay.prompt_probex, fail_closed, escalate=call.judged is not None)
        except (ValueError, AttributeError, TypeError):
            raise ApiError(502, "upstream sent malformed probe scores", kind="server_error") from None
        if verdict.escalations:
            # Nothing is relayed until the judge has answered (or `judge.timeout_s` has passed).
            held = time.perf_counter()
            verdict = await self.cascade.settle(call, verdict)
            call.upstream_s += time.perf_counter() - held
        relay.judge = StreamJudge(call.tenant, verdict)
        if relay.gone:
            return
        headers = call.headers(verdict.decision)
        if verdict.decision is Decision.BLOCK:
            relay.close()  # closing the connection aborts the request in the worker
            relay.finished = relay.done_sending = True
            if call.tenant.on_block == "error":
                blocked = ApiError(400, "request blocked by content policy", code="content_filter")
                await respond(send, 400, dumps(blocked.body()), headers)
                return
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", SSE_TYPE), *headers]})
            await send({"type": "http.response.body", "body": refusal_events(call, relay.path, relay.head)})
            return

        out: list[bytes] = []
        try:
            for event in relay.head:
                if relay.relay_event(event, out):
                    break
            else:
                relay.relay_lines(lines, out)
        except (ValueError, AttributeError, TypeError):
            raise ApiError(502, "upstream sent a malformed stream", kind="server_error") from None
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", SSE_TYPE), *headers]})
        # A caller that reads nothing for `stall_s` is dropped (its upstream request aborted): the
        # send below waits while the caller's socket is full, one timer per write.
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        failure: ApiError | None = None
        try:
            while not relay.finished:
                if out:
                    timer = loop.call_later(self.stall_s, relay.stalled, task)
                    try:
                        await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                    finally:
                        timer.cancel()
                    out = []
                    if relay.unrecorded:
                        relay.record()
                lines = await relay.read_lines()
                if relay.gone:
                    return
                if lines is None:  # the upstream ended without [DONE]
                    failure = ApiError(502, f"upstream worker {upstream.url} ended the stream before it was complete",
                                       kind="server_error", code="upstream_error")
                    break
                relay.relay_lines(lines, out)
        except asyncio.CancelledError:
            if not relay.stalled_out:
                raise
            task.uncancel()
            log.warning("probex: stream %s dropped: its caller read nothing for %g s", call.request_id, self.stall_s)
            return  # the response is left incomplete: the server drops the connection
        except UPSTREAM_ERRORS as exc:
            if relay.gone:
                return
            failure = upstream_failure(exc, upstream, metrics)  # counted; a dropped worker is marked unhealthy
            failure.message = f"{failure.message} mid-stream"
            log.warning("probex: upstream %s failed mid-stream (%s: %s); ending stream %s with an error",
                        upstream.url, type(exc).__name__, exc, call.request_id)
        except (ValueError, AttributeError, TypeError):
            if relay.gone:
                return
            failure = ApiError(502, "upstream sent a malformed stream", kind="server_error", code="upstream_error")
        except Exception:
            log.exception("probex gateway: unexpected error mid-stream; ending stream %s with an error",
                          call.request_id)
            failure = ApiError(500, "internal gateway error", kind="server_error")
        if failure is not None:
            # The response has started: the caller learns of the failure from a last event (the
            # OpenAI SDK raises it as an APIError) and the stream still ends with [DONE].
            out.append(sse(failure.body()))
            out.append(DONE)
        relay.done_sending = True
        try:
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})
        except OSError:  # the caller's connection broke while the last bytes went out
            return
        if relay.blocked:
            relay.close()
        elif relay.finished:
            relay.release()


class Relay:
    """One relayed stream: reads SSE lines from the worker, judges chunks, writes SSE bytes."""

    __slots__ = ("call", "response", "path", "metrics", "buffer", "head", "prompt_probex", "judge",
                 "finished", "blocked", "gone", "done_sending", "released", "expose", "unrecorded", "stalled_out")

    def __init__(self, call: Call, response: UpstreamResponse, path: str, metrics: GatewayMetrics) -> None:
        self.call, self.response = call, response
        self.path, self.metrics = path, metrics
        self.buffer = b""
        self.head: list[dict | None] = []  # events read before the decision on the prompt; None is [DONE]
        self.prompt_probex: dict | None = None
        self.judge: StreamJudge | None = None  # from the decision on the prompt on
        self.finished = False  # [DONE] relayed, or the stream was cut by a block
        self.blocked = False
        self.gone = False  # the caller hung up
        self.stalled_out = False  # the caller read nothing for too long and is being dropped
        self.done_sending = False
        self.released = False  # the upstream connection went back to the pool
        self.expose = call.expose_scores
        # Generated scores already judged, for the score histograms: recorded after the chunk is sent,
        # so that the caller does not wait for them.
        self.unrecorded: list[dict] = []

    @property
    def verdict(self) -> Verdict:
        return self.judge.verdict if self.judge is not None else Verdict()

    def record(self) -> None:
        for generated in self.unrecorded:
            record_generated(generated, self.metrics)
        self.unrecorded.clear()

    def caller_gone(self, task: asyncio.Future) -> None:
        if self.done_sending or task.cancelled():
            return
        self.gone = True
        self.close()

    def stalled(self, task: asyncio.Task) -> None:
        """The write to the caller has waited too long: abort the worker's request and stop waiting."""
        if self.done_sending or self.gone:
            return
        self.gone = self.stalled_out = True
        self.close()
        task.cancel()

    def close(self) -> None:
        self.response.close()
        self.released = True

    def release(self) -> None:
        """The connection goes back to the pool once the rest of the upstream stream is in."""
        self.response.release()
        self.released = True

    async def read_lines(self) -> list[bytes] | None:
        """The next complete lines from the worker (without line ends); None once the stream has ended."""
        call = self.call
        while True:
            waited = time.perf_counter()
            data = await self.response.readany()
            call.upstream_s += time.perf_counter() - waited
            if not data:
                if self.buffer:
                    last, self.buffer = self.buffer, b""
                    return [last]
                return None
            if b"\n" not in data:
                self.buffer += data
                continue
            if self.buffer:
                data, self.buffer = self.buffer + data, b""
            lines = data.split(b"\n")
            self.buffer = lines.pop()
            return lines

    async def read_head(self) -> list[bytes]:
        """Events up to the prompt decision point into `head`; returns the lines read past it."""
        head = self.head
        while True:
            lines = await self.read_lines()
            if lines is None:
                return []
            for i, line in enumerate(lines):
                if not line.startswith(b"data: "):
                    continue
                if line[-1:] == b"\r":
                    line = line[:-1]
                if line == b"data: [DONE]":
                    head.append(None)
                    return lines[i + 1:]
                chunk = loads(line[6:])
                head.append(chunk)
                probex = chunk.get("probex")
                scores = (probex or {}).get("scores") or {}
                if any("prompt" in s for s in scores.values()):
                    self.prompt_probex = probex
                    return lines[i + 1:]
                if any(chunk_has_tokens(c) for c in chunk.get("choices") or ()):
                    return lines[i + 1:]  # prompt scores, if any, would have been on or before this chunk

    def relay_lines(self, lines: list[bytes], out: list[bytes]) -> None:
        for line in lines:
            if not line.startswith(b"data: "):
                continue
            if line[-1:] == b"\r":
                line = line[:-1]
            if line == b"data: [DONE]":
                self.relay_event(None, out)
                return
            if b'"probex"' not in line:  # nothing to judge or strip: pass the worker's bytes through
                out.append(line + b"\n\n")
                continue
            if self.relay_event(loads(line[6:]), out):
                return

    def relay_event(self, event: dict | None, out: list[bytes]) -> bool:
        """Append the SSE bytes for one event; True when the stream ends here."""
        if event is None:
            out.append(DONE)
            self.finished = True
            return True
        probex = event.pop("probex", None)
        generated = generated_scores(probex)
        if generated:
            self.unrecorded.append(generated)
            if self.judge.step(generated) is Decision.BLOCK:
                out.append(b"data: " + dumps(content_filter_chunk(event, self.path)) + b"\n\n")
                out.append(DONE)
                self.finished = self.blocked = True
                return True
        if self.expose and probex is not None:
            event["probex"] = probex
        out.append(b"data: " + dumps(event) + b"\n\n")
        return False


def sse(obj: dict) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def chunk_has_tokens(choice: dict) -> bool:
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or choice.get("text") or delta.get("tool_calls"))



def content_filter_chunk(template: dict, path: str) -> dict:
    chunk = {k: template[k] for k in ("id", "object", "created", "model") if k in template}
    index = ((template.get("choices") or [{}])[0]).get("index", 0)
    choice = {"index": index, "finish_reason": "content_filter"}
    choice.update({"delta": {}} if path == "/v1/chat/completions" else {"text": ""})
    chunk["choices"] = [choice]
    return chunk


def refusal_events(call: Call, path: str, head: list) -> bytes:
    template = next((e for e in head if isinstance(e, dict)), {"object": "chat.completion.chunk"})
    base = {k: template[k] for k in ("id", "object", "created", "model") if k in template}
    message = call.policy.policy.refusal_message
    if path == "/v1/chat/completions":
        first = {"index": 0, "delta": {"role": "assistant", "content": message}, "finish_reason": None}
    else:
        first = {"index": 0, "text": message, "finish_reason": None}
    return sse({**base, "choices": [first]}) + sse(content_filter_chunk(base, path)) + DONE
