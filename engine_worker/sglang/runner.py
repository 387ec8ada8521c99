"""Adapter for SGLang 0.5.14's scheduler and model runner: the only module that reads them.

Where it hooks (class patches made by plugin.py in every SGLang process, before any is built):
- `ModelRunner.load_model`, after: the taps' buffers get storage next to the weights (before
  the KV pool is sized from the memory left and before any graph is captured), the startup
  probe set is loaded and a `TapController` is kept for the runner.
- `ModelRunner.init_cuda_graphs`, before: the attention backend's `forward` calls
  `controller.layer_scores_final(L)` when layer L + 1's attention is about to run. SGLang runs
  that call from Python in every prefill: between the pieces of its torch.compile'd
  piecewise CUDA graphs (`unified_attention_with_output`) and in eager forwards, so a prompt
  chunk's scores leave mid-forward. Decode steps replay whole CUDA graphs: theirs are copied
  behind the forward.
- `Scheduler.run_batch`, around: the batch's rows are read as requests (layout.py) before
  the forward is enqueued, and mid-forward copies are opened for a step carrying a prompt.
- `Scheduler.process_batch_result`, around: the step is handed to the controller before its
  own results are processed and after every earlier step's (layout.StepSequence says why:
  SGLang's overlap scheduler runs requests past their end, and retracts requests of a step
  in flight), its copies enqueued on the stream its forward ran on; requests that ended are
  read from the batch afterwards.
- `Scheduler.set_internal_state`, around: ProbeX's engine RPC (api_server.py) rides on
  SGLang's own internal-state request, answered here between steps on the scheduler thread.

What the adapter keeps per model runner lives in a `RunnerState` beside it (a weak mapping),
never on SGLang's objects.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from probes.artifact import ServedModel
from engine_worker.settings import TAP_CONFIG
from engine_worker.sglang.layout import Handover, StepSequence, snapshot_step, view_of
from engine_worker.sglang.recompute import custom_params_of
from engine_worker.step import StepView
from engine_worker.tap.config import TapConfig
from engine_worker.tap.controller import ProbeSetRejected, TapController
from engine_worker.tap.layer import LayerTap, awaiting_storage, materialize

log = logging.getLogger("probex.sglang.runner")

# The key of SGLang's internal-state request that carries a ProbeX call (api_server.py).
RPC_KEY = "__probex__"
_PATCHED_MARK = "_probex_patched"


@dataclass
class RunnerState:
    controller: TapController
    sequence: StepSequence = field(default_factory=StepSequence)
    stream: Any = None  # the stream the waiting step's forward was enqueued on (None: the current one)
    mid_forward: dict[int, int] = field(default_factory=dict)  # attention layer -> tapped layer before it


_STATES: "weakref.WeakKeyDictionary[Any, RunnerState]" = weakref.WeakKeyDictionary()
# attention backend -> the model runner it serves (the mid-forward hook's way to its state)
_BACKENDS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def state_of(runner) -> RunnerState | None:
    return _STATES.get(runner)


def _scheduler_state(scheduler) -> RunnerState | None:
    worker = getattr(scheduler, "tp_worker", None)
    runner = getattr(worker, "model_runner", None)
    return _STATES.get(runner) if runner is not None else None


def tap_config_from_env() -> TapConfig | None:
    raw = os.environ.get(TAP_CONFIG)
    return TapConfig.from_json(raw) if raw else None


# -- set-up ------------------------------------------------------------------------------------

def install_controller(runner, tap_config: TapConfig | None = None, start_ring: Callable | None = None,
                       driver=None) -> RunnerState | None:
    """After the weights are loaded: give the taps storage, load the startup probe set and keep
    a controller beside the runner. None where the process has no tap."""
    tap_config = tap_config or tap_config_from_env()
    if tap_config is None:
        return None
    existing = _STATES.get(runner)
    if existing is not None:
        return existing
    model = runner.model
    taps = {m.layer: m for m in model.modules() if isinstance(m, LayerTap)}
    missing = sorted(set(tap_config.layers) - set(taps))
    if missing:
        raise RuntimeError(
            f"probex: layers {missing} were asked to be tapped but the model has no tap there: either the layer"
            f" index is out of range or {type(model).__name__} uses a decoder layer ProbeX does not patch"
            " (supported on SGLang: Llama, Mistral, Qwen2)")
    device = getattr(runner, "device", None)
    device = next(model.parameters()).device if device is None or isinstance(device, str) else device
    modules = list(taps.values()) + [m for m in awaiting_storage() if m not in taps.values()]
    for module in modules:
        materialize(module, device)
        for buffer in module.buffers(recurse=False):
            buffer.zero_()
    dtype = getattr(runner, "dtype", None) or getattr(getattr(runner, "model_config", None), "dtype", None)
    if dtype is not None:
        warmed = sum(tap.warm_kernels(dtype) for tap in taps.values())
        if warmed:
            log.info("probex: the tap's kernel compiled before serving (%d launches over %d layers)", warmed, len(taps))
    model_config = runner.model_config
    hf_config = model_config.hf_config.to_dict() if hasattr(model_config.hf_config, "to_dict") else dict(
        vars(model_config.hf_config))
    served = ServedModel.from_hf_config(hf_config, name=getattr(model_config, "model_path", None))
    delivering = getattr(runner, "tp_rank", 0) == 0
    capture_dir = tap_config.capture_dir if tap_config.capture_enabled and delivering else None
    if start_ring is None:
        from engine_worker.tap.ring_copies import start_score_ring as start_ring
    ring = start_ring(tap_config, taps) if delivering else None
    controller = TapController(taps, served, ring, capture_dir, driver=driver)
    try:
        controller.load(list(tap_config.probe_dirs))
    except ProbeSetRejected as exc:
        raise RuntimeError(f"probex: refusing to start: {exc}") from None
    state = _STATES[runner] = RunnerState(controller)
    return state


def hook_mid_forward(runner, backend) -> list[int]:
    """Have the attention `backend` call `layer_scores_final(L)` before layer L + 1's attention
    runs, for each tapped layer L with a next layer; returns those layers."""
    state = _STATES.get(runner)
    if state is None or backend is None:
        return []
    state.mid_forward = {layer + 1: layer for layer in state.controller.taps}
    _patch_backend_class(type(backend))
    _BACKENDS[backend] = runner
    return sorted(state.mid_forward.values())


def _patch_backend_class(cls: type) -> None:
    if cls.__dict__.get(_PATCHED_MARK):
        return
    original = cls.forward

    @functools.wraps(original)
    def forward(self, q, k, v, layer, *args, **kwargs):
        runner = _BACKENDS.get(self)
        if runner is not None and not _compiling():
            state = _STATES.get(runner)
            tapped = state.mid_forward.get(getattr(layer, "layer_id", -1)) if state is not None else None
            if tapped is not None:
                state.controller.layer_scores_final(tapped)
        return original(self, q, k, v, layer, *args, **kwargs)

    cls.forward = forward
    setattr(cls, _PATCHED_MARK, True)


def _compiling() -> bool:
    import torch

    return torch.compiler.is_compiling()


# -- per step ----------------------------------------------------------------------------------

def hand_over(state: RunnerState, handover: Handover | None) -> None:
    if handover is None:
        return
    controller = state.controller
    if handover.step is None:
        controller.after_idle_step(list(handover.finished))
        return
    with _on_stream(state.stream):  # behind the step's forward, ahead of the next one
        controller.after_forward(view_of(handover.step, handover.finished, handover.dropped))


def _on_stream(stream):
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


def _launch_stream(scheduler):
    """The stream `run_batch` enqueues the forward on: the overlap scheduler's forward stream,
    else the scheduler's current one; None off CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    if getattr(scheduler, "enable_overlap", False) and getattr(scheduler, "forward_stream", None) is not None:
        return scheduler.forward_stream
    return torch.cuda.current_stream()


def _capture_requests(batch) -> set[str]:
    return {str(req.rid) for req in batch.reqs if (custom_params_of(req) or {}).get("probex_capture")}


def _run_batch(run_batch):
    @functools.wraps(run_batch)
    def wrapper(self, batch, *args, **kwargs):
        state = _scheduler_state(self)
        if state is None or batch is None:
            return run_batch(self, batch, *args, **kwargs)
        hand_over(state, state.sequence.launching())  # copied before this forward overwrites the buffers
        controller = state.controller
        snapshot = snapshot_step(batch, getattr(self, "forward_ct", 0) + 1)
        if snapshot is not None and controller.needs_view_before_forward:
            controller.before_forward(view_of(snapshot), _capture_requests(batch))
        if snapshot is not None and snapshot.has_prompt_rows:
            controller.open_mid_forward_copies(snapshot.rows)
        try:
            result = run_batch(self, batch, *args, **kwargs)
        except BaseException:
            controller.close_mid_forward_copies(launched=False)
            raise
        controller.close_mid_forward_copies()
        if snapshot is not None:
            launched = getattr(batch, "forward_iter", None)  # run_batch numbers the batch
            if isinstance(launched, int) and launched != snapshot.forward_iter:
                snapshot = replace(snapshot, forward_iter=launched)
            state.stream = _launch_stream(self)
        state.sequence.launched(snapshot)
        return result

    return wrapper


def _process_batch_result(process_batch_result):
    @functools.wraps(process_batch_result)
    def wrapper(self, batch, result, *args, **kwargs):
        state = _scheduler_state(self)
        if state is None:
            return process_batch_result(self, batch, result, *args, **kwargs)
        forward_iter = int(getattr(batch, "forward_iter", 0) or 0)
        hand_over(state, state.sequence.before_result(forward_iter))
        out = process_batch_result(self, batch, result, *args, **kwargs)
        ended = [str(req.rid) for req in batch.reqs if req.finished()]
        hand_over(state, state.sequence.after_result(forward_iter, ended))
        return out

    return wrapper


def patch_model_runner_class(cls: type) -> bool:
    if cls.__dict__.get(_PATCHED_MARK):
        return False
    load_model, init_cuda_graphs = cls.load_model, cls.init_cuda_graphs

    @functools.wraps(load_model)
    def load_model_wrapper(self, *args, **kwargs):
        out = load_model(self, *args, **kwargs)
        install_controller(self)
        return out

    @functools.wraps(init_cuda_graphs)
    def init_cuda_graphs_wrapper(self, *args, **kwargs):
        hooked = hook_mid_forward(self, getattr(self, "attn_backend", None))
        if hooked:
            log.info("probex: prompt scores of layers %s leave mid-forward", hooked)
        return init_cuda_graphs(self, *args, **kwargs)

    cls.load_model, cls.init_cuda_graphs = load_model_wrapper, init_cuda_graphs_wrapper
    setattr(cls, _PATCHED_MARK, True)
    return True


def patch_scheduler_class(cls: type, rpc_output: Callable | None = None) -> bool:
    if cls.__dict__.get(_PATCHED_MARK):
        return False
    cls.run_batch = _run_batch(cls.run_batch)
    cls.process_batch_result = _process_batch_result(cls.process_batch_result)
    set_internal_state = cls.set_internal_state

    @functools.wraps(set_internal_state)
    def set_internal_state_wrapper(self, recv_req, *args, **kwargs):
        call = getattr(recv_req, "server_args", None)
        if not (isinstance(call, dict) and RPC_KEY in call):
            return set_internal_state(self, recv_req, *args, **kwargs)
        from engine_worker.sglang.controls import answer

        state = _scheduler_state(self)
        if state is not None:
            # Between steps, nothing in flight that could end a request: the waiting step goes
            # first, scored by the probe set it ran with.
            hand_over(state, state.sequence.flush())
        result = answer(state.controller if state is not None else None, call[RPC_KEY])
        return (rpc_output or _sglang_rpc_output)(result)

    cls.set_internal_state = set_internal_state_wrapper
    setattr(cls, _PATCHED_MARK, True)
    return True


def _sglang_rpc_output(result: dict):
    from sglang.srt.managers.io_struct import SetInternalStateReqOutput

    return SetInternalStateReqOutput(updated=True, server_args={RPC_KEY: result})


def patch_sglang() -> None:
    """Patch SGLang's scheduler and model runner (in an SGLang process)."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.model_runner import ModelRunner

    patch_model_runner_class(ModelRunner)
    patch_scheduler_class(Scheduler)
