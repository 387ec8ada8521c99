"""Adapter for vLLM's model runner V2 (`vllm/v1/worker/gpu/model_runner.py`).

The only module that reads V2 runner internals. vLLM 0.25 picks V2 for dense Llama /
Qwen2 models on CUDA (it needs Triton, so the CPU backend stays on V1). Compared with V1:

- V2 orders a step's requests itself (decodes first) in `prepare_inputs`, which returns
  an `InputBatch` with the batch-order request ids, rows per request and tokens computed
  before the step; prompt lengths live in `req_states`. We read the layout there, right
  before the forward, and set capture rows from it.
- The forward happens inside `execute_model` (sampling is a separate `sample_tokens`
  call), so the step is handed to the controller when `execute_model` returns: the
  forward is enqueued by then and the controller only enqueues a copy behind it. When
  nothing is staged before the forward (no steering, no capture), the layout itself is
  built later, by the scores' consumer, from the batch's per-step arrays.
- V2 keeps no `SamplingParams` per request after `add_requests`, so the per-request
  capture flag and steering settings are read there.
- The engine thread consumes the scores (the default here on one GPU; with tensor
  parallelism, and with PROBEX_SCORE_CONSUMER=thread, the transfer thread does), when vLLM
  reads the step's sampled tokens: `sample_tokens` returns an `AsyncOutput`, wrapped by
  `vllm_worker.scores_with_sampled_tokens` as runner V1's async output is.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable

import numpy as np

from engine_worker.scores.bookkeeping import StepLayout
from engine_worker.vllm.worker import (controller_of, default_score_consumer, install_controller,
                                       scores_with_sampled_tokens, steering_of, wants_capture)

log = logging.getLogger("vllm.probex.v2_runner")  # under "vllm": printed by its log handler

_PATCHED_MARK = "_probex_v2_patched"


def patch_v2_runner() -> bool:
    """Patch the V2 runner class if this vLLM has one; False where it cannot be imported (e.g. CPU)."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except Exception:  # no Triton / no CUDA build: V2 is not available, V1 is used
        return False
    if GPUModelRunner.__dict__.get(_PATCHED_MARK):
        return True
    GPUModelRunner.load_model = _after_load_model(GPUModelRunner.load_model)
    GPUModelRunner.add_requests = _remember_capture_flags(GPUModelRunner.add_requests)
    GPUModelRunner.prepare_inputs = _layout_before_forward(GPUModelRunner.prepare_inputs)
    GPUModelRunner.execute_model = _scores_after_forward(GPUModelRunner.execute_model)
    GPUModelRunner.sample_tokens = scores_with_sampled_tokens(GPUModelRunner.sample_tokens)
    setattr(GPUModelRunner, _PATCHED_MARK, True)
    return True


def _after_load_model(load_model):
    @functools.wraps(load_model)
    def wrapper(self, *args, **kwargs):
        result = load_model(self, *args, **kwargs)
        if install_controller(self, score_consumer=default_score_consumer(self, reads_tokens_async=True)) is not None:
            self._probex_capture_flags = {}
            self._probex_steering = {}  # req id -> SteerRequest, steered requests only
            self._probex_layout = None  # built before the forward (steering or capture on)
            self._probex_batch = None  # or the step's batch, to build it after the launch
            self._probex_timed_forward = None  # PROBEX_STEP_TIMING=1: the span begun before the forward
            log.info("probex: tap attached to vLLM model runner V2")
        return result

    return wrapper


def _remember_capture_flags(add_requests):
    @functools.wraps(add_requests)
    def wrapper(self, scheduler_output, *args, **kwargs):
        if controller_of(self) is not None:
            for new_req in scheduler_output.scheduled_new_reqs:
                params = new_req.sampling_params
                extra_args = params.extra_args if params else None
                self._probex_capture_flags[new_req.req_id] = wants_capture(extra_args)
                steering = steering_of(extra_args)
                if steering is not None:
                    self._probex_steering[new_req.req_id] = steering
        return add_requests(self, scheduler_output, *args, **kwargs)

    return wrapper


def _layout_before_forward(prepare_inputs):
    # Only real steps call prepare_inputs (dummy, profile and capture runs build a dummy
    # batch instead), so a layout recorded here always belongs to the next forward.
    @functools.wraps(prepare_inputs)
    def wrapper(self, scheduler_output, *args, **kwargs):
        batch = prepare_inputs(self, scheduler_output, *args, **kwargs)
        controller = controller_of(self)
        if controller is not None and not controller.needs_layout_before_forward:
            # Scores are only read after the forward: build the layout once it is launched,
            # keeping this step's pre-launch host work as it is without ProbeX.
            self._probex_batch = batch
        elif controller is not None:
            started = time.perf_counter()
            layout = _step_layout(self, batch)
            controller.layout_s += time.perf_counter() - started
            flags, steering = self._probex_capture_flags, self._probex_steering
            controller.before_forward(layout, {r for r in layout.req_ids if flags.get(r)},
                                      {r: steering[r] for r in layout.req_ids if r in steering})
            self._probex_layout = layout
            controller.engine_thread_s += time.perf_counter() - started
        if controller is not None and batch.num_tokens > batch.num_reqs:  # a prompt chunk in the step
            started = time.perf_counter()
            controller.open_mid_forward_copies(batch.num_tokens)  # rows: the scheduled tokens, as after_forward's
            controller.engine_thread_s += time.perf_counter() - started
        if controller is not None and controller.step_timer is not None:
            _begin_timing(self, controller.step_timer, batch)
        return batch

    return wrapper


def _scores_after_forward(execute_model):
    @functools.wraps(execute_model)
    def wrapper(self, scheduler_output, *args, **kwargs):
        controller = controller_of(self)
        if controller is not None:  # every forward, dummy runs included, starts after this
            began = time.perf_counter()
            controller.before_forward_launch()
            controller.engine_thread_s += time.perf_counter() - began
        try:
            output = execute_model(self, scheduler_output, *args, **kwargs)
        except BaseException:
            if controller is not None:
                controller.close_mid_forward_copies(launched=False)
            raise
        if controller is None:
            return output
        controller.close_mid_forward_copies()
        if controller.step_timer is not None:
            timed, self._probex_timed_forward = self._probex_timed_forward, None
            if timed is not None:  # the forward is enqueued: the span's end goes behind it
                controller.step_timer.end(timed, paused=controller.paused)
        started = time.perf_counter()
        layout, self._probex_layout = self._probex_layout, None
        batch, self._probex_batch = self._probex_batch, None
        num_rows = None
        if batch is not None:  # scores only: the layout is built on the transfer thread
            if controller.reads_scores:
                layout, num_rows = _deferred_step_layout(self, batch)
            else:
                layout = StepLayout.empty()
            controller.layout_s += time.perf_counter() - started
        finished = list(scheduler_output.finished_req_ids or ())
        for req_id in finished:
            self._probex_capture_flags.pop(req_id, None)
            self._probex_steering.pop(req_id, None)
        if layout is not None:
            controller.after_forward(layout, finished, num_rows)
        elif finished:
            controller.after_idle_step(finished)  # nothing ran, but requests ended
        controller.engine_thread_s += time.perf_counter() - started
        return output

    return wrapper


def _begin_timing(runner, timer, batch) -> None:
    """PROBEX_STEP_TIMING=1: the span of a prompt-sized forward begins here, once its inputs
    are prepared and right before it is enqueued (step_timing.py)."""
    n = batch.num_reqs
    rows = int(batch.num_scheduled_tokens[:n].sum())
    runner._probex_timed_forward = timer.begin(rows, batch.req_ids[:n]) if timer.wants(rows) else None


def _step_layout(runner, batch) -> StepLayout:
    return _layout_of(*_step_arrays(runner, batch))


def _deferred_step_layout(runner, batch) -> tuple[Callable[[], StepLayout], int]:
    """The layout as a function for the transfer thread, and the step's row count. What the
    function reads is the step's own: `prepare_inputs` builds the batch's request ids, token
    counts and computed-token counts afresh every step (the computed counts by fancy
    indexing, a copy; vLLM 0.25 and 0.32), so only the prompt lengths, which live in the
    runner's per-slot state, are copied out now (a slot is reused once its request ends)."""
    arrays = _step_arrays(runner, batch)
    # Rows are the scheduled tokens, as the layout counts them (batch.num_tokens can be fewer
    # with speculative decoding's adaptive verification).
    return functools.partial(_layout_of, *arrays), int(arrays[1].sum())


def _step_arrays(runner, batch) -> tuple[list, np.ndarray, np.ndarray, np.ndarray]:
    n = batch.num_reqs
    return (batch.req_ids[:n], batch.num_scheduled_tokens[:n], batch.num_computed_tokens_np[:n],
            runner.req_states.prompt_len.np[batch.idx_mapping_np[:n]])  # fancy index: a copy


def _layout_of(req_ids: list, num_scheduled: np.ndarray, num_computed: np.ndarray,
               prompt_lens: np.ndarray) -> StepLayout:
    return StepLayout(
        req_ids=list(req_ids),
        num_scheduled=np.asarray(num_scheduled, dtype=np.int64),
        num_computed=np.asarray(num_computed, dtype=np.int64),
        num_prompt=np.asarray(prompt_lens, dtype=np.int64),
    )
