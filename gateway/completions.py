"""POST /v1/chat/completions and /v1/completions: the hot path, in plain ASGI.

Relays over the gateway's own keep-alive HTTP/1.1 client (`gateway.upstream_http`); whole
responses are judged here, streams by `gateway.streaming`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from random import getrandbits as _random_bits  # request ids need to be unique, not secret: no syscall

from gateway.audit import AuditSink
from gateway.auth import Authenticator, bearer_token
from gateway.calls import Call, account, judge_whole, observe_overhead
from gateway.cascade import Cascade
from gateway.config import GatewayConfig
from gateway.controls import XARGS_FIELD, check_request, with_policy_xargs
from gateway.decisions import Verdict
from gateway.errors import (UPSTREAM_ERRORS, ApiError, ClientGone, relay_upstream_error, respond,
                            upstream_failure)
from gateway.jsoncodec import dumps, loads
from gateway.judge import JUDGE_MARK_HEADER, JudgeClient, judge_mark
from gateway.metrics import GatewayMetrics
from gateway.policy import Decision
from gateway.policy_manager import PolicyManager
from gateway.request_body import parse_body, read_body
from gateway.streaming import StreamResponder
from gateway.upstream_http import (UpstreamAbandoned, UpstreamClient, UpstreamError, UpstreamResponse,
                                   UpstreamUnreachable)
from gateway.upstreams import NoHealthyUpstream, Upstream, UpstreamPool

log = logging.getLogger("probex.gateway")

COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
_MARK = JUDGE_MARK_HEADER.encode()


class Completions:
    """POST /v1/chat/completions and /v1/completions: the hot path, in plain ASGI."""

    def __init__(self, config: GatewayConfig, manager: PolicyManager, pool: UpstreamPool, metrics: GatewayMetrics,
                 audit: AuditSink, auth: Authenticator) -> None:
        self.config, self.manager, self.pool, self.metrics, self.audit = config, manager, pool, metrics, audit
        self.auth = auth
        self.client = UpstreamClient(connect_timeout=config.connect_timeout_s, read_timeout=config.upstream_timeout_s,
                                     token=config.worker_admin_token, upstream_urls=[u.url for u in pool.upstreams])
        self.cascade = Cascade(pool, metrics, JudgeClient(judge_mark(config.worker_admin_token),
                                                          config.connect_timeout_s))
        self.stream = StreamResponder(metrics, audit, config.client_stall_timeout_s, self.cascade)

    async def close(self) -> None:
        self.client.close()
        await self.cascade.close()

    async def __call__(self, path: str, scope, receive, send) -> None:
        in_flight = self.metrics.in_flight
        in_flight.inc()
        try:
            await self.handle(path, scope["headers"], receive, send)
        except ClientGone:
            return
        except ApiError as exc:
            headers = [(b"x-probex-policy-version", self.manager.current.version.encode("latin-1"))]
            await respond(send, exc.status, dumps(exc.body()), headers)
        except Exception:
            log.exception("probex gateway: unexpected error")
            await respond(send, 500, dumps(ApiError(500, "internal gateway error", kind="server_error").body()), [])
        finally:
            in_flight.dec()

    async def handle(self, path: str, raw_headers, receive, send) -> None:
        started = time.perf_counter()
        auth = declared = mark = None
        for name, value in raw_headers:
            if name == b"authorization" and auth is None:
                auth = value.decode("latin-1")
            elif name == b"content-length" and declared is None:
                declared = value
            elif name == _MARK and mark is None:
                mark = value.decode("latin-1")
        policy = self.manager.current
        caller = self.auth.identify(bearer_token(auth), policy)
        tenant_name, is_admin = caller.tenant, caller.is_admin
        raw = await read_body(receive, self.config.max_body_bytes, declared)
        body, plain = parse_body(raw)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' is required", param="model")
        streaming = body.get("stream")
        if streaming is not None and not isinstance(streaming, bool):
            # The worker's server reads "false" as false: taken as true here, its JSON answer
            # would be relayed as an empty stream, unjudged.
            raise ApiError(400, "'stream' must be true or false", param="stream")
        known = self.pool.models
        if known and model not in known:
            raise ApiError(404, f"model {model!r} does not exist; available: {sorted(known)}", code="model_not_found",
                           param="model")
        tenant = policy.tenant(tenant_name)
        check_request(path, body, tenant.granted, is_admin, policy.forward_fields)
        # A judge's own call (marked by this gateway, or a replica sharing its worker token) is never judged again.
        judged = raw if tenant.escalates and not self.cascade.judge.is_judge_call(mark) else None
        # The body goes to the worker byte for byte unless the gateway has to add to it.
        payload = raw if plain else json.dumps(body).encode()
        added: dict = {}
        if policy.needs_recompute and policy.policy.rules:
            added["probex_recompute"] = True
        if tenant.steering_xargs is not None:
            # The policy's steering replaces any the client asked for: one configuration per request.
            added.update(tenant.steering_xargs)
        if added:
            exact = json.loads(raw)  # the standard library keeps every number exactly as sent
            exact[XARGS_FIELD] = with_policy_xargs(exact.get(XARGS_FIELD), added)
            payload = json.dumps(exact).encode()
        tried: list[Upstream] = []
        while True:
            try:
                upstream = self.pool.pick(tried)
            except NoHealthyUpstream as exc:
                raise ApiError(502, f"{exc}; see /ready", kind="server_error", code="upstream_unavailable") from None
            upstream.outstanding += 1
            watch = call = None  # the call exists once the request is sent (an abandoned one always has it)
            try:
                try:
                    waited = time.perf_counter()
                    conn = await self.client.send(upstream.url, path, payload)
                    upstream_s = time.perf_counter() - waited
                    # The request is on its way: the book-keeping is done while the worker works.
                    call = Call(f"probex-gw-{_random_bits(128):032x}", tenant, policy, is_admin,
                                raw if policy.policy.audit.include_prompt else None, started, upstream_s, judged)
                    # A whole response's head comes only with its body: a caller hanging up meanwhile
                    # must abort the worker's request (as vLLM does for its own callers), not leave it
                    # generating up to max_tokens for nobody. A stream's relay watches from its head on.
                    watch = None if streaming else CallerWatch(receive, conn)
                    waited = time.perf_counter()
                    try:
                        response = await self.client.response(conn, None if watch is None else watch.follow)
                    finally:
                        call.upstream_s += time.perf_counter() - waited
                except UpstreamUnreachable as exc:
                    # Nothing reached that worker (it is down, or restarting): another one may serve.
                    failure = upstream_failure(exc, upstream, self.metrics)
                    tried.append(upstream)
                    if len(tried) >= len(self.pool.upstreams):
                        raise failure from None
                    continue
                except UPSTREAM_ERRORS as exc:
                    raise await self._whole_failed(exc, call, upstream) from None
                if streaming:
                    await self.stream(path, response, call, upstream, receive, send)
                else:
                    await self.whole(path, response, call, upstream, watch, send)
                return
            finally:
                if watch is not None:
                    watch.stop()
                upstream.outstanding -= 1

    # -- whole responses

    async def _whole_failed(self, exc: UpstreamError, call: Call | None, upstream: Upstream) -> Exception:
        """What to raise for an upstream failure before a response's answer is in: a caller who
        hung up (the connection abandoned) is accounted and gone; anything else is the worker's."""
        if isinstance(exc, UpstreamAbandoned):
            await account(call, Verdict(), self.metrics, self.audit)  # as an abandoned stream: no scores yet
            observe_overhead(call, self.metrics)
            return ClientGone()
        return upstream_failure(exc, upstream, self.metrics)

    async def whole(self, path: str, response: UpstreamResponse, call: Call, upstream: Upstream,
                    watch: "CallerWatch", send) -> None:
        metrics = self.metrics
        status = response.status
        waited = time.perf_counter()
        try:
            content = await response.read()
        except UPSTREAM_ERRORS as exc:
            raise await self._whole_failed(exc, call, upstream) from None
        finally:
            watch.stop()  # the answer is in: the connection may go back to the pool
            response.release()
            call.upstream_s += time.perf_counter() - waited
        if status != 200:
            await relay_upstream_error(send, status, content, upstream, call, metrics)
            return
        try:
            data = loads(content)
            if not isinstance(data, dict):
                raise ValueError("not an object")
            choices = data.get("choices") or []
            probex = data.pop("probex", None)
            if probex is None and len(choices) > 1:  # batched completions carry scores per choice
                per_choice = [c.pop("probex", None) for c in choices]
            else:
                per_choice = [probex]
        except (ValueError, AttributeError, TypeError):
            raise ApiError(502, "upstream sent a malformed response", kind="server_error") from None
        verdict = Verdict()
        try:
            for scores in per_choice:
                verdict = verdict.merge(judge_whole(call, scores, metrics))
        except (ValueError, AttributeError, TypeError):
            raise ApiError(502, "upstream sent malformed probe scores", kind="server_error") from None
        if verdict.escalations:
            held = time.perf_counter()
            verdict = await self.cascade.settle(call, verdict)
            call.upstream_s += time.perf_counter() - held  # the judge's time is not the gateway's overhead
        await account(call, verdict, metrics, self.audit)
        headers = call.headers(verdict.decision)
        observe_overhead(call, metrics)
        if verdict.decision is Decision.BLOCK:
            if call.tenant.on_block == "error":
                blocked = ApiError(400, "request blocked by content policy", code="content_filter")
                await respond(send, 400, dumps(blocked.body()), headers)
                return
            refuse_whole(call, data, path)
        elif call.expose_scores:
            if probex is not None:
                data["probex"] = probex
            elif len(choices) > 1:
                for choice, scores in zip(choices, per_choice):
                    choice["probex"] = scores
        await respond(send, 200, dumps(data), headers)


class CompletionRoute:
    """The ASGI endpoint of one completion path (the worker's path, whatever prefix the gateway is served under)."""

    __slots__ = ("completions", "path")

    def __init__(self, completions: Completions, path: str) -> None:
        self.completions, self.path = completions, path

    async def __call__(self, scope, receive, send) -> None:
        await self.completions(self.path, scope, receive, send)


class CallerWatch:
    """Abandons the upstream connection (which aborts the request in the worker) if the caller
    hangs up before `stop`."""

    def __init__(self, receive, conn: UpstreamResponse) -> None:
        self._receive, self._conn = receive, conn
        self._stopped = self.gone = False
        self._listen()

    def _listen(self) -> None:
        self._task = asyncio.ensure_future(self._receive())
        self._task.add_done_callback(self._heard)

    def _heard(self, task: asyncio.Future) -> None:
        if task.cancelled() or task.exception() is not None or self._stopped:
            return
        if task.result().get("type") == "http.disconnect":
            self.gone = True
            self._conn.abandon()
        else:  # nothing else is expected once the body is in; keep listening
            self._listen()

    def follow(self, conn: UpstreamResponse) -> None:
        """The request went out again on `conn` (the pooled connection was stale): watch that one."""
        self._conn = conn
        if self.gone:
            conn.abandon()

    def stop(self) -> None:
        """Before the connection goes back to the pool: a hang-up heard later must not close it
        under the next request (the callback of a receive that has just completed still runs)."""
        self._stopped = True
        self._task.cancel()


def refuse_whole(call: Call, data: dict, path: str) -> None:
    message = call.policy.policy.refusal_message
    for choice in data.get("choices") or []:
        if path == "/v1/chat/completions":
            choice["message"] = {"role": "assistant", "content": message}
        else:
            choice["text"] = message
        choice["finish_reason"] = "content_filter"
