"""The OpenAI-compatible monitoring proxy.

Requests go to a worker (`probex worker`) which returns per-request probe scores in a
`probex` field; the gateway turns them into allow / flag / block under the tenant's
policy, relays streams chunk by chunk (blocking mid-stream when generated tokens cross
a threshold), strips scores unless the caller may see them, and records metrics and
audit events. It speaks to workers over HTTP only.

The two completion routes are the hot path: one plain ASGI application (no FastAPI request
machinery, no Starlette response classes, `gateway.completions` and `gateway.streaming`)
relaying over a small keep-alive HTTP/1.1 client of its own (`gateway.upstream_http`).
Health checks, probe pushes and the admin routes (`gateway.admin`) use FastAPI and httpx.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from gateway.admin import add_routes
from gateway.audit import AuditSink, JsonlAudit, RedisAudit
from gateway.auth import Authenticator
from gateway.completions import COMPLETION_PATHS, CompletionRoute, Completions
from gateway.config import GatewayConfig
from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from gateway.policy_manager import PolicyManager, periodic
from gateway.upstreams import UpstreamPool, WorkerAuth

__all__ = ["GatewayApp", "GatewayConfig", "create_app"]

log = logging.getLogger("probex.gateway")


class GatewayApp(FastAPI):
    """FastAPI, except that POSTs to the completion routes go straight to their ASGI endpoint.

    That skips the middleware stack and the router: about 50 us off time-to-first-token on the
    2-core benchmark machine. The routes are registered with the router too (other methods get
    405). Middleware added to this app does not see completion POSTs.
    """

    fast_routes: dict[str, "CompletionRoute"] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.fast_routes.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(config: GatewayConfig, metrics: GatewayMetrics | None = None) -> FastAPI:
    metrics = metrics or GatewayMetrics()
    auth = Authenticator(config.admin_keys, config.listen_host)
    client = httpx.AsyncClient(  # control plane: health checks, probe pushes, /v1/models
        timeout=httpx.Timeout(config.upstream_timeout_s, connect=config.connect_timeout_s),
        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        auth=WorkerAuth(config.worker_admin_token, config.upstreams),  # the worker token goes to workers only
    )
    pool = UpstreamPool(config.upstreams, client, metrics)
    audit: AuditSink = RedisAudit(config.redis_url, metrics) if config.redis_url else JsonlAudit(config.audit_path, metrics)
    manager = PolicyManager(config, pool, metrics, audit)
    auth.check_startup(manager.current, config.listen_host)  # AdminKeyError: open to the network without admin keys
    if isinstance(audit, RedisAudit):
        audit.maxlen = manager.current.policy.audit.maxlen
    metrics.set_policy(manager.current)
    completions = Completions(config, manager, pool, metrics, audit, auth)
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
        tasks.append(asyncio.create_task(periodic(manager.poll_retention, 5.0)))
        tasks.append(asyncio.create_task(periodic(audit.flush, 1.0)))
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

    add_routes(app, manager, pool, metrics, client, auth, audit)
    app.fast_routes = {path: CompletionRoute(completions, path) for path in COMPLETION_PATHS}
    for path, endpoint in app.fast_routes.items():  # an ASGI app as endpoint: Starlette hands it the raw scope
        app.router.routes.append(Route(path, endpoint, methods=["POST"]))
    return app
