"""The gateway's FastAPI routes besides the completions: health, readiness, metrics, models, admin."""

from __future__ import annotations

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.audit import AuditSink, admin_event
from gateway.auth import Authenticator
from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from gateway.policy_manager import PolicyManager
from gateway.upstreams import NoHealthyUpstream, UpstreamPool


def add_routes(app: FastAPI, manager: PolicyManager, pool: UpstreamPool, metrics: GatewayMetrics,
               client: httpx.AsyncClient, auth: Authenticator, audit: AuditSink) -> None:
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
        auth.authenticate(request, manager.current)
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
        caller = auth.require_admin(request, manager.current)
        before = manager.current.version
        ok, message = await manager.reload(f"admin request by {caller.key_name}")
        await audit.record(admin_event(action="reload", actor=caller.key_name, ok=ok, message=message,
                                       previous_version=before, policy_version=manager.current.version))
        if not ok:
            raise ApiError(400, message, code="policy_rejected")
        return {"status": "ok", "message": message, "policy_version": manager.current.version}

    @app.get("/admin/policy")
    async def admin_policy(request: Request):
        auth.require_admin(request, manager.current)
        current = manager.current
        # Thresholds as the decisions use them, each with the false-positive rate it was resolved from.
        return {"policy_version": current.version, "probes": list(current.probes),
                "needs_recompute": current.needs_recompute, "last_reload_error": manager.last_error,
                "rules": current.describe_rules(),
                "judge": current.policy.judge.model_dump(include={"url", "model", "block_above", "flag_above",
                                                                  "timeout_s", "on_failure", "min_answer_mass"})}
