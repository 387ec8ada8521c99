"""Adapter for vLLM's V1 model runner (`GPUModelRunner`, and `CPUModelRunner` built on it).

The only module that reads V1 runner internals. Per step it describes the batch as a
`StepView` (requests in row order, rows per request, tokens computed before the step,
prompt lengths) from `input_batch` and the scheduler output, and hands it to the
engine-agnostic `TapController`, which copies the step's scores to the host. V1 keeps one
persistent batch, which the next step's `_update_states` rewrites before this step's scores
are described, so the batch's arrays are snapshotted right after the forward's launch (a few
copies); the view itself is built from the snapshot once the step's copies are enqueued (a
`DeferredStep`), and the step is handed over when `execute_model` returns, with the logits
launched behind the forward (as on runner V2). With steering or capture the view is read
before the forward, as it must be.

Controller set-up, the worker extension and the prefix-cache bypass are shared with the V2
adapter (`worker.py`).
"""

from __future__ import annotations

import functools
import logging

import numpy as np

from engine_worker.step import DeferredStep, StepView
from engine_worker.steering import SteerRequest
from engine_worker.vllm.worker import RunnerState, install_controller, state_of, steering_of, wants_capture

log = logging.getLogger("vllm.probex.v1_runner")  # under "vllm": printed by its log handler

_PATCHED_MARK = "_probex_v1_patched"
_STEP_PATCHED_MARK = "_probex_step_patched"


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
    if not GPUModelRunner.__dict__.get(_STEP_PATCHED_MARK):
        GPUModelRunner.execute_model = _remember_scheduler_output(GPUModelRunner.execute_model)
        GPUModelRunner._model_forward = _tapped_forward(GPUModelRunner._model_forward)
        setattr(GPUModelRunner, _STEP_PATCHED_MARK, True)


def _after_load_model(load_model):
    @functools.wraps(load_model)
    def wrapper(self, *args, **kwargs):
        result = load_model(self, *args, **kwargs)
        install_controller(self)
        return result

    return wrapper


def _remember_scheduler_output(execute_model):
    @functools.wraps(execute_model)
    def wrapper(self, scheduler_output, *args, **kwargs):
        state = state_of(self)
        if state is None:
            return execute_model(self, scheduler_output, *args, **kwargs)
        state.scheduler_output = scheduler_output
        state.pending = None
        try:
            return execute_model(self, scheduler_output, *args, **kwargs)
        finally:
            launched, state.pending = state.pending, None
            if launched is not None:  # the forward ran: its step goes to the ring now
                state.controller.after_forward(launched)
            # Still set means no forward ran this step (nothing scheduled); requests can end anyway.
            elif state.scheduler_output is not None:
                state.scheduler_output = None
                finished = list(scheduler_output.finished_req_ids or ())
                if finished:
                    _forget(state, finished)
                    state.controller.after_idle_step(finished)

    return wrapper


def _tapped_forward(model_forward):
    @functools.wraps(model_forward)
    def wrapper(self, *args, **kwargs):
        state = state_of(self)
        if state is None or state.scheduler_output is None:  # dummy, profile and capture runs
            return model_forward(self, *args, **kwargs)
        controller = state.controller
        scheduler_output, state.scheduler_output = state.scheduler_output, None  # later runs see none
        view = None
        if controller.needs_view_before_forward:
            view = _step_view(self, scheduler_output)
            controller.before_forward(view, _capture_requests(self, state, view), _steering_requests(self, state, view))
        rows = scheduler_output.total_num_scheduled_tokens
        if rows > len(scheduler_output.num_scheduled_tokens):  # a prompt chunk in the step
            controller.open_mid_forward_copies(rows)
        try:
            output = model_forward(self, *args, **kwargs)
        except BaseException:
            controller.close_mid_forward_copies(launched=False)
            raise
        controller.close_mid_forward_copies()
        finished = tuple(scheduler_output.finished_req_ids or ())
        if view is not None:
            step = StepView(view.req_ids, view.num_scheduled, view.num_computed, view.num_prompt, finished)
        elif controller.reads_scores:  # scores only: snapshot the batch now, build the view later
            step = DeferredStep(int(scheduler_output.total_num_scheduled_tokens),
                                functools.partial(_view_of, *_step_snapshot(self, scheduler_output)), finished)
        else:
            step = StepView.empty(finished)
        _forget(state, finished)
        # Handed over when execute_model returns (its wrapper, which also set the scheduler
        # output this forward needed to get here).
        state.pending = step
        return output

    return wrapper


def _step_view(runner, scheduler_output) -> StepView:
    return _view_of(*_step_snapshot(runner, scheduler_output))


def _step_snapshot(runner, scheduler_output) -> tuple[list, dict, np.ndarray, np.ndarray]:
    batch = runner.input_batch
    n = batch.num_reqs
    # Slices of the batch's list and arrays are copies (`astype` copies by default).
    return (batch.req_ids[:n], scheduler_output.num_scheduled_tokens,
            batch.num_computed_tokens_cpu[:n].astype(np.int64), batch.num_prompt_tokens[:n].astype(np.int64))


def _view_of(req_ids: list, scheduled: dict, num_computed: np.ndarray, num_prompt: np.ndarray) -> StepView:
    return StepView(
        req_ids=list(req_ids),
        num_scheduled=np.fromiter((scheduled.get(r, 0) for r in req_ids), dtype=np.int64, count=len(req_ids)),
        num_computed=num_computed,
        num_prompt=num_prompt,
    )


def _forget(state: RunnerState, finished) -> None:
    for req_id in finished:
        state.capture_flags.pop(req_id, None)
        state.steering.pop(req_id, None)


def _extra_args(runner, req_id: str) -> dict | None:
    state = runner.requests.get(req_id)
    params = state.sampling_params if state else None
    return params.extra_args if params else None


def _steering_requests(runner, state: RunnerState, view: StepView) -> dict[str, SteerRequest]:
    known = state.steering
    steering = {}
    for req_id in view.req_ids:
        if req_id not in known:
            known[req_id] = steering_of(_extra_args(runner, req_id))
        if known[req_id] is not None:
            steering[req_id] = known[req_id]
    return steering


def _capture_requests(runner, state: RunnerState, view: StepView) -> set[str]:
    flags = state.capture_flags
    wanted = set()
    for req_id in view.req_ids:
        flag = flags.get(req_id)
        if flag is None:
            flag = flags[req_id] = wants_capture(_extra_args(runner, req_id))
        if flag:
            wanted.add(req_id)
    return wanted
