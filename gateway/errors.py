"""OpenAI-style error answers, and the upstream failures turned into them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse

from gateway.jsoncodec import dumps
from gateway.metrics import GatewayMetrics
from gateway.policy import Decision
from gateway.upstream_http import UpstreamError, UpstreamTimeout
from gateway.upstreams import Upstream

if TYPE_CHECKING:
    from gateway.calls import Call

JSON_TYPE = b"application/json"
UPSTREAM_ERRORS = (UpstreamError,)


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class ClientGone(Exception):
    """The caller went away before a response could be sent."""


async def respond(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]],
                   content_type: bytes = JSON_TYPE) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", b"%d" % len(body)), *headers]})
    await send({"type": "http.response.body", "body": body})


def upstream_failure(exc: Exception, upstream: Upstream, metrics: GatewayMetrics) -> ApiError:
    kind = "timeout" if isinstance(exc, UpstreamTimeout) else "connect"
    metrics.child(metrics.upstream_errors, upstream.url, kind).inc()
    if kind == "connect":
        upstream.healthy = False
        upstream.last_error = str(exc)
        return ApiError(502, f"upstream worker {upstream.url} unreachable: {type(exc).__name__}", kind="server_error",
                        code="upstream_unavailable")
    return ApiError(504, f"upstream worker {upstream.url} timed out", kind="server_error", code="upstream_timeout")


async def relay_upstream_error(send, status: int, content: bytes, upstream: Upstream, call: Call,
                                metrics: GatewayMetrics) -> None:
    """Client errors pass through as the worker wrote them; a worker's 5xx is the gateway's 502."""
    headers = call.headers(Decision.ALLOW)
    if status < 500:
        await respond(send, status, content, headers)
        return
    metrics.child(metrics.upstream_errors, upstream.url, f"http_{status}").inc()
    detail = content[:300].decode(errors="replace")
    error = ApiError(502, f"upstream worker {upstream.url} failed with HTTP {status}: {detail}", kind="server_error",
                     code="upstream_error")
    await respond(send, 502, dumps(error.body()), headers)
