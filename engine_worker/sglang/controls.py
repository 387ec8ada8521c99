"""ProbeX's engine RPC on SGLang, answered in the scheduler process between steps.

The API server's middleware calls these by name (api_server.py sends them inside SGLang's
internal-state request; runner.py routes them here): the same methods, arguments and
answers as vLLM's worker extension, so the engine-agnostic middleware serves both.
Steering is not available on SGLang: its listing is empty and loading vectors is refused.
"""

from __future__ import annotations

import logging

from engine_worker.tap.controller import ProbeSetRejected, TapController

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


def _list_probes(controller: TapController) -> dict:
    return controller.listing()


def _load_probes(controller: TapController, probe_dirs) -> dict:
    try:
        controller.load(list(probe_dirs))
    except ProbeSetRejected as exc:
        log.warning("probex: probe set rejected, keeping version %d: %s", controller.table.version, exc)
        return {"ok": False, "error": str(exc), "version": controller.table.version}
    return {"ok": True, **controller.listing()}


def _set_paused(controller: TapController, paused) -> dict:
    try:
        controller.set_paused(bool(paused))
    except ValueError as exc:
        return {"ok": False, "error": str(exc), "paused": controller.paused}
    return {"ok": True, "paused": controller.paused, "sequence": controller.pause_changes}


def _list_steering(controller: TapController) -> dict:
    return controller.steering_listing()


def _load_steering(controller: TapController, vector_dirs) -> dict:
    return {"ok": False, "error": NO_STEERING, "version": controller.vector_version}


_METHODS = {
    "probex_list_probes": _list_probes,
    "probex_load_probes": _load_probes,
    "probex_set_paused": _set_paused,
    "probex_list_steering": _list_steering,
    "probex_load_steering": _load_steering,
}
