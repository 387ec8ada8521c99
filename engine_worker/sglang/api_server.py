"""ProbeX's middleware on SGLang's OpenAI server (launch.py adds it to SGLang's `app`).

The engine-agnostic middleware (engine_worker/api_server/middleware.py) with SGLang's answers:

- Engine RPC. SGLang's HTTP server reaches its scheduler through the tokenizer manager's
  fan-out communicators, one per control request type; none takes an arbitrary call. ProbeX's
  calls ride on the internal-state request (`SetInternalStateReq`, whose `server_args` dict
  goes to the scheduler as is): runner.py answers those carrying `RPC_KEY` between steps on
  the scheduler thread and passes every other one to SGLang.
- Request ids. SGLang ignores `X-Request-Id`; its `rid` body field names the request in the
  scheduler and the response's `id`. The id the middleware gives a monitored request
  becomes its `rid`, as vLLM would name it (`chatcmpl-<id>`, `cmpl-<id>-0`), so the scores the
  scheduler sends under that rid are the request's.
- Options. The `probex_*` options come in `vllm_xargs` (checked by the middleware); SGLang
  reads per-request options from `custom_params`, where they are moved.
- Tokens per chunk. The relays count a chunk's generated tokens by the `token_ids` vLLM
  writes into each choice; SGLang writes none, but counts a stream's tokens in each chunk's
  `usage` (`stream_options.continuous_usage_stats`) and a whole response's in its `usage`.
  Each choice gets a `token_ids` member of that many zeros, which the relay counts and
  removes; the usage the client did not ask for is removed too. A chat stream sends no
  chunk for tokens that add no text (a stop token, a trimmed stop string), and its closing
  `finish_reason` chunk carries no usage: that chunk is held back until the closing usage
  chunk (always asked for) says how many tokens it ends with. A client asking for token
  ids (`return_token_ids: true`) is refused: SGLang gives none to return. So is a completion
  of several prompts (one `rid` per prompt, which this worker does not map).
"""

from __future__ import annotations

import contextvars
import json
from typing import Any

from engine_worker.api_server.asgi import _body_headers, _read_body, _replay, _send_json
from engine_worker.api_server.middleware import ProbexMiddleware
from engine_worker.api_server.requests import MONITORED_PATHS, openai_error
from engine_worker.sglang.runner import RPC_KEY

# Set while the middleware relays a request whose client did not ask for token ids.
_IDS_UNWANTED = contextvars.ContextVar("probex_sglang_ids_unwanted", default=False)
_OPTION_PREFIX = "probex_"


class _IdsUnwanted:
    def __enter__(self):
        self._token = _IDS_UNWANTED.set(True)

    def __exit__(self, *exc) -> None:
        _IDS_UNWANTED.reset(self._token)


class SglangMiddleware(ProbexMiddleware):
    def __init__(self, app, hub=None, tap_config=None) -> None:
        super().__init__(SglangOpenAI(app), hub, tap_config)

    async def engine_rpc(self, app, method: str, *args) -> list[dict]:
        manager = self.tokenizer_manager()
        manager.auto_create_handle_loop()
        outputs = await manager.set_internal_state_communicator(
            self.rpc_request({RPC_KEY: {"method": method, "args": list(args)}}))
        return [output.server_args[RPC_KEY] for output in outputs]

    def prompt_ids_left_out(self):
        return _IdsUnwanted()

    def tokenizer_manager(self):
        from sglang.srt.entrypoints.http_server import get_global_state

        return get_global_state().tokenizer_manager

    def rpc_request(self, server_args: dict) -> Any:
        from sglang.srt.managers.io_struct import SetInternalStateReq

        return SetInternalStateReq(server_args=server_args)


def engine_request_id(path: str, request_id: str) -> str:
    """The rid a monitored request runs under: the key its scores are filed by (MonitoredCall.key)."""
    prefix = f"{MONITORED_PATHS[path]}-{request_id}"
    return prefix if path == "/v1/chat/completions" else f"{prefix}-0"


def rewrite_request(path: str, body: dict, request_id: str | None) -> tuple[dict, dict] | str:
    """The body SGLang gets and what the response's rewrite needs to know (whether the client
    asked for usage), or the reason the request is refused."""
    xargs = body.pop("vllm_xargs", None)
    if isinstance(xargs, dict) and xargs:
        params = body.get("custom_params")
        body["custom_params"] = {**(params if isinstance(params, dict) else {}), **xargs}
    wants = {"usage": False, "continuous": False}
    if request_id is None:  # passed on unmonitored: options moved, nothing else
        body.pop("return_token_ids", None)
        return body, wants
    if not _IDS_UNWANTED.get():
        return "return_token_ids is not available on SGLang: it writes no token ids into its responses"
    prompt = body.get("prompt")
    if path == "/v1/completions" and isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return "a completion of several prompts is not monitored on SGLang; send one request per prompt"
    body.pop("return_token_ids", None)
    body["rid"] = engine_request_id(path, request_id)
    if body.get("stream"):
        options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        wants = {"usage": bool(options.get("include_usage")), "continuous": bool(options.get("continuous_usage_stats"))}
        # The closing usage chunk counts the tokens after the last chunk with text (ChunkCounter).
        body["stream_options"] = {**options, "include_usage": True, "continuous_usage_stats": True}
    else:
        wants["usage"] = True  # a whole response's usage is SGLang's own answer
    return body, wants


class ChunkCounter:
    """Adds each choice's `token_ids` (zeros: only their number is read) to SGLang's chunks and
    responses from the usage they carry, and removes the usage the client did not ask for."""

    def __init__(self, wants: dict) -> None:
        self.wants = wants
        self.seen: dict[int, int] = {}  # choice index -> completion tokens counted so far
        self.pending = b""
        self.held: list = []  # a closing chunk without usage and what followed it: (chunk or raw event)

    def whole(self, body: bytes) -> bytes:
        try:
            payload = json.loads(body)
        except ValueError:
            return body
        usage = payload.get("usage") or {}
        for choice in payload.get("choices") or []:
            choice["token_ids"] = [0] * int(usage.get("completion_tokens") or 0)
        return json.dumps(payload).encode()

    def stream(self, body: bytes, more: bool) -> bytes:
        events = (self.pending + body).split(b"\n\n")
        self.pending = events.pop() if more else b""
        out: list[bytes] = []
        for event in events:
            if event:
                out += self._event(event)
        if not more:
            out += self._release(None)
        return b"".join(e + b"\n\n" for e in out)

    def _event(self, event: bytes) -> list[bytes]:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return self._release(None) + [event] if self.held else [event]
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return self._hold_or_pass(event)
        choices = chunk.get("choices")
        usage = chunk.get("usage")
        if not choices:
            if usage is None or "choices" not in chunk:  # an error or extension chunk: kept as sent
                return self._hold_or_pass(event)
            # the closing usage chunk: its total ends a held closing chunk's count
            released = self._release(int(usage.get("completion_tokens") or 0))
            return released + ([event] if self.wants["usage"] else [])
        if usage is None and not self.held and all(c.get("finish_reason") for c in choices):
            self.held.append(chunk)  # tokens without text may end here: the usage chunk says
            return []
        if self.held:
            self.held.append(chunk)
            return []
        return [self._counted(chunk, usage)]

    def _hold_or_pass(self, event: bytes) -> list[bytes]:
        if self.held:
            self.held.append(event)
            return []
        return [event]

    def _counted(self, chunk: dict, usage) -> bytes:
        total = int((usage or {}).get("completion_tokens") or 0)
        for choice in chunk.get("choices") or []:
            index = int(choice.get("index") or 0)
            counted = self.seen.get(index, 0)
            if usage is not None and total > counted:
                self.seen[index] = total
            choice["token_ids"] = [0] * max(0, total - counted) if usage is not None else []
        if usage is not None and not self.wants["continuous"]:
            chunk.pop("usage", None)
        return b"data: " + json.dumps(chunk).encode()

    def _release(self, total: int | None) -> list[bytes]:
        """The held events, the first (the closing chunk) given the tokens up to `total` (None:
        the stream ended without a usage chunk, and it gets none)."""
        held, self.held = self.held, []
        out = []
        for i, item in enumerate(held):
            if isinstance(item, bytes):
                out.append(item)
            elif i == 0 and total is not None:
                out.append(self._counted(item, {"completion_tokens": total}))
            else:
                out.append(self._counted(item, item.get("usage")))
        return out


class SglangOpenAI:
    """SGLang's app as the middleware sees it: monitored routes' bodies and responses in the
    shape the relays read (module docstring)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or path not in MONITORED_PATHS or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        raw = await _read_body(receive)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return await self.app(scope, _replay(raw, receive), send)
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1") or None
        if request_id is not None and not request_id.startswith("probex-"):
            request_id = None  # a client's own id on an unmonitored request
        rewritten = rewrite_request(path, body, request_id)
        if isinstance(rewritten, str):
            return await _send_json(send, 400, openai_error(rewritten, status=400, code="unsupported_on_sglang"))
        body, wants = rewritten
        new_body = json.dumps(body).encode()
        inner = dict(scope, headers=_body_headers(scope, new_body))
        if request_id is None:
            return await self.app(inner, _replay(new_body, receive), send)
        counter = ChunkCounter(wants)
        state = {"stream": False, "whole": b""}

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                kinds = dict(message.get("headers") or []).get(b"content-type", b"")
                state["stream"] = kinds.startswith(b"text/event-stream")
                if not state["stream"]:  # the body's length changes
                    message = dict(message, headers=[(k, v) for k, v in message.get("headers") or []
                                                     if k.lower() != b"content-length"])
                return await send(message)
            if message["type"] != "http.response.body":
                return await send(message)
            more = message.get("more_body", False)
            if state["stream"]:
                return await send(dict(message, body=counter.stream(message.get("body", b""), more)))
            state["whole"] += message.get("body", b"")
            if not more:
                await send(dict(message, body=counter.whole(state["whole"])))

        await self.app(inner, _replay(new_body, receive), counted_send)
