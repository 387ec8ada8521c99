"""TapController and ScoreTransfer without an engine: LayerTaps on the CPU, steps described by hand."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_worker.scores.bookkeeping import CONTROL, StepLayout, StepReader, lost_message, step_message
from engine_worker.tap.layer import controller as controller_module
from engine_worker.tap.controller import TapController
from engine_worker.api_server.hub import ScoreHub
from engine_worker.tap.cuda_driver import ScoreTransfer
from engine_worker.tap.layer import LayerTap
from probes.artifact import ProbeArtifact, ReadPoint, ServedModel, save_probe

HIDDEN = 16


def served() -> ServedModel:
    return ServedModel.from_hf_config(
        {"model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": 4, "architectures": ["LlamaForCausalLM"]},
        name="toy",
    )


def make_probe(root: Path, name: str, layer: int, read: ReadPoint, seed: int) -> Path:
    weight = np.random.default_rng(seed).standard_normal(HIDDEN).astype(np.float32)
    artifact = ProbeArtifact(name=name, layer=layer, read=read, weight=weight, bias=0.5, model={"name": "toy"})
    return save_probe(artifact, root / name)


def run_step(taps: dict[int, LayerTap], streams: dict[int, torch.Tensor]) -> None:
    """What the compiled model does: the op fills each tap's score buffer for the step's rows."""
    for layer, tap in taps.items():
        x = streams[layer]
        tap(x, torch.zeros_like(x))


class Published(list):
    """What a controller published: its step messages, in order, and (`control`) its control
    messages to every API server process (pauses, swaps)."""

    def __init__(self) -> None:
        super().__init__()
        self.control: list[dict] = []

    def append(self, message: dict) -> None:
        (self.control if CONTROL in message else super()).append(message)


@pytest.fixture
def setup(tmp_path):
    taps = {1: LayerTap(1, HIDDEN, capacity=2, max_rows=32), 3: LayerTap(3, HIDDEN, capacity=2, max_rows=32)}
    probes = [
        make_probe(tmp_path, "first", 1, ReadPoint.LAST_PROMPT_TOKEN, 0),
        make_probe(tmp_path, "second", 3, ReadPoint.PROMPT_MEAN, 1),
    ]
    published = Published()
    return taps, probes, published


@pytest.mark.parametrize("threaded,deferred", [(False, False), (True, False), (True, True)])
def test_steps_are_scored_published_in_order_and_match_w_dot_x(setup, threaded, deferred):
    """`deferred`: the adapter hands over a function building the layout (runner V2 does when
    nothing is staged before the forward); the transfer thread calls it, with the same result."""
    taps, probes, published = setup
    built_on = []

    def builder(layout):
        def build():
            built_on.append(threading.current_thread().name)
            return layout
        return build

    controller = TapController(taps, served(), published.append, threaded=threaded)
    controller.load([str(p) for p in probes])
    weights = {l: t.weight[:1].clone() for l, t in taps.items()}
    rng = torch.Generator().manual_seed(3)
    expected_last = {}
    # prefill of a (prompt 5) and b (prompt 3), then 3 decode steps each
    steps = [
        StepLayout(["a", "b"], np.array([5, 3]), np.array([0, 0]), np.array([5, 3])),
        StepLayout(["a", "b"], np.array([1, 1]), np.array([5, 3]), np.array([5, 3])),
        StepLayout(["b", "a"], np.array([1, 1]), np.array([4, 6]), np.array([3, 5])),
    ]
    streams_by_step = []
    for layout in steps:
        rows = layout.num_rows
        streams = {l: torch.randn(rows, HIDDEN, generator=rng) for l in taps}
        streams_by_step.append(streams)
        run_step(taps, streams)
        if deferred:
            controller.after_forward(builder(layout), num_rows=rows)
        else:
            controller.after_forward(layout)
    # Overwriting the device buffers after submission must not change what was delivered.
    for tap in taps.values():
        tap.scores.fill_(1e9)
    assert controller.flush()
    # The worker sends each step's layout and raw block; the API server's reader books them.
    reader = StepReader()
    events = [reader.read(m) for m in published]
    assert [e.token_indexes[0] for e in events] == [0, 1, 2]
    first = events[0]
    assert [p["req"] for p in first.prompt] == ["a", "b"]
    # request a's last prompt token is row 4 of step 0; probe "first" reads layer 1
    w1, b1 = taps[1].weight[0], taps[1].bias[0]
    want = float(streams_by_step[0][1][4] @ w1 + b1)
    assert first.prompt[0]["last_raw"][0] == pytest.approx(want, rel=1e-5)
    # "second" (layer 3) mean over b's three prompt rows (rows 5..7)
    w3, b3 = taps[3].weight[0], taps[3].bias[0]
    want_mean = float((streams_by_step[0][3][5:8] @ w3 + b3).mean())
    assert first.prompt[1]["mean_raw"][1] == pytest.approx(want_mean, rel=1e-5)
    # step 2: rows are in the order b, a; a's generated token 2 is row 1
    a_row = events[2].token_req_ids.index("a")
    assert events[2].token_indexes[a_row] == 2
    assert events[2].token_raw[a_row, 0] == pytest.approx(float(streams_by_step[2][1][1] @ w1 + b1), rel=1e-5)
    assert built_on == (["probex-score-transfer"] * 3 if deferred else [])
    controller.transfer.close()


def test_the_slow_hook_diagnostic_spins_the_engine_thread_after_each_step(setup, monkeypatch):
    """PROBEX_HOOK_SPIN_US (bench set-up tap-slow-hook) lengthens every hook by at least that much."""
    taps, probes, _ = setup
    monkeypatch.setenv("PROBEX_HOOK_SPIN_US", "20000")
    controller = TapController(taps, served(), lambda message: None, threaded=False)
    controller.load([str(p) for p in probes])
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})
    started = time.perf_counter()
    controller.after_forward(StepLayout(["a"], np.array([2]), np.array([0]), np.array([2])))
    assert time.perf_counter() - started >= 0.02
    controller.transfer.close()


def test_scores_are_consumed_off_the_engine_thread(setup):
    taps, probes, published = setup
    threads = []
    controller = TapController(taps, served(), lambda m: CONTROL in m or threads.append(threading.current_thread().name))
    assert not controller.consumes_on_engine_thread  # the default
    controller.load([str(p) for p in probes])
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})
    controller.after_forward(StepLayout(["a"], np.array([2]), np.array([0]), np.array([2])))
    assert controller.flush()
    assert threads == ["probex-score-transfer"]
    controller.transfer.close()


def test_the_adapter_picks_the_consumer_and_the_environment_overrides_it(setup, monkeypatch):
    taps, _, _ = setup
    monkeypatch.delenv("PROBEX_SCORE_CONSUMER", raising=False)
    picked = TapController(taps, served(), None, threaded=False, consumer="engine")
    assert picked.transfer.consumer == "engine"
    monkeypatch.setenv("PROBEX_SCORE_CONSUMER", "thread")
    overridden = TapController(taps, served(), None, threaded=False, consumer="engine")
    assert overridden.transfer.consumer == "thread" and not overridden.consumes_on_engine_thread
    for controller in (picked, overridden):
        controller.transfer.close()


def test_with_the_engine_as_consumer_steps_are_published_in_order_on_the_engine_thread(setup, monkeypatch):
    """PROBEX_SCORE_CONSUMER=engine on the CPU: copies are synchronous there, so each step is
    consumed inside its own hook, on the engine thread, with the same messages."""
    monkeypatch.setenv("PROBEX_SCORE_CONSUMER", "engine")
    taps, probes, published = setup
    threads = []
    controller = TapController(taps, served(), lambda m: CONTROL in m or (threads.append(threading.current_thread().name),
                                                                           published.append(m)))
    controller.load([str(p) for p in probes])
    assert controller.transfer.consumer == "engine" and controller.consumes_on_engine_thread
    controller.consume_landed_scores()  # nothing pending: nothing happens
    assert published == []
    for computed in (0, 2, 3):
        run_step(taps, {l: torch.randn(2 if computed == 0 else 1, HIDDEN) for l in taps})
        rows = 2 if computed == 0 else 1
        controller.after_forward(StepLayout(["a"], np.array([rows]), np.array([computed]), np.array([2])))
        assert len(published) == (1 if computed == 0 else computed)  # consumed before after_forward returned
    assert threads == [threading.current_thread().name] * 3
    events = [StepReader().read(m) for m in published[:1]]
    assert events[0].prompt[0]["req"] == "a"
    assert controller.flush() and controller.transfer.describe()["consumer"] == "engine"
    controller.transfer.close()


def test_idle_step_releases_finished_requests(setup):
    taps, probes, published = setup
    controller = TapController(taps, served(), published.append, threaded=False)
    controller.load([str(p) for p in probes])
    run_step(taps, {l: torch.randn(3, HIDDEN) for l in taps})
    # a 6-token prompt, half prefilled: an open accumulator
    controller.after_forward(StepLayout(["a"], np.array([3]), np.array([0]), np.array([6])))
    reader = StepReader()
    assert not reader.read(published[-1]) and len(reader.book) == 1
    controller.after_idle_step(["a"])
    assert reader.read(published[-1]).finished == ["a"]
    assert len(reader.book) == 0


def test_a_rank_that_neither_delivers_nor_captures_copies_no_scores(setup):
    """Tensor-parallel ranks other than the delivering one score the same rows; they skip
    the device-to-host copy and the transfer thread entirely (steering still runs there)."""
    taps, probes, _ = setup
    controller = TapController(taps, served(), publish=None, threaded=False)
    controller.load([str(p) for p in probes])
    assert not controller.reads_scores
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})
    controller.after_forward(StepLayout(["a"], np.array([2]), np.array([0]), np.array([2])))
    controller.after_idle_step(["a"])
    assert controller.steps == 1 and controller.transfer.describe()["steps"] == 0


def test_a_paused_tap_scores_copies_and_sends_nothing_until_it_runs_again(setup):
    """`set_paused`: the op leaves the score buffers alone, no step is handed over or sent;
    running again, the next step is scored and sent as before. A worker that steers refuses."""
    taps, probes, published = setup
    controller = TapController(taps, served(), published.append, threaded=False)
    controller.load([str(p) for p in probes])
    # every API server process hears of swaps (with what their retention check needs) and pauses
    assert published.control == [{"control": "swapped", "what": "probes", "version": 1,
                                   "dirs": [str(p) for p in probes]}]
    controller.set_paused(True)
    assert published.control[-1] == {"control": "paused", "paused": True, "sequence": 1}
    assert controller.listing()["paused"] and not controller.reads_scores
    assert all(int(t.paused[0]) == 1 for t in taps.values())
    before = {l: t.scores.clone() for l, t in taps.items()}
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})
    controller.after_forward(StepLayout(["a"], np.array([2]), np.array([0]), np.array([2])))
    assert all(torch.equal(t.scores, before[l]) for l, t in taps.items())
    assert published == [] and controller.transfer.describe()["steps"] == 0
    # requests that end while paused are still announced (their books released on both sides)
    controller.after_forward(StepLayout.empty(), ["a"])
    (ended,) = published
    assert ended["step"]["req"] == [] and ended["finished"] == ["a"]
    controller.set_paused(False)
    assert published.control[-1] == {"control": "paused", "paused": False, "sequence": 2}
    streams = {l: torch.randn(2, HIDDEN) for l in taps}
    run_step(taps, streams)
    controller.after_forward(StepLayout(["b"], np.array([2]), np.array([0]), np.array([2])))
    message = published[-1]
    assert message["step"]["req"] == ["b"]
    raw = np.frombuffer(message["raw"], np.float32).reshape(2, -1)
    np.testing.assert_allclose(raw[:, 0], (streams[1] @ taps[1].weight[0]).numpy() + float(taps[1].bias[0]),
                               rtol=1e-5, atol=1e-5)

    from engine_worker.tap.steer import LayerSteer

    steering = TapController(taps, served(), published.append, threaded=False,
                             steers={1: LayerSteer(1, HIDDEN, capacity=2, max_rows=32, gate_taps=[taps[1]])})
    with pytest.raises(ValueError, match="steering gates read its scores"):
        steering.set_paused(True)
    assert not steering.paused and all(int(t.paused[0]) == 0 for t in taps.values())
    assert published.control[-1]["sequence"] == 2  # a refused pause announces nothing


def test_a_capture_is_never_written_in_part_around_a_pause(tmp_path):
    """Pausing is refused while a capture is being written; a capture request that runs while
    paused (sent before the pause) is left out for good, not captured from the resume on."""
    taps = {1: LayerTap(1, HIDDEN, capacity=2, max_rows=32, capture_rows=8)}
    controller = TapController(taps, served(), lambda message: None, capture_dir=str(tmp_path), threaded=False)
    controller._capture_requests["writing"] = {}
    with pytest.raises(ValueError, match="a capture is being written"):
        controller.set_paused(True)
    controller._capture_requests.clear()
    controller.set_paused(True)
    layout = StepLayout(["c"], np.array([2]), np.array([0]), np.array([4]))
    controller.before_forward(layout, {"c"})
    assert controller._capture_plan == []
    controller.set_paused(False)
    controller.before_forward(StepLayout(["c"], np.array([2]), np.array([2]), np.array([4])), {"c"})
    assert controller._capture_plan == []  # its first half ran paused: none of it is written
    controller.after_idle_step(["c"])
    controller.before_forward(StepLayout(["d"], np.array([2]), np.array([0]), np.array([2])), {"d"})
    assert controller._capture_plan == [("d", 0, 2)]  # a capture after the pause is written as ever


def test_a_failing_consumer_does_not_stop_later_steps():
    source = torch.zeros(4, 1)
    seen = []

    def consume(step):
        if step.context == "bad":
            raise RuntimeError("boom")
        seen.append((step.context, step.scores()[0][:, 0].tolist()))

    transfer = ScoreTransfer({0: source}, consume, depth=1)
    source[:2, 0] = torch.tensor([1.0, 2.0])
    transfer.submit(2, "bad")
    transfer.submit(2, "good")
    assert transfer.flush()
    assert seen == [("good", [1.0, 2.0])] and transfer.consume_errors == 1
    transfer.close()


def test_engine_waits_for_a_staging_buffer_instead_of_dropping_steps():
    source = torch.zeros(4, 1)
    release = threading.Event()
    seen = []

    def consume(step):
        release.wait(5)
        seen.append(step.context)

    transfer = ScoreTransfer({0: source}, consume, depth=2)
    for i in range(2):
        transfer.submit(1, i)
    done = threading.Event()
    threading.Thread(target=lambda: (transfer.submit(1, 2), done.set())).start()
    # two buffers: the first is held by consume, the second queued; the third submit waits
    assert not done.wait(0.3)
    release.set()
    assert done.wait(5)
    assert transfer.flush()
    assert seen == [0, 1, 2] and transfer.waits_for_staging == 1
    stats = transfer.describe()
    assert stats["steps"] == 3 and stats["waits_for_staging"] == 1
    assert stats["consume_max_s"] >= 0.25  # the first consume was held ~0.3 s
    transfer.close()


def test_prefill_sized_steps_have_their_consume_timed_apart():
    """Steps of more than LARGE_STEP_ROWS rows (prefill chunks, on their way to a first token)
    are counted apart, so a benchmark can read their consume separately from decode steps'."""
    from engine_worker.tap.cuda_driver import LARGE_STEP_ROWS

    rows_seen = []
    transfer = ScoreTransfer({0: torch.zeros(LARGE_STEP_ROWS + 8, 2)}, lambda step: rows_seen.append(step.rows),
                             threaded=False)
    for rows in (4, LARGE_STEP_ROWS + 1, LARGE_STEP_ROWS, LARGE_STEP_ROWS + 8):
        transfer.submit(rows, None)
    stats = transfer.describe()
    assert rows_seen == [4, LARGE_STEP_ROWS + 1, LARGE_STEP_ROWS, LARGE_STEP_ROWS + 8]
    assert stats["steps"] == 4 and stats["large_steps"] == 2
    assert 0 < stats["large_consume_s"] <= stats["consume_s"] and stats["large_consume_max_s"] <= stats["consume_max_s"]
    transfer.close()


def test_the_consume_is_split_into_its_parts_for_published_steps(tmp_path, monkeypatch):
    """Each published step's consume is timed in four parts (layout, gather, message,
    publish), prefill-sized steps apart; a step with nothing to publish is not counted."""
    from engine_worker.tap.cuda_driver import LARGE_STEP_ROWS

    rows = LARGE_STEP_ROWS + 8
    taps = {1: LayerTap(1, HIDDEN, capacity=2, max_rows=rows)}
    published = Published()

    def slow_publish(message: dict) -> None:
        time.sleep(0.02)  # the socket's send, made long enough to be told from the rest on a loaded machine
        published.append(message)

    controller = TapController(taps, served(), slow_publish, threaded=False)
    controller.load([str(make_probe(tmp_path, "first", 1, ReadPoint.LAST_PROMPT_TOKEN, 0))])
    controller.after_forward(StepLayout(["a"], np.array([rows]), np.array([0]), np.array([rows])))  # a prefill
    controller.after_forward(functools.partial(StepLayout, ["a"], np.array([1]), np.array([rows]), np.array([rows])),
                             num_rows=1)  # a decode step whose layout the consumer builds
    controller.after_forward(StepLayout.empty())  # nothing to publish
    parts = controller.listing()["transfer"]["consume_parts"]
    assert len(published) == 2 and parts["count"] == 2 and parts["large_count"] == 1
    assert parts["publish_s"] >= 0.04 and parts["large_publish_s"] >= 0.02
    assert parts["publish_s"] > parts["layout_s"] + parts["gather_s"] + parts["message_s"]
    assert all(parts[f"large_{part}_s"] <= parts[f"{part}_s"] for part in ("layout", "gather", "message", "publish"))
    # the prefill's thread CPU time: its send's 20 ms asleep count in its wall time, not there
    assert 0 < parts["large_cpu_s"] < parts["large_publish_s"] - 0.015
    controller.transfer.close()


class RecordingDriver:
    """Stands in for the CUDA driver on the CPU: the copies are real memmoves between host
    addresses, so the consumer sees what a device copy would have delivered."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.events = 0

    def event(self, blocking=True):
        self.events += 1
        return f"event-{self.events}" + ("" if blocking else "-device-only")

    def stream(self) -> int:
        self.calls.append(("new stream",))
        return 9

    def wait_event(self, stream, event) -> None:
        self.calls.append(("stream waits", stream, event))

    def current_stream(self) -> int:
        return 7

    def bind_thread(self) -> None:
        self.calls.append(("bind", threading.current_thread().name))

    def copy_rows(self, copy, rows, stream) -> None:
        import ctypes

        ctypes.memmove(copy.target_ptr, copy.source_ptr, rows * copy.row_bytes)
        self.calls.append(("copy", copy.source_ptr, rows * copy.row_bytes, stream))

    def record(self, event, stream) -> None:
        self.calls.append(("record", event, stream))

    def synchronize(self, event) -> None:
        self.calls.append(("wait", event))


class LandingDriver(RecordingDriver):
    """A recording driver whose events land when the test says so (`land`); a wait lands them."""

    def __init__(self) -> None:
        super().__init__()
        self.landed: set = set()
        self.recorded: dict = {}  # event -> how many times recorded (slots reuse their events)

    def record(self, event, stream) -> None:
        super().record(event, stream)
        self.recorded[event] = self.recorded.get(event, 0) + 1
        self.landed.discard(event)

    def land(self, *events) -> None:
        self.landed.update(events)

    def query(self, event) -> bool:
        self.calls.append(("query", event))
        return event in self.landed

    def synchronize(self, event) -> None:
        super().synchronize(event)
        self.landed.add(event)


def engine_consumer(depth: int, driver: LandingDriver | None = None):
    """A ScoreTransfer with the engine as consumer, inline (no watchdog), over one 8-row
    buffer: the transfer, its driver and the contexts of the steps consumed, in order."""
    driver = driver or LandingDriver()
    seen: list = []
    transfer = ScoreTransfer({0: torch.zeros(8, 1)}, lambda step: seen.append(step.context), depth=depth,
                             threaded=False, driver=driver, consumer="engine")
    return transfer, driver, seen


def test_the_engine_consumes_landed_steps_at_its_next_hooks_in_order_without_waiting():
    source = torch.zeros(8, 1)
    driver = LandingDriver()
    seen = []
    transfer = ScoreTransfer({0: source}, lambda step: seen.append((step.context, threading.current_thread().name)),
                             depth=4, threaded=False, driver=driver, consumer="engine")
    transfer.submit(1, "s0")  # its copy is in flight: nothing to consume yet
    assert seen == [] and ("wait", "event-1") not in driver.calls
    transfer.submit(1, "s1")
    assert seen == []
    driver.land("event-1")  # s0's copy lands; s1's has not
    transfer.submit(1, "s2")
    assert [c for c, _ in seen] == ["s0"] and seen[0][1] == threading.current_thread().name
    assert not [c for c in driver.calls if c[0] == "wait"]  # landed steps are never waited for
    driver.land("event-3")  # s2 landed before s1: order is kept, s2 waits behind s1
    transfer.submit(1, "s3")
    assert [c for c, _ in seen] == ["s0"]
    # A step without rows (requests ending; the engine may go idle) waits for all that is left.
    transfer.submit(0, "end")
    assert [c for c, _ in seen] == ["s0", "s1", "s2", "s3", "end"]
    assert transfer.flush() and transfer.describe()["steps"] == 5


@pytest.mark.parametrize("copy_stream", ["same", "side"])
def test_a_step_without_rows_records_nothing_on_the_device_and_waits_only_for_earlier_steps(copy_stream):
    """Requests ending with no rows to copy (an idle step, or any step while the tap is
    paused): an event recorded behind the forward just enqueued would hold the engine thread
    until that forward finished. Alone, the step is consumed at once, without a device call."""
    transfer, driver, seen = engine_consumer(depth=4)
    if copy_stream == "side":
        transfer = ScoreTransfer({0: torch.zeros(8, 1)}, lambda step: seen.append(step.context), depth=4,
                                 threaded=False, driver=driver, consumer="engine", copy_stream="side")
    driver.calls.clear()
    transfer.submit(0, "ended while paused")
    assert seen == ["ended while paused"] and driver.calls == []
    transfer.submit(1, "a")
    transfer.submit(0, "a's request ended")  # ordered behind a: waits for a's copy, records nothing itself
    assert seen == ["ended while paused", "a", "a's request ended"]
    assert [c[0] for c in driver.calls].count("record") == (2 if copy_stream == "side" else 1)
    assert transfer.describe()["steps"] == 3


def test_consume_landed_takes_what_has_landed_and_never_waits():
    transfer, driver, seen = engine_consumer(depth=4)
    transfer.submit(1, "a")
    transfer.submit(1, "b")
    driver.land("event-1")
    transfer.consume_landed()  # where the engine has read step a's tokens
    assert seen == ["a"] and not [c for c in driver.calls if c[0] == "wait"]
    default = ScoreTransfer({0: torch.zeros(8, 1)}, lambda step: None, depth=2, threaded=False, driver=driver)
    default.consume_landed()  # the transfer thread is the consumer: nothing to do here
    assert default.describe()["steps"] == 0


def test_consume_through_waits_for_the_steps_up_to_the_mark_and_no_later_one():
    """Where the engine is about to wait for step b's tokens: a and b are consumed (b waited
    for, with the GIL released; a had landed), c, handed over after b, is left pending."""
    transfer, driver, seen = engine_consumer(depth=4)
    transfer.submit(1, "a")
    transfer.submit(1, "b")
    mark = transfer.submitted_steps
    transfer.submit(1, "c")
    driver.land("event-1")
    transfer.consume_through(mark)
    assert seen == ["a", "b"] and driver.calls.count(("wait", "event-2")) == 1
    assert ("wait", "event-1") not in driver.calls and ("wait", "event-3") not in driver.calls
    transfer.consume_through(mark)  # nothing left up to the mark: no wait, nothing consumed
    assert seen == ["a", "b"] and [c for c in driver.calls if c[0] == "wait"] == [("wait", "event-2")]
    assert transfer.flush() and seen == ["a", "b", "c"]


def test_consume_through_leaves_side_stream_copies_to_land_after_the_tokens():
    """Side-stream copies may land after the tokens: waiting for them could hold the tokens up."""
    driver = LandingDriver()
    seen = []
    transfer = ScoreTransfer({0: torch.zeros(8, 1)}, lambda step: seen.append(step.context), depth=2,
                             threaded=False, driver=driver, consumer="engine", copy_stream="side")
    transfer.submit(1, "a")
    transfer.consume_through(transfer.submitted_steps)
    assert seen == [] and not [c for c in driver.calls if c[0] == "wait"]
    driver.land(*driver.recorded)
    transfer.consume_landed()  # after the tokens
    assert seen == ["a"]


@pytest.mark.parametrize("value, ahead", [(None, True), ("", True), ("1", True), ("0", False), (" off ", False),
                                          ("no", False)])
def test_the_scores_ahead_diagnostic_is_read_from_the_environment_and_listed(setup, monkeypatch, value, ahead):
    taps, probes, _ = setup
    if value is None:
        monkeypatch.delenv("PROBEX_SCORES_AHEAD_OF_TOKENS", raising=False)
    else:
        monkeypatch.setenv("PROBEX_SCORES_AHEAD_OF_TOKENS", value)
    controller = TapController(taps, served(), lambda message: None, threaded=False)
    assert controller.scores_ahead_of_tokens is ahead
    assert controller.listing()["transfer"]["scores_ahead_of_tokens"] is ahead  # what the bench checks
    controller.transfer.close()


class SlowLandingDriver(LandingDriver):
    """Each wait for an event takes 20 ms, as a copy still in flight behind a forward would."""

    def synchronize(self, event) -> None:
        time.sleep(0.02)
        super().synchronize(event)


def test_the_engine_threads_wait_for_copies_is_counted_apart_from_its_hook_time(setup, monkeypatch):
    """consume_scores_through's wait (GIL released, instead of vLLM's own wait for the tokens)
    shows in the transfer's device_wait_s, not in the controller's engine-thread time."""
    taps, probes, published = setup
    monkeypatch.setattr(controller_module, "ScoreTransfer", functools.partial(ScoreTransfer, driver=SlowLandingDriver()))
    controller = TapController(taps, served(), published.append, threaded=False, consumer="engine")
    controller.load([str(p) for p in probes])
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})
    controller.after_forward(StepLayout(["a"], np.array([2]), np.array([0]), np.array([2])))
    assert published == []  # in flight
    before = controller.engine_thread_s
    controller.consume_scores_through(controller.scores_step_mark())
    assert len(published) == 1
    wait = controller.transfer.describe()["device_wait_s"]
    assert wait >= 0.02 and controller.engine_thread_s - before < wait


def test_the_engine_consumer_frees_a_buffer_itself_when_all_are_pending():
    transfer, driver, seen = engine_consumer(depth=2)
    transfer.submit(1, "a")
    transfer.submit(1, "b")
    # Both buffers pending: the oldest is waited for and consumed, not dropped (in a thread
    # with a deadline, so a regression that waits for a buffer nobody frees fails, not hangs).
    third = threading.Thread(target=transfer.submit, args=(1, "c"), daemon=True)
    third.start()
    third.join(5)
    assert not third.is_alive()
    assert seen == ["a"] and ("wait", "event-1") in driver.calls and transfer.waits_for_staging == 1
    transfer.close()  # consumes what is still pending
    assert seen == ["a", "b", "c"]


def test_the_engine_consumer_flushes_pending_steps_on_request():
    transfer, driver, seen = engine_consumer(depth=4)
    transfer.submit(1, "a")
    transfer.submit(1, "b")
    assert seen == [] and transfer.flush() and seen == ["a", "b"]


def test_a_failing_event_query_is_waited_through_instead_of_raising_in_the_engine_step():
    driver = LandingDriver()

    def broken_query(event):
        raise RuntimeError("cuEventQuery failed with CUDA driver error 700")

    driver.query = broken_query
    transfer, driver, seen = engine_consumer(depth=4, driver=driver)
    transfer.submit(1, "a")  # not consumed (its event counts as not landed), and no exception
    transfer.submit(0, "end")
    assert seen == ["a", "end"] and transfer.query_errors >= 1


def test_the_watchdog_consumes_steps_the_engine_left_pending():
    driver = LandingDriver()
    consumed = threading.Event()
    seen = []

    def consume(step):
        seen.append((step.context, threading.current_thread().name))
        consumed.set()

    transfer = ScoreTransfer({0: torch.zeros(8, 1)}, consume, depth=2, driver=driver, consumer="engine",
                             stale_after_s=0.02)
    transfer.submit(1, "last")  # the engine never comes by again
    assert consumed.wait(5)
    transfer.close()  # joins the watchdog, so its count is final
    assert seen == [("last", "probex-score-watchdog")] and transfer.stale_steps == 1
    assert ("bind", "probex-score-watchdog") in driver.calls  # it waits in the engine's context
    with pytest.raises(ValueError, match="consumer"):
        ScoreTransfer({0: torch.zeros(8, 1)}, consume, consumer="gpu")


def test_the_watchdog_leaves_steps_to_an_engine_that_keeps_coming_by():
    """Old pending steps are the engine's while it calls the hook: the watchdog takes over only
    once the engine has been away for `stale_after_s`, not when a step is merely old."""
    driver = LandingDriver()
    busy = threading.Event()
    busy.set()
    # While the engine keeps feeding it, no copy has landed yet when it looks; once it stops,
    # the device finishes everything.
    driver.query = lambda event: not busy.is_set()
    seen = []
    transfer = ScoreTransfer({0: torch.zeros(64, 1)}, lambda step: seen.append(threading.current_thread().name),
                             depth=64, driver=driver, consumer="engine", stale_after_s=0.2)
    for i in range(50):  # 0.5 s of steps every 10 ms: the oldest is long past 0.2 s
        transfer.submit(1, i)
        time.sleep(0.01)
    assert seen == [] and transfer.stale_steps == 0
    busy.clear()
    deadline = time.monotonic() + 5
    while len(seen) < 50 and time.monotonic() < deadline:  # the engine is gone: the watchdog takes them
        time.sleep(0.01)
    transfer.close()
    assert seen == ["probex-score-watchdog"] * 50 and transfer.stale_steps == 50


def test_on_a_device_each_step_is_one_driver_copy_per_layer_then_one_event_the_consumer_waits_for():
    sources = {1: torch.zeros(8, 3), 4: torch.zeros(8, 3)}
    driver = RecordingDriver()
    seen = []
    transfer = ScoreTransfer(sources, lambda step: seen.append({l: a.tolist() for l, a in step.scores().items()}),
                             depth=2, threaded=False, driver=driver)
    assert driver.events == 2  # one event per staging slot, made once
    sources[1][:2] = torch.tensor([[1.0, 2, 3], [4, 5, 6]])
    sources[4][:2] = -sources[1][:2]
    transfer.submit(2, None)
    row_bytes = 3 * 4
    assert driver.calls == [("copy", sources[1].data_ptr(), 2 * row_bytes, 7),
                            ("copy", sources[4].data_ptr(), 2 * row_bytes, 7),
                            ("record", "event-1", 7), ("wait", "event-1")]
    assert seen == [{1: [[1.0, 2, 3], [4, 5, 6]], 4: [[-1.0, -2, -3], [-4, -5, -6]]}]
    driver.calls.clear()
    transfer.submit(0, None)  # a step without rows (requests ending) copies nothing and waits for nothing
    assert driver.calls == [] and len(seen) == 2  # its consumer takes steps in order all the same
    assert transfer.stage_s > 0
    transfer.submit(1, None)
    assert driver.events == 2  # the slots' events are reused, never made per step
    with pytest.raises(ValueError, match="does not fit"):
        transfer.submit(9, None)  # more rows than the buffers hold: refused, nothing copied past them


def test_a_reserved_step_copies_each_layer_mid_forward_and_records_its_event_after_the_last():
    """A prompt step's rows are copied as each tapped layer finishes (`copy_layer_now`, from
    the forward), the event right after the last layer's copy; its submit enqueues nothing."""
    sources = {1: torch.zeros(8, 3), 4: torch.zeros(8, 3)}
    driver = LandingDriver()
    seen = []
    transfer = ScoreTransfer(sources, lambda step: seen.append({l: a.tolist() for l, a in step.scores().items()}),
                             depth=2, threaded=False, driver=driver, consumer="engine")
    assert transfer.reserve_step(2)
    assert not transfer.copy_layer_now(7)  # no tap at that layer: nothing
    sources[1][:2] = torch.tensor([[1.0, 2, 3], [4, 5, 6]])
    assert transfer.copy_layer_now(1)
    assert not transfer.copy_layer_now(1)  # once per layer
    sources[1][:2] = 0  # the forward goes on; what was copied is what the layer had written
    sources[4][:2] = torch.tensor([[7.0, 8, 9], [1, 1, 1]])
    assert transfer.copy_layer_now(4)
    row_bytes = 3 * 4
    assert driver.calls == [("copy", sources[1].data_ptr(), 2 * row_bytes, 7),
                            ("copy", sources[4].data_ptr(), 2 * row_bytes, 7), ("record", "event-1", 7)]
    driver.calls.clear()
    transfer.submit(2, "prompt step")
    assert [c for c in driver.calls if c[0] in ("copy", "record")] == []
    transfer.consume_through(transfer.submitted_steps)
    assert seen == [{1: [[1.0, 2, 3], [4, 5, 6]], 4: [[7.0, 8, 9], [1, 1, 1]]}]
    described = transfer.describe()
    assert described["mid_forward_steps"] == 1 and described["mid_forward_layer_copies"] == 2
    assert not transfer.copy_layer_now(1)  # no step reserved any more: the next forward's layers copy nothing


def test_a_reserved_step_whose_forward_reached_only_some_layers_copies_the_rest_at_submit():
    """A tapped last layer (no next layer's attention) or a forward replaying a whole graph
    never reaches the hook: what is left is copied behind the forward, then the event."""
    sources = {1: torch.zeros(8, 3), 4: torch.zeros(8, 3)}
    driver = RecordingDriver()
    seen = []
    transfer = ScoreTransfer(sources, lambda step: seen.append({l: a.tolist() for l, a in step.scores().items()}),
                             depth=2, threaded=False, driver=driver)
    assert transfer.reserve_step(1)
    sources[1][:1] = 2.0
    transfer.copy_layer_now(1)
    sources[4][:1] = 3.0
    driver.calls.clear()
    transfer.submit(1, None)
    assert driver.calls == [("copy", sources[4].data_ptr(), 12, 7), ("record", "event-1", 7), ("wait", "event-1")]
    assert seen == [{1: [[2.0, 2, 2]], 4: [[3.0, 3, 3]]}]
    assert transfer.describe()["mid_forward_steps"] == 0


def test_a_reservation_is_kept_past_a_step_without_rows_and_dropped_for_a_step_of_other_rows():
    sources = {1: torch.zeros(8, 1)}
    transfer = ScoreTransfer(sources, lambda step: None, depth=2, threaded=False, driver=RecordingDriver())
    assert not transfer.reserve_step(0) and not transfer.reserve_step(9)  # nothing to copy / past the buffers
    assert transfer.reserve_step(3)
    transfer.submit(0, None)  # requests ending: not the step reserved for
    assert transfer.mismatched_reservations == 0 and transfer._early is not None
    transfer.submit(2, None)  # other rows: the reservation is dropped, the step copied behind its forward
    assert transfer.mismatched_reservations == 1 and transfer._early is None
    transfer.reserve_step(3)
    transfer.release_reservation()  # the forward failed: the buffer goes back
    assert transfer._free.qsize() == 2
    side = ScoreTransfer(sources, lambda step: None, threaded=False, driver=RecordingDriver(), copy_stream="side")
    assert not side.reserve_step(3)  # side-stream copies keep their own ordering: whole steps only


def test_on_the_cpu_a_reserved_layer_is_copied_when_its_forward_says_so():
    source = torch.zeros(8, 2)
    seen = []
    transfer = ScoreTransfer({3: source}, lambda step: seen.append(step.scores()[3].tolist()), threaded=False)
    assert transfer.reserve_step(2)
    source[:2] = 5.0
    transfer.copy_layer_now(3)
    source[:2] = 0.0  # overwritten later in the forward (or by the next one): the copy was taken
    transfer.submit(2, None)
    assert seen == [[[5.0, 5.0], [5.0, 5.0]]] and transfer.mid_forward_steps == 1


def test_a_prompt_step_copied_mid_forward_publishes_what_the_step_copied_behind_its_forward_does(setup):
    taps, probes, _ = setup
    streams = {l: torch.randn(5, HIDDEN) for l in taps}
    layout = StepLayout(["a"], np.array([5]), np.array([0]), np.array([5]))
    messages = {}
    for mid_forward in (False, True):
        published = Published()
        controller = TapController(taps, served(), published.append, threaded=False)
        controller.load([str(p) for p in probes])
        if mid_forward:
            controller.open_mid_forward_copies(5)
        for layer, tap in taps.items():  # the forward, layer by layer, the hook after each tap
            tap(streams[layer], torch.zeros_like(streams[layer]))
            controller.layer_scores_final(layer)
        controller.close_mid_forward_copies()
        for tap in taps.values():
            tap.scores.zero_()  # rows the forward wrote later than the copies are never read from here
        if not mid_forward:  # the copies behind the forward read the buffers as the forward left them
            run_step(taps, streams)
        controller.after_forward(layout)
        assert controller.transfer.mid_forward_steps == int(mid_forward)
        messages[mid_forward] = published
        controller.transfer.close()
    assert len(messages[True]) == 1 and messages[True] == messages[False]


def test_the_controller_copies_mid_forward_only_inside_an_opened_step_of_a_running_tap(setup, monkeypatch):
    taps, probes, published = setup
    controller = TapController(taps, served(), published.append, threaded=False)
    controller.load([str(p) for p in probes])
    calls = []
    monkeypatch.setattr(controller.transfer, "copy_layer_now", lambda layer: calls.append(layer))
    controller.layer_scores_final(1)  # a decode step, a dummy run, a capture: nothing opened
    assert calls == []
    controller.open_mid_forward_copies(5)
    controller.layer_scores_final(1)
    controller.close_mid_forward_copies()
    controller.layer_scores_final(1)  # after the forward was enqueued (a draft model's, say)
    assert calls == [1]
    controller.set_paused(True)
    controller.open_mid_forward_copies(5)  # a paused tap copies nothing
    controller.layer_scores_final(1)
    assert calls == [1]
    controller.set_paused(False)
    monkeypatch.setattr(controller, "prompt_scores_mid_forward", False)  # PROBEX_PROMPT_SCORES_MID_FORWARD=0
    controller.open_mid_forward_copies(5)
    controller.layer_scores_final(1)
    assert calls == [1]


def test_a_failed_forward_gives_its_reserved_buffer_back(setup):
    taps, probes, published = setup
    controller = TapController(taps, served(), published.append, threaded=False)
    controller.load([str(p) for p in probes])
    free = controller.transfer._free.qsize()
    controller.open_mid_forward_copies(5)
    assert controller.transfer._free.qsize() == free - 1
    controller.close_mid_forward_copies(launched=False)
    assert controller.transfer._free.qsize() == free


def test_side_stream_copies_wait_for_the_forward_and_the_next_forward_waits_for_them():
    """PROBEX_COPY_STREAM=side: the copies leave the engine's stream (7) for a side stream
    (9), ordered after the forward by an event, and the next forward's stream waits for the
    copy before it may overwrite the score buffers."""
    sources = {1: torch.zeros(8, 3)}
    driver = RecordingDriver()
    seen = []
    transfer = ScoreTransfer(sources, lambda step: seen.append(step.scores()[1].tolist()), depth=2,
                             threaded=False, driver=driver, copy_stream="side")
    assert driver.calls == [("new stream",)] and driver.events == 4  # per slot: ready + launched
    driver.calls.clear()
    sources[1][:1] = torch.tensor([[1.0, 2, 3]])
    transfer.submit(1, None)
    assert driver.calls == [("record", "event-2-device-only", 7), ("stream waits", 9, "event-2-device-only"),
                            ("copy", sources[1].data_ptr(), 12, 9), ("record", "event-1", 9), ("wait", "event-1")]
    assert seen == [[[1.0, 2, 3]]]
    driver.calls.clear()
    transfer.before_next_forward()
    assert driver.calls == [("stream waits", 7, "event-1")]
    transfer.before_next_forward()  # once per copy
    assert len(driver.calls) == 1 and transfer.unguarded_forwards == 0
    transfer.submit(1, None)
    driver.calls.clear()
    transfer.submit(0, None)  # a step that only ends requests: nothing copied, nothing to order on the device
    assert driver.calls == [] and transfer.unguarded_forwards == 0
    transfer.submit(1, None)  # a forward ran without the guard since the copy before: counted (and logged)
    assert transfer.unguarded_forwards == 1
    assert transfer.describe()["copy_stream"] == "side"


def test_same_stream_copies_need_no_guard_before_the_next_forward():
    driver = RecordingDriver()
    transfer = ScoreTransfer({1: torch.zeros(8, 3)}, lambda step: None, threaded=False, driver=driver)
    transfer.submit(1, None)
    driver.calls.clear()
    transfer.before_next_forward()
    assert driver.calls == [] and transfer.describe()["copy_stream"] == "same"
    with pytest.raises(ValueError, match="copy_stream"):
        ScoreTransfer({1: torch.zeros(8, 3)}, lambda step: None, threaded=False, driver=driver, copy_stream="other")


def test_a_failing_device_call_loses_the_step_but_not_its_staging_buffer():
    class Failing(RecordingDriver):
        fail = True

        def record(self, event, stream):
            if self.fail:
                raise RuntimeError("probex: cuEventRecord failed with CUDA driver error 700")
            super().record(event, stream)

    driver = Failing()
    seen = []
    transfer = ScoreTransfer({0: torch.zeros(4, 1)}, lambda step: seen.append(step.rows), depth=1, threaded=False,
                             driver=driver)
    with pytest.raises(RuntimeError, match="error 700"):
        transfer.submit(1, None)
    driver.fail = False
    transfer.submit(2, None)  # the one buffer is free again: no wait, no hang
    assert seen == [2] and transfer.waits_for_staging == 0


def test_a_transfer_thread_that_cannot_bind_the_context_fails_the_next_step_loudly():
    class Unbindable(RecordingDriver):
        def bind_thread(self):
            raise RuntimeError("probex: cuCtxSetCurrent failed with CUDA driver error 201")

    transfer = ScoreTransfer({0: torch.zeros(4, 1)}, lambda step: None, depth=1, driver=Unbindable())
    transfer._thread.join(timeout=5)
    with pytest.raises(RuntimeError, match="failed to start: .*error 201"):
        transfer.submit(1, None)


def test_a_score_buffer_that_is_not_one_float32_block_is_refused_when_copied_by_the_driver():
    with pytest.raises(ValueError, match="contiguous float32"):
        ScoreTransfer({0: torch.zeros(4, 2).t()}, lambda step: None, threaded=False, driver=RecordingDriver())
    with pytest.raises(ValueError, match="contiguous float32"):
        ScoreTransfer({0: torch.zeros(4, 2, dtype=torch.float64)}, lambda step: None, threaded=False,
                      driver=RecordingDriver())


def test_the_transfer_thread_binds_the_engine_context_before_its_first_wait():
    source = torch.zeros(4, 1)
    driver = RecordingDriver()
    transfer = ScoreTransfer({0: source}, lambda step: None, depth=1, driver=driver)
    transfer.submit(1, None)
    assert transfer.flush()
    transfer.close()
    kinds = [c[0] for c in driver.calls]
    assert sorted(kinds) == ["bind", "copy", "record", "wait"]
    assert ("bind", "probex-score-transfer") in driver.calls and kinds.index("bind") < kinds.index("wait")


class FakeCudaLibrary:
    """Stands in for libcuda.so.1 as ctypes loads it: records each call and its argtypes."""

    def __init__(self, calls: list) -> None:
        self._calls = calls
        self._functions: dict = {}

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._functions:
            calls = self._calls

            def function(*args):
                calls.append((name, args))
                if name in ("cuCtxGetCurrent", "cuEventCreate"):
                    args[0]._obj.value = 0xC0DE if name == "cuCtxGetCurrent" else 0xE1
                return 0

            function.argtypes = None
            self._functions[name] = function
        return self._functions[name]


def test_the_cuda_driver_calls_match_the_driver_api(monkeypatch):
    import contextlib
    import ctypes

    from engine_worker.tap.layer import cuda_driver as score_transfer

    calls: list = []
    library = FakeCudaLibrary(calls)
    monkeypatch.setattr(ctypes, "PyDLL", lambda name: library)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: library)
    stream = type("Stream", (), {"cuda_stream": 99, "synchronize": lambda self: None})()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    asked = []
    # the raw current-stream handle, as torch's own generated code reads it (absent from CPU builds)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: asked.append(index) or 99,
                        raising=False)
    driver = score_transfer._CudaDriver(torch.device("cuda", 0))
    assert library.cuMemcpyDtoHAsync_v2.argtypes == [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    assert library.cuEventRecord.argtypes == [ctypes.c_void_p, ctypes.c_void_p]
    event = driver.event()
    assert event.value == 0xE1 and calls[-1][1][1] == 3  # blocking sync, no timing
    source, target = torch.zeros(8, 4), torch.zeros(8, 4)
    copy = score_transfer._LayerCopy(0, source, target, 0x1000, 0x2000, 16)
    driver.copy_rows(copy, 3, driver.current_stream())
    assert calls[-1] == ("cuMemcpyDtoHAsync_v2", (0x2000, 0x1000, 48, 99)) and asked == [0]
    driver.record(event, 99)
    assert calls[-1] == ("cuEventRecord", (event, 99))
    assert driver.event(blocking=False).value == 0xE1 and calls[-1][1][1] == 2  # no timing; streams wait on it
    side = driver.stream()
    assert calls[-1][0] == "cuStreamCreate" and calls[-1][1][1] == 1  # non-blocking
    assert library.cuStreamWaitEvent.argtypes == [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    driver.wait_event(side, event)
    assert calls[-1] == ("cuStreamWaitEvent", (side, event, 0))
    driver.bind_thread()
    assert calls[-1][0] == "cuCtxSetCurrent" and calls[-1][1][0].value == 0xC0DE
    assert library.cuEventQuery.argtypes == [ctypes.c_void_p]
    assert driver.query(event) is True and calls[-1] == ("cuEventQuery", (event,))
    monkeypatch.setattr(library, "cuEventQuery", lambda event: 600, raising=False)  # CUDA_ERROR_NOT_READY
    assert driver.query(event) is False
    monkeypatch.setattr(library, "cuEventQuery", lambda event: 700, raising=False)
    with pytest.raises(RuntimeError, match="cuEventQuery failed"):
        driver.query(event)
    monkeypatch.setattr(library, "cuEventSynchronize", lambda event: 700, raising=False)  # an error code
    with pytest.raises(RuntimeError, match="cuEventSynchronize failed with CUDA driver error 700"):
        driver.synchronize(event)


def test_without_the_cuda_driver_library_scores_are_copied_through_torch(monkeypatch):
    import ctypes

    from engine_worker.tap.layer import cuda_driver as score_transfer

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "PyDLL", missing)
    assert isinstance(score_transfer._device_calls(torch.device("cuda", 0)), score_transfer._TorchCopies)


@pytest.mark.parametrize("problem", ["raises", "wrong rows"])
def test_a_layout_that_cannot_be_built_loses_its_scores_but_still_ends_its_requests(setup, problem):
    """A layout handed over as a function is built on the transfer thread; if that fails, the
    step's scores have nowhere to go, but the requests ending with it must still be announced
    (the API server would otherwise hold their last chunks until its wait times out)."""
    taps, probes, published = setup
    controller = TapController(taps, served(), published.append, threaded=False)
    controller.load([str(p) for p in probes])
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})

    def build():
        if problem == "raises":
            raise RuntimeError("runner state gone")
        return StepLayout(["a"], np.array([3]), np.array([0]), np.array([3]))  # 3 rows, 2 copied

    controller.after_forward(build, ["a"], num_rows=2)
    assert controller.transfer.consume_errors == 1
    assert list(published) == [] and published.control[-1] == lost_message([], ["a"])  # after the load's swap
    message = published.control[-1]
    with pytest.raises(TypeError, match="num_rows"):
        controller.after_forward(build, [])
    # the API server's side: a book opened earlier for "a" is closed by it, the request ends,
    # and the hub counts the loss (so responses in flight stop waiting)
    hub = ScoreHub("inproc://unused")
    key = "cmpl-probex-a"
    hub.get(key)  # the relay of the request's response asks for it
    hub.ingest(step_message(controller.table, StepLayout([f"{key}-0123abcd"], np.array([1]), np.array([0]),
                                                         np.array([3])), np.zeros((1, 2), np.float32), []))
    assert hub.open_prompt_books == 1
    hub.ingest({**message, "finished": [f"{key}-0123abcd"]})
    assert hub.open_prompt_books == 0 and hub.get(key).finished
    assert hub.steps_lost == 1 and hub.losses == 1
    hub.ingest(lost_message([f"{key}-0123abcd"], []))  # a step whose layout was built names its requests
    assert hub.get(key).lost and hub.get(key).has(prompt=True, tokens=5)  # which wait for nothing more


def test_each_step_carries_the_workers_pause_state(setup):
    taps, probes, published = setup
    controller = TapController(taps, served(), published.append, threaded=False)
    controller.load([str(p) for p in probes])
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})
    controller.after_forward(StepLayout(["a"], np.array([2]), np.array([0]), np.array([2])), [], num_rows=2)
    controller.set_paused(True)
    controller.after_forward(StepLayout.empty(), ["a"], num_rows=0)
    assert [m["pause"] for m in published] == [[0, False], [1, True]]


def test_a_capture_that_fails_costs_no_scores(setup, tmp_path, monkeypatch):
    """Capture books (and files) come before the step goes out, so a captured request's files
    exist when its response ends; one that fails still lets the step's scores out."""
    taps, probes, published = setup
    controller = TapController(taps, served(), published.append, capture_dir=str(tmp_path / "captures"),
                               threaded=False)
    controller.load([str(p) for p in probes])
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(controller.book, "record_step", full_disk)
    controller.after_forward(StepLayout(["a"], np.array([2]), np.array([0]), np.array([2])), [], num_rows=2)
    assert controller.transfer.consume_errors == 1
    assert [m["step"]["req"] for m in published] == [["a"]] and published.control[-1][CONTROL] != "lost"


def test_a_step_that_fails_after_its_layout_is_announced_as_lost(setup, monkeypatch):
    """Any failure on a step's way out (gathering, capture books, encoding) is announced the same way."""
    taps, probes, published = setup
    controller = TapController(taps, served(), published.append, threaded=False)
    controller.load([str(p) for p in probes])
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})

    def failing_gather(*args):
        raise MemoryError("no room for the step's scores")

    monkeypatch.setattr(controller_module, "gather_scores", failing_gather)
    controller.after_forward(StepLayout(["a"], np.array([2]), np.array([0]), np.array([2])), ["b"], num_rows=2)
    assert controller.transfer.consume_errors == 1
    assert list(published) == [] and published.control[-1] == lost_message(["a"], ["b"])


def test_the_wait_for_each_steps_tokens_after_its_scores_is_booked_by_step_size():
    """The engine consumer books vLLM's wait for a step's tokens after consuming its scores;
    a wait under 50 µs means the tokens were ready (the consume held them back), and steps of
    more than 256 rows (prefill chunks, on a first token's way) are booked apart too."""
    from types import SimpleNamespace

    from engine_worker.tap.controller import TapController, TokenReads

    consumer = SimpleNamespace(transfer=SimpleNamespace(last_consumed_rows=1024), token_reads=TokenReads())
    TapController.tokens_read(consumer, 0.00001)  # a prefill whose tokens were ready
    consumer.transfer.last_consumed_rows = 64
    TapController.tokens_read(consumer, 0.002)  # a decode step whose tokens came 2 ms later
    TapController.tokens_read(consumer, 0.00002)
    assert consumer.token_reads.as_dict() == {"count": 3, "wait_s": pytest.approx(0.00203), "ready": 2,
                                              "large_count": 1, "large_wait_s": pytest.approx(0.00001),
                                              "large_ready": 1}
