"""ProbeX's engine RPC on SGLang, answered in the scheduler process between steps.

The API server's middleware calls these by name (api_server.py sends them inside SGLang's
internal-state request; runner.py routes them here): the same methods, arguments and
answers as vLLM's worker extension, so the engine-agnostic middleware serves both.
Steering is not available on SGLang: its listing is empty and loading vectors is refused.
"""

from __future__ import annotations

import logging

from engine_worker.tap import replies
from engine_worker.tap.controller import TapController

log = logging.getLogger("probex.sglang.controls")

NO_STEERING = "steering is not available on SGLang"


def answer(controller: TapController | None, call: dict) -> dict:
    """`call`: {"method": name, "args": [...]}. Every failure is an answer, never an exception
    (it would end the scheduler's loop)."""
    method = call.get("method") if isinstance(call, dict) else None
    args = list(call.get("args") or ()) if isinstance(call, dict) else []
    handler = _METHODS.get(method)
    if handler is None:
        return {"ok": False, "error": f"unknown ProbeX call {method!r}"}
    if controller is None:
        return {"ok": False, "error": "probex: this worker has no tap configured"}
    try:
        return handler(controller, *args)
    except Exception as exc:  # a bad argument from the API server
        log.exception("probex: %s failed", method)
        return {"ok": False, "error": f"{method} failed: {exc}"}


def _load_steering(controller: TapController, vector_dirs) -> dict:
    return {"ok": False, "error": NO_STEERING, "version": controller.vector_version}


_METHODS = {
    "probex_list_probes": replies.list_probes,
    "probex_load_probes": replies.load_probes,
    "probex_set_paused": replies.set_paused,
    "probex_list_steering": replies.list_steering,
    "probex_load_steering": _load_steering,
}
