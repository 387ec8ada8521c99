"""The OpenAI-compatible monitoring proxy.

Requests go to a worker (`probex worker`) which returns per-request probe scores in a
`probex` field; the gateway turns them into allow / flag / block under the tenant's
policy, relays streams chunk by chunk (blocking mid-stream when generated tokens cross
a threshold), strips scores unless the caller may see them, and records metrics and
audit events. It speaks to workers over HTTP only.

The two completion routes are the hot path: one plain ASGI application (no FastAPI request
machinery, no Starlette response classes) relaying over a small keep-alive HTTP/1.1 client of
its own (`gateway.upstream_http`). Health checks, probe pushes and the admin routes use FastAPI
and httpx.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from random import getrandbits as _random_bits  # request ids need to be unique, not secret: no syscall
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from gateway.audit import POLICY_VERSION_KEY, AuditSink, JsonlAudit, RedisAudit, audit_event
from gateway.decisions import StreamJudge, Verdict, generated_scores, judge_generated, judge_prompt
from gateway.jsoncodec import dumps, loads, loads_strict
from gateway.metrics import GatewayMetrics
from gateway.policy import Decision, LoadedPolicy, PolicyError, TenantView, load_policy
from gateway.upstream_http import (UpstreamAbandoned, UpstreamClient, UpstreamError, UpstreamResponse,
                                   UpstreamTimeout)
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

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


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
                return await self._reload(reason)
            except Exception as exc:
                # A reload is reached from the watcher and the replica follower too: an exception
                # escaping here would end those tasks and with them every later live reload.
                log.exception("probex: policy reload (%s) failed unexpectedly", reason)
                return self._failed(f"reload failed unexpectedly ({type(exc).__name__}: {exc})", reason)

    async def _reload(self, reason: str) -> tuple[bool, str]:
        try:
            candidate = load_policy(self.config.policy_path)
        except PolicyError as exc:
            return self._failed(str(exc), reason)
        except Exception as exc:  # the file is what is new, so a crash on it refuses the file
            log.exception("probex: policy reload (%s): loading %s crashed", reason, self.config.policy_path)
            return self._failed(f"{self.config.policy_path}: cannot load policy ({type(exc).__name__}: {exc})",
                                reason)
        if candidate.version == self.current.version:
            self.last_error = None  # the file again matches what is served: an earlier refusal is history
            return True, f"policy {candidate.version} unchanged"
        if candidate.probe_dirs != self.current.probe_dirs or candidate.probe_digests != self.current.probe_digests:
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
        retry_s = 1.0
        while True:
            try:
                async for changes in awatch(path.parent, debounce=50, step=20):
                    retry_s = 1.0
                    if any(Path(p).resolve() == path for _, p in changes):
                        await self.reload("file changed")
            except Exception:
                # Live reload must outlive a failing watch (its directory replaced, say): watch again,
                # and reload once in case the file changed while nobody watched.
                log.exception("probex: watching %s failed; watching again in %.0f s", path, retry_s)
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, 30.0)
                await self.reload("file watch restarted")
            else:
                return

    async def follow_replicas(self, redis_client, interval_s: float = 1.0) -> None:
        """Replicas sharing a policy file converge on the version one of them published."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                raw = await redis_client.get(POLICY_VERSION_KEY)
                published = json.loads(raw).get("version") if raw else None
            except Exception:  # Redis away, or a value this follower cannot read: not this replica's policy
                continue
            if published and published != self.current.version:
                await self.reload("another replica published a new version")

    async def poll_retention(self) -> None:
        """Read each worker's calibration retention (when it reports one) and raise alarms."""
        threshold = self.current.policy.calibration_alarm_below
        self.metrics.alarm_below.set(threshold)
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


class GatewayApp(FastAPI):
    """FastAPI, except that POSTs to the completion routes go straight to their ASGI endpoint.

    That skips the middleware stack and the router: about 50 us off time-to-first-token on the
    2-core benchmark machine. The routes are registered with the router too (other methods get
    405). Middleware added to this app does not see completion POSTs.
    """

    fast_routes: dict[str, "_CompletionRoute"] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.fast_routes.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(config: GatewayConfig, metrics: GatewayMetrics | None = None) -> FastAPI:
    metrics = metrics or GatewayMetrics()
    client = httpx.AsyncClient(  # control plane: health checks, probe pushes, /v1/models
        timeout=httpx.Timeout(config.upstream_timeout_s, connect=config.connect_timeout_s),
        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
    )
    pool = UpstreamPool(config.upstreams, client, metrics)
    audit: AuditSink = RedisAudit(config.redis_url, metrics) if config.redis_url else JsonlAudit(config.audit_path, metrics)
    manager = PolicyManager(config, pool, metrics, audit)
    if isinstance(audit, RedisAudit):
        audit.maxlen = manager.current.policy.audit.maxlen
    metrics.set_policy_version(manager.current.version)
    completions = Completions(config, manager, pool, metrics, audit)
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
        await completions.close()
        await client.aclose()

    app = GatewayApp(title="ProbeX gateway", lifespan=lifespan)
    app.state.manager, app.state.pool, app.state.metrics, app.state.audit = manager, pool, metrics, audit

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response({"x-probex-policy-version": manager.current.version})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # Unknown routes and wrong methods, as OpenAI errors like every other answer (405 keeps `Allow`)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind=kind).response(exc.headers)

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

    app.fast_routes = {path: _CompletionRoute(completions, path) for path in COMPLETION_PATHS}
    for path, endpoint in app.fast_routes.items():  # an ASGI app as endpoint: Starlette hands it the raw scope
        app.router.routes.append(Route(path, endpoint, methods=["POST"]))
    return app


async def _periodic(fn, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await fn()
        except Exception:
            log.exception("probex: periodic task %s failed", getattr(fn, "__name__", fn))


def _bearer(auth: str | None) -> str | None:
    if auth and auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return None


def authenticate(request: Request, policy: LoadedPolicy) -> tuple[str, bool]:
    """(tenant, is_admin). Without configured keys (embedded default) everyone is the default tenant."""
    return authenticate_token(_bearer(request.headers.get("authorization")), policy)


def authenticate_token(token: str | None, policy: LoadedPolicy) -> tuple[str, bool]:
    keys, admins = policy.policy.api_keys, policy.policy.admin_keys
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


# -- the completion routes: plain ASGI ----------------------------------------------------------

_JSON = b"application/json"
_SSE = b"text/event-stream; charset=utf-8"
_UPSTREAM_ERRORS = (UpstreamError,)
_DONE = b"data: [DONE]\n\n"


class _ClientGone(Exception):
    """The caller went away before a response could be sent."""


async def _respond(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]],
                   content_type: bytes = _JSON) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", b"%d" % len(body)), *headers]})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive, limit: int, declared: bytes | None) -> bytes:
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body larger than {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise _ClientGone()
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body larger than {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# Deeper request bodies are refused: the standard library's parser, which the gateway uses to
# re-encode a body exactly and the worker's server uses to read it, recurses once per level and
# fails near 1000; no OpenAI request nests anywhere near this.
MAX_JSON_DEPTH = 256


def _too_deep() -> ApiError:
    return ApiError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels")


def _parse_body(raw: bytes) -> tuple[dict, bool]:
    """The body, and whether it is plain UTF-8 JSON that can be forwarded as it came."""
    try:
        body, plain = loads_strict(raw), True
    except RecursionError:  # the standard library's parser where orjson is not installed
        raise _too_deep() from None
    except ValueError:
        try:  # NaN / Infinity, lone surrogates, UTF-16: what the standard library accepts
            body, plain = json.loads(raw), False
        except RecursionError:
            raise _too_deep() from None
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    if _nested_deeper_than(raw, body, MAX_JSON_DEPTH):
        raise _too_deep()
    return body, plain


def _nested_deeper_than(raw: bytes, body: dict, limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` levels in `body` (parsed from `raw`).
    A body with no more brackets than that cannot (the usual case, counted in C); the rest are
    walked without recursion."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    pending: list[tuple[dict | list, int]] = [(body, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


class _Call:
    """Book-keeping of one monitored request, for metrics and audit."""

    __slots__ = ("request_id", "tenant", "policy", "is_admin", "raw_body", "started", "upstream_s")

    def __init__(self, request_id: str, tenant: TenantView, policy: LoadedPolicy, is_admin: bool,
                 raw_body: bytes | None, started: float, upstream_s: float = 0.0) -> None:
        self.request_id, self.tenant, self.policy, self.is_admin = request_id, tenant, policy, is_admin
        self.raw_body = raw_body  # kept only when the audit records prompts
        self.started = started
        self.upstream_s = upstream_s  # waiting for the worker, not the gateway's own time

    @property
    def expose_scores(self) -> bool:
        return self.is_admin or self.tenant.expose_scores

    @property
    def prompt_text(self) -> str | None:
        return None if self.raw_body is None else _prompt_text(json.loads(self.raw_body))

    def headers(self, decision: Decision) -> list[tuple[bytes, bytes]]:
        return [(b"x-probex-decision", decision.value.encode()),
                (b"x-probex-policy-version", self.policy.version.encode("latin-1")),
                (b"x-request-id", self.request_id.encode())]


class Completions:
    """POST /v1/chat/completions and /v1/completions: the hot path, in plain ASGI."""

    def __init__(self, config: GatewayConfig, manager: PolicyManager, pool: UpstreamPool, metrics: GatewayMetrics,
                 audit: AuditSink) -> None:
        self.config, self.manager, self.pool, self.metrics, self.audit = config, manager, pool, metrics, audit
        self.client = UpstreamClient(connect_timeout=config.connect_timeout_s, read_timeout=config.upstream_timeout_s)

    async def close(self) -> None:
        self.client.close()

    async def __call__(self, path: str, scope, receive, send) -> None:
        try:
            await self.handle(path, scope["headers"], receive, send)
        except _ClientGone:
            return
        except ApiError as exc:
            headers = [(b"x-probex-policy-version", self.manager.current.version.encode("latin-1"))]
            await _respond(send, exc.status, dumps(exc.body()), headers)
        except Exception:
            log.exception("probex gateway: unexpected error")
            await _respond(send, 500, dumps(ApiError(500, "internal gateway error", kind="server_error").body()), [])

    async def handle(self, path: str, raw_headers, receive, send) -> None:
        started = time.perf_counter()
        auth = declared = None
        for name, value in raw_headers:
            if name == b"authorization" and auth is None:
                auth = value.decode("latin-1")
            elif name == b"content-length" and declared is None:
                declared = value
        policy = self.manager.current
        tenant_name, is_admin = authenticate_token(_bearer(auth), policy)
        raw = await _read_body(receive, self.config.max_body_bytes, declared)
        body, plain = _parse_body(raw)
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
        # The body goes to the worker byte for byte unless the gateway has to add to it.
        payload = raw if plain else json.dumps(body).encode()
        tenant = policy.tenant(tenant_name)
        added: dict = {}
        if policy.needs_recompute and policy.policy.rules:
            added["probex_recompute"] = True
        if tenant.steering_xargs is not None:
            # The policy's steering replaces any the client asked for: one configuration per request.
            added.update(tenant.steering_xargs)
        if added:
            xargs = body.get("vllm_xargs")
            if xargs is None or isinstance(xargs, dict):
                exact = json.loads(raw)  # the standard library keeps every number exactly as sent
                exact["vllm_xargs"] = {**(exact.get("vllm_xargs") or {}), **added}
                payload = json.dumps(exact).encode()
        try:
            upstream = self.pool.pick()
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
                call = _Call(f"probex-gw-{_random_bits(128):032x}", tenant, policy, is_admin,
                             raw if policy.policy.audit.include_prompt else None, started, upstream_s)
                # A whole response's head comes only with its body: a caller hanging up meanwhile
                # must abort the worker's request (as vLLM does for its own callers), not leave it
                # generating up to max_tokens for nobody. A stream's relay watches from its head on.
                watch = None if streaming else _CallerWatch(receive, conn)
                waited = time.perf_counter()
                try:
                    response = await self.client.response(conn, None if watch is None else watch.follow)
                finally:
                    call.upstream_s += time.perf_counter() - waited
            except _UPSTREAM_ERRORS as exc:
                raise await self._whole_failed(exc, call, upstream) from None
            if streaming:
                await self.stream(path, response, call, upstream, receive, send)
            else:
                await self.whole(path, response, call, upstream, watch, send)
        finally:
            if watch is not None:
                watch.stop()
            upstream.outstanding -= 1

    # -- whole responses

    async def _whole_failed(self, exc: UpstreamError, call: _Call | None, upstream: Upstream) -> Exception:
        """What to raise for an upstream failure before a response's answer is in: a caller who
        hung up (the connection abandoned) is accounted and gone; anything else is the worker's."""
        if isinstance(exc, UpstreamAbandoned):
            await _account(call, Verdict(), self.metrics, self.audit)  # as an abandoned stream: no scores yet
            _observe_overhead(call, self.metrics)
            return _ClientGone()
        return _upstream_failure(exc, upstream, self.metrics)

    async def whole(self, path: str, response: UpstreamResponse, call: _Call, upstream: Upstream,
                    watch: "_CallerWatch", send) -> None:
        metrics = self.metrics
        status = response.status
        waited = time.perf_counter()
        try:
            content = await response.read()
        except _UPSTREAM_ERRORS as exc:
            raise await self._whole_failed(exc, call, upstream) from None
        finally:
            watch.stop()  # the answer is in: the connection may go back to the pool
            response.release()
            call.upstream_s += time.perf_counter() - waited
        if status != 200:
            await _relay_upstream_error(send, status, content, upstream, call, metrics)
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
                verdict = verdict.merge(_judge_whole(call, scores, metrics))
        except (ValueError, AttributeError, TypeError):
            raise ApiError(502, "upstream sent malformed probe scores", kind="server_error") from None
        await _account(call, verdict, metrics, self.audit)
        headers = call.headers(verdict.decision)
        _observe_overhead(call, metrics)
        if verdict.decision is Decision.BLOCK:
            if call.tenant.on_block == "error":
                blocked = ApiError(400, "request blocked by content policy", code="content_filter")
                await _respond(send, 400, dumps(blocked.body()), headers)
                return
            _refuse_whole(call, data, path)
        elif call.expose_scores:
            if probex is not None:
                data["probex"] = probex
            elif len(choices) > 1:
                for choice, scores in zip(choices, per_choice):
                    choice["probex"] = scores
        await _respond(send, 200, dumps(data), headers)

    # -- streams

    async def stream(self, path: str, response: UpstreamResponse, call: _Call, upstream: Upstream, receive,
                     send) -> None:
        metrics = self.metrics
        status = response.status
        if status != 200:
            try:
                content = await response.read()
            except _UPSTREAM_ERRORS as exc:
                raise _upstream_failure(exc, upstream, metrics) from None
            finally:
                response.release()  # the connection may serve another request from here on
            await _relay_upstream_error(send, status, content, upstream, call, metrics)
            return
        relay = _Relay(call, response, path, metrics)
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
            await _account(call, relay.verdict, metrics, self.audit)
            _observe_overhead(call, metrics)
            if not relay.finished:
                log.info("probex: stream %s ended early (client or upstream closed)", call.request_id)

    async def _relay(self, relay: "_Relay", upstream: Upstream, send) -> None:
        call, metrics = relay.call, self.metrics
        # Read up to the chunk carrying the prompt scores (or the first tokens), then decide on the prompt.
        try:
            lines = await relay.read_head()
        except (*_UPSTREAM_ERRORS, ValueError, AttributeError, TypeError) as exc:
            if relay.gone:
                return
            if isinstance(exc, _UPSTREAM_ERRORS):
                raise _upstream_failure(exc, upstream, metrics) from None
            raise ApiError(502, "upstream sent a malformed stream", kind="server_error") from None
        if relay.gone:
            return
        fail_closed = call.policy.policy.missing_scores == "fail_closed"
        if relay.prompt_probex is None:
            metrics.child(metrics.scores_missing, call.tenant.name).inc()
        try:
            _record_scores(relay.prompt_probex, metrics)
            verdict = judge_prompt(call.tenant, relay.prompt_probex, fail_closed)
        except (ValueError, AttributeError, TypeError):
            raise ApiError(502, "upstream sent malformed probe scores", kind="server_error") from None
        relay.judge = StreamJudge(call.tenant, verdict)
        headers = call.headers(verdict.decision)
        if verdict.decision is Decision.BLOCK:
            relay.close()  # closing the connection aborts the request in the worker
            relay.finished = relay.done_sending = True
            if call.tenant.on_block == "error":
                blocked = ApiError(400, "request blocked by content policy", code="content_filter")
                await _respond(send, 400, dumps(blocked.body()), headers)
                return
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", _SSE), *headers]})
            await send({"type": "http.response.body", "body": _refusal_events(call, relay.path, relay.head)})
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
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", _SSE), *headers]})
        try:
            while not relay.finished:
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                    out = []
                    if relay.unrecorded:
                        relay.record()
                lines = await relay.read_lines()
                if relay.gone:
                    return
                if lines is None:  # the upstream ended without [DONE]
                    break
                relay.relay_lines(lines, out)
        except (*_UPSTREAM_ERRORS, ValueError, AttributeError, TypeError) as exc:
            if not relay.gone:
                # Returning without completing the response makes the server drop the connection,
                # so the caller sees a broken stream rather than a clean end.
                log.warning("probex: upstream %s failed mid-stream (%s: %s); dropping stream %s", upstream.url,
                            type(exc).__name__, exc, call.request_id)
            return
        except Exception:  # the response has started: no error response is possible any more
            log.exception("probex gateway: unexpected error mid-stream; dropping stream %s", call.request_id)
            return
        relay.done_sending = True
        await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})
        if relay.blocked:
            relay.close()
        elif relay.finished:
            relay.release()


class _CompletionRoute:
    """The ASGI endpoint of one completion path (the worker's path, whatever prefix the gateway is served under)."""

    __slots__ = ("completions", "path")

    def __init__(self, completions: Completions, path: str) -> None:
        self.completions, self.path = completions, path

    async def __call__(self, scope, receive, send) -> None:
        await self.completions(self.path, scope, receive, send)


class _Relay:
    """One relayed stream: reads SSE lines from the worker, judges chunks, writes SSE bytes."""

    __slots__ = ("call", "response", "path", "metrics", "buffer", "head", "prompt_probex", "judge",
                 "finished", "blocked", "gone", "done_sending", "released", "expose", "unrecorded")

    def __init__(self, call: _Call, response: UpstreamResponse, path: str, metrics: GatewayMetrics) -> None:
        self.call, self.response = call, response
        self.path, self.metrics = path, metrics
        self.buffer = b""
        self.head: list[dict | None] = []  # events read before the decision on the prompt; None is [DONE]
        self.prompt_probex: dict | None = None
        self.judge: StreamJudge | None = None  # from the decision on the prompt on
        self.finished = False  # [DONE] relayed, or the stream was cut by a block
        self.blocked = False
        self.gone = False  # the caller hung up
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
            _record_generated(generated, self.metrics)
        self.unrecorded.clear()

    def caller_gone(self, task: asyncio.Future) -> None:
        if self.done_sending or task.cancelled():
            return
        self.gone = True
        self.close()

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
                if any(_chunk_has_tokens(c) for c in chunk.get("choices") or ()):
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
            out.append(_DONE)
            self.finished = True
            return True
        probex = event.pop("probex", None)
        generated = generated_scores(probex)
        if generated:
            self.unrecorded.append(generated)
            if self.judge.step(generated) is Decision.BLOCK:
                out.append(b"data: " + dumps(_content_filter_chunk(event, self.path)) + b"\n\n")
                out.append(_DONE)
                self.finished = self.blocked = True
                return True
        if self.expose and probex is not None:
            event["probex"] = probex
        out.append(b"data: " + dumps(event) + b"\n\n")
        return False


def _prompt_text(body: dict) -> str:
    if "messages" in body:
        return json.dumps(body["messages"])[:4000]
    return str(body.get("prompt"))[:4000]


class _CallerWatch:
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


def _upstream_failure(exc: Exception, upstream: Upstream, metrics: GatewayMetrics) -> ApiError:
    kind = "timeout" if isinstance(exc, UpstreamTimeout) else "connect"
    metrics.child(metrics.upstream_errors, upstream.url, kind).inc()
    if kind == "connect":
        upstream.healthy = False
        upstream.last_error = str(exc)
        return ApiError(502, f"upstream worker {upstream.url} unreachable: {type(exc).__name__}", kind="server_error",
                        code="upstream_unavailable")
    return ApiError(504, f"upstream worker {upstream.url} timed out", kind="server_error", code="upstream_timeout")


async def _relay_upstream_error(send, status: int, content: bytes, upstream: Upstream, call: _Call,
                                metrics: GatewayMetrics) -> None:
    """Client errors pass through as the worker wrote them; a worker's 5xx is the gateway's 502."""
    headers = call.headers(Decision.ALLOW)
    if status < 500:
        await _respond(send, status, content, headers)
        return
    metrics.child(metrics.upstream_errors, upstream.url, f"http_{status}").inc()
    detail = content[:300].decode(errors="replace")
    error = ApiError(502, f"upstream worker {upstream.url} failed with HTTP {status}: {detail}", kind="server_error",
                     code="upstream_error")
    await _respond(send, 502, dumps(error.body()), headers)


def _judge_whole(call: _Call, probex: dict | None, metrics: GatewayMetrics) -> Verdict:
    fail_closed = call.policy.policy.missing_scores == "fail_closed"
    if not probex or not probex.get("scores"):
        metrics.child(metrics.scores_missing, call.tenant.name).inc()
    _record_scores(probex, metrics)
    return judge_prompt(call.tenant, probex, fail_closed).merge(judge_generated(call.tenant, generated_scores(probex)))


def _record_scores(probex: dict | None, metrics: GatewayMetrics) -> None:
    for name, entry in ((probex or {}).get("scores") or {}).items():
        if entry.get("score") is not None:
            metrics.child(metrics.probe_score, name, "prompt").observe(entry["score"])
        prompt = entry.get("prompt")
        if prompt:
            metrics.prompt_tokens.inc(prompt.get("prompt_tokens", 0))
            metrics.prompt_tokens_scored.inc(prompt.get("tokens_scored", 0))
            break  # token counts are per request, not per probe
    for name, entry in ((probex or {}).get("scores") or {}).items():
        values = [v for v in (entry.get("generated") or {}).get("scores") or () if v is not None]
        if values:
            metrics.child(metrics.probe_score, name, "generated").observe(max(values))


async def _account(call: _Call, verdict: Verdict, metrics: GatewayMetrics, audit: AuditSink) -> None:
    metrics.child(metrics.requests, verdict.decision.value, verdict.probe or "", call.tenant.name).inc()
    if verdict.decision is not Decision.ALLOW:
        await audit.record(audit_event(request_id=call.request_id, tenant=call.tenant.name,
                                       decision=verdict.decision.value, probe=verdict.probe, phase=verdict.phase,
                                       scores=verdict.scores, policy_version=call.policy.version,
                                       prompt=call.prompt_text))


def _observe_overhead(call: _Call, metrics: GatewayMetrics) -> None:
    metrics.overhead.observe(max(0.0, time.perf_counter() - call.started - call.upstream_s))


def _refuse_whole(call: _Call, data: dict, path: str) -> None:
    message = call.policy.policy.refusal_message
    for choice in data.get("choices") or []:
        if path == "/v1/chat/completions":
            choice["message"] = {"role": "assistant", "content": message}
        else:
            choice["text"] = message
        choice["finish_reason"] = "content_filter"


# -- stream helpers ---------------------------------------------------------------------------


def _sse(obj: dict) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def _chunk_has_tokens(choice: dict) -> bool:
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or choice.get("text") or delta.get("tool_calls"))


def _record_generated(generated: dict, metrics: GatewayMetrics) -> None:
    for name, values in generated.items():
        child = metrics.child(metrics.probe_score, name, "generated")
        for v in values:
            if v is not None:
                child.observe(v)


def _content_filter_chunk(template: dict, path: str) -> dict:
    chunk = {k: template[k] for k in ("id", "object", "created", "model") if k in template}
    index = ((template.get("choices") or [{}])[0]).get("index", 0)
    choice = {"index": index, "finish_reason": "content_filter"}
    choice.update({"delta": {}} if path == "/v1/chat/completions" else {"text": ""})
    chunk["choices"] = [choice]
    return chunk


def _refusal_events(call: _Call, path: str, head: list) -> bytes:
    template = next((e for e in head if isinstance(e, dict)), {"object": "chat.completion.chunk"})
    base = {k: template[k] for k in ("id", "object", "created", "model") if k in template}
    message = call.policy.policy.refusal_message
    if path == "/v1/chat/completions":
        first = {"index": 0, "delta": {"role": "assistant", "content": message}, "finish_reason": None}
    else:
        first = {"index": 0, "text": message, "finish_reason": None}
    return _sse({**base, "choices": [first]}) + _sse(_content_filter_chunk(base, path)) + _DONE
