"""TapController and RingTransfer without an engine: LayerTaps on the CPU, steps described by
hand, and the score ring read back as the score formatter reads it."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from engine_worker.api_server.hub import ScoreHub
from engine_worker.scores.bookkeeping import CONTROL, SEQUENCE, StepReader, lost_message, step_message
from engine_worker.scores.formatter import ScoreFormatter, ring_message
from engine_worker.scores.ring import MESSAGE, STEP, RingPublisher, RingReader, ScoreRing
from engine_worker.step import DeferredStep, StepView
from engine_worker.tap import controller as controller_module
from engine_worker.tap.controller import TapController
from engine_worker.tap.layer import LayerTap
from engine_worker.tap.ring_copies import RingTransfer
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
    """What reached the score formatter, in order: step messages (with the scores the formatter
    gathers from the ring's slot) and (`control`) control messages; their running numbers apart
    (`sequences`)."""

    def __init__(self) -> None:
        super().__init__()
        self.control: list[dict] = []
        self.sequences: list[int] = []

    def append(self, message: dict) -> None:
        self.sequences.append(message.pop(SEQUENCE))
        (self.control if CONTROL in message else super()).append(message)


class Delivery:
    """A score ring for `taps` with the engine's publisher on it, read (`read`) through a
    mapping of its own, as the score formatter's process reads it."""

    def __init__(self, taps: dict[int, LayerTap] | None = None, slots: int = 16, full_wait_s: float = 0.1,
                 layers: dict[int, tuple[int, int]] | None = None) -> None:
        layers = layers or {layer: tuple(tap.scores.shape) for layer, tap in taps.items()}
        self.ring = ScoreRing.create(layers, slots=slots)
        self.publisher = RingPublisher(self.ring, heartbeat_s=0, full_wait_s=full_wait_s)
        self.reader = RingReader(ScoreRing.attach(self.ring.fd))
        self.published = Published()
        self._decoder, self._tables = msgspec.msgpack.Decoder(), {}

    def read(self) -> Published:
        """Every entry ready so far, taken as the formatter takes it (its slot freed)."""
        while (entry := self.reader.poll()) is not None:
            _, meta, scores = entry
            self.published.append(ring_message(bytes(meta), scores, self._decoder, self._tables))
            self.reader.done()
        return self.published

    def entries(self) -> list[tuple[int, dict, dict[int, list]]]:
        """Every entry ready so far as (kind, message, the slot's scores) without the formatter's
        reading of it: for a transfer given messages of its own."""
        out = []
        while (entry := self.reader.poll()) is not None:
            kind, meta, scores = entry
            out.append((kind, msgspec.msgpack.decode(bytes(meta)), {l: a.tolist() for l, a in scores.items()}))
            self.reader.done()
        return out


@pytest.fixture
def setup(tmp_path):
    taps = {1: LayerTap(1, HIDDEN, capacity=2, max_rows=32), 3: LayerTap(3, HIDDEN, capacity=2, max_rows=32)}
    probes = [
        make_probe(tmp_path, "first", 1, ReadPoint.LAST_PROMPT_TOKEN, 0),
        make_probe(tmp_path, "second", 3, ReadPoint.PROMPT_MEAN, 1),
    ]
    return taps, probes, Delivery(taps)


def view(req: str, rows: int, computed: int, prompt: int, finished=()) -> StepView:
    return StepView([req], np.array([rows]), np.array([computed]), np.array([prompt]), tuple(finished))


class HostDriver:
    """Stands in for the CUDA driver on the CPU: its calls are recorded and carried out on host
    memory (the ring's mapping stands for its own device address), so the formatter's side
    reads what a device's copies and ticket write would have left in the ring."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def register_host_memory(self, address: int, size: int) -> int:
        self.calls.append(("register", size))
        return address

    def current_stream(self) -> int:
        return 7

    def copy_rows(self, copy, rows: int, stream: int) -> None:
        ctypes.memmove(copy.target_ptr, copy.source_ptr, rows * copy.row_bytes)
        self.calls.append(("copy", copy.layer, rows, stream))

    def write_value(self, address: int, value: int, stream: int) -> None:
        ctypes.c_uint32.from_address(address).value = value
        self.calls.append(("landed", value, stream))


def message_of(rows, context, scores):
    """A transfer's message builder for tests of the transfer alone: the step's context as its message."""
    return {"context": context, "rows": rows}


@pytest.mark.parametrize("deferred", [False, True])
def test_steps_are_scored_published_in_order_and_match_w_dot_x(setup, deferred):
    """`deferred`: the adapter hands over a `DeferredStep` (its view built once the step's
    copies are enqueued), with the same result; nothing reaches the formatter's side but
    through the ring, and `flush` waits for the formatter to take it all."""
    taps, probes, delivery = setup
    built = []

    def builder(layout):
        def build():
            built.append(layout)
            return layout
        return build

    controller = TapController(taps, served(), delivery.publisher)
    controller.load([str(p) for p in probes])
    rng = torch.Generator().manual_seed(3)
    # prefill of a (prompt 5) and b (prompt 3), then decode steps
    steps = [
        StepView(["a", "b"], np.array([5, 3]), np.array([0, 0]), np.array([5, 3])),
        StepView(["a", "b"], np.array([1, 1]), np.array([5, 3]), np.array([5, 3])),
        StepView(["b", "a"], np.array([1, 1]), np.array([4, 6]), np.array([3, 5])),
    ]
    streams_by_step = []
    for layout in steps:
        rows = layout.num_rows
        streams = {l: torch.randn(rows, HIDDEN, generator=rng) for l in taps}
        streams_by_step.append(streams)
        run_step(taps, streams)
        controller.after_forward(DeferredStep(rows, builder(layout)) if deferred else layout)
    # Overwriting the device buffers after submission must not change what was delivered.
    for tap in taps.values():
        tap.scores.fill_(1e9)
    assert not controller.flush(timeout=0.05)  # nobody has read the ring yet
    published = delivery.read()
    assert controller.flush(timeout=1)
    assert built == (steps if deferred else [])
    assert published.sequences == [1, 2, 3, 4]  # the probe set's swap, then the steps
    listing = controller.listing()
    assert listing["steps"] == 3 and listing["transfer"]["submitted_steps"] == 3
    assert listing["transfer"]["consumer"] == "formatter" and listing["transfer"]["synchronous"]
    # The formatter's reader books each step's view and raw block.
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


def test_idle_step_releases_finished_requests(setup):
    taps, probes, delivery = setup
    controller = TapController(taps, served(), delivery.publisher)
    controller.load([str(p) for p in probes])
    run_step(taps, {l: torch.randn(3, HIDDEN) for l in taps})
    # a 6-token prompt, half prefilled: an open accumulator
    controller.after_forward(view("a", 3, 0, 6))
    reader = StepReader()
    assert not reader.read(delivery.read()[-1]) and len(reader.book) == 1
    controller.after_idle_step(["a"])
    ended = delivery.read()[-1]
    assert ended["step"]["req"] == [] and reader.read(ended).finished == ["a"]
    assert len(reader.book) == 0
    controller.after_idle_step([])  # nothing ended: nothing is sent
    assert len(delivery.read()) == 2 and controller.steps == 1


def test_a_rank_that_does_not_deliver_copies_no_scores_and_sends_nothing(setup, tmp_path):
    """Tensor-parallel ranks other than the delivering one score the same rows; they have no
    ring, copy nothing and never build a step's view (steering still runs there)."""
    taps, probes, _ = setup
    controller = TapController(taps, served())
    controller.load([str(p) for p in probes])
    assert not controller.delivers and not controller.reads_scores
    assert controller.transfer is None and controller.publish is None
    built = []
    controller.open_mid_forward_copies(2)
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})
    controller.layer_scores_final(1)
    controller.close_mid_forward_copies()
    assert not controller._mid_forward_open
    controller.after_forward(view("a", 2, 0, 2))
    controller.after_forward(DeferredStep(1, lambda: built.append("built") or view("a", 1, 2, 2), ("a",)))
    controller.after_idle_step(["a"])
    controller.set_paused(True)
    controller.after_forward(StepView.empty(["b"]))
    assert built == [] and controller.steps == 3 and controller.flush(timeout=0)
    assert controller.listing()["transfer"] is None and controller.listing()["steps"] == 3
    with pytest.raises(ValueError, match="capture mode needs the score ring"):
        TapController(taps, served(), capture_dir=str(tmp_path / "captures"))


def test_a_paused_tap_scores_copies_and_sends_nothing_until_it_runs_again(setup):
    """`set_paused`: the op leaves the score buffers alone, no step is handed over or sent;
    running again, the next step is scored and sent as before. A worker that steers refuses."""
    taps, probes, delivery = setup
    controller = TapController(taps, served(), delivery.publisher)
    controller.load([str(p) for p in probes])
    # every API server process hears of swaps (with what their retention check needs) and pauses
    published = delivery.read()
    assert published.control == [{"control": "swapped", "what": "probes", "version": 1,
                                   "dirs": [str(p) for p in probes]}]
    controller.set_paused(True)
    assert delivery.read().control[-1] == {"control": "paused", "paused": True, "sequence": 1}
    assert controller.listing()["paused"] and not controller.reads_scores
    assert all(int(t.paused[0]) == 1 for t in taps.values())
    before = {l: t.scores.clone() for l, t in taps.items()}
    controller.open_mid_forward_copies(2)  # a paused tap opens no copies
    assert not controller._mid_forward_open
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})
    controller.after_forward(view("a", 2, 0, 2))
    assert all(torch.equal(t.scores, before[l]) for l, t in taps.items())
    assert delivery.read() == [] and controller.transfer.describe()["submitted_steps"] == 0
    # requests that end while paused are still announced (their books released on both sides)
    controller.after_forward(StepView.empty(["a"]))
    (ended,) = delivery.read()
    assert ended["step"]["req"] == [] and ended["finished"] == ["a"]
    controller.set_paused(False)
    assert delivery.read().control[-1] == {"control": "paused", "paused": False, "sequence": 2}
    streams = {l: torch.randn(2, HIDDEN) for l in taps}
    run_step(taps, streams)
    controller.after_forward(view("b", 2, 0, 2))
    message = delivery.read()[-1]
    assert message["step"]["req"] == ["b"]
    raw = np.frombuffer(message["raw"], np.float32).reshape(2, -1)
    np.testing.assert_allclose(raw[:, 0], (streams[1] @ taps[1].weight[0]).numpy() + float(taps[1].bias[0]),
                               rtol=1e-5, atol=1e-5)

    from engine_worker.tap.steer import LayerSteer

    other = Delivery(taps)
    steering = TapController(taps, served(), other.publisher,
                             steers={1: LayerSteer(1, HIDDEN, capacity=2, max_rows=32, gate_taps=[taps[1]])})
    with pytest.raises(ValueError, match="steering gates read its scores"):
        steering.set_paused(True)
    assert not steering.paused and all(int(t.paused[0]) == 0 for t in taps.values())
    assert other.read().control == []  # a refused pause announces nothing


def test_a_capture_is_never_written_in_part_around_a_pause(tmp_path):
    """Pausing is refused while a capture is being written; a capture request that runs while
    paused (sent before the pause) is left out for good, not captured from the resume on."""
    taps = {1: LayerTap(1, HIDDEN, capacity=2, max_rows=32, capture_rows=8)}
    controller = TapController(taps, served(), Delivery(taps).publisher, capture_dir=str(tmp_path))
    controller._capture_requests["writing"] = {}
    with pytest.raises(ValueError, match="a capture is being written"):
        controller.set_paused(True)
    controller._capture_requests.clear()
    controller.set_paused(True)
    controller.before_forward(view("c", 2, 0, 4), {"c"})
    assert controller._capture_plan == []
    controller.set_paused(False)
    controller.before_forward(view("c", 2, 2, 4), {"c"})
    assert controller._capture_plan == []  # its first half ran paused: none of it is written
    controller.after_idle_step(["c"])
    controller.before_forward(view("d", 2, 0, 2), {"d"})
    assert controller._capture_plan == [("d", 0, 2)]  # a capture after the pause is written as ever


def test_a_message_that_cannot_be_built_does_not_stop_later_steps():
    """A failing message builder loses its step alone: a heartbeat takes its place in the
    ring (the order and the count are kept) and the next step goes out."""
    source = torch.zeros(4, 1)
    delivery = Delivery(layers={0: (4, 1)})

    def build(rows, context, scores):
        if context == "bad":
            raise RuntimeError("boom")
        return message_of(rows, context, scores)

    transfer = RingTransfer({0: source}, delivery.publisher, build)
    source[:2, 0] = torch.tensor([1.0, 2.0])
    transfer.submit(2, "bad")
    transfer.submit(2, "good")
    entries = delivery.entries()
    assert [(kind, message.get(CONTROL, message.get("context"))) for kind, message, _ in entries] \
        == [(MESSAGE, "heartbeat"), (STEP, "good")]
    assert entries[1][2][0][:2] == [[1.0], [2.0]] and transfer.message_errors == 1
    assert transfer.describe()["message_errors"] == 1


def test_the_engine_waits_a_bounded_time_for_room_in_the_ring_then_drops_the_step_but_not_its_number():
    """A full ring is waited for (the formatter frees a slot once it has read one): a step is
    dropped only once the ring stayed full for `full_wait_s`, and its message number is used
    up, so the formatter sees the gap."""
    source = torch.zeros(4, 1)
    delivery = Delivery(layers={0: (4, 1)}, slots=2, full_wait_s=5.0)
    transfer = RingTransfer({0: source}, delivery.publisher, message_of)
    transfer.submit(1, 0)
    transfer.submit(1, 1)
    reader = delivery.reader
    freeing = threading.Timer(0.2, lambda: (reader.poll(), reader.done()))
    freeing.start()
    began = time.monotonic()
    transfer.submit(1, 2)  # waits until the formatter frees a slot
    waited = time.monotonic() - began
    freeing.join()
    assert 0.15 <= waited < 5.0 and transfer.dropped_steps == 0
    delivery.publisher.full_wait_s = 0.05
    transfer.submit(1, 3)  # nobody frees one this time
    assert transfer.dropped_steps == 1 and transfer.describe()["dropped_steps"] == 1
    assert transfer.describe()["ring_dropped_messages"] == 1 and transfer.submitted_steps == 4
    rest = delivery.entries()
    transfer.submit(1, 4)
    rest += delivery.entries()
    assert [(m["context"], m[SEQUENCE]) for _, m, _ in rest] == [(1, 2), (2, 3), (4, 5)]


def test_on_a_device_each_step_is_one_copy_per_layer_then_the_landed_ticket_and_nothing_waits():
    sources = {1: torch.zeros(8, 3), 4: torch.zeros(8, 3)}
    delivery = Delivery(layers={1: (8, 3), 4: (8, 3)}, slots=4)
    driver = HostDriver()
    transfer = RingTransfer(sources, delivery.publisher, message_of, driver=driver)
    assert driver.calls == [("register", delivery.ring.size)] and not transfer.synchronous
    driver.calls.clear()
    sources[1][:2] = torch.tensor([[1.0, 2, 3], [4, 5, 6]])
    sources[4][:2] = -sources[1][:2]
    transfer.submit(2, "s")
    assert driver.calls == [("copy", 1, 2, 7), ("copy", 4, 2, 7), ("landed", 1, 7)]
    driver.calls.clear()
    transfer.submit(0, "end")  # a step without rows (requests ending) copies nothing and writes no ticket
    assert driver.calls == []
    (kind, message, scores), (end_kind, end, _) = delivery.entries()
    assert (kind, message["context"], end_kind, end["context"]) == (STEP, "s", MESSAGE, "end")
    assert scores[1][:2] == [[1.0, 2, 3], [4, 5, 6]] and scores[4][:2] == [[-1.0, -2, -3], [-4, -5, -6]]
    assert transfer.host_copied_steps == 0
    produced = delivery.publisher.produced
    with pytest.raises(ValueError, match="does not fit"):
        transfer.submit(9, None)  # more rows than the buffers hold: refused, nothing copied or reserved
    assert driver.calls == [] and delivery.publisher.produced == produced


def test_a_step_copied_on_the_host_waits_for_its_rows_and_writes_its_ticket_itself():
    """`host_copy` (capture mode's steps): the rows are copied before `submit` returns and the
    message is built with them; no device call is made."""
    sources = {1: torch.zeros(8, 3)}
    delivery = Delivery(layers={1: (8, 3)})
    driver = HostDriver()
    given = []
    transfer = RingTransfer(sources, delivery.publisher,
                            lambda rows, context, scores: given.append({l: a.tolist() for l, a in scores.items()})
                            or message_of(rows, context, scores), driver=driver)
    driver.calls.clear()
    sources[1][:1] = 3.0
    transfer.submit(1, "captured", host_copy=True)
    assert driver.calls == [] and given == [{1: [[3.0, 3.0, 3.0]]}] and transfer.host_copied_steps == 1
    ((kind, message, scores),) = delivery.entries()
    assert kind == STEP and scores[1][0] == [3.0, 3.0, 3.0]


def test_a_reserved_step_copies_each_layer_mid_forward_and_writes_its_ticket_after_the_last():
    """A prompt step's rows are copied as each tapped layer finishes (`copy_layer_now`, from
    the forward), the ticket right after the last layer's copy; its submit enqueues nothing."""
    sources = {1: torch.zeros(8, 3), 4: torch.zeros(8, 3)}
    delivery = Delivery(layers={1: (8, 3), 4: (8, 3)}, slots=4)
    driver = HostDriver()
    transfer = RingTransfer(sources, delivery.publisher, message_of, driver=driver)
    driver.calls.clear()
    assert transfer.reserve_step(2)
    assert not transfer.copy_layer_now(7)  # no tap at that layer: nothing
    sources[1][:2] = torch.tensor([[1.0, 2, 3], [4, 5, 6]])
    assert transfer.copy_layer_now(1)
    assert not transfer.copy_layer_now(1)  # once per layer
    sources[1][:2] = 0  # the forward goes on; what was copied is what the layer had written
    sources[4][:2] = torch.tensor([[7.0, 8, 9], [1, 1, 1]])
    assert delivery.reader.poll() is None  # reserved, not committed
    assert transfer.copy_layer_now(4)
    assert driver.calls == [("copy", 1, 2, 7), ("copy", 4, 2, 7), ("landed", 1, 7)]
    driver.calls.clear()
    transfer.submit(2, "prompt step")
    assert driver.calls == []
    ((_, message, scores),) = delivery.entries()
    assert message["context"] == "prompt step"
    assert scores[1][:2] == [[1.0, 2, 3], [4, 5, 6]] and scores[4][:2] == [[7.0, 8, 9], [1, 1, 1]]
    described = transfer.describe()
    assert described["mid_forward_steps"] == 1 and described["mid_forward_layer_copies"] == 2
    assert not transfer.copy_layer_now(1)  # no step reserved any more: the next forward's layers copy nothing


def test_a_reserved_step_whose_forward_reached_only_some_layers_copies_the_rest_at_submit():
    """A tapped last layer (no next layer's attention) or a forward replaying a whole graph
    never reaches the hook: what is left is copied behind the forward, then the ticket."""
    sources = {1: torch.zeros(8, 3), 4: torch.zeros(8, 3)}
    delivery = Delivery(layers={1: (8, 3), 4: (8, 3)}, slots=4)
    driver = HostDriver()
    transfer = RingTransfer(sources, delivery.publisher, message_of, driver=driver)
    assert transfer.reserve_step(1)
    sources[1][:1] = 2.0
    transfer.copy_layer_now(1)
    sources[1][:1] = 0.0
    sources[4][:1] = 3.0
    driver.calls.clear()
    transfer.submit(1, None)
    assert driver.calls == [("copy", 4, 1, 7), ("landed", 1, 7)]
    ((_, _, scores),) = delivery.entries()
    assert scores[1][0] == [2.0, 2, 2] and scores[4][0] == [3.0, 3, 3]
    assert transfer.describe()["mid_forward_steps"] == 0


def test_a_reservation_is_kept_past_a_step_without_rows_and_given_back_for_a_step_of_other_rows():
    sources = {1: torch.zeros(8, 1)}
    delivery = Delivery(layers={1: (8, 1)}, slots=8)
    transfer = RingTransfer(sources, delivery.publisher, message_of, driver=HostDriver())
    assert not transfer.reserve_step(0) and not transfer.reserve_step(9)  # nothing to copy / past the buffers
    assert delivery.publisher.produced == 0
    assert transfer.reserve_step(3)
    assert transfer.reserve_step(3)  # a reservation no step took (its forward failed): the same entry again
    assert delivery.publisher.produced == 1
    transfer.submit(0, "ended")  # requests ending: not the step reserved for
    assert transfer.mismatched_reservations == 0 and transfer._early is not None
    transfer.submit(2, "other rows")  # the reservation is given back, the step copied behind its forward
    assert transfer.mismatched_reservations == 1 and transfer._early is None
    assert transfer.reserve_step(3)
    transfer.release_reservation()  # the forward failed: the entry carries a heartbeat
    transfer.release_reservation()  # nothing reserved: nothing happens
    kinds = [(kind, message.get(CONTROL, message.get("context"))) for kind, message, _ in delivery.entries()]
    assert kinds == [(MESSAGE, "heartbeat"), (MESSAGE, "ended"), (STEP, "other rows"), (MESSAGE, "heartbeat")]
    assert delivery.publisher.drained()


def test_on_the_cpu_a_reserved_layer_is_copied_when_its_forward_says_so():
    source = torch.zeros(8, 2)
    delivery = Delivery(layers={3: (8, 2)})
    transfer = RingTransfer({3: source}, delivery.publisher, message_of)
    assert transfer.synchronous
    assert transfer.reserve_step(2)
    source[:2] = 5.0
    transfer.copy_layer_now(3)
    source[:2] = 0.0  # overwritten later in the forward (or by the next one): the copy was taken
    transfer.submit(2, None)
    ((_, _, scores),) = delivery.entries()
    assert scores[3][:2] == [[5.0, 5.0], [5.0, 5.0]] and transfer.mid_forward_steps == 1


def test_a_prompt_step_copied_mid_forward_publishes_what_the_step_copied_behind_its_forward_does(setup):
    taps, probes, _ = setup
    streams = {l: torch.randn(5, HIDDEN) for l in taps}
    layout = view("a", 5, 0, 5)
    messages = {}
    for mid_forward in (False, True):
        delivery = Delivery(taps)
        controller = TapController(taps, served(), delivery.publisher)
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
        messages[mid_forward] = delivery.read()
    assert len(messages[True]) == 1 and messages[True] == messages[False]


def test_the_controller_copies_mid_forward_only_inside_an_opened_step_of_a_running_tap(setup, monkeypatch):
    taps, probes, delivery = setup
    controller = TapController(taps, served(), delivery.publisher)
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
    controller.after_forward(view("a", 5, 0, 5))
    controller.set_paused(True)
    controller.open_mid_forward_copies(5)  # a paused tap copies nothing
    controller.layer_scores_final(1)
    assert calls == [1]
    controller.set_paused(False)
    controller.open_mid_forward_copies(99)  # more rows than the buffers hold: not opened
    controller.layer_scores_final(1)
    assert calls == [1]


def test_a_failed_forward_gives_its_reserved_entry_back(setup):
    """The entry taken before the forward carries a heartbeat instead: the order and the count
    stay whole, and the next step takes the next entry."""
    taps, probes, delivery = setup
    controller = TapController(taps, served(), delivery.publisher)
    controller.load([str(p) for p in probes])
    produced = delivery.publisher.produced
    controller.open_mid_forward_copies(5)
    assert controller._mid_forward_open and delivery.publisher.produced == produced + 1
    controller.close_mid_forward_copies(launched=False)
    assert not controller._mid_forward_open and controller.transfer._early is None
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})
    controller.after_forward(view("b", 2, 0, 2))
    published = delivery.read()
    assert [m[CONTROL] for m in published.control] == ["swapped", "heartbeat"]
    assert [m["step"]["req"] for m in published] == [["b"]] and published.sequences == [1, 2, 3]
    assert controller.transfer.mid_forward_steps == 0


def test_a_failing_device_call_loses_the_step_but_not_its_place_in_the_ring():
    class Failing(HostDriver):
        fail = True

        def write_value(self, address, value, stream):
            if self.fail:
                raise RuntimeError("probex: cuStreamWriteValue32 failed with CUDA driver error 700")
            super().write_value(address, value, stream)

    driver = Failing()
    delivery = Delivery(layers={0: (4, 1)}, slots=2)
    transfer = RingTransfer({0: torch.zeros(4, 1)}, delivery.publisher, message_of, driver=driver)
    with pytest.raises(RuntimeError, match="error 700"):
        transfer.submit(1, "lost")
    driver.fail = False
    transfer.submit(2, "next")
    kinds = [(kind, message.get(CONTROL, message.get("context"))) for kind, message, _ in delivery.entries()]
    assert kinds == [(MESSAGE, "heartbeat"), (STEP, "next")]


def test_a_score_buffer_that_is_not_one_float32_block_or_has_no_room_in_the_ring_is_refused():
    delivery = Delivery(layers={0: (4, 2)})
    with pytest.raises(ValueError, match="contiguous float32"):
        RingTransfer({0: torch.zeros(2, 4).t()}, delivery.publisher, message_of, driver=HostDriver())
    with pytest.raises(ValueError, match="contiguous float32"):
        RingTransfer({0: torch.zeros(4, 2, dtype=torch.float64)}, delivery.publisher, message_of)
    with pytest.raises(ValueError, match="no room shaped like layer 0"):
        RingTransfer({0: torch.zeros(8, 2)}, delivery.publisher, message_of)
    with pytest.raises(ValueError, match="no room shaped like layer 5"):
        RingTransfer({5: torch.zeros(4, 2)}, delivery.publisher, message_of)


class FakeCudaLibrary:
    """Stands in for libcuda.so.1 as ctypes loads it: records each call and its argtypes;
    `missing` names entry points this driver lacks, `context` the current context it reports."""

    def __init__(self, calls: list, missing: tuple[str, ...] = (), context: int = 0xC0DE) -> None:
        self._calls = calls
        self._missing = missing
        self._context = context
        self._functions: dict = {}

    def __getattr__(self, name):
        if name.startswith("_") or name in self._missing:
            raise AttributeError(name)
        if name not in self._functions:
            calls = self._calls

            def function(*args):
                calls.append((name, args))
                if name == "cuCtxGetCurrent":
                    args[0]._obj.value = self._context
                elif name == "cuMemHostGetDevicePointer_v2":
                    args[0]._obj.value = 0xD000
                return 0

            function.argtypes = None
            self._functions[name] = function
        return self._functions[name]


@pytest.fixture
def fake_cuda(monkeypatch):
    """The torch calls CudaDriver makes, without a GPU; returns how to load a fake library."""
    import contextlib

    stream = type("Stream", (), {"cuda_stream": 99, "synchronize": lambda self: None})()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    asked: list = []
    # the raw current-stream handle, as torch's own generated code reads it (absent from CPU builds)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: asked.append(index) or 99,
                        raising=False)

    def load(**kwargs) -> tuple[FakeCudaLibrary, list, list]:
        calls: list = []
        library = FakeCudaLibrary(calls, **kwargs)
        monkeypatch.setattr(ctypes, "PyDLL", lambda name: library if name == "libcuda.so.1" else None)
        return library, calls, asked

    return load


def test_the_cuda_driver_calls_match_the_driver_api(fake_cuda):
    from engine_worker.tap.cuda_driver import CudaDriver, LayerCopy

    library, calls, asked = fake_cuda()
    driver = CudaDriver(torch.device("cuda", 0))
    assert driver.context.value == 0xC0DE and calls[-1][0] == "cuCtxGetCurrent"
    assert library.cuMemcpyDtoHAsync_v2.argtypes == [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    source, target = torch.zeros(8, 4), torch.zeros(8, 4)
    copy = LayerCopy(0, source, target, 0x1000, 0x2000, 16)
    driver.copy_rows(copy, 3, driver.current_stream())
    assert calls[-1] == ("cuMemcpyDtoHAsync_v2", (0x2000, 0x1000, 48, 99)) and asked == [0]
    # the ring's mapping, pinned once for the device's copies and its ticket writes
    assert driver.register_host_memory(0x5000, 8192) == 0xD000
    assert calls[-2] == ("cuMemHostRegister_v2", (0x5000, 8192, 0x1 | 0x2))  # portable, device-mapped
    assert calls[-1][0] == "cuMemHostGetDevicePointer_v2" and calls[-1][1][1:] == (0x5000, 0)
    assert library.cuMemHostRegister_v2.argtypes == [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    write = library.cuStreamWriteValue32_v2
    assert write.argtypes == [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    driver.write_value(0xD040, (1 << 32) + 5, 99)  # a ticket's low 32 bits
    assert calls[-1] == ("cuStreamWriteValue32_v2", (99, 0xD040, 5, 0))
    library._functions["cuMemcpyDtoHAsync_v2"] = lambda *args: 700  # an error code
    with pytest.raises(RuntimeError, match="cuMemcpyDtoHAsync failed with CUDA driver error 700"):
        driver.copy_rows(copy, 1, 99)


def test_the_cuda_driver_writes_tickets_through_the_first_stream_memory_entry_point_where_v2_is_missing(fake_cuda):
    from engine_worker.tap.cuda_driver import CudaDriver

    library, calls, _ = fake_cuda(missing=("cuStreamWriteValue32_v2",))
    driver = CudaDriver(torch.device("cuda", 0))
    driver.register_host_memory(0x5000, 4096)
    driver.write_value(0xD000, 3, 42)
    assert calls[-1] == ("cuStreamWriteValue32", (42, 0xD000, 3, 0))


def test_the_cuda_driver_refuses_an_engine_thread_without_a_current_context(fake_cuda):
    from engine_worker.tap.cuda_driver import CudaDriver

    fake_cuda(context=0)
    with pytest.raises(RuntimeError, match="no CUDA context is current"):
        CudaDriver(torch.device("cuda", 0))


@pytest.mark.parametrize("problem", ["raises", "wrong rows"])
def test_a_view_that_cannot_be_built_loses_its_scores_but_still_ends_its_requests(setup, problem):
    """A `DeferredStep`'s view is built once its copies are enqueued; if that fails, the step's
    scores have nowhere to go, but the requests ending with it must still be announced (the API
    server would otherwise hold their last chunks until its wait times out)."""
    taps, probes, delivery = setup
    controller = TapController(taps, served(), delivery.publisher)
    controller.load([str(p) for p in probes])
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})

    def build():
        if problem == "raises":
            raise RuntimeError("runner state gone")
        return view("a", 3, 0, 3)  # 3 rows, 2 copied

    controller.after_forward(DeferredStep(2, build, ("a",)))
    assert controller.transfer.message_errors == 1
    published = delivery.read()
    assert list(published) == [] and published.control[-1] == lost_message([], ["a"])  # after the load's swap
    # On through the formatter to an API server's hub: a book opened earlier for "a" is
    # closed by it, the request ends, and the hub counts the loss (so responses in flight
    # stop waiting).
    formatter = ScoreFormatter(api_server_count=1)
    hub = ScoreHub("inproc://unused")

    def deliver(message: dict) -> None:
        for topic, frame in formatter.take(message):
            hub.take_formatted(topic, frame)

    key = "cmpl-probex-a"
    engine_id = f"{key}-0123abcd"
    hub.get(key)  # the relay of the request's response asks for it
    deliver(step_message(controller.table, StepView([engine_id], np.array([1]), np.array([0]), np.array([3])),
                         np.zeros((1, 2), np.float32), []))
    assert len(formatter._reader.book) == 1 and not hub.get(key).finished
    deliver({**published.control[-1], "finished": [engine_id]})
    assert len(formatter._reader.book) == 0 and hub.get(key).finished
    assert hub.steps_lost == 1 and hub.losses == 1
    deliver(lost_message([engine_id], []))  # a step whose view was built names its requests
    assert hub.get(key).lost and hub.get(key).has(prompt=True, tokens=5)  # which wait for nothing more


def test_each_step_carries_the_workers_pause_state(setup):
    taps, probes, delivery = setup
    controller = TapController(taps, served(), delivery.publisher)
    controller.load([str(p) for p in probes])
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})
    controller.after_forward(view("a", 2, 0, 2))
    controller.set_paused(True)
    controller.after_forward(StepView.empty(["a"]))
    assert [m["pause"] for m in delivery.read()] == [[0, False], [1, True]]


def test_a_capture_that_fails_costs_no_scores(setup, tmp_path, monkeypatch, caplog):
    """Capture books (and files) come before the step goes out, so a captured request's files
    exist when its response ends; one that fails still lets the step's scores out."""
    taps, probes, delivery = setup
    controller = TapController(taps, served(), delivery.publisher, capture_dir=str(tmp_path / "captures"))
    controller.load([str(p) for p in probes])
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(controller.book, "record_step", full_disk)
    with caplog.at_level(logging.ERROR, logger="probex.controller"):
        controller.after_forward(view("a", 2, 0, 2))
    assert "capturing a step's rows failed" in caplog.text and "No space left" in caplog.text
    published = delivery.read()
    assert [m["step"]["req"] for m in published] == [["a"]] and published.control[-1][CONTROL] != "lost"
    assert controller.transfer.message_errors == 0


@pytest.mark.parametrize("failing", ["step_message", "gather_scores"])
def test_a_step_that_fails_after_its_view_is_announced_as_lost(setup, tmp_path, monkeypatch, failing):
    """Any failure on a step's way out (its message; in capture mode the gathering for the
    books) is announced the same way: the step's requests and those ending with it."""
    taps, probes, delivery = setup
    capture_dir = str(tmp_path / "captures") if failing == "gather_scores" else None
    controller = TapController(taps, served(), delivery.publisher, capture_dir=capture_dir)
    controller.load([str(p) for p in probes])
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})

    def failing_call(*args):
        raise MemoryError("no room for the step's scores")

    monkeypatch.setattr(controller_module, failing, failing_call)
    controller.after_forward(view("a", 2, 0, 2, finished=["b"]))
    assert controller.transfer.message_errors == 1
    published = delivery.read()
    assert list(published) == [] and published.control[-1] == lost_message(["a"], ["b"])


def test_capture_mode_writes_a_captured_prompts_rows_before_its_step_goes_out(tmp_path):
    """The residual rows of a capture request's prompt, saved per tapped layer once its last
    prompt step is booked (a prompt in two steps here), before that step reaches the ring."""
    from safetensors.numpy import load_file

    taps = {1: LayerTap(1, HIDDEN, capacity=2, max_rows=32, capture_rows=8)}
    delivery = Delivery(taps)
    controller = TapController(taps, served(), delivery.publisher, capture_dir=str(tmp_path))
    controller.load([str(make_probe(tmp_path, "first", 1, ReadPoint.LAST_PROMPT_TOKEN, 0))])
    streams = [torch.randn(3, HIDDEN), torch.randn(2, HIDDEN)]
    for computed, stream in zip((0, 3), streams):
        layout = view("c", len(stream), computed, 5)
        controller.before_forward(layout, {"c"})
        taps[1](stream, torch.zeros_like(stream))
        controller.after_forward(layout)
        assert (tmp_path / "c.safetensors").exists() == (computed == 3)
    np.testing.assert_allclose(load_file(str(tmp_path / "c.safetensors"))["layer_1"], torch.cat(streams).numpy(),
                               rtol=1e-6)
    reader = StepReader()
    events = [reader.read(m) for m in delivery.read()]
    assert [[p["req"] for p in e.prompt] for e in events] == [[], ["c"]]  # the scores went out as ever
