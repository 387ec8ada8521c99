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
  nothing is staged before the forward (no steering, no capture), the step's view is built
  after the launch (a `DeferredStep`), from the batch's per-step arrays.
- V2 keeps no `SamplingParams` per request after `add_requests`, so the per-request
  capture flag and steering settings are read there.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

import numpy as np

from engine_worker.step import DeferredStep, StepView
from engine_worker.vllm.worker import install_controller, state_of, steering_of, wants_capture

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
    GPUModelRunner.prepare_inputs = _view_before_forward(GPUModelRunner.prepare_inputs)
    GPUModelRunner.execute_model = _scores_after_forward(GPUModelRunner.execute_model)
    setattr(GPUModelRunner, _PATCHED_MARK, True)
    return True


def _after_load_model(load_model):
    @functools.wraps(load_model)
    def wrapper(self, *args, **kwargs):
        result = load_model(self, *args, **kwargs)
        if install_controller(self) is not None:
            log.info("probex: tap attached to vLLM model runner V2")
        return result

    return wrapper


def _remember_capture_flags(add_requests):
    @functools.wraps(add_requests)
    def wrapper(self, scheduler_output, *args, **kwargs):
        state = state_of(self)
        if state is not None:
            for new_req in scheduler_output.scheduled_new_reqs:
                params = new_req.sampling_params
                extra_args = params.extra_args if params else None
                state.capture_flags[new_req.req_id] = wants_capture(extra_args)
                steering = steering_of(extra_args)
                if steering is not None:
                    state.steering[new_req.req_id] = steering
        return add_requests(self, scheduler_output, *args, **kwargs)

    return wrapper


def _view_before_forward(prepare_inputs):
    # Only real steps call prepare_inputs (dummy, profile and capture runs build a dummy
    # batch instead), so a view recorded here always belongs to the next forward.
    @functools.wraps(prepare_inputs)
    def wrapper(self, scheduler_output, *args, **kwargs):
        batch = prepare_inputs(self, scheduler_output, *args, **kwargs)
        state = state_of(self)
        if state is None:
            return batch
        controller = state.controller
        if not controller.needs_view_before_forward:
            # Scores are only read after the forward: build the view once it is launched,
            # keeping this step's pre-launch host work as it is without ProbeX.
            state.pending = batch
        else:
            view = _step_view(self, batch)
            flags, steering = state.capture_flags, state.steering
            controller.before_forward(view, {r for r in view.req_ids if flags.get(r)},
                                      {r: steering[r] for r in view.req_ids if steering.get(r) is not None})
            state.pending = view
        if batch.num_tokens > batch.num_reqs:  # a prompt chunk in the step
            controller.open_mid_forward_copies(batch.num_tokens)  # rows: the scheduled tokens, as after_forward's
        return batch

    return wrapper


def _scores_after_forward(execute_model):
    @functools.wraps(execute_model)
    def wrapper(self, scheduler_output, *args, **kwargs):
        state = state_of(self)
        try:
            output = execute_model(self, scheduler_output, *args, **kwargs)
        except BaseException:
            if state is not None:
                state.controller.close_mid_forward_copies(launched=False)
            raise
        if state is None:
            return output
        controller = state.controller
        controller.close_mid_forward_copies()
        pending, state.pending = state.pending, None
        finished = tuple(scheduler_output.finished_req_ids or ())
        for req_id in finished:
            state.capture_flags.pop(req_id, None)
            state.steering.pop(req_id, None)
        if isinstance(pending, StepView):
            controller.after_forward(replace(pending, finished=finished))
        elif pending is not None:  # scores only: the view is built after the launch
            controller.after_forward(_deferred_step(self, pending, finished) if controller.reads_scores
                                     else StepView.empty(finished))
        elif finished:
            controller.after_idle_step(finished)  # nothing ran, but requests ended
        return output

    return wrapper


def _step_view(runner, batch) -> StepView:
    return _view_of(*_step_arrays(runner, batch))


def _deferred_step(runner, batch, finished: tuple[str, ...]) -> DeferredStep:
    """The step as a function that builds its view, and its row count. What the function
    reads is the step's own: `prepare_inputs` builds the batch's request ids, token counts
    and computed-token counts afresh every step (the computed counts by fancy indexing, a
    copy), so only the prompt lengths, which live in the runner's per-slot state, are copied
    out now (a slot is reused once its request ends)."""
    arrays = _step_arrays(runner, batch)
    # Rows are the scheduled tokens, as the view counts them (batch.num_tokens can be fewer
    # with speculative decoding's adaptive verification).
    return DeferredStep(int(arrays[1].sum()), functools.partial(_view_of, *arrays), finished)


def _step_arrays(runner, batch) -> tuple[list, np.ndarray, np.ndarray, np.ndarray]:
    n = batch.num_reqs
    return (batch.req_ids[:n], batch.num_scheduled_tokens[:n], batch.num_computed_tokens_np[:n],
            runner.req_states.prompt_len.np[batch.idx_mapping_np[:n]])  # fancy index: a copy


def _view_of(req_ids: list, num_scheduled: np.ndarray, num_computed: np.ndarray,
               prompt_lens: np.ndarray) -> StepView:
    return StepView(
        req_ids=list(req_ids),
        num_scheduled=np.asarray(num_scheduled, dtype=np.int64),
        num_computed=np.asarray(num_computed, dtype=np.int64),
        num_prompt=np.asarray(prompt_lens, dtype=np.int64),
    )
