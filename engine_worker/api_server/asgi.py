"""ASGI types and the few helpers every part of the API-server middleware uses."""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable


Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


async def _read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(parts)

def _body_headers(scope: Scope, body: bytes, request_id: str | None = None) -> list[tuple[bytes, bytes]]:
    """The request's headers for a rewritten `body` (its length), with ProbeX's request id if given."""
    replaced = (b"content-length", b"x-request-id") if request_id else (b"content-length",)
    headers = [(k, v) for k, v in scope["headers"] if k not in replaced]
    headers.append((b"content-length", str(len(body)).encode()))
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    return headers

def _replay(body: bytes, downstream: Receive) -> Receive:
    """Hand the (possibly rewritten) body to the app, then the client's own messages (disconnects)."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await downstream()

    return receive

async def _send_json(send: Send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
