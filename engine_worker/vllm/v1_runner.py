"""Adapter for vLLM's V1 model runner (`GPUModelRunner`, and `CPUModelRunner` built on it).

The only module that reads V1 runner internals. Per step it describes the batch as a
`StepLayout` (requests in row order, rows per request, tokens computed before the step,
prompt lengths) from `input_batch` and the scheduler output, and hands it to the
engine-agnostic `TapController`, which copies the step's scores to the host. V1 keeps one
persistent batch, which the next step's `_update_states` rewrites before this step's scores
are consumed, so the batch's arrays are snapshotted right after the forward's launch (a few
copies); the layout itself is built from the snapshot by the scores' consumer, and the step
is handed over when `execute_model` returns, with the logits launched behind the forward (as
on runner V2). With steering or capture the layout is read before the forward, as it must be.

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
from typing import Callable

import numpy as np

from engine_worker.scores.bookkeeping import StepLayout
from engine_worker.tap.controller import TapController
from engine_worker.steering import SteerRequest
from engine_worker.vllm.worker import (controller_of, default_score_consumer, install_controller,
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
        self._probex_launched_step = None
        try:
            return execute_model(self, scheduler_output, *args, **kwargs)
        finally:
            launched, self._probex_launched_step = self._probex_launched_step, None
            if launched is not None:  # the forward ran: its step goes to the consumer now
                controller = controller_of(self)
                started = time.perf_counter()
                controller.after_forward(*launched)
                controller.engine_thread_s += time.perf_counter() - started
            # Still set means no forward ran this step (nothing scheduled); requests can end anyway.
            elif self._probex_scheduler_output is not None:
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
        timer, timed = controller.step_timer, None
        if timer is not None and timer.wants(scheduler_output.total_num_scheduled_tokens):  # PROBEX_STEP_TIMING=1
            timed = timer.begin(scheduler_output.total_num_scheduled_tokens,
                                self.input_batch.req_ids[:self.input_batch.num_reqs])
        rows = scheduler_output.total_num_scheduled_tokens
        if rows > len(scheduler_output.num_scheduled_tokens):  # a prompt chunk in the step
            controller.open_mid_forward_copies(rows)
        before = time.perf_counter()
        try:
            output = model_forward(self, *args, **kwargs)
        except BaseException:
            controller.close_mid_forward_copies(launched=False)
            raise
        controller.close_mid_forward_copies()
        after = time.perf_counter()
        if timed is not None:
            timer.end(timed, paused=controller.paused)
        num_rows = None
        if layout is None:  # scores only: snapshot the batch now, build the layout later
            if controller.reads_scores:
                layout, num_rows = _deferred_step_layout(self, scheduler_output)
            else:
                layout = StepLayout.empty()
            controller.layout_s += time.perf_counter() - after
        finished = list(scheduler_output.finished_req_ids or ())
        _forget(self, finished)
        # Handed over when execute_model returns (its wrapper, which also set the scheduler
        # output this forward needed to get here).
        self._probex_launched_step = (layout, finished, num_rows)
        controller.engine_thread_s += (before - started) + (time.perf_counter() - after)
        return output

    return wrapper


def _step_layout(runner, scheduler_output) -> StepLayout:
    return _layout_of(*_step_snapshot(runner, scheduler_output))


def _deferred_step_layout(runner, scheduler_output) -> tuple[Callable[[], StepLayout], int]:
    """The layout as a function for the scores' consumer, and the step's row count. The
    persistent batch's arrays are copied now; the scheduler output is the step's own (the
    scheduler builds a new one every step), so its token counts are read later."""
    return (functools.partial(_layout_of, *_step_snapshot(runner, scheduler_output)),
            int(scheduler_output.total_num_scheduled_tokens))


def _step_snapshot(runner, scheduler_output) -> tuple[list, dict, np.ndarray, np.ndarray]:
    batch = runner.input_batch
    n = batch.num_reqs
    # Slices of the batch's list and arrays are copies (`astype` copies by default).
    return (batch.req_ids[:n], scheduler_output.num_scheduled_tokens,
            batch.num_computed_tokens_cpu[:n].astype(np.int64), batch.num_prompt_tokens[:n].astype(np.int64))


def _layout_of(req_ids: list, scheduled: dict, num_computed: np.ndarray, num_prompt: np.ndarray) -> StepLayout:
    return StepLayout(
        req_ids=list(req_ids),
        num_scheduled=np.fromiter((scheduled.get(r, 0) for r in req_ids), dtype=np.int64, count=len(req_ids)),
        num_computed=num_computed,
        num_prompt=num_prompt,
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
