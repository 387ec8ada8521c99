"""The worker's answers to the middleware's engine calls (list, swap, pause), the same on every
engine: each engine folder only carries the call to the controller (vLLM's worker extension,
SGLang's scheduler-side handler) and hands back what these return. A refusal is an answer
(`ok` false, the reason), never an exception: the old probe set or vector set stays loaded."""

from __future__ import annotations

import logging

from engine_worker.tap.controller import ProbeSetRejected, TapController, VectorSetRejected

log = logging.getLogger("probex.controller")


def list_probes(controller: TapController) -> dict:
    return controller.listing()


def load_probes(controller: TapController, probe_dirs) -> dict:
    try:
        controller.load(list(probe_dirs))
    except ProbeSetRejected as exc:
        log.warning("probex: probe set rejected, keeping version %d: %s", controller.table.version, exc)
        return {"ok": False, "error": str(exc), "version": controller.table.version}
    return {"ok": True, **controller.listing()}


def set_paused(controller: TapController, paused) -> dict:
    try:
        controller.set_paused(bool(paused))
    except ValueError as exc:
        return {"ok": False, "error": str(exc), "paused": controller.paused}
    return {"ok": True, "paused": controller.paused, "sequence": controller.pause_changes}


def list_steering(controller: TapController) -> dict:
    return controller.steering_listing()


def load_steering(controller: TapController, vector_dirs) -> dict:
    if not controller.steers:
        return {"ok": False, "error": "this worker steers no layer (start it with --steer-layer L)",
                "version": controller.vector_version}
    try:
        listing = controller.load_vectors(list(vector_dirs))
    except VectorSetRejected as exc:
        log.warning("probex: steering vectors rejected, keeping version %d: %s", controller.vector_version, exc)
        return {"ok": False, "error": str(exc), "version": controller.vector_version}
    return {"ok": True, **listing}
