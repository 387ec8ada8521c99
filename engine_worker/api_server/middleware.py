"""ASGI middleware in the engine's API server processes: ProbeX's part of the worker.

Engine-agnostic: an engine folder subclasses `ProbexMiddleware` to say how its API server
reaches the engine's workers (`engine_rpc`) and, optionally, how to keep the engine from
writing a prompt's token ids that the client did not ask for (`prompt_ids_left_out`);
engine_worker/vllm/api_server.py is vLLM's. This module only dispatches: request checks
live in requests.py, the relays in relay.py, the score hub in hub.py. It does four things:

1. checks `probex_*` keys in `vllm_xargs` and refuses what ProbeX cannot monitor (400);
   those keys are engine controls (recompute, capture, steering), taken only from a caller
   holding the worker's admin token (401 without it; 403 on a worker started without one);
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
import contextlib
import hmac
import json
import logging
import os
from dataclasses import dataclass
from typing import Callable


from engine_worker.api_server.asgi import Receive, Scope, Send, _body_headers, _read_body, _replay, _send_json
from engine_worker.api_server.hub import ScoreHub
from engine_worker.api_server.relay import BodyRelay, StreamRelay
from engine_worker.api_server.requests import (MONITORED_PATHS, MonitoredCall, RequestRefused, UNMONITORED_GENERATION_PATHS, body_as_sent, check_steering, inspect_request, openai_error)
from engine_worker.api_server.retention import RetentionTracker, _shared_dir
from engine_worker.api_server.splice import _decode_request, _encode_json
from engine_worker.scores.wire import owner_tag
from engine_worker.settings import ADMIN_TOKEN, RETENTION, TAP_CONFIG, score_wait_s
from engine_worker.tap.config import TapConfig

log = logging.getLogger("probex.middleware")


class ProbexMiddleware:
    async def engine_rpc(self, app, method: str, *args) -> list[dict]:
        """Call `method` of the ProbeX worker extension on every engine worker (one result a
        rank) through the API server's `app`: the engine folder's to say how."""
        raise NotImplementedError

    def prompt_ids_left_out(self):
        """A context manager around the relay of a request whose client did not ask for token
        ids: the engine may then leave the prompt's ids out of the first chunk. By default
        nothing is left out (the relay cuts them out itself)."""
        return contextlib.nullcontext()

    def __init__(self, app: Callable, hub: ScoreHub | None = None, tap_config: TapConfig | None = None) -> None:
        self.app = app
        raw_config = os.environ.get(TAP_CONFIG)
        self.tap_config = tap_config or (TapConfig.from_json(raw_config) if raw_config else None)
        address = self.tap_config.score_address if self.tap_config else None
        # With --api-server-count N (N > 1) this is one of N processes, each relaying the
        # requests it received: its ids carry its own tag, its hub books only those.
        self.api_server_count = self.tap_config.api_server_count if self.tap_config else 1
        self.owner = owner_tag() if self.api_server_count > 1 else ""
        self.hub = hub if hub is not None else (ScoreHub(address, owner=self.owner or None) if address else None)
        self.admin_token = os.environ.get(ADMIN_TOKEN) or None
        self.score_wait_s = score_wait_s()
        self._swap_lock = asyncio.Lock()
        # (steering, probes) and the hub's swap count when they were read: dropped on every swap,
        # this process's own (below) or another's (the worker's control message, ScoreHub.swaps)
        self._listings: tuple[dict, dict] | None = None
        self._listings_swaps = 0
        self.retention = RetentionTracker(self.tap_config.model_dir if self.tap_config else None,
                                          _shared_dir(address) if self.api_server_count > 1 else None)
        self._retention_enabled = os.environ.get(RETENTION, "1") != "0"
        self._retention_version = 0  # the probe set version whose retention was last scheduled
        if self.hub is not None:
            self.hub.on_probes_swapped = self._schedule_retention
            self.hub.on_probes_unannounced = self._retention_for_unannounced
        self._started = False
        self._app = None  # the server's app, once a request came: its engine client answers RPCs
        self._background: set[asyncio.Task] = set()  # tasks started from the hub's callbacks, kept alive

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
        return await self.app(scope, receive, send)

    # -- monitored completions ------------------------------------------------------------

    async def _monitored(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_body = await _read_body(receive)
        as_sent = body_as_sent(scope["path"], raw_body, self.owner) if raw_body else None
        if as_sent is not None:  # the usual request: nothing to check or rewrite beyond the token ids
            call, new_body = as_sent
            if self.hub.paused:  # passed on unmonitored, as the client sent it
                return await self.app(scope, _replay(raw_body, receive), send)
            return await self._relayed(scope, receive, send, call, new_body)
        try:
            body, encode = _decode_request(raw_body) if raw_body else (None, _encode_json)
            self._check_controls(scope, body)
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
            return await self.app(dict(scope, headers=_body_headers(scope, new_body)), _replay(new_body, receive),
                                  send)
        return await self._relayed(scope, receive, send, call, encode(call.body))

    def _check_controls(self, scope: Scope, body) -> None:
        """Refuse engine controls (any `probex_*` key in `vllm_xargs`, known or not) from a
        caller without the worker's admin token: the gateway forwards them only for tenants
        granted them, with that token; a client reaching the worker directly has none."""
        xargs = body.get("vllm_xargs") if isinstance(body, dict) else None
        if not isinstance(xargs, dict):
            return
        controls = sorted(key for key in xargs if isinstance(key, str) and key.startswith("probex_"))
        if not controls or self._is_admin(scope):
            return
        param = f"vllm_xargs.{controls[0]}"
        if not self.admin_token:
            raise RequestRefused(f"engine controls ({', '.join(controls)}) are disabled: the worker was started without"
                                 " an admin token (start it with `probex worker --admin-token TOKEN` or"
                                 " PROBEX_ADMIN_TOKEN, and send Authorization: Bearer TOKEN)",
                                 param=param, status=403, code="engine_controls_disabled")
        named = ", ".join(f"vllm_xargs.{key}" for key in controls)
        raise RequestRefused(f"engine controls need the worker's admin token (Authorization: Bearer <token>): {named}",
                             param=param, status=401, code="admin_token_required")

    async def _relayed(self, scope: Scope, receive: Receive, send: Send, call: MonitoredCall, new_body: bytes) -> None:
        """Hand the request to vLLM under ProbeX's id and relay its response with scores attached."""
        request_id = call.key_prefix.split("-", 1)[1]
        inner_scope = dict(scope, headers=_body_headers(scope, new_body, request_id))
        if call.stream:
            relay = StreamRelay(self.hub, call, send, self.score_wait_s)
        else:
            relay = BodyRelay(self.hub, call, send, self.score_wait_s)
        # A client that did not ask for token ids gets none: the engine then need not write the
        # prompt's ids into the first chunk for the relay to cut them out.
        try:
            with contextlib.nullcontext() if call.wants_token_ids else self.prompt_ids_left_out():
                await self.app(inner_scope, _replay(new_body, receive), relay.send)
        finally:
            for index in range(call.num_prompts):
                self.hub.release(call.key(index))

    async def _rpc(self, scope: Scope, method: str, args: tuple = ()) -> list[dict]:
        return await self.engine_rpc(scope["app"], method, *args)

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
            result = _every_rank(await self._rpc(scope, "probex_set_paused", (paused,)))
            sequence = result.pop("sequence", None)  # between the worker and its API servers only
            if result.get("ok"):
                self.hub.set_paused(result["paused"], sequence)
        if not result.get("ok"):
            return await _send_json(send, 400, openai_error(result["error"], status=400, param="paused",
                                                            code="pause_refused"))
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
            listing = (await self.engine_rpc(self._app, "probex_list_probes"))[0]
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
        if method == "GET":
            await _send_json(send, 200, (await self._rpc(scope, kind.list_rpc))[0])
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
            result = _every_rank(await self._rpc(scope, kind.load_rpc, (dirs,)))
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
            steering = (await self._rpc(scope, "probex_list_steering"))[0]
            probes = (await self._rpc(scope, "probex_list_probes"))[0]
            listings = self._listings = (steering, probes)
            self._listings_swaps = swaps
        return listings

    async def _health(self, scope: Scope, send: Send) -> None:
        listing = (await self._rpc(scope, "probex_list_probes"))[0]
        listing["score_messages_received"] = self.hub.messages_received
        listing["score_messages_lost"] = self.hub.messages_lost
        listing["score_steps_lost"] = self.hub.steps_lost
        listing["score_waits"] = self.hub.wait_stats()
        listing["score_formatter"] = {"restarts_seen": self.hub.formatter_restarts, "silent": self.hub.silent}
        listing["retention"] = self.retention.values
        listing["retention_status"] = self.retention.status
        # Which API server process answered: with several, each counts its own requests above,
        # and `relay_paused` is whether this one has heard of the tap's pause (`paused` above is
        # the worker's own state).
        listing["api_server"] = {"pid": os.getpid(), "count": self.api_server_count, "owner": self.owner or None,
                                 "relay_paused": self.hub.paused}
        return await _send_json(send, 200, listing)

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
