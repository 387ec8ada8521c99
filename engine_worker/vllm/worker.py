"""vLLM glue shared by the runner adapters: controller set-up, the worker extension, recompute.

Both model runners (V1 in `vllm_v1_runner.py`, V2 in `vllm_v2_runner.py`) expose the
loaded model as `runner.model` and the engine configuration as `runner.vllm_config`;
that is all this module reads from a runner, besides the async output both runners'
`sample_tokens` return (`scores_with_sampled_tokens`).
Everything a runner does differently — how a step's rows map to requests, where the
forward is — stays in its own adapter.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import time

from probes.artifact import ServedModel
from engine_worker.tap.controller import ProbeSetRejected, TapController, VectorSetRejected
from engine_worker.tap.steer import LayerSteer
from engine_worker.steering import SteeringError, SteerRequest, steering_from_xargs
from engine_worker.tap.layer import LayerTap, awaiting_storage, materialize
from engine_worker.tap.config import (ENV_API_SERVER_COUNT, ENV_DELIVERY, ENV_PROMPT_SCORES_MID_FORWARD,
                                      ENV_SCORE_RING, TapConfig, score_ring_wanted, scores_delivered)
from engine_worker.vllm.models import copy_scores_mid_forward

log = logging.getLogger("vllm.probex.worker")  # under "vllm": printed by its log handler

CONTROLLER_ATTR = "probex_controller"
# Diagnostic: the engine process's GIL switch interval (Python's default is 5 ms: a thread
# woken while another runs Python may wait that long for the GIL). For measuring how the
# score transfer thread and the engine thread share the GIL; not a tuning recommendation.
ENV_SWITCH_INTERVAL = "PROBEX_SWITCH_INTERVAL_S"


def controller_of(runner) -> TapController | None:
    return getattr(runner, CONTROLLER_ATTR, None)


def install_controller(runner, score_consumer: str = "thread") -> TapController | None:
    """After the model is loaded: find its taps, load the startup probe set, attach a controller.

    `score_consumer`: the adapter's default for who consumes each step's scores (see
    `TapController`); "engine" only from an adapter that calls `consume_scores_through` and
    `consume_landed_scores` around the engine's read of each step's tokens."""
    tap_config = TapConfig.for_engine(runner.vllm_config.additional_config)
    if tap_config is None:
        return None
    existing = controller_of(runner)
    if existing is not None:
        return existing
    taps = {m.layer: m for m in runner.model.modules() if isinstance(m, LayerTap)}
    missing = sorted(set(tap_config.layers) - set(taps))
    if missing:
        raise RuntimeError(
            f"probex: layers {missing} were asked to be tapped but the model has no tap there: either the layer"
            f" index is out of range or {type(runner.model).__name__} uses a decoder layer ProbeX does not patch"
            " (supported: Llama, Mistral, Qwen2)"
        )
    steers = {m.layer: m for m in runner.model.modules() if isinstance(m, LayerSteer)}
    missing = sorted(set(tap_config.steer_layers) - set(steers))
    if missing:
        raise RuntimeError(f"probex: layers {missing} were asked to be steered but the model has no steering op there")
    served_modules = [*taps.values(), *steers.values()]
    _give_buffers_storage(runner, served_modules + [m for m in awaiting_storage() if m not in served_modules])
    warmed = sum(tap.warm_kernels(runner.vllm_config.model_config.dtype) for tap in taps.values())
    if warmed:
        log.info("probex: the tap's kernel compiled before serving (%d launches over %d layers)", warmed, len(taps))
    hf_config = runner.vllm_config.model_config.hf_config.to_dict()
    served = ServedModel.from_hf_config(hf_config, name=runner.vllm_config.model_config.model)
    # Every rank computes the same rows; one writes them (two would race on the same files).
    capture_dir = tap_config.capture_dir if tap_config.capture_enabled and _is_delivering_rank() else None
    publish, ring = _publisher(tap_config, taps)
    controller = TapController(taps, served, publish, capture_dir, steers=steers, consumer=score_consumer, ring=ring)
    try:
        controller.load(list(tap_config.probe_dirs))
        if steers:
            controller.load_vectors(list(tap_config.steer_vector_dirs))
    except (ProbeSetRejected, VectorSetRejected) as exc:
        raise RuntimeError(f"probex: refusing to start: {exc}") from None
    setattr(runner, CONTROLLER_ATTR, controller)
    if controller.prompt_scores_mid_forward:
        hooked = copy_scores_mid_forward(runner.model, controller.layer_scores_final, controller.taps)
        log.info("probex: prompt steps' scores of layers %s are copied out mid-forward (%s=0 turns it off)",
                 hooked, ENV_PROMPT_SCORES_MID_FORWARD)
    interval = os.environ.get(ENV_SWITCH_INTERVAL)
    if interval:
        sys.setswitchinterval(float(interval))
        log.info("probex: GIL switch interval set to %s s (%s)", interval, ENV_SWITCH_INTERVAL)
    return controller


def default_score_consumer(runner, reads_tokens_async: bool) -> str:
    """Who consumes each step's scores unless PROBEX_SCORE_CONSUMER says otherwise: the
    engine thread where vLLM reads a step's sampled tokens there, through the async output
    `sample_tokens` returns (`reads_tokens_async`, the adapter's to say: runner V2 always,
    runner V1 with async scheduling, vLLM's default on CUDA; the engine consumer was
    measured on the H200 with V2 against the transfer thread, docs/benchmark-sessions.md sessions 8
    and 9), in a single-process engine on one GPU; otherwise the transfer thread. With more
    than one GPU, or workers in their own processes, vLLM reads the tokens on a worker's
    output-copy thread, a path not yet run on a GPU with the engine consumer: the transfer
    thread there, as measured at TP=2. The CPU backend schedules synchronously: the
    transfer thread."""
    parallel = getattr(runner.vllm_config, "parallel_config", None)
    world_size = getattr(parallel, "world_size", getattr(parallel, "tensor_parallel_size", 1))
    in_process = getattr(parallel, "distributed_executor_backend", None) in (None, "uni")
    return "engine" if reads_tokens_async and world_size == 1 and in_process else "thread"


def scores_with_sampled_tokens(sample_tokens):
    """Wraps a runner's `sample_tokens` (V1 and V2 alike): with the engine consumer, the
    step's scores are consumed where the engine core reads the step's sampled tokens, in the
    `get_output` of the async output `sample_tokens` returns (vLLM's interface between either
    runner and the engine core). At TP=1 vLLM calls it on the engine-core thread."""

    @functools.wraps(sample_tokens)
    def wrapper(self, *args, **kwargs):
        controller = controller_of(self)
        # The step this output samples was the last one handed over (at its forward's launch).
        this_step = controller.scores_step_mark() if controller is not None else None
        output = sample_tokens(self, *args, **kwargs)
        if controller is None or not controller.consumes_on_engine_thread or not hasattr(output, "get_output"):
            return output  # the transfer thread consumes (PROBEX_SCORE_CONSUMER=thread), or no async output
        read_tokens = output.get_output

        def scores_then_tokens():
            # Drop the instance attribute first: it holds this closure, which holds the bound
            # method, which holds the output — a cycle keeping each step's tensors alive
            # until the garbage collector runs.
            output.__dict__.pop("get_output", None)
            if controller.scores_ahead_of_tokens:  # PROBEX_SCORES_AHEAD_OF_TOKENS=0 (a diagnostic) skips this
                try:
                    # The step's score copies were queued behind its forward, ahead of its
                    # logits and sampling: waiting for them (GIL released, as vLLM's own wait
                    # for the tokens is), then booking and sending them, overlaps the device's
                    # sampling, and the scores leave ahead of their tokens instead of holding
                    # them up. (Side-stream copies, PROBEX_COPY_STREAM=side, are not waited
                    # for: they are consumed after the tokens.)
                    controller.consume_scores_through(this_step)
                except Exception:  # ProbeX must never cost vLLM a step's tokens
                    log.exception("probex: consuming the step's scores failed")
            reading = time.perf_counter()
            result = read_tokens()
            # Anything else landed meanwhile (side-stream copies, which may land after the
            # tokens, are taken here or at a later hook).
            try:
                controller.tokens_read(time.perf_counter() - reading)
                controller.consume_landed_scores()
            except Exception:
                log.exception("probex: consuming landed scores failed")
            return result

        output.get_output = scores_then_tokens
        return output

    return wrapper


def _give_buffers_storage(runner, modules: list) -> None:
    """The weights are in: the tap's and steering's buffers, built as shapes only
    (engine_worker/tap.py says why), get their storage now, after the weights, on the
    runner's device (a model's first parameter may be offloaded to the CPU)."""
    device = getattr(runner, "device", None) or next(runner.model.parameters()).device
    materialized = sum(materialize(module, device) for module in modules)
    for module in modules:
        for buffer in module.buffers(recurse=False):
            # Zero whatever storage they have: a loader may have given meta buffers storage of
            # its own, uninitialised (vLLM 0.32's weight-cache loader does), and the steering
            # op relies on rows it has not written being zero.
            buffer.zero_()
    if materialized and isinstance(getattr(runner, "model_memory_usage", None), (int, float)):
        # vLLM 0.25 sizes the KV cache from the model's memory measured inside load_model; the
        # buffers are the model's too (capture mode's are max_rows x hidden x 4 bytes per layer).
        runner.model_memory_usage += sum(b.numel() * b.element_size() for m in modules for b in m.buffers(recurse=False))


def _publisher(tap_config: TapConfig, taps: dict[int, LayerTap]):
    """(publish, ring): where this rank's steps and control messages go. With a score formatter,
    through the shared-memory score ring it reads (the default; `ring` set, score_ring.py) or
    over ZMQ (PROBEX_SCORE_RING=0; `publish` set); without one, over ZMQ to the API servers."""
    if not tap_config.score_address or not _is_delivering_rank():
        return None, None
    if not scores_delivered():
        log.warning("probex: %s=off: scores are computed in the graphs but never copied out or delivered "
                    "(diagnostic)", ENV_DELIVERY)
        return None, None
    from engine_worker.api_server.hub import ScorePublisher

    if tap_config.step_address is None:
        return ScorePublisher(tap_config.score_address).publish, None
    from engine_worker.scores.formatter import FormatterProcess

    api_servers = int(os.environ.get(ENV_API_SERVER_COUNT, "1"))
    if score_ring_wanted() and _ring_supported(taps):
        from engine_worker.scores.ring import RingPublisher, ScoreRing

        ring = ScoreRing.create({layer: tuple(tap.scores.shape) for layer, tap in taps.items()})
        FormatterProcess(None, tap_config.score_address, api_servers, ring_fd=ring.fd).start()
        log.info("probex: scores go to the score formatter through a %d-slot shared-memory ring (%.1f MiB; %s=0 "
                 "sends them over ZMQ instead)", ring.slots, ring.size / 2**20, ENV_SCORE_RING)
        return None, RingPublisher(ring)
    publisher = ScorePublisher(tap_config.step_address)
    FormatterProcess(tap_config.step_address, tap_config.score_address, api_servers).start()
    return publisher.publish, None


def _ring_supported(taps: dict[int, LayerTap]) -> bool:
    """The ring needs Linux's memfd and, on a GPU, the CUDA driver library (a ROCm build
    reports its GPUs as "cuda" without one): elsewhere the ZMQ path is taken."""
    if not hasattr(os, "memfd_create"):
        return False
    device = next(iter(taps.values())).scores.device
    if device.type == "cuda":
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            log.warning("probex: no CUDA driver library: scores go to the score formatter over ZMQ")
            return False
    return True


def _is_delivering_rank() -> bool:
    """Tensor-parallel ranks compute identical scores; only one of them may deliver."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group().rank_in_group == 0 and get_pp_group().is_last_rank
    except (AssertionError, ImportError):
        return True


def wants_capture(extra_args: dict | None) -> bool:
    return bool((extra_args or {}).get("probex_capture"))


def steering_of(extra_args: dict | None) -> SteerRequest | None:
    """A request's steering settings. The middleware refused malformed ones; anything that
    still fails here (a request that bypassed it) runs unsteered rather than failing the step."""
    try:
        return steering_from_xargs(extra_args)
    except SteeringError as exc:
        log.warning("probex: ignoring malformed steering settings: %s", exc)
        return None


def patch_prefix_cache_bypass() -> None:
    """`vllm_xargs: {"probex_recompute": true}` -> skip prefix-cache reads for that request only.

    Scheduler side, so it is the same whichever model runner executes the request.
    """
    from vllm.v1.request import Request

    if Request.__dict__.get("_probex_patched"):
        return
    original = Request.get_skip_reading_prefix_cache

    @functools.wraps(original)
    def get_skip_reading_prefix_cache(self) -> bool:
        params = self.sampling_params
        if params is not None and params.extra_args and params.extra_args.get("probex_recompute"):
            return True
        return original(self)

    Request.get_skip_reading_prefix_cache = get_skip_reading_prefix_cache
    Request._probex_patched = True


class ProbexWorkerExtension:
    """Mixed into vLLM's worker (`--worker-extension-cls`); methods run between engine steps."""

    def _probex_controller(self) -> TapController:
        controller = controller_of(self.model_runner)
        if controller is None:
            raise RuntimeError("probex: this worker has no tap configured")
        return controller

    def probex_list_probes(self) -> dict:
        return self._probex_controller().listing()

    def probex_load_probes(self, probe_dirs: list[str]) -> dict:
        controller = self._probex_controller()
        try:
            controller.load(list(probe_dirs))
        except ProbeSetRejected as exc:
            log.warning("probex: probe set rejected, keeping version %d: %s", controller.table.version, exc)
            return {"ok": False, "error": str(exc), "version": controller.table.version}
        return {"ok": True, **controller.listing()}

    def probex_set_paused(self, paused: bool) -> dict:
        controller = self._probex_controller()
        try:
            controller.set_paused(bool(paused))
        except ValueError as exc:
            return {"ok": False, "error": str(exc), "paused": controller.paused}
        return {"ok": True, "paused": controller.paused, "sequence": controller.pause_changes}

    def probex_step_timings(self, after: int = -1) -> dict:
        controller = self._probex_controller()
        try:
            return {"ok": True, **controller.step_timings(int(after))}
        except ValueError as exc:
            return {"ok": False, "error": str(exc)}

    def probex_list_steering(self) -> dict:
        return self._probex_controller().steering_listing()

    def probex_load_steering(self, vector_dirs: list[str]) -> dict:
        controller = self._probex_controller()
        if not controller.steers:
            return {"ok": False, "error": "this worker steers no layer (start it with --steer-layer L)",
                    "version": controller.vector_version}
        try:
            listing = controller.load_vectors(list(vector_dirs))
        except VectorSetRejected as exc:
            log.warning("probex: steering vectors rejected, keeping version %d: %s", controller.vector_version, exc)
            return {"ok": False, "error": str(exc), "version": controller.vector_version}
        return {"ok": True, **listing}
