"""vLLM glue shared by the runner adapters: controller set-up, the worker extension, recompute.

Both model runners (V1 in `v1_runner.py`, V2 in `v2_runner.py`) expose the loaded model as
`runner.model` and the engine configuration as `runner.vllm_config`; that is all this module
reads from a runner. Everything a runner does differently (how a step's rows map to
requests, where the forward is) stays in its own adapter. What an adapter keeps per runner
(its controller, the requests' capture flags and steering settings, the step being
launched) lives in a `RunnerState` held beside the runner, not on it.
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

from probes.artifact import ServedModel
from engine_worker.steering import SteeringError, SteerRequest, steering_from_xargs
from engine_worker.tap.config import TapConfig
from engine_worker.tap import replies
from engine_worker.tap.controller import ProbeSetRejected, TapController, VectorSetRejected
from engine_worker.tap.layer import LayerTap, awaiting_storage, materialize
from engine_worker.tap.ring_copies import start_score_ring as _score_ring
from engine_worker.tap.steer import LayerSteer
from engine_worker.vllm.models import copy_scores_mid_forward

log = logging.getLogger("vllm.probex.worker")  # under "vllm": printed by its log handler


@dataclass
class RunnerState:
    """What an adapter keeps for one model runner with a tap."""

    controller: TapController
    capture_flags: dict[str, bool] = field(default_factory=dict)  # req id -> probex_capture
    steering: dict[str, SteerRequest | None] = field(default_factory=dict)  # req id -> its steering, if any
    pending: Any = None  # the step being launched: built before the forward, or what builds it after
    scheduler_output: Any = None  # runner V1: the step's scheduler output until its forward runs


_STATES: "weakref.WeakKeyDictionary[Any, RunnerState]" = weakref.WeakKeyDictionary()


def state_of(runner) -> RunnerState | None:
    return _STATES.get(runner)


def controller_of(runner) -> TapController | None:
    state = _STATES.get(runner)
    return state.controller if state is not None else None


def install_controller(runner) -> RunnerState | None:
    """After the model is loaded: find its taps, load the startup probe set, attach a controller."""
    tap_config = TapConfig.for_engine(runner.vllm_config.additional_config)
    if tap_config is None:
        return None
    existing = state_of(runner)
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
    delivering = _is_delivering_rank()
    # Every rank computes the same rows; one writes them (two would race on the same files).
    capture_dir = tap_config.capture_dir if tap_config.capture_enabled and delivering else None
    ring = _score_ring(tap_config, taps) if delivering else None
    controller = TapController(taps, served, ring, capture_dir, steers=steers)
    try:
        controller.load(list(tap_config.probe_dirs))
        if steers:
            controller.load_vectors(list(tap_config.steer_vector_dirs))
    except (ProbeSetRejected, VectorSetRejected) as exc:
        raise RuntimeError(f"probex: refusing to start: {exc}") from None
    state = _STATES[runner] = RunnerState(controller)
    copy_scores_mid_forward(runner.model, controller.layer_scores_final, controller.taps)
    return state


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
        return replies.list_probes(self._probex_controller())

    def probex_load_probes(self, probe_dirs: list[str]) -> dict:
        return replies.load_probes(self._probex_controller(), probe_dirs)

    def probex_set_paused(self, paused: bool) -> dict:
        return replies.set_paused(self._probex_controller(), paused)

    def probex_list_steering(self) -> dict:
        return replies.list_steering(self._probex_controller())

    def probex_load_steering(self, vector_dirs: list[str]) -> dict:
        return replies.load_steering(self._probex_controller(), vector_dirs)
