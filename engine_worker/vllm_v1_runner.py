"""Adapter for vLLM's V1 model runner (`GPUModelRunner`, and `CPUModelRunner` built on it).

The only module that reads V1 runner internals. Per step it describes the batch as a
`StepLayout` (requests in row order, rows per request, tokens computed before the step,
prompt lengths) from `input_batch` and the scheduler output, and hands it to the
engine-agnostic `TapController`. It also provides the worker extension (the control
plane reached through `collective_rpc`) and the per-request prefix-cache bypass.
"""

from __future__ import annotations

import functools
import logging

import numpy as np

from probes.artifact import ServedModel
from engine_worker.bookkeeping import StepLayout
from engine_worker.controller import ProbeSetRejected, TapController
from engine_worker.tap import LayerTap
from engine_worker.tap_config import TapConfig

log = logging.getLogger("probex.vllm_v1")

_CONTROLLER_ATTR = "probex_controller"
_PATCHED_MARK = "_probex_v1_patched"


def patch_v1_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner_classes = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        runner_classes.append(CPUModelRunner)
    except ImportError:
        pass
    for cls in runner_classes:
        if "load_model" in cls.__dict__ and not cls.__dict__.get(_PATCHED_MARK):
            cls.load_model = _after_load_model(cls.load_model)
            setattr(cls, _PATCHED_MARK, True)
    if not GPUModelRunner.__dict__.get("_probex_step_patched"):
        GPUModelRunner.execute_model = _remember_scheduler_output(GPUModelRunner.execute_model)
        GPUModelRunner._model_forward = _tapped_forward(GPUModelRunner._model_forward)
        GPUModelRunner._probex_step_patched = True
    _patch_prefix_cache_bypass()


def _after_load_model(load_model):
    @functools.wraps(load_model)
    def wrapper(self, *args, **kwargs):
        result = load_model(self, *args, **kwargs)
        _install_controller(self)
        return result

    return wrapper


def _install_controller(runner) -> None:
    tap_config = TapConfig.from_additional_config(runner.vllm_config.additional_config)
    if tap_config is None or getattr(runner, _CONTROLLER_ATTR, None) is not None:
        return
    taps = {m.layer: m for m in runner.model.modules() if isinstance(m, LayerTap)}
    missing = sorted(set(tap_config.layers) - set(taps))
    if missing:
        raise RuntimeError(
            f"probex: layers {missing} were asked to be tapped but the model has no tap there: either the layer"
            f" index is out of range or {type(runner.model).__name__} uses a decoder layer ProbeX does not patch"
            " (supported: Llama, Mistral, Qwen2)"
        )
    hf_config = runner.vllm_config.model_config.hf_config.to_dict()
    served = ServedModel.from_hf_config(hf_config, name=runner.vllm_config.model_config.model)
    controller = TapController(taps, served, _publisher(tap_config), tap_config.capture_dir if tap_config.capture_enabled else None)
    try:
        controller.load(list(tap_config.probe_dirs))
    except ProbeSetRejected as exc:
        raise RuntimeError(f"probex: refusing to start: {exc}") from None
    setattr(runner, _CONTROLLER_ATTR, controller)
    runner._probex_capture_flags = {}


def _publisher(tap_config: TapConfig):
    if not tap_config.score_address or not _is_delivering_rank():
        return None
    from engine_worker.delivery import ScorePublisher

    return ScorePublisher(tap_config.score_address).publish


def _is_delivering_rank() -> bool:
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group().rank_in_group == 0 and get_pp_group().is_last_rank
    except (AssertionError, ImportError):
        return True


def _remember_scheduler_output(execute_model):
    @functools.wraps(execute_model)
    def wrapper(self, scheduler_output, *args, **kwargs):
        self._probex_scheduler_output = scheduler_output
        return execute_model(self, scheduler_output, *args, **kwargs)

    return wrapper


def _tapped_forward(model_forward):
    @functools.wraps(model_forward)
    def wrapper(self, *args, **kwargs):
        controller: TapController | None = getattr(self, _CONTROLLER_ATTR, None)
        scheduler_output = getattr(self, "_probex_scheduler_output", None)
        if controller is None or scheduler_output is None:
            return model_forward(self, *args, **kwargs)
        self._probex_scheduler_output = None  # dummy/profile runs after this see none
        layout = _step_layout(self, scheduler_output)
        controller.before_forward(layout, _capture_requests(self, layout))
        output = model_forward(self, *args, **kwargs)
        finished = scheduler_output.finished_req_ids
        for req_id in finished:
            self._probex_capture_flags.pop(req_id, None)
        controller.after_forward(layout, finished)
        return output

    return wrapper


def _step_layout(runner, scheduler_output) -> StepLayout:
    batch = runner.input_batch
    n = batch.num_reqs
    req_ids = list(batch.req_ids[:n])
    scheduled = scheduler_output.num_scheduled_tokens
    return StepLayout(
        req_ids=req_ids,
        num_scheduled=np.fromiter((scheduled.get(r, 0) for r in req_ids), dtype=np.int64, count=n),
        num_computed=batch.num_computed_tokens_cpu[:n].astype(np.int64),
        num_prompt=batch.num_prompt_tokens[:n].astype(np.int64),
    )


def _capture_requests(runner, layout: StepLayout) -> set[str]:
    flags = runner._probex_capture_flags
    wanted = set()
    for req_id in layout.req_ids:
        flag = flags.get(req_id)
        if flag is None:
            state = runner.requests.get(req_id)
            extra = (state.sampling_params.extra_args or {}) if state and state.sampling_params else {}
            flag = flags[req_id] = bool(extra.get("probex_capture"))
        if flag:
            wanted.add(req_id)
    return wanted


def _patch_prefix_cache_bypass() -> None:
    """`vllm_xargs: {"probex_recompute": true}` -> skip prefix-cache reads for that request only."""
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
        controller = getattr(self.model_runner, _CONTROLLER_ATTR, None)
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

