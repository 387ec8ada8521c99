"""ASGI middleware that vLLM's API server loads (`--middleware`): ProbeX's part of the worker.

It does four things and touches no engine internals (the engine is reached only through
the public `engine_client.collective_rpc`):

1. checks `probex_*` keys in `vllm_xargs` and refuses what ProbeX cannot monitor (400);
2. gives each monitored request an id it controls (`X-Request-Id`), so score events from
   the worker can be matched to the response before the response exists;
3. attaches the `probex` field to non-streaming bodies and to every stream chunk, waiting
   (bounded) for the scores of the tokens a chunk carries;
4. serves `/probex/probes` (list, live swap), `/probex/steering` (list, replace steering
   vectors), `/probex/tap` (pause the tap and run it again; paused, requests pass through
   unmonitored) and `/probex/health`.

Steered requests (`probex_steer*` xargs, see engine_worker/steering.py) are checked
against the worker's loaded vectors and probes (400 naming the problem) and get a
`cache_salt` derived from their steering configuration, so their KV blocks are never
shared with unsteered requests or differently steered ones.
"""

from __future__ import annotations

import asyncio
import atexit
import hmac
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, NamedTuple
from urllib.parse import parse_qs

import msgspec

from engine_worker.scores import render as responses
from engine_worker.api_server.hub import ScoreHub
from engine_worker.scores.columns import RequestScores
from engine_worker.scores.wire import owner_tag
from engine_worker.steering import STEERING_XARGS, SteeringError, SteerRequest, cache_salt, steering_from_xargs
from engine_worker.tap.config import ENV_ADMIN_TOKEN, ENV_API_SERVER_COUNT, ENV_TAP_CONFIG, TapConfig, scores_delivered
from engine_worker.vllm.openai import PROMPT_TOKEN_IDS_UNWANTED, leave_out_unwanted_prompt_token_ids

log = logging.getLogger("probex.middleware")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

ENV_SCORE_WAIT = "PROBEX_SCORE_WAIT_S"
ENV_MODEL_DIR = "PROBEX_MODEL_DIR"
ENV_RETENTION = "PROBEX_RETENTION"

MONITORED_PATHS = {"/v1/chat/completions": "chatcmpl", "/v1/completions": "cmpl"}
BOOLEAN_XARGS = ("probex_recompute", "probex_capture")


class RequestRefused(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def openai_error(message: str, *, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(status)
    if kind is None:
        kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# vLLM's other routes that generate text (those of vLLM 0.25-0.32 that a chat model can serve):
# ProbeX monitors only MONITORED_PATHS, so a monitored worker refuses these instead of serving
# them unscored (and, for steered requests, without the prefix-cache salt that keeps them apart).
UNMONITORED_GENERATION_PATHS = frozenset({
    "/invocations", "/v1/chat/completions/batch", "/v1/responses", "/v1/messages", "/inference/v1/generate",
    "/cohere/v2/chat", "/generative_scoring", "/v1/systemone",
})

# A request body nested deeper than Python's parsers can follow (they recurse once per level).
_TOO_DEEP = "request body is nested too deeply"


def _truthy(key: str, value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)) and value in (0, 1):
        return int(value)
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return int(value.lower() in ("true", "1"))
    raise RequestRefused(f"vllm_xargs.{key} must be true or false, got {value!r}", param=f"vllm_xargs.{key}")


@dataclass
class MonitoredCall:
    """What the middleware learned from a request body before passing it on."""

    key_prefix: str
    stream: bool
    wants_token_ids: bool
    num_prompts: int = 1
    body: dict = field(default_factory=dict)
    steering: SteerRequest | None = None

    def key(self, choice_index: int) -> str:
        return self.key_prefix if self.key_prefix.startswith("chatcmpl-") else f"{self.key_prefix}-{choice_index}"


def inspect_request(path: str, body: Any, owner: str = "") -> MonitoredCall | None:
    """Validate ProbeX-relevant fields and rewrite the body; None = not ours to monitor (pass through)."""
    if not isinstance(body, dict):
        return None
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise RequestRefused("vllm_xargs must be an object", param="vllm_xargs")
    if xargs:
        for key in list(xargs):
            if key.startswith("probex_") and key not in STEERING_XARGS:
                if key not in BOOLEAN_XARGS:
                    raise RequestRefused(
                        f"unknown ProbeX option vllm_xargs.{key}; known: {', '.join(BOOLEAN_XARGS + STEERING_XARGS)}",
                        param=f"vllm_xargs.{key}",
                    )
                xargs[key] = _truthy(key, xargs[key])
    try:
        steering = steering_from_xargs(xargs)
    except SteeringError as exc:
        raise RequestRefused(str(exc), param=exc.param) from None
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        # vLLM reads "false" as false: taken as true here, its JSON answer would go out as a broken stream
        raise RequestRefused("stream must be true or false", param="stream")
    for name in ("n", "best_of"):
        value = body.get(name)
        if value not in (None, 1):
            raise RequestRefused(
                f"{name}={value!r}: ProbeX scores one sequence per request; send separate requests instead",
                param=name,
            )
    if body.get("use_beam_search"):
        raise RequestRefused("beam search is not supported with ProbeX monitoring", param="use_beam_search")
    if path == "/v1/completions" and body.get("echo"):
        raise RequestRefused("echo is not supported with ProbeX monitoring", param="echo")
    if body.get("include_reasoning") is False:
        # vLLM then leaves out the token ids that say which tokens each chunk carries (where a
        # reasoning or tool parser is on): the generated tokens' scores could not be placed.
        raise RequestRefused("include_reasoning: false is not supported with ProbeX monitoring",
                             param="include_reasoning")

    num_prompts = 1
    prompt = body.get("prompt")
    if path == "/v1/completions" and isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        num_prompts = len(prompt)

    wants_token_ids = bool(body.get("return_token_ids"))
    # Token ids tell us exactly how many generated tokens each chunk carries; we strip
    # them again unless the client asked for them.
    body["return_token_ids"] = True
    # `owner`: this API server process's tag where there are several (delivery.owner_tag), so
    # its hub can tell its requests' rows from the others'; the id stays 32 hex digits.
    request_id = f"probex-{owner}{uuid.uuid4().hex[len(owner):]}"
    return MonitoredCall(
        key_prefix=f"{MONITORED_PATHS[path]}-{request_id}",
        stream=bool(body.get("stream")),
        wants_token_ids=wants_token_ids,
        num_prompts=num_prompts,
        body=body,
        steering=steering,
    )


class _RequestFields(msgspec.Struct):
    """The fields of a request body that `inspect_request` looks at; the prompt or messages are
    only skipped over (`msgspec.Raw`), not turned into Python objects."""

    prompt: msgspec.Raw = msgspec.Raw()
    stream: Any = None
    n: Any = None
    best_of: Any = None
    use_beam_search: Any = None
    echo: Any = None
    include_reasoning: Any = None
    return_token_ids: Any = None
    vllm_xargs: Any = None


_request_fields = msgspec.json.Decoder(_RequestFields)
_ASK_FOR_TOKEN_IDS = b',"return_token_ids":true}'


def body_as_sent(path: str, raw: bytes, owner: str = "") -> tuple[MonitoredCall, bytes] | None:
    """The usual request, monitored without decoding and re-encoding its body: (its call, the
    body for vLLM), or None for anything `inspect_request` must see (a ProbeX option, a
    steering request, a field it refuses or checks, a batch of prompts, a body msgspec does
    not take, which may still be JSON that Python's parser takes).

    The body for vLLM is the client's own bytes, with `"return_token_ids":true` added
    before the closing brace if the client did not send the key. What it saves is on every
    request's way to its first token: `probex bench engine`'s 1024-token request takes
    13-15 µs here against 32-34 µs decoded, checked and re-encoded on the dev machine
    (`python3 -m probex.bench_handoff`: request_us, request_decoded_us)."""
    try:
        fields = _request_fields.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None  # the full path answers (a body nested too deeply is refused there)
    xargs = fields.vllm_xargs
    if xargs is not None and (not isinstance(xargs, dict) or any(str(key).startswith("probex_") for key in xargs)):
        return None
    if (fields.n not in (None, 1) or fields.best_of not in (None, 1) or fields.use_beam_search
            or not isinstance(fields.stream, (bool, type(None)))
            or (path == "/v1/completions" and fields.echo) or fields.include_reasoning is False):
        return None
    if path == "/v1/completions" and _lists_several_prompts(bytes(fields.prompt)):
        return None
    if fields.return_token_ids is True:
        body = raw
    elif fields.return_token_ids is None:
        stripped = raw.rstrip()
        if not stripped.endswith(b"}") or stripped[:-1].rstrip().endswith(b"{"):
            return None  # an empty object: vLLM's own validation answers it, from the full path
        body = stripped[:-1] + _ASK_FOR_TOKEN_IDS
    else:
        return None  # asked not to have them, or something else: the full path sets the field
    request_id = f"probex-{owner}{uuid.uuid4().hex[len(owner):]}"
    call = MonitoredCall(key_prefix=f"{MONITORED_PATHS[path]}-{request_id}", stream=bool(fields.stream),
                         wants_token_ids=fields.return_token_ids is True)
    return call, body


def _lists_several_prompts(prompt: bytes) -> bool:
    """Does a completion's raw `prompt` hold a list of prompts (strings or token lists),
    whose choices are scored one by one, rather than one text or one list of token ids?"""
    text = prompt.lstrip()
    return text.startswith(b"[") and text[1:].lstrip()[:1] in (b'"', b"[")


def check_steering(body: dict, request: SteerRequest, steering: dict, probes: dict) -> str:
    """Check a steering request against what the worker has loaded; normalise its xargs and
    set its `cache_salt`. `steering` / `probes` are the worker's listings. Returns the salt."""
    if not steering.get("steer_layers"):
        raise RequestRefused("this worker steers no layer (start it with --steer-layer L)", param="vllm_xargs.probex_steer")
    vector = next((v for v in steering["vectors"] if v["name"] == request.vector), None)
    if vector is None:
        known = ", ".join(v["name"] for v in steering["vectors"]) or "none"
        raise RequestRefused(f"unknown steering vector {request.vector!r}; loaded: {known}",
                             param="vllm_xargs.probex_steer", code="unknown_steering_vector")
    if request.gate is not None:
        probe = next((p for p in probes["probes"] if p["name"] == request.gate), None)
        if probe is None:
            known = ", ".join(p["name"] for p in probes["probes"]) or "none"
            raise RequestRefused(f"gate probe {request.gate!r} is not loaded; loaded: {known}",
                                 param="vllm_xargs.probex_steer_gate", code="unknown_gate_probe")
        if probe["layer"] not in steering["gate_layers"].get(str(vector["layer"]), []):
            raise RequestRefused(
                f"gate probe {request.gate!r} reads layer {probe['layer']}, but steering vector {request.vector!r}"
                f" writes at layer {vector['layer']}: a gate must be at a tapped layer at or before the write",
                param="vllm_xargs.probex_steer_gate")
        if not probe["calibration"]["slope"] > 0:
            raise RequestRefused(f"gate probe {request.gate!r} has a non-positive calibration slope, so a"
                                 " probability threshold cannot be turned into a raw one",
                                 param="vllm_xargs.probex_steer_gate")
    xargs = body["vllm_xargs"]
    xargs["probex_steer_alpha"] = request.alpha
    xargs["probex_steer_window"] = request.window
    if request.threshold is not None:
        xargs["probex_steer_threshold"] = request.threshold
    salt = cache_salt(request, vector["digest"], body.get("cache_salt"))
    body["cache_salt"] = salt
    return salt


class ProbexMiddleware:
    def __init__(self, app: Callable, hub: ScoreHub | None = None, tap_config: TapConfig | None = None) -> None:
        self.app = app
        raw_config = os.environ.get(ENV_TAP_CONFIG)
        self.tap_config = tap_config or (TapConfig.from_json(raw_config) if raw_config else None)
        address = self.tap_config.score_address if self.tap_config else None
        # With vLLM's --api-server-count N (N > 1) this is one of N processes, each relaying
        # the requests it received: its ids carry its own tag, its hub books only those.
        self.api_server_count = int(os.environ.get(ENV_API_SERVER_COUNT, "1"))
        self.owner = owner_tag() if self.api_server_count > 1 else ""
        formatted = self.tap_config is not None and self.tap_config.step_address is not None
        self.hub = hub if hub is not None else (ScoreHub(address, owner=self.owner or None, formatted=formatted)
                                                if address else None)
        self.admin_token = os.environ.get(ENV_ADMIN_TOKEN) or None
        self.score_wait_s = float(os.environ.get(ENV_SCORE_WAIT, "10"))
        if not scores_delivered():
            self.score_wait_s = 0.0  # no scores will come (diagnostic set-up): waiting would only stall chunks
        self._swap_lock = asyncio.Lock()
        # (steering, probes) and the hub's swap count when they were read: dropped on every swap,
        # this process's own (below) or another's (the worker's control message, ScoreHub.swaps)
        self._listings: tuple[dict, dict] | None = None
        self._listings_swaps = 0
        self.retention = RetentionTracker(os.environ.get(ENV_MODEL_DIR), _shared_dir(address)
                                          if self.api_server_count > 1 else None)
        self._retention_enabled = os.environ.get(ENV_RETENTION, "1") != "0"
        self._retention_version = 0  # the probe set version whose retention was last scheduled
        if self.hub is not None:
            self.hub.on_probes_swapped = self._schedule_retention
            self.hub.on_probes_unannounced = self._retention_for_unannounced
        self._started = False
        self._app = None  # the server's app, once a request came: its engine client answers RPCs
        self._background: set[asyncio.Task] = set()  # tasks started from the hub's callbacks, kept alive
        if self.hub is not None:
            leave_out_unwanted_prompt_token_ids()  # see `_relayed`

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.hub is not None and scope["type"] in ("lifespan", "http"):
            self.hub.start()
            self._app = scope.get("app", self._app)
            if not self._started:
                self._started = True
                if self.tap_config is not None:
                    # the worker loads the startup set as version 1 (TapController.load)
                    self._schedule_retention(1, list(self.tap_config.probe_dirs))
        if scope["type"] != "http" or self.hub is None:
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        if path in MONITORED_PATHS and method == "POST":
            return await self._monitored(scope, receive, send)
        if path in UNMONITORED_GENERATION_PATHS and method == "POST":
            message = (f"{path} is not served by this ProbeX worker: generation is monitored on "
                       f"{' and '.join(MONITORED_PATHS)} only")
            return await _send_json(send, 404, openai_error(message, status=404, code="unmonitored_route"))
        if path == "/probex/probes":
            return await self._probes_route(scope, receive, send)
        if path == "/probex/steering":
            return await self._steering_route(scope, receive, send)
        if path == "/probex/tap":
            return await self._tap_route(scope, receive, send)
        if path == "/probex/health":
            if method != "GET":
                return await _send_json(send, 405, openai_error(f"{method} not allowed on /probex/health",
                                                                status=405))
            return await self._health(scope, send)
        if path == "/probex/step-timings":
            return await self._step_timings_route(scope, send)
        return await self.app(scope, receive, send)

    # -- monitored completions ------------------------------------------------------------

    async def _monitored(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.perf_counter()
        raw_body = await _read_body(receive)
        as_sent = body_as_sent(scope["path"], raw_body, self.owner) if raw_body else None
        if as_sent is not None:  # the usual request: nothing to check or rewrite beyond the token ids
            call, new_body = as_sent
            if self.hub.paused:  # passed on unmonitored, as the client sent it
                timed = FirstChunkTimer(self.hub, arrived, send) if call.stream else None
                return await self.app(scope, _replay(raw_body, receive), timed.send if timed else send)
            return await self._relayed(scope, receive, send, call, new_body, arrived)
        try:
            body, encode = _decode_request(raw_body) if raw_body else (None, _encode_json)
            call = inspect_request(scope["path"], body, self.owner)
            if call is not None and (call.body.get("vllm_xargs") or {}).get("probex_capture") \
                    and not (self.tap_config is not None and self.tap_config.capture_rows):
                raise RequestRefused("capture is off on this worker (start it with --capture-dir)",
                                     param="vllm_xargs.probex_capture", code="capture_off")
        except RequestRefused as refusal:
            return await _send_json(send, refusal.status, openai_error(refusal.message, status=refusal.status, param=refusal.param, code=refusal.code))
        if call is None:  # not JSON we understand: vLLM answers with its own validation error
            return await self.app(scope, _replay(raw_body, receive), send)
        if call.steering is not None:
            steering, probes = await self._current_listings(scope)
            try:
                check_steering(call.body, call.steering, steering, probes)
            except RequestRefused as refusal:
                return await _send_json(send, refusal.status, openai_error(refusal.message, status=refusal.status, param=refusal.param, code=refusal.code))

        if self.hub.paused:  # the tap is switched off: checked as above, then passed on unmonitored
            if (call.body.get("vllm_xargs") or {}).get("probex_capture"):
                message = "capture is unavailable while the tap is paused (PUT /probex/tap)"
                return await _send_json(send, 409, openai_error(message, status=409, param="vllm_xargs.probex_capture",
                                                                code="tap_paused"))
            if not call.wants_token_ids:
                call.body.pop("return_token_ids", None)
            new_body = encode(call.body)
            timed = FirstChunkTimer(self.hub, arrived, send) if call.stream else None
            return await self.app(dict(scope, headers=_body_headers(scope, new_body)), _replay(new_body, receive),
                                  timed.send if timed else send)
        return await self._relayed(scope, receive, send, call, encode(call.body), arrived)

    async def _relayed(self, scope: Scope, receive: Receive, send: Send, call: MonitoredCall, new_body: bytes,
                       arrived: float) -> None:
        """Hand the request to vLLM under ProbeX's id and relay its response with scores attached."""
        request_id = call.key_prefix.split("-", 1)[1]
        inner_scope = dict(scope, headers=_body_headers(scope, new_body, request_id))
        if call.stream:
            timed = FirstChunkTimer(self.hub, arrived, send, monitored=True)
            relay = StreamRelay(self.hub, call, timed.send, self.score_wait_s)
            timed.relay = relay
        else:
            relay = BodyRelay(self.hub, call, send, self.score_wait_s)
        # A client that did not ask for token ids gets none: vLLM then need not write the
        # prompt's ids into the first chunk for the relay to cut them out (vllm_openai.py).
        unwanted = None if call.wants_token_ids else PROMPT_TOKEN_IDS_UNWANTED.set(True)
        try:
            await self.app(inner_scope, _replay(new_body, receive), relay.send)
        finally:
            if unwanted is not None:
                PROMPT_TOKEN_IDS_UNWANTED.reset(unwanted)
            for index in range(call.num_prompts):
                self.hub.release(call.key(index))

    # -- admin routes -------------------------------------------------------------------------

    def _is_admin(self, scope: Scope) -> bool:
        if not self.admin_token:
            return False
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"").decode("latin-1")  # HTTP header bytes: any byte decodes
        token = auth[7:] if auth.lower().startswith("bearer ") else headers.get(b"x-probex-admin-token",
                                                                                 b"").decode("latin-1")
        return hmac.compare_digest(token.encode("latin-1"), self.admin_token.encode("utf-8", "surrogateescape"))

    async def _tap_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET says whether the tap is paused; PUT {"paused": true|false} (admin) switches it on
        every worker, without a restart. While paused, requests are served unmonitored."""
        method = scope["method"]
        if method == "GET":
            return await _send_json(send, 200, {"paused": self.hub.paused})
        if method != "PUT":
            return await _send_json(send, 405, openai_error(f"{method} not allowed on /probex/tap", status=405))
        if await self._refused_admin(scope, send, "pausing the tap is disabled"):
            return
        try:
            paused = json.loads(await _read_body(receive))["paused"]
            if not isinstance(paused, bool):
                raise TypeError
        except (ValueError, KeyError, TypeError, RecursionError):
            return await _send_json(send, 400, openai_error('body must be {"paused": true} or {"paused": false}',
                                                            status=400, param="paused"))
        async with self._swap_lock:
            result = _every_rank(await _engine_client(scope).collective_rpc("probex_set_paused", args=(paused,)))
            sequence = result.pop("sequence", None)  # between the worker and its API servers only
            if result.get("ok"):
                self.hub.set_paused(result["paused"], sequence)
        if not result.get("ok"):
            return await _send_json(send, 400, openai_error(result["error"], status=400, param="paused",
                                                            code="pause_refused"))
        await _send_json(send, 200, result)

    async def _step_timings_route(self, scope: Scope, send: Send) -> None:
        """GET ?after=N (admin): the worker's timed prompt-sized forwards numbered above N, with
        their device spans (a diagnostic, PROBEX_STEP_TIMING=1; engine_worker/step_timing.py)."""
        if scope["method"] != "GET":
            return await _send_json(send, 405, openai_error(f"{scope['method']} not allowed on /probex/step-timings",
                                                            status=405))
        if await self._refused_admin(scope, send, "reading step timings is disabled"):
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        try:
            after = int(query.get("after", ["-1"])[-1])
            if not -1 <= after < 2**63:  # a record number; larger ones cannot cross to the worker (int64)
                raise ValueError
        except ValueError:
            return await _send_json(send, 400, openai_error("after must be an integer from -1", status=400,
                                                            param="after"))
        result = (await _engine_client(scope).collective_rpc("probex_step_timings", args=(after,)))[0]
        if not result.pop("ok"):
            return await _send_json(send, 409, openai_error(result["error"], status=409, code="step_timing_off"))
        await _send_json(send, 200, result)

    async def _refused_admin(self, scope: Scope, send: Send, disabled: str) -> bool:
        """Answer a request to an admin route that may not proceed (no admin token configured,
        or not given); True if it was answered."""
        if not self.admin_token:
            await _send_json(send, 403, openai_error(f"{disabled}: the worker was started without an admin token",
                                                     status=403))
            return True
        if not self._is_admin(scope):
            await _send_json(send, 401, openai_error("admin token required (Authorization: Bearer <token>)", status=401))
            return True
        return False

    async def _probes_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        swapped = await self._artifact_route(scope, receive, send, _PROBE_SET)
        if swapped is not None:
            self._schedule_retention(*swapped)

    def _schedule_retention(self, version: int, dirs: list[str]) -> None:
        """Retention for probe-set `version`, once per process: after this process's own swap
        (the reply) or another's (the worker's control message), whichever comes first."""
        if self._retention_enabled and version > self._retention_version:
            self._retention_version = version
            self.retention.schedule(dirs)

    def _retention_for_unannounced(self, version: int) -> None:
        """A probe set this process heard no swap message of (it was lost): its directories
        are read from the worker's listing, then its retention check is scheduled as usual."""
        if not self._retention_enabled or version <= self._retention_version or self._app is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a hub fed outside the server's loop (tests): nothing to ask the worker with
            return
        task = loop.create_task(self._retention_from_listing(version))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _retention_from_listing(self, version: int) -> None:
        try:
            listing = (await self._app.state.engine_client.collective_rpc("probex_list_probes"))[0]
        except Exception as exc:  # the check is skipped for this set, as for one that fails to compute
            log.warning("probex: could not list probe set %d for its retention check: %s", version, exc)
            return
        dirs = [p["source"] for p in listing.get("probes", []) if p.get("source")]
        self._schedule_retention(int(listing.get("version", version)), dirs)

    async def _steering_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._artifact_route(scope, receive, send, _STEERING_SET)

    async def _artifact_route(self, scope: Scope, receive: Receive, send: Send,
                              kind: "_ArtifactSet") -> tuple[int, list[str]] | None:
        """GET lists the loaded set; PUT (admin) replaces it on every worker. Returns the new
        set's version and dirs after a swap."""
        method = scope["method"]
        if method not in ("GET", "PUT"):
            await _send_json(send, 405, openai_error(f"{method} not allowed on {kind.path}", status=405))
            return None
        engine = _engine_client(scope)
        if method == "GET":
            await _send_json(send, 200, (await engine.collective_rpc(kind.list_rpc))[0])
            return None
        if await self._refused_admin(scope, send, kind.swap_disabled):
            return None
        raw = await _read_body(receive)
        try:
            dirs = json.loads(raw)[kind.body_key]
            if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
                raise TypeError
        except (ValueError, KeyError, TypeError, RecursionError):
            await _send_json(send, 400, openai_error(f'body must be {{"{kind.body_key}": ["/path/to/{kind.dir_word}-dir", ...]}}', status=400, param=kind.body_key))
            return None
        async with self._swap_lock:
            result = _every_rank(await engine.collective_rpc(kind.load_rpc, args=(dirs,)))
            self._listings = None
        if not result.get("ok"):
            await _send_json(send, 400, openai_error(result["error"], status=400, param=kind.body_key, code=kind.rejected_code))
            return None
        await _send_json(send, 200, result)
        return int(result.get("version", 0)), dirs

    async def _current_listings(self, scope: Scope) -> tuple[dict, dict]:
        listings = self._listings
        if listings is None or self._listings_swaps != self.hub.swaps:
            swaps = self.hub.swaps
            engine = _engine_client(scope)
            steering = (await engine.collective_rpc("probex_list_steering"))[0]
            probes = (await engine.collective_rpc("probex_list_probes"))[0]
            listings = self._listings = (steering, probes)
            self._listings_swaps = swaps
        return listings

    async def _health(self, scope: Scope, send: Send) -> None:
        listing = (await _engine_client(scope).collective_rpc("probex_list_probes"))[0]
        listing["score_messages_received"] = self.hub.messages_received
        listing["score_messages_lost"] = self.hub.messages_lost
        listing["score_steps_lost"] = self.hub.steps_lost
        listing["score_waits"] = self.hub.wait_stats()
        listing["score_loop_time"] = self.hub.loop_time_stats()
        listing["open_prompt_books"] = self.hub.open_prompt_books
        if self.hub.formatted:
            listing["score_formatter"] = {"restarts_seen": self.hub.formatter_restarts, "silent": self.hub.silent}
        listing["retention"] = self.retention.values
        listing["retention_status"] = self.retention.status
        # Which API server process answered: with several, each counts its own requests above,
        # and `relay_paused` is whether this one has heard of the tap's pause (`paused` above is
        # the worker's own state).
        listing["api_server"] = {"pid": os.getpid(), "count": self.api_server_count, "owner": self.owner or None,
                                 "relay_paused": self.hub.paused}
        return await _send_json(send, 200, listing)


def _shared_dir(score_address: str | None) -> Path | None:
    """A directory every API server process of one worker finds: beside the score socket
    (launch.py names it anew for each start)."""
    if not score_address or not score_address.startswith("ipc://"):
        return None
    return Path(score_address[len("ipc://"):] + ".shared")


class RetentionTracker:
    """Relative calibration retention of the loaded probes, recomputed at startup and after each swap.

    The work (HF forward passes over each probe's retention set, on the model directory the
    engine serves) runs in a thread so requests keep flowing; a newer swap supersedes an
    older computation.
    """

    def __init__(self, model_dir: str | None, shared_dir: Path | None = None) -> None:
        """`shared_dir`: where several API server processes share the worker, a directory they
        all see: one of them computes each probe set's retention, the others read its result."""
        self.model_dir = model_dir
        self.shared_dir = shared_dir
        if shared_dir is not None:
            # Whichever process leaves first takes it along: the worker's start names a new one
            # (launch.py), so nothing in it serves a later start.
            atexit.register(shutil.rmtree, shared_dir, ignore_errors=True)
        self.values: dict[str, float | None] = {}
        self.status = "not computed"
        self._generation = 0

    def schedule(self, probe_dirs: list[str]) -> None:
        if not self.model_dir:
            self.status = "unavailable: the worker was started without PROBEX_MODEL_DIR"
            return
        self._generation += 1
        generation = self._generation
        self.status = "computing"

        async def job() -> None:
            from probes.retention import compute_retention

            try:
                if self.shared_dir is None:
                    results = await asyncio.to_thread(compute_retention, self.model_dir, probe_dirs)
                else:
                    results = await asyncio.to_thread(computed_once, self.shared_dir, self.model_dir, probe_dirs,
                                                      compute_retention)
            except Exception as exc:  # no datasets offline, odd artifact...: say so, keep serving
                if generation == self._generation:
                    self.status = f"unavailable: {type(exc).__name__}: {exc}"
                log.warning("probex: retention not computed: %s", exc)
                return
            if generation == self._generation:
                self.values = {name: r["retention"] for name, r in results.items()}
                self.status = "ready"
                log.info("probex: calibration retention %s", self.values)

        asyncio.get_running_loop().create_task(job())


def computed_once(shared_dir: Path, model_dir: str, probe_dirs: list[str], compute: Callable[[str, list[str]], dict]) -> dict:
    """`compute(model_dir, probe_dirs)`, run by one process of several for the same model and
    probe files: the first takes a lock and writes the result into `shared_dir`, the others
    wait for the lock and read it (HF forward passes over every retention set, and the model
    in memory, once instead of once per API server process). Keyed by the probe files' paths,
    sizes and times, so a probe rewritten in place is computed again."""
    import fcntl
    import hashlib

    from probes.atomic_files import replacing

    stats = [(d, f.name, f.stat().st_size, f.stat().st_mtime_ns)
             for d in probe_dirs for f in sorted(Path(d).iterdir()) if f.is_file()]
    key = hashlib.sha256(json.dumps([model_dir, stats]).encode()).hexdigest()[:24]
    shared_dir.mkdir(parents=True, exist_ok=True)
    result_path = shared_dir / f"retention-{key}.json"
    with open(shared_dir / "retention.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not result_path.exists():
            try:
                outcome = {"results": compute(model_dir, probe_dirs)}
            except Exception as exc:  # the others would only fail the same way, one after another
                outcome = {"error": f"{type(exc).__name__}: {exc}"}
            with replacing(result_path) as side:
                side.write_text(json.dumps(outcome))
        outcome = json.loads(result_path.read_text())
    if "error" in outcome:
        raise RuntimeError(outcome["error"])
    return outcome["results"]


class BodyRelay:
    """Non-streaming: hold the JSON body, attach scores when they are in, fix Content-Length."""

    def __init__(self, hub: ScoreHub, call: MonitoredCall, send: Send, wait_s: float) -> None:
        self.hub, self.call, self._send, self._wait_s = hub, call, send, wait_s
        self._pauses_at_start = hub.pauses
        self._start: dict | None = None
        self._chunks: list[bytes] = []

    @property
    def wait_s(self) -> float:
        return _score_wait(self.hub, self._pauses_at_start, self._wait_s)

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self._start = message
            return
        if message["type"] != "http.response.body":
            return await self._send(message)
        self._chunks.append(message.get("body", b""))
        if message.get("more_body"):
            return
        body = b"".join(self._chunks)
        if self._start and self._start["status"] == 200:
            body = await self._decorate(body)
        headers = [(k, v) for k, v in self._start["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self._send(dict(self._start, headers=headers))
        await self._send({"type": "http.response.body", "body": body})

    async def _decorate(self, body: bytes) -> bytes:
        try:
            payload = _decode_json(body if self.call.wants_token_ids else _without_prompt_token_ids(body))
        except ValueError:
            return body  # as vLLM wrote it
        choices = payload.get("choices") or []
        per_choice = []
        for choice in choices:
            key = self.call.key(choice.get("index", 0))
            generated = len(choice.get("token_ids") or ())
            await self.hub.wait_for(key, prompt=True, tokens=generated, timeout=self.wait_s)
            per_choice.append(responses.full_scores(self.hub.get(key), generated))
            if not self.call.wants_token_ids:
                choice.pop("token_ids", None)
        if not self.call.wants_token_ids:
            payload.pop("prompt_token_ids", None)
            for choice in choices:
                choice.pop("prompt_token_ids", None)
        if len(per_choice) == 1:
            payload["probex"] = per_choice[0]
        elif per_choice:
            for choice, scores in zip(choices, per_choice):
                choice["probex"] = scores
        return _encode_json(payload)


class FirstChunkTimer:
    """Times a streamed request's way through this process into the hub (`ScoreHub.requests`),
    the tap running or paused: made as the request is handed to vLLM (`arrived`: when the
    middleware first saw it), its `send` wraps the one vLLM's response goes out through —
    the server's, or, where the tap runs, sits under the relay, which then tells it when
    vLLM's first data chunk reached it (`relay` set; otherwise its own first look at that
    chunk counts). Once the first chunk is out it only passes messages on."""

    def __init__(self, hub: ScoreHub, arrived: float, send: Send, monitored: bool = False) -> None:
        """`monitored`: the tap runs for this request (its times are also booked as `*_running`)."""
        self.hub, self._send = hub, send
        self.handed = time.perf_counter()
        self._states = ("", "_running") if monitored else ("",)
        for state in self._states:
            hub.requests["request_way_in" + state].add(self.handed - arrived)
        self.relay: "StreamRelay | None" = None
        self._pending = True

    async def send(self, message: dict) -> None:
        if not self._pending or message["type"] != "http.response.body":
            return await self._send(message)
        relay = self.relay
        reached = relay.first_content_at if relay is not None else (
            time.perf_counter() if b"data: {" in message.get("body", b"") else 0.0)
        await self._send(message)
        if reached:
            self._pending = False
            out = time.perf_counter() - reached
            for state in self._states:
                self.hub.requests["vllm_to_first_chunk" + state].add(reached - self.handed)
                self.hub.requests["first_chunk_out" + state].add(out)


class StreamRelay:
    """Streaming: pass SSE events through one by one, each with the scores of its tokens.

    `splice=False` decodes and re-encodes every chunk (the path chunks in any other form
    take): the benchmarks' comparison for the splice."""

    def __init__(self, hub: ScoreHub, call: MonitoredCall, send: Send, wait_s: float, splice: bool = True) -> None:
        self.hub, self.call, self._send, self._wait_s, self.splice = hub, call, send, wait_s, splice
        self._pauses_at_start = hub.pauses
        self._is_sse = False
        self._pending = b""
        self._generated: dict[int, int] = {}
        self._prompt_sent: set[int] = set()
        self._first_splice_waited = False  # the chunk being decorated waited for its scores in `_splice_first`
        self.first_content_at = 0.0  # time.perf_counter() when vLLM's first data chunk reached `send`

    @property
    def wait_s(self) -> float:
        return _score_wait(self.hub, self._pauses_at_start, self._wait_s)

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self._is_sse = message["status"] == 200 and any(
                k == b"content-type" and v.startswith(b"text/event-stream") for k, v in message["headers"]
            )
            return await self._send(message)
        if message["type"] != "http.response.body" or not self._is_sse:
            return await self._send(message)
        body = message.get("body", b"")
        if not self.first_content_at and b"data: {" in body:
            self.first_content_at = time.perf_counter()
        more = message.get("more_body", False)
        # One whole event with no line break inside, as vLLM sends them: a one-byte search for
        # the first break (memchr) says so, where splitting at "\n\n" scans a first chunk's
        # 5 KB of prompt ids byte by byte (5 µs on the dev machine, on the way to the first token)
        if not self._pending and body.find(b"\n") == len(body) - 2 and body.endswith(b"\n\n"):
            decorated = await self._decorate_event(body[:-2])
            return await self._send({"type": "http.response.body", "body": decorated + b"\n\n", "more_body": more})
        events = (self._pending + body).split(b"\n\n")
        self._pending = events.pop()  # what follows the last complete event: b"" as vLLM sends them
        out = [await self._decorate_event(event) + b"\n\n" for event in events]
        if not more and self._pending:
            out.append(self._pending)
            self._pending = b""
        await self._send({"type": "http.response.body", "body": b"".join(out), "more_body": more})

    async def _decorate_event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return event
        started = time.perf_counter()
        points = _splice_points(event, self.call.wants_token_ids) if self.splice else None
        if points is None or points.index not in self._prompt_sent:
            self._first_splice_waited = False
            first = await self._splice_first(event, points, started) if self.splice else None
            if first is not None:
                self.hub.chunks["spliced"].add(time.perf_counter() - started)
                return first
            # (the first splice may have waited for the scores already: this path waits no more)
            decorated = await self._decode_and_decorate(event, started, wait=not self._first_splice_waited)
            self.hub.chunks["decoded"].add(time.perf_counter() - started)
            return decorated
        # Chunks in vLLM's compact form once their choice's prompt scores have gone out, nearly
        # all of a stream's: the scores of their tokens are spliced into the bytes and the token
        # ids cut out, the chunk never decoded. The first chunk with tokens, which carries the
        # prompt's scores, is spliced too where it can be (`_splice_first`); chunks without
        # tokens and any other form take the decoded path.
        index, new_tokens, cut_from, cut_to = points
        key = self.call.key(index)
        start = self._generated.get(index, 0)
        stop = self._generated[index] = start + new_tokens
        state = self.hub.get(key)
        if not self.hub.scores_in(state, prompt=False, tokens=stop):
            await self.hub.wait_more(key, prompt=False, tokens=stop, timeout=self.wait_s)
        scores = _take_written(state, start, stop) or responses.generated_scores_json(state, start, stop)
        if not self.call.wants_token_ids:
            event = event[:cut_from] + event[cut_to:]
        decorated = event[:-1] + b',"probex":{"scores":' + scores + b"}}"
        self.hub.chunks["spliced"].add(time.perf_counter() - started)
        return decorated

    async def _splice_first(self, event: bytes, points: SplicePoints | None, started: float) -> bytes | None:
        """A choice's first chunk with tokens, its prompt's scores and its tokens' spliced into
        its bytes, or None for the decoded path: a chunk not in vLLM's compact form with one
        choice and tokens, or whose scores cannot be written directly (a probe swap between the
        prompt and the tokens, a prompt whose scores never came). `points`: the chunk's, read
        by the caller (None where it could not read them).

        On every request's way to its first token, so it does not read the chunk's bytes
        again (but where it must cut ids, below) and writes nothing the hub could write ahead
        (`responses.write_first_chunk_ahead`). A completion's first chunk carries the prompt's
        token ids (1024 for a 1024-token prompt) only where the client asked for token ids:
        they stay, and the splice points are read around them; for other clients vLLM is made
        to leave them out (vllm_openai.py). Where a vLLM still writes them for such a client
        (one whose classes that patch does not find) they are cut out here first
        (`chunks["prompt_ids_cut"]`)."""
        cut_s = None
        if points is None:
            if self.call.wants_token_ids:
                return None
            cutting = time.perf_counter()
            cut = event[:6] + _without_prompt_token_ids(event[6:])
            if len(cut) == len(event):
                return None  # nothing to cut: not a chunk the splice can read
            cut_s = time.perf_counter() - cutting
            points, event = _splice_points(cut), cut
            if points is None:
                return None
        if points.index in self._prompt_sent:
            return None
        index, new_tokens, cut_from, cut_to = points
        key = self.call.key(index)
        start = self._generated.get(index, 0)
        stop = start + new_tokens
        state = self.hub.get(key)
        if not self.hub.scores_in(state, prompt=True, tokens=stop):
            self._first_splice_waited = True
            await self.hub.wait_more(key, prompt=True, tokens=stop, timeout=self.wait_s)
        scores = responses.first_chunk_scores_json(state, start, stop)
        if scores is None:
            return None
        self._generated[index] = stop
        self._prompt_sent.add(index)
        _write_tokens_ahead(state, stop)
        self.hub.first_chunk_came(state, started)
        # The client's token ids stay as vLLM wrote them, or go
        base = event if self.call.wants_token_ids else event[:cut_from] + event[cut_to:]
        decorated = base[:-1] + b',"probex":{"scores":' + scores + b"}}"
        self.hub.first_chunks.add(time.perf_counter() - started)
        if cut_s is not None:  # counted once the chunk is this path's (the decoded path counts its own)
            self.hub.chunks["prompt_ids_cut"].add(cut_s)
        return decorated

    async def _decode_and_decorate(self, event: bytes, started: float, wait: bool = True) -> bytes:
        """`wait`: False where this chunk already waited for its scores (`_splice_first`)."""
        include_prompt = False
        payload = event[6:]
        if not self.call.wants_token_ids:
            cutting = time.perf_counter()
            payload = _without_prompt_token_ids(payload)
            if len(payload) != len(event) - 6:
                self.hub.chunks["prompt_ids_cut"].add(time.perf_counter() - cutting)
        try:
            chunk = _decode_json(payload)
        except ValueError:
            return event
        choices = chunk.get("choices") or []
        if len(choices) == 1:
            choice = choices[0]
            index = choice.get("index", 0)
            key = self.call.key(index)
            start = self._generated.get(index, 0)
            new_tokens = len(choice.get("token_ids") or ())
            stop = self._generated[index] = start + new_tokens
            need_prompt = index not in self._prompt_sent and (new_tokens > 0 or choice.get("finish_reason"))
            state = self.hub.get(key)
            if wait and (need_prompt or stop > start) and not self.hub.scores_in(state, prompt=bool(need_prompt),
                                                                                  tokens=stop):
                await self.hub.wait_more(key, prompt=bool(need_prompt), tokens=stop, timeout=self.wait_s)
            _take_written(state, start, stop)  # written ahead for spliced chunks: this one is decoded
            include_prompt = index not in self._prompt_sent and state.prompt is not None
            if include_prompt:
                _write_tokens_ahead(state, stop)  # a chat stream's role chunk comes this way
                self._prompt_sent.add(index)
                self.hub.first_chunk_came(state, started)
            if include_prompt or stop > start:
                chunk["probex"] = responses.chunk_scores(state, start, stop, include_prompt)
            if not self.call.wants_token_ids:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
        if not self.call.wants_token_ids:
            chunk.pop("prompt_token_ids", None)
        encoded = b"data: " + _encode_json(chunk)
        if include_prompt:  # the request's first chunk with scores: on its way to the client's TTFT
            self.hub.first_chunks.add(time.perf_counter() - started)
        return encoded


def _write_tokens_ahead(state: RequestScores, sent_through: int) -> None:
    """A stream's chunks up to token `sent_through` (exclusive) have gone out, its prompt's
    scores with them: the hub writes the later tokens' JSON as they come in
    (`RequestScores.token_json`), for the chunks that will carry them."""
    if state.token_json is None:
        state.token_json = {}
    state.token_json_from = sent_through


def _take_written(state: RequestScores, start: int, stop: int) -> bytes | None:
    """A chunk carrying tokens [start, stop) goes out: the JSON the hub wrote ahead for it if it
    holds one token (None if none was written), and none is written for those tokens from now on
    (a chunk of several, where vLLM merged tokens, has its own written at once by the caller)."""
    written = state.token_json
    if written is None:
        return None
    state.token_json_from = stop
    if stop == start + 1:
        return written.pop(start, None)
    for token in range(start, stop):
        written.pop(token, None)
    return None


# Request bodies, and the stream chunks that are not spliced, are decoded and re-encoded on
# the API server's event loop, which at high concurrency is the busiest thread of the worker:
# msgspec (a vLLM dependency) is several times faster than the json module at it.
_json_decoder = msgspec.json.Decoder()
_json_encoder = msgspec.json.Encoder()


def _decode_request(raw: bytes) -> tuple[Any, Callable[[Any], bytes]]:
    """A request body as vLLM's server will read it (None if it is not JSON), and the encoder
    that writes it back the same way.

    msgspec first (a 1024-token prompt: 20 µs against 44 µs for json.loads on the dev
    machine, and the re-encoding 5 µs against 48 µs, all on the request's way to its first
    token); Python's json, which vLLM's server uses, for what msgspec refuses and it accepts
    (NaN, Infinity): such a body must still be checked here, or it would reach the engine
    unmonitored, and written back with json.dumps (msgspec would write NaN as null)."""
    try:
        return _json_decoder.decode(raw), _encode_json
    except (msgspec.DecodeError, UnicodeDecodeError):
        pass
    except RecursionError:
        raise RequestRefused(_TOO_DEEP) from None
    try:
        return json.loads(raw), _encode_python_json
    except (ValueError, UnicodeDecodeError):
        return None, _encode_json
    except RecursionError:
        raise RequestRefused(_TOO_DEEP) from None


def _encode_python_json(payload: Any) -> bytes:
    return json.dumps(payload).encode()


def _decode_json(raw: bytes) -> Any:
    try:
        return _json_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None


def _encode_json(payload: Any) -> bytes:
    return _json_encoder.encode(payload)


_TOKEN_IDS_MEMBER = b',"token_ids":['
_IDS_KEY_END, _PROMPT_IDS_KEY_START = b'token_ids"', b'"prompt_'
_NULL_PROMPT_IDS_MEMBER = b',"prompt_token_ids":null'
_FIRST_CHOICE_INDEX = b'"choices":[{"index":'
_NEXT_CHOICE = b'},{"index":'
_DIGITS_AND_COMMAS = b"0123456789,"
_COMMA, _CLOSING_BRACE = ord(","), ord("}")


class SplicePoints(NamedTuple):
    """Where a stream chunk's scores go (`_splice_points`)."""

    index: int  # the choice's
    tokens: int  # in the chunk
    cut_from: int  # the bytes [cut_from, cut_to) to cut for a client that did not ask for token ids
    cut_to: int


def _splice_points(event: bytes, prompt_ids_kept: bool = False) -> SplicePoints | None:
    """What a stream chunk's bytes say of its tokens, read without decoding it, or None unless
    the chunk is in vLLM's compact form with one choice, at least one token and no list of
    prompt token ids (`prompt_ids_kept`: the client asked for token ids, so nothing will be
    cut, and one `prompt_token_ids` member, a list or null, may stand right before the
    choice's `token_ids`, as in a completion's first chunk, or be the chunk's last member, as
    in a chat's). An unescaped quote cannot occur inside a JSON string, so what is found here
    by its quotes is structure, not text.

    vLLM writes a choice's `token_ids` last. A completion's choice has
    `"prompt_token_ids":null` right before them in every chunk after the first (vLLM sets
    the field explicitly): the bytes cut then start there, as the decoded path drops that
    key too. Runs once per chunk of every stream: as few passes over the bytes as the
    checks allow."""
    member = event.rfind(_TOKEN_IDS_MEMBER)
    first = member + len(_TOKEN_IDS_MEMBER)
    end = event.find(b"]", first)
    if member < 0 or end < 0 or event[-1] != _CLOSING_BRACE or event[end + 1] not in (_COMMA, _CLOSING_BRACE):
        return None
    ids = event[first:end]
    if not ids or ids.translate(None, _DIGITS_AND_COMMAS) or ids[0] == _COMMA or ids[-1] == _COMMA:
        return None  # no token, or not a plain list of ids
    cut_from = member - len(_NULL_PROMPT_IDS_MEMBER) if event.endswith(_NULL_PROMPT_IDS_MEMBER, 0, member) else member
    before, after = event.find(_IDS_KEY_END, 0, cut_from), event.find(_IDS_KEY_END, end)
    if before >= 0 or after >= 0:  # another choice's ids, or the prompt's (a first chunk), or a null one elsewhere
        if not prompt_ids_kept or (before >= 0 and after >= 0):
            return None
        other = before if before >= 0 else after
        # The prompt's ids, kept: no other member may follow them before the chunk's ids (or the
        # chunk's end): no quote at all, found with a one-byte search over their 5 KB.
        if (not event.endswith(_PROMPT_IDS_KEY_START, 0, other)
                or event.find(b'"', other + len(_IDS_KEY_END), cut_from if before >= 0 else len(event)) >= 0):
            return None
    where = event.find(_FIRST_CHOICE_INDEX, 0, member)
    if where < 0:
        return None
    where += len(_FIRST_CHOICE_INDEX)
    digits = event[where : event.find(b",", where, member + 1)]  # the index's comma may be the member's
    if not digits.isdigit():
        return None
    # The ids found last must be the first choice's: a second choice opening before them means
    # they are a later choice's (the first has none), whose scores would go to the wrong choice.
    # (A chat delta's list of tool calls looks the same and goes the decoded way too.) Kept
    # prompt ids right before them hold no quote (checked above): the search stops at them
    # rather than scanning a first chunk's 5 KB of ids again.
    if event.find(_NEXT_CHOICE, where, before if before >= 0 else member) >= 0:
        return None
    return SplicePoints(int(digits), ids.count(b",") + 1, cut_from, end + 1)


_PROMPT_IDS_MEMBER = b'"prompt_token_ids":['
_INTEGER_LIST_BYTES = b"0123456789,-"


def _without_prompt_token_ids(payload: bytes) -> bytes:
    """`payload` with its `"prompt_token_ids":[...]` members cut out of the bytes, unparsed.

    The middleware asks vLLM for token ids (to count each chunk's tokens) and strips them
    again for clients that did not. vLLM is made to build no prompt ids for those clients
    (vllm_openai.py); where it still writes them (a vLLM whose response classes that patch
    does not find), they arrive with the first chunk, 1024 of them for a 1024-token prompt,
    on that chunk's way to the client's first token, and the hub counts each cut
    (`chunks["prompt_ids_cut"]`). Cutting them out first saves decoding and re-encoding them.
    Only vLLM's compact form is cut: a member right after `{` or `,`, whose list holds nothing
    but digits, commas and minus signs and is followed by `,` or `}`; the bytes cannot occur
    inside a JSON string, where quotes are escaped. Anything else is returned unchanged, for the
    decoded path, which drops the key as well."""
    start = payload.find(_PROMPT_IDS_MEMBER)
    while start > 0:
        first = start + len(_PROMPT_IDS_MEMBER)
        end = payload.find(b"]", first)
        before, after = payload[start - 1 : start], payload[end + 1 : end + 2]
        if (end < 0 or before not in (b",", b"{") or after not in (b",", b"}")
                or payload[first:end].translate(None, _INTEGER_LIST_BYTES)):  # anything but digits, commas, signs
            return payload
        if before == b",":  # drop the comma ahead of the member
            payload = payload[: start - 1] + payload[end + 1 :]
        elif after == b",":  # first member: drop the comma after it
            payload = payload[:start] + payload[end + 2 :]
        else:  # the only member
            payload = payload[:start] + payload[end + 1 :]
        start = payload.find(_PROMPT_IDS_MEMBER, start - 1)
    return payload


@dataclass(frozen=True)
class _ArtifactSet:
    """What differs between the two live-swappable sets a worker serves (probes, steering vectors)."""

    path: str
    list_rpc: str
    load_rpc: str
    body_key: str
    dir_word: str
    swap_disabled: str
    rejected_code: str


_PROBE_SET = _ArtifactSet("/probex/probes", "probex_list_probes", "probex_load_probes", "probes", "probe",
                          "live swap is disabled", "probe_rejected")
_STEERING_SET = _ArtifactSet("/probex/steering", "probex_list_steering", "probex_load_steering", "vectors", "vector",
                             "replacing steering vectors is disabled", "steering_rejected")


def _every_rank(results: list[dict]) -> dict:
    """A swap's outcome over all workers (tensor-parallel ranks): rank 0's, unless any rank refused.

    Every rank validates the same files against the same model, so they agree; if one ever
    did not, reporting success from rank 0 would hide ranks serving different probes.
    """
    refused = [r for r in results if not r.get("ok")]
    if refused and len(refused) < len(results):
        first = refused[0]
        return dict(first, error=f"{first.get('error')} (refused by {len(refused)} of {len(results)} workers:"
                                 " the workers now disagree; repeat the swap or restart)")
    return refused[0] if refused else results[0]


def _engine_client(scope: Scope):
    return scope["app"].state.engine_client


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


def _score_wait(hub: ScoreHub, pauses_at_start: int, wait_s: float) -> float:
    """How long a response may wait for its scores: not at all once the tap has been paused
    since the request came in (the tokens of the pause never get scores, and those after it
    would wait for them)."""
    return wait_s if hub.pauses == pauses_at_start else 0.0


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

