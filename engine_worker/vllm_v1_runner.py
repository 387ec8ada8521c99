"""Adapter for vLLM's V1 model runner (`GPUModelRunner`, and `CPUModelRunner` built on it).

The only module that reads V1 runner internals. Per step it describes the batch as a
`StepLayout` (requests in row order, rows per request, tokens computed before the step,
prompt lengths) from `input_batch` and the scheduler output, and hands it to the
engine-agnostic `TapController`, which copies the step's scores to the host. The layout
is read on the engine thread right after the launch: V1 keeps one persistent batch, which
the next step's `_update_states` rewrites before this step's scores are consumed.

Who consumes the scores: on one GPU with async scheduling (vLLM's default on CUDA) the
engine thread, where it reads the step's sampled tokens (`sample_tokens`' async output,
as on runner V2); otherwise (tensor parallelism, the CPU backend's synchronous
scheduling, PROBEX_SCORE_CONSUMER=thread) the transfer thread. Controller set-up, the
worker extension, the consumer wrapper and the prefix-cache bypass are shared with the V2
adapter (`vllm_worker.py`).
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np

from engine_worker.bookkeeping import StepLayout
from engine_worker.controller import TapController
from engine_worker.steering import SteerRequest
from engine_worker.vllm_worker import (controller_of, default_score_consumer, install_controller,
                                       scores_with_sampled_tokens, steering_of, wants_capture)

log = logging.getLogger("vllm.probex.v1_runner")  # under "vllm": printed by its log handler

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
        GPUModelRunner.sample_tokens = scores_with_sampled_tokens(GPUModelRunner.sample_tokens)
        GPUModelRunner._probex_step_patched = True


def _after_load_model(load_model):
    @functools.wraps(load_model)
    def wrapper(self, *args, **kwargs):
        result = load_model(self, *args, **kwargs)
        consumer = default_score_consumer(self, reads_tokens_async=bool(getattr(self, "use_async_scheduling", False)))
        if install_controller(self, score_consumer=consumer) is not None:
            self._probex_capture_flags = {}
            self._probex_steering = {}  # req id -> SteerRequest | None, parsed once per request
        return result

    return wrapper


def _remember_scheduler_output(execute_model):
    @functools.wraps(execute_model)
    def wrapper(self, scheduler_output, *args, **kwargs):
        self._probex_scheduler_output = scheduler_output
        try:
            return execute_model(self, scheduler_output, *args, **kwargs)
        finally:
            # Still set means no forward ran this step (nothing scheduled); requests can end anyway.
            if self._probex_scheduler_output is not None:
                self._probex_scheduler_output = None
                controller = controller_of(self)
                finished = list(scheduler_output.finished_req_ids or ())
                if controller is not None and finished:
                    started = time.perf_counter()
                    _forget(self, finished)
                    controller.after_idle_step(finished)
                    controller.engine_thread_s += time.perf_counter() - started

    return wrapper


def _tapped_forward(model_forward):
    @functools.wraps(model_forward)
    def wrapper(self, *args, **kwargs):
        controller: TapController | None = controller_of(self)
        if controller is None:
            return model_forward(self, *args, **kwargs)
        started = time.perf_counter()
        controller.before_forward_launch()  # every forward, dummy and profile runs included
        scheduler_output = getattr(self, "_probex_scheduler_output", None)
        if scheduler_output is None:
            return model_forward(self, *args, **kwargs)
        self._probex_scheduler_output = None  # dummy/profile runs after this see none
        layout = None
        if controller.needs_layout_before_forward:
            reading = time.perf_counter()
            layout = _step_layout(self, scheduler_output)
            controller.layout_s += time.perf_counter() - reading
            controller.before_forward(layout, _capture_requests(self, layout), _steering_requests(self, layout))
        before = time.perf_counter()
        output = model_forward(self, *args, **kwargs)
        after = time.perf_counter()
        if layout is None:  # scores only: read the layout once the forward is launched
            layout = _step_layout(self, scheduler_output) if controller.reads_scores else StepLayout.empty()
            controller.layout_s += time.perf_counter() - after
        finished = scheduler_output.finished_req_ids
        _forget(self, finished)
        controller.after_forward(layout, finished)
        controller.engine_thread_s += (before - started) + (time.perf_counter() - after)
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


def _forget(runner, finished) -> None:
    for req_id in finished:
        runner._probex_capture_flags.pop(req_id, None)
        runner._probex_steering.pop(req_id, None)


def _extra_args(runner, req_id: str) -> dict | None:
    state = runner.requests.get(req_id)
    params = state.sampling_params if state else None
    return params.extra_args if params else None


def _steering_requests(runner, layout: StepLayout) -> dict[str, SteerRequest]:
    known = runner._probex_steering
    steering = {}
    for req_id in layout.req_ids:
        if req_id not in known:
            known[req_id] = steering_of(_extra_args(runner, req_id))
        if known[req_id] is not None:
            steering[req_id] = known[req_id]
    return steering


def _capture_requests(runner, layout: StepLayout) -> set[str]:
    flags = runner._probex_capture_flags
    wanted = set()
    for req_id in layout.req_ids:
        flag = flags.get(req_id)
        if flag is None:
            flag = flags[req_id] = wants_capture(_extra_args(runner, req_id))
        if flag:
            wanted.add(req_id)
    return wanted
