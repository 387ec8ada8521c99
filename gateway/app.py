"""The OpenAI-compatible monitoring proxy.

Requests go to a worker (`probex worker`) which returns per-request probe scores in a
`probex` field; the gateway turns them into allow / flag / block under the tenant's
policy, relays streams chunk by chunk (blocking mid-stream when generated tokens cross
a threshold), strips scores unless the caller may see them, and records metrics and
audit events. It speaks to workers over HTTP only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.audit import POLICY_VERSION_KEY, AuditSink, JsonlAudit, RedisAudit, audit_event
from gateway.decisions import Verdict, generated_scores, judge_generated, judge_prompt
from gateway.metrics import GatewayMetrics
from gateway.policy import Decision, LoadedPolicy, PolicyError, TenantView, load_policy
from gateway.upstreams import NoHealthyUpstream, Upstream, UpstreamPool

log = logging.getLogger("probex.gateway")

COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")


@dataclass
class GatewayConfig:
    policy_path: Path
    upstreams: list[str]
    worker_admin_token: str | None = None
    redis_url: str | None = None
    audit_path: Path = field(default_factory=lambda: Path.home() / ".cache" / "probex" / "audit.jsonl")
    max_body_bytes: int = 1 << 20
    upstream_timeout_s: float = 120.0
    connect_timeout_s: float = 2.0
    watch_policy: bool = True
    health_interval_s: float = 2.0


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def response(self, headers: dict | None = None) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


class PolicyManager:
    """Holds the active policy; a reload validates, pushes probes to every worker, then swaps."""

    def __init__(self, config: GatewayConfig, pool: UpstreamPool, metrics: GatewayMetrics, audit: AuditSink) -> None:
        self.config, self.pool, self.metrics, self.audit = config, pool, metrics, audit
        self.current: LoadedPolicy = load_policy(config.policy_path)
        self._lock = asyncio.Lock()
        self.last_error: str | None = None
        self.retention: dict[str, float] = {}

    async def push_probes(self, probe_dirs: list[str]) -> None:
        headers = {"Authorization": f"Bearer {self.config.worker_admin_token}"} if self.config.worker_admin_token else {}
        for upstream in self.pool.upstreams:
            try:
                r = await self.pool.client.put(upstream.url + "/probex/probes", json={"probes": probe_dirs},
                                               headers=headers, timeout=30)
            except httpx.HTTPError as exc:
                raise PolicyError(f"worker {upstream.url} unreachable while swapping probes: {exc}") from None
            if r.status_code != 200:
                try:
                    message = r.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = r.text[:300]
                raise PolicyError(f"worker {upstream.url} refused the probe set: {message}")

    async def reload(self, reason: str) -> tuple[bool, str]:
        async with self._lock:
            try:
                candidate = load_policy(self.config.policy_path)
            except PolicyError as exc:
                return self._failed(str(exc), reason)
            if candidate.version == self.current.version:
                return True, f"policy {candidate.version} unchanged"
            if candidate.probe_dirs != self.current.probe_dirs or _probe_files_changed(candidate, self.current):
                try:
                    await self.push_probes(candidate.probe_dirs)
                except PolicyError as exc:
                    try:  # put back what the old policy serves on workers that did take the new set
                        await self.push_probes(self.current.probe_dirs)
                    except PolicyError:
                        log.exception("probex: rollback of the probe set failed")
                    return self._failed(str(exc), reason)
            previous, self.current = self.current, candidate
            self.metrics.reloads.labels(result="ok").inc()
            self.metrics.set_policy_version(candidate.version)
            await self.audit.publish_policy_version(candidate.version)
            self.last_error = None
            log.info("probex: policy %s -> %s (%s)", previous.version, candidate.version, reason)
            return True, f"policy {candidate.version} active"

    def _failed(self, message: str, reason: str) -> tuple[bool, str]:
        self.metrics.reloads.labels(result="error").inc()
        self.last_error = message
        log.error("probex: policy reload (%s) rejected, keeping %s: %s", reason, self.current.version, message)
        return False, message

    async def watch(self) -> None:
        from watchfiles import awatch

        path = self.config.policy_path.resolve()
        async for changes in awatch(path.parent, debounce=50, step=20):
            if any(Path(p).resolve() == path for _, p in changes):
                await self.reload("file changed")

    async def follow_replicas(self, redis_client, interval_s: float = 1.0) -> None:
        """Replicas sharing a policy file converge on the version one of them published."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                raw = await redis_client.get(POLICY_VERSION_KEY)
            except Exception:
                continue
            if raw and json.loads(raw).get("version") != self.current.version:
                await self.reload("another replica published a new version")

    async def poll_retention(self) -> None:
        """Read each worker's calibration retention (when it reports one) and raise alarms."""
        threshold = self.current.policy.calibration_alarm_below
        for upstream in self.pool.upstreams:
            try:
                health = (await self.pool.client.get(upstream.url + "/probex/health", timeout=2)).json()
            except (httpx.HTTPError, ValueError):
                continue
            for probe, value in (health.get("retention") or {}).items():
                if value is None:
                    continue
                self.retention[probe] = float(value)
                self.metrics.retention.labels(probe=probe).set(value)
                alarm = float(value) < threshold
                self.metrics.alarm.labels(probe=probe).set(1 if alarm else 0)
                if alarm:
                    log.warning("probex: calibration retention alarm: probe %s retention %.3f < %.3f",
                                probe, value, threshold)


def _probe_files_changed(a: LoadedPolicy, b: LoadedPolicy) -> bool:
    return any(
        not (pa.weight.shape == pb.weight.shape and (pa.weight == pb.weight).all() and pa.bias == pb.bias)
        for name, pa in a.probes.items()
        if (pb := b.probes.get(name)) is not None
    )


def create_app(config: GatewayConfig, metrics: GatewayMetrics | None = None) -> FastAPI:
    metrics = metrics or GatewayMetrics()
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(config.upstream_timeout_s, connect=config.connect_timeout_s),
        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
    )
    pool = UpstreamPool(config.upstreams, client, metrics)
    audit: AuditSink = RedisAudit(config.redis_url, metrics) if config.redis_url else JsonlAudit(config.audit_path, metrics)
    manager = PolicyManager(config, pool, metrics, audit)
    if isinstance(audit, RedisAudit):
        audit.maxlen = manager.current.policy.audit.maxlen
    metrics.set_policy_version(manager.current.version)
    tasks: list[asyncio.Task] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.check_all()
        pool.start(config.health_interval_s)
        await audit.publish_policy_version(manager.current.version)
        if config.watch_policy:
            tasks.append(asyncio.create_task(manager.watch()))
        if isinstance(audit, RedisAudit):
            tasks.append(asyncio.create_task(manager.follow_replicas(audit.client)))
        tasks.append(asyncio.create_task(_periodic(manager.poll_retention, 5.0)))
        tasks.append(asyncio.create_task(_periodic(audit.flush, 1.0)))
        yield
        for task in tasks:
            task.cancel()
        await pool.stop()
        await audit.close()
        await client.aclose()

    app = FastAPI(title="ProbeX gateway", lifespan=lifespan)
    app.state.manager, app.state.pool, app.state.metrics, app.state.audit = manager, pool, metrics, audit

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response({"x-probex-policy-version": manager.current.version})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("probex gateway: unexpected error")
        return ApiError(500, "internal gateway error", kind="server_error").response()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        reasons = []
        if not any(u.healthy for u in pool.upstreams):
            reasons += [f"upstream {u.url} unhealthy: {u.last_error}" for u in pool.upstreams]
        threshold = manager.current.policy.calibration_alarm_below
        reasons += [f"calibration retention of {p} is {v:.3f} (< {threshold})"
                    for p, v in manager.retention.items() if v < threshold]
        body = {"status": "degraded" if reasons else "ready", "policy_version": manager.current.version,
                "reasons": reasons, "last_reload_error": manager.last_error}
        return JSONResponse(body, status_code=503 if reasons else 200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authenticate(request, manager.current)
        try:
            upstream = pool.pick()
            r = await client.get(upstream.url + "/v1/models")
        except NoHealthyUpstream as exc:
            raise ApiError(502, str(exc), kind="server_error", code="upstream_unavailable") from None
        except httpx.HTTPError as exc:
            raise ApiError(502, f"upstream error: {exc}", kind="server_error", code="upstream_unavailable") from None
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.post("/admin/reload")
    async def admin_reload(request: Request):
        require_admin(request, manager.current)
        ok, message = await manager.reload("admin request")
        if not ok:
            raise ApiError(400, message, code="policy_rejected")
        return {"status": "ok", "message": message, "policy_version": manager.current.version}

    @app.get("/admin/policy")
    async def admin_policy(request: Request):
        require_admin(request, manager.current)
        return {"policy_version": manager.current.version, "probes": list(manager.current.probes),
                "needs_recompute": manager.current.needs_recompute, "last_reload_error": manager.last_error}

    for path in COMPLETION_PATHS:
        app.add_api_route(path, _completion_handler(path, config, manager, pool, metrics, audit), methods=["POST"])
    return app


async def _periodic(fn, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await fn()
        except Exception:
            log.exception("probex: periodic task %s failed", getattr(fn, "__name__", fn))


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth and auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return None


def authenticate(request: Request, policy: LoadedPolicy) -> tuple[str, bool]:
    """(tenant, is_admin). Without configured keys (embedded default) everyone is the default tenant."""
    token = _bearer(request)
    keys, admins = policy.policy.api_keys, set(policy.policy.admin_keys)
    if token is not None and token in admins:
        return "default", True
    if not keys:
        return "default", False
    if token is None:
        raise ApiError(401, "missing API key (Authorization: Bearer <key>)", kind="authentication_error",
                       code="invalid_api_key")
    if token not in keys:
        raise ApiError(401, "invalid API key", kind="authentication_error", code="invalid_api_key")
    return keys[token], False


def require_admin(request: Request, policy: LoadedPolicy) -> None:
    tenant, is_admin = authenticate(request, policy)
    open_embedded = not policy.policy.api_keys and not policy.policy.admin_keys
    if not (is_admin or open_embedded):
        raise ApiError(401, "admin key required", kind="authentication_error", code="invalid_api_key")


async def _read_json_body(request: Request, limit: int) -> dict:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body larger than {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body larger than {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


@dataclass
class _Call:
    """Book-keeping of one monitored request, for metrics and audit."""

    request_id: str
    tenant: TenantView
    policy: LoadedPolicy
    is_admin: bool
    prompt_text: str | None
    started: float = field(default_factory=time.perf_counter)
    upstream_s: float = 0.0

    @property
    def expose_scores(self) -> bool:
        return self.is_admin or self.tenant.expose_scores

    def headers(self, decision: Decision) -> dict[str, str]:
        return {"x-probex-decision": decision.value, "x-probex-policy-version": self.policy.version,
                "x-request-id": self.request_id}


def _completion_handler(path, config: GatewayConfig, manager: PolicyManager, pool: UpstreamPool,
                        metrics: GatewayMetrics, audit: AuditSink):
    async def handler(request: Request):
        policy = manager.current
        tenant_name, is_admin = authenticate(request, policy)
        body = await _read_json_body(request, config.max_body_bytes)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' is required", param="model")
        known = pool.models
        if known and model not in known:
            raise ApiError(404, f"model {model!r} does not exist; available: {sorted(known)}", code="model_not_found",
                           param="model")
        if policy.needs_recompute and policy.policy.rules:
            xargs = body.get("vllm_xargs")
            if xargs is None or isinstance(xargs, dict):
                body["vllm_xargs"] = {**(xargs or {}), "probex_recompute": True}
        call = _Call(request_id=f"probex-gw-{uuid.uuid4().hex}", tenant=policy.tenant(tenant_name), policy=policy,
                     is_admin=is_admin, prompt_text=_prompt_text(body) if policy.policy.audit.include_prompt else None)
        try:
            upstream = pool.pick()
        except NoHealthyUpstream as exc:
            raise ApiError(502, f"{exc}; see /ready", kind="server_error", code="upstream_unavailable") from None
        payload = json.dumps(body).encode()
        if body.get("stream"):
            return await _stream(path, payload, body, call, upstream, manager, metrics, audit)
        return await _whole(path, payload, body, call, upstream, manager, metrics, audit)

    return handler


def _prompt_text(body: dict) -> str:
    if "messages" in body:
        return json.dumps(body["messages"])[:4000]
    return str(body.get("prompt"))[:4000]


async def _upstream_failure(exc: Exception, upstream: Upstream, metrics: GatewayMetrics) -> ApiError:
    kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "connect"
    metrics.upstream_errors.labels(upstream=upstream.url, kind=kind).inc()
    if kind == "connect":
        upstream.healthy = False
        upstream.last_error = str(exc)
        return ApiError(502, f"upstream worker {upstream.url} unreachable: {type(exc).__name__}", kind="server_error",
                        code="upstream_unavailable")
    return ApiError(504, f"upstream worker {upstream.url} timed out", kind="server_error", code="upstream_timeout")


async def _whole(path, payload, body, call: _Call, upstream: Upstream, manager, metrics, audit) -> Response:
    upstream.outstanding += 1
    sent = time.perf_counter()
    try:
        r = await manager.pool.client.post(upstream.url + path, content=payload,
                                           headers={"content-type": "application/json"})
    except httpx.HTTPError as exc:
        raise await _upstream_failure(exc, upstream, metrics) from None
    finally:
        upstream.outstanding -= 1
        call.upstream_s += time.perf_counter() - sent
    if r.status_code != 200:
        return _relay_upstream_error(r.status_code, r.content, upstream, call, metrics)
    data = r.json()
    choices = data.get("choices") or []
    probex = data.pop("probex", None)
    if probex is None and len(choices) > 1:  # batched completions carry scores per choice
        per_choice = [c.pop("probex", None) for c in choices]
    else:
        per_choice = [probex]
    verdict = Verdict()
    for scores in per_choice:
        verdict = verdict.merge(_judge_whole(call, scores, manager, metrics))
    await _account(call, verdict, metrics, audit)
    headers = call.headers(verdict.decision)
    _observe_overhead(call, metrics)
    if verdict.decision is Decision.BLOCK:
        return _blocked_response(call, data, path, headers)
    if call.expose_scores:
        if probex is not None:
            data["probex"] = probex
        elif len(choices) > 1:
            for choice, scores in zip(choices, per_choice):
                choice["probex"] = scores
    return JSONResponse(data, headers=headers)


def _relay_upstream_error(status: int, content: bytes, upstream: Upstream, call: _Call,
                          metrics: GatewayMetrics) -> Response:
    """Client errors pass through as the worker wrote them; a worker's 5xx is the gateway's 502."""
    headers = call.headers(Decision.ALLOW)
    if status < 500:
        return Response(content, status_code=status, media_type="application/json", headers=headers)
    metrics.upstream_errors.labels(upstream=upstream.url, kind=f"http_{status}").inc()
    detail = content[:300].decode(errors="replace")
    return ApiError(502, f"upstream worker {upstream.url} failed with HTTP {status}: {detail}", kind="server_error",
                    code="upstream_error").response(headers)


def _judge_whole(call: _Call, probex: dict | None, manager: PolicyManager, metrics: GatewayMetrics) -> Verdict:
    fail_closed = call.policy.policy.missing_scores == "fail_closed"
    if not probex or not probex.get("scores"):
        metrics.scores_missing.labels(tenant=call.tenant.name).inc()
    _record_scores(probex, metrics)
    return judge_prompt(call.tenant, probex, fail_closed).merge(judge_generated(call.tenant, generated_scores(probex)))


def _record_scores(probex: dict | None, metrics: GatewayMetrics) -> None:
    for name, entry in ((probex or {}).get("scores") or {}).items():
        if entry.get("score") is not None:
            metrics.probe_score.labels(probe=name, phase="prompt").observe(entry["score"])
        prompt = entry.get("prompt")
        if prompt:
            metrics.prompt_tokens.inc(prompt.get("prompt_tokens", 0))
            metrics.prompt_tokens_scored.inc(prompt.get("tokens_scored", 0))
            break  # token counts are per request, not per probe
    for name, entry in ((probex or {}).get("scores") or {}).items():
        values = [v for v in (entry.get("generated") or {}).get("scores") or () if v is not None]
        if values:
            metrics.probe_score.labels(probe=name, phase="generated").observe(max(values))


async def _account(call: _Call, verdict: Verdict, metrics: GatewayMetrics, audit: AuditSink) -> None:
    metrics.requests.labels(decision=verdict.decision.value, probe=verdict.probe or "", tenant=call.tenant.name).inc()
    if verdict.decision is not Decision.ALLOW:
        await audit.record(audit_event(request_id=call.request_id, tenant=call.tenant.name,
                                       decision=verdict.decision.value, probe=verdict.probe, phase=verdict.phase,
                                       scores=verdict.scores, policy_version=call.policy.version,
                                       prompt=call.prompt_text))


def _observe_overhead(call: _Call, metrics: GatewayMetrics) -> None:
    metrics.overhead.observe(max(0.0, time.perf_counter() - call.started - call.upstream_s))


def _blocked_response(call: _Call, data: dict, path: str, headers: dict) -> Response:
    if call.tenant.on_block == "error":
        return ApiError(400, "request blocked by content policy", code="content_filter").response(headers)
    message = call.policy.policy.refusal_message
    for choice in data.get("choices") or []:
        if path == "/v1/chat/completions":
            choice["message"] = {"role": "assistant", "content": message}
        else:
            choice["text"] = message
        choice["finish_reason"] = "content_filter"
    return JSONResponse(data, headers=headers)


# -- streaming ------------------------------------------------------------------------------


def _sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"


async def _stream(path, payload, body, call: _Call, upstream: Upstream, manager, metrics, audit) -> Response:
    client = manager.pool.client
    upstream.outstanding += 1
    sent = time.perf_counter()
    try:
        request = client.build_request("POST", upstream.url + path, content=payload,
                                       headers={"content-type": "application/json"})
        response = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        upstream.outstanding -= 1
        raise await _upstream_failure(exc, upstream, metrics) from None
    call.upstream_s += time.perf_counter() - sent
    if response.status_code != 200:
        content = await response.aread()
        await response.aclose()
        upstream.outstanding -= 1
        return _relay_upstream_error(response.status_code, content, upstream, call, metrics)

    lines = response.aiter_lines()
    head: list[dict | str] = []  # events read before the decision on the prompt
    prompt_probex: dict | None = None
    try:
        while True:
            waited = time.perf_counter()
            try:
                line = await lines.__anext__()
            except StopAsyncIteration:
                break
            call.upstream_s += time.perf_counter() - waited
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                head.append("[DONE]")
                break
            chunk = json.loads(line[6:])
            head.append(chunk)
            scores = (chunk.get("probex") or {}).get("scores") or {}
            if any("prompt" in s for s in scores.values()):
                prompt_probex = chunk["probex"]
                break
            if any(_chunk_has_tokens(c) for c in chunk.get("choices") or ()):
                break  # prompt scores, if any, would have been on or before this chunk
    except (httpx.HTTPError, ValueError) as exc:
        await response.aclose()
        upstream.outstanding -= 1
        if isinstance(exc, httpx.HTTPError):
            raise await _upstream_failure(exc, upstream, metrics) from None
        raise ApiError(502, "upstream sent a malformed stream", kind="server_error") from None

    fail_closed = call.policy.policy.missing_scores == "fail_closed"
    if prompt_probex is None:
        metrics.scores_missing.labels(tenant=call.tenant.name).inc()
    _record_scores(prompt_probex, metrics)
    verdict = judge_prompt(call.tenant, prompt_probex, fail_closed)
    if verdict.decision is Decision.BLOCK:
        await response.aclose()  # closing the connection aborts the request in the worker
        upstream.outstanding -= 1
        await _account(call, verdict, metrics, audit)
        _observe_overhead(call, metrics)
        headers = call.headers(verdict.decision)
        if call.tenant.on_block == "error":
            return ApiError(400, "request blocked by content policy", code="content_filter").response(headers)
        return StreamingResponse(_refusal_stream(call, path, head, body), media_type="text/event-stream",
                                 headers=headers)

    async def relay() -> AsyncIterator[bytes]:
        nonlocal verdict
        finished = False
        try:
            pending = list(head)
            while True:
                if pending:
                    event = pending.pop(0)
                else:
                    waited = time.perf_counter()
                    try:
                        line = await lines.__anext__()
                    except StopAsyncIteration:
                        break
                    call.upstream_s += time.perf_counter() - waited
                    if not line.startswith("data: "):
                        continue
                    event = "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])
                if event == "[DONE]":
                    yield _sse("[DONE]")
                    finished = True
                    # Read the stream to its end so the connection goes back to the pool.
                    async for _ in lines:
                        pass
                    break
                probex = event.pop("probex", None)
                generated = generated_scores(probex)
                if generated:
                    _record_generated(generated, metrics)
                    step = judge_generated(call.tenant, generated)
                    verdict = verdict.merge(step)
                    if step.decision is Decision.BLOCK:
                        yield _sse(_content_filter_chunk(event, path))
                        yield _sse("[DONE]")
                        finished = True
                        break
                if call.expose_scores and probex is not None:
                    event["probex"] = probex
                yield _sse(event)
        finally:
            await response.aclose()
            upstream.outstanding -= 1
            await _account(call, verdict, metrics, audit)
            _observe_overhead(call, metrics)
            if not finished:
                log.info("probex: stream %s ended early (client or upstream closed)", call.request_id)

    return StreamingResponse(relay(), media_type="text/event-stream", headers=call.headers(verdict.decision))


def _chunk_has_tokens(choice: dict) -> bool:
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or choice.get("text") or delta.get("tool_calls"))


def _record_generated(generated: dict, metrics: GatewayMetrics) -> None:
    for name, values in generated.items():
        for v in values:
            if v is not None:
                metrics.probe_score.labels(probe=name, phase="generated").observe(v)


def _content_filter_chunk(template: dict, path: str) -> dict:
    chunk = {k: template[k] for k in ("id", "object", "created", "model") if k in template}
    index = ((template.get("choices") or [{}])[0]).get("index", 0)
    choice = {"index": index, "finish_reason": "content_filter"}
    choice.update({"delta": {}} if path == "/v1/chat/completions" else {"text": ""})
    chunk["choices"] = [choice]
    return chunk


async def _refusal_stream(call: _Call, path: str, head: list, body: dict) -> AsyncIterator[bytes]:
    template = next((e for e in head if isinstance(e, dict)), {"object": "chat.completion.chunk"})
    base = {k: template[k] for k in ("id", "object", "created", "model") if k in template}
    message = call.policy.policy.refusal_message
    if path == "/v1/chat/completions":
        first = {"index": 0, "delta": {"role": "assistant", "content": message}, "finish_reason": None}
    else:
        first = {"index": 0, "text": message, "finish_reason": None}
    yield _sse({**base, "choices": [first]})
    yield _sse(_content_filter_chunk(base, path))
    yield _sse("[DONE]")
