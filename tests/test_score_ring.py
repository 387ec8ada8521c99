"""The score ring (engine_worker/scores/ring.py, engine_worker/tap/ring_copies.py): the engine thread stages each
step into shared memory and the score formatter's process reads it. Without an engine: CPU taps,
steps described by hand, and a recording stand-in for the CUDA driver's calls. The real engine
path (vLLM on the CPU, the formatter reading the ring) is covered by tests/test_engine_api_servers.py
and the bench's smoke run."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time

import msgspec
import numpy as np
import pytest
import torch

from engine_worker.api_server.hub import ScoreHub
from engine_worker.api_server.requests import inspect_request
from engine_worker.scores.bookkeeping import CONTROL, SEQUENCE, ProbeSlot, ProbeTable, StepReader, step_message
from engine_worker.scores.formatter import FormatterProcess, ScoreFormatter, ring_message
from engine_worker.scores.ring import MESSAGE, STEP, RingPublisher, RingReader, ScoreRing
from engine_worker.scores.wire import external_request_id, owner_tag
from engine_worker.step import StepView
from engine_worker.tap.controller import TapController
from engine_worker.tap.layer import LayerTap
from engine_worker.tap.ring_copies import RingTransfer
from probes.artifact import ReadPoint
from probes.scoring import calibrate
from tests.test_controller import HIDDEN, make_probe, run_step, served

ONE_PROBE = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 2.0, -0.5),))


def engine_id(owner: str) -> str:
    """A request id as vLLM's engine sees it: the middleware's, and vLLM's "-<8 hex>"."""
    return inspect_request("/v1/chat/completions", {"messages": []}, owner=owner).key(0) + "-0123abcd"


async def until(condition, timeout: float = 20.0) -> None:
    """Wait (polling, in the event loop) until `condition()` holds; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def read_all(reader: RingReader) -> list[dict]:
    """Every ready entry, as the formatter turns it into a message."""
    decoder, tables = msgspec.msgpack.Decoder(), {}
    out = []
    while (entry := reader.poll()) is not None:
        _, meta, scores = entry
        out.append(ring_message(meta, scores, decoder, tables))
        reader.done()
    return out


@pytest.fixture
def taps_and_probes(tmp_path):
    taps = {1: LayerTap(1, HIDDEN, capacity=2, max_rows=32), 3: LayerTap(3, HIDDEN, capacity=2, max_rows=32)}
    probes = [make_probe(tmp_path, "first", 1, ReadPoint.LAST_PROMPT_TOKEN, 0),
              make_probe(tmp_path, "second", 3, ReadPoint.PROMPT_MEAN, 1)]
    return taps, probes


def ring_for(taps, slots=8) -> ScoreRing:
    return ScoreRing.create({layer: tuple(tap.scores.shape) for layer, tap in taps.items()}, slots=slots)


def test_the_formatter_reads_every_step_through_the_ring_in_order_with_its_scores(taps_and_probes):
    taps, probes = taps_and_probes
    ring = ring_for(taps)
    controller = TapController(taps, served(), RingPublisher(ring, heartbeat_s=0))
    controller.load([str(p) for p in probes])
    assert controller.transfer.consumer == "formatter" and controller.publish == controller.transfer.publisher.publish
    reader = RingReader(ScoreRing.attach(ring.fd))  # the formatter's own mapping of it
    rng = torch.Generator().manual_seed(7)
    steps = [StepView(["a", "b"], np.array([5, 3]), np.array([0, 0]), np.array([5, 3])),
             StepView(["b", "a"], np.array([1, 1]), np.array([3, 5]), np.array([3, 5]))]
    streams = []
    for layout in steps:
        stream = {layer: torch.randn(layout.num_rows, HIDDEN, generator=rng) for layer in taps}
        streams.append(stream)
        run_step(taps, stream)
        controller.after_forward(layout)
    controller.after_idle_step(["a"])  # an end without a forward: a message of its own
    for tap in taps.values():  # what the device buffers hold now does not change what was staged
        tap.scores.fill_(1e9)
    messages = read_all(reader)
    assert controller.flush(timeout=1) and reader.ring.consumed == 4
    assert [m.get(CONTROL) for m in messages] == ["swapped", None, None, None]
    assert [m[SEQUENCE] for m in messages] == [1, 2, 3, 4]
    books = StepReader()
    events = [books.read(m) for m in messages[1:]]
    w1, b1 = taps[1].weight[0], taps[1].bias[0]
    w3, b3 = taps[3].weight[0], taps[3].bias[0]
    assert events[0].prompt[0]["last_raw"][0] == pytest.approx(float(streams[0][1][4] @ w1 + b1), rel=1e-5)
    assert events[0].prompt[1]["mean_raw"][1] == pytest.approx(float((streams[0][3][5:8] @ w3 + b3).mean()), rel=1e-5)
    a_row = events[1].token_req_ids.index("a")
    assert events[1].token_raw[a_row, 0] == pytest.approx(float(streams[1][1][1] @ w1 + b1), rel=1e-5)
    assert events[2].finished == ["a"]


def test_a_step_is_read_only_once_its_rows_have_landed():
    ring = ScoreRing.create({2: (4, 1)}, slots=2)
    publisher = RingPublisher(ring, heartbeat_s=0)
    reader = RingReader(ring)
    entry = publisher.reserve()
    publisher.commit(entry, {"step": {"req": []}, "rows": 0, "slots": [], "probes": []}, kind=STEP)
    assert reader.poll() is None and reader.waiting_for_device()  # committed, its rows on their way
    ring.mark_landed(entry.slot, entry.ticket)
    kind, _, _ = reader.poll()
    assert kind == STEP


def test_a_full_ring_drops_after_a_bounded_wait_and_the_formatter_reports_the_gap():
    ring = ScoreRing.create({2: (4, 1)}, slots=2)
    publisher = RingPublisher(ring, heartbeat_s=0, full_wait_s=0.02)
    publisher.publish({CONTROL: "heartbeat"})
    publisher.publish({CONTROL: "heartbeat"})
    began = time.monotonic()
    publisher.publish({CONTROL: "heartbeat"})  # no formatter took the first two: dropped
    assert time.monotonic() - began >= 0.02 and publisher.dropped == 1
    began = time.monotonic()
    assert publisher.reserve() is None and publisher.dropped == 2  # still full: dropped at once
    assert time.monotonic() - began < 0.02
    reader = RingReader(ring)
    formatter = ScoreFormatter(api_server_count=1)
    for message in read_all(reader):
        formatter.take(message)
    publisher.publish({CONTROL: "heartbeat"})  # room again
    (message,) = read_all(reader)
    assert message[SEQUENCE] == 5  # the dropped ones' numbers were used up
    frames = formatter.take(message)
    lost = [msgspec.msgpack.decode(frame) for _, frame in frames]
    assert lost and lost[0][CONTROL] == "lost" and lost[0]["messages"] == 2


def test_a_message_too_large_for_a_slot_goes_out_as_a_loss_of_its_requests():
    ring = ScoreRing.create({2: (4, 1)}, slots=2, meta_capacity=256)
    publisher = RingPublisher(ring, heartbeat_s=0)
    entry = publisher.reserve()
    publisher.commit(entry, {"step": {"req": ["r1", "r2"]}, "finished": ["r0"], "pad": "x" * 1000}, kind=STEP)
    (message,) = read_all(RingReader(ring))
    assert message[CONTROL] == "lost" and message["requests"] == ["r1", "r2"] and message["finished"] == ["r0"]
    assert publisher.oversized == 1


class RecordingDriver:
    """The CUDA driver's calls as RingTransfer makes them, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def register_host_memory(self, address: int, size: int) -> int:
        self.calls.append(("register", address, size))
        return 1 << 40  # the mapping's device address

    def current_stream(self) -> int:
        return 7

    def copy_rows(self, copy, rows: int, stream: int) -> None:
        self.calls.append(("copy", copy.layer, rows, copy.target_ptr, stream))

    def write_value(self, address: int, value: int, stream: int) -> None:
        self.calls.append(("write", address, value, stream))


def test_on_a_device_the_copies_and_the_landed_ticket_are_enqueued_and_nothing_waits():
    sources = {1: torch.zeros(32, 2), 3: torch.zeros(32, 2)}
    ring = ScoreRing.create({1: (32, 2), 3: (32, 2)}, slots=8)
    publisher = RingPublisher(ring, heartbeat_s=0)
    driver = RecordingDriver()
    # CPU tensors standing in for device buffers: with a driver given, the copies are its calls.
    transfer = RingTransfer(sources, publisher, lambda rows, context, scores: {"step": context, "rows": rows},
                            driver=driver)
    assert driver.calls == [("register", ring.address, ring.size)] and not transfer.synchronous
    driver.calls.clear()
    transfer.submit(5, "whole")
    assert driver.calls == [("copy", 1, 5, ring.address + ring.scores_offset(0, 1), 7),
                            ("copy", 3, 5, ring.address + ring.scores_offset(0, 3), 7),
                            ("write", (1 << 40) + ring.landed_offset(0), 1, 7)]
    driver.calls.clear()
    # mid-forward: the entry is taken before the forward, each layer copied as it is final,
    # the ticket written after the last; the submit then enqueues nothing
    assert transfer.reserve_step(9)
    transfer.copy_layer_now(3)
    transfer.copy_layer_now(1)
    transfer.copy_layer_now(1)  # a layer copies once
    transfer.submit(9, "prompt")
    assert driver.calls == [("copy", 3, 9, ring.address + ring.scores_offset(1, 3), 7),
                            ("copy", 1, 9, ring.address + ring.scores_offset(1, 1), 7),
                            ("write", (1 << 40) + ring.landed_offset(1), 2, 7)]
    assert transfer.mid_forward_steps == 1
    # a reservation whose forward failed leaves a heartbeat in its place; a step of other rows
    # than reserved for skips it and is copied whole
    assert transfer.reserve_step(4)
    transfer.release_reservation()
    assert transfer.reserve_step(4)
    transfer.submit(6, "other rows")
    assert transfer.mismatched_reservations == 1
    reader = RingReader(ring)
    kinds = []
    while reader.waiting_for_device():  # committed; a step's rows still "on the device"
        if reader.poll() is None:
            ring.mark_landed(reader.next % ring.slots, reader.next + 1)  # the device's write, by hand
        kind, meta, _ = reader.poll()
        message = msgspec.msgpack.decode(meta)
        kinds.append((kind, message.get("step", message.get(CONTROL))))
        reader.done()
    assert kinds == [(STEP, "whole"), (STEP, "prompt"), (MESSAGE, "heartbeat"), (MESSAGE, "heartbeat"),
                     (STEP, "other rows")]


def test_capture_mode_books_the_steps_of_capture_requests_from_rows_copied_at_once(taps_and_probes, tmp_path):
    """A step of capture requests is staged with its rows copied synchronously (no mid-forward
    copies) and booked here; other steps go through the ring as usual and only end requests."""
    taps, probes = taps_and_probes
    ring = ring_for(taps)
    driver = RecordingDriver()
    controller = TapController(taps, served(), RingPublisher(ring, heartbeat_s=0),
                               capture_dir=str(tmp_path / "capture"))
    controller.load([str(p) for p in probes])
    # the CPU's copies stand in for a device's here: the transfer is given a recording driver
    controller.transfer = RingTransfer({layer: tap.scores for layer, tap in taps.items()}, controller.transfer.publisher,
                                       controller._ring_message, driver=driver)
    for tap in taps.values():
        tap.capture_index = torch.zeros(8, dtype=torch.long)  # room for 8 captured rows a step
    captured = StepView(["a"], np.array([4]), np.array([0]), np.array([4]))
    controller.before_forward(captured, {"a"})
    controller.open_mid_forward_copies(4)
    assert not controller._mid_forward_open  # its rows are copied behind the forward, at once
    run_step(taps, {layer: torch.randn(4, HIDDEN) for layer in taps})
    driver.calls.clear()
    controller.after_forward(captured)
    assert driver.calls == [] and controller.transfer.host_copied_steps == 1 and len(controller.book) == 1
    plain = StepView(["b"], np.array([3]), np.array([0]), np.array([3]))
    controller.before_forward(plain, set())
    controller.open_mid_forward_copies(3)
    assert controller._mid_forward_open
    run_step(taps, {layer: torch.randn(3, HIDDEN) for layer in taps})
    controller.after_forward(StepView(plain.req_ids, plain.num_scheduled, plain.num_computed, plain.num_prompt,
                                      finished=("a",)))
    assert [call[0] for call in driver.calls] == ["copy", "copy", "write"] and len(controller.book) == 0
    assert controller.transfer.host_copied_steps == 1
    # on the CPU a step of capture requests is still copied layer by layer mid-forward
    cpu = TapController(taps, served(), RingPublisher(ring_for(taps), heartbeat_s=0),
                        capture_dir=str(tmp_path / "capture-cpu"))
    cpu.load([str(p) for p in probes])
    cpu.before_forward(captured, {"a"})
    cpu.open_mid_forward_copies(4)
    assert cpu._mid_forward_open


def test_the_worker_runs_the_formatter_on_the_ring_and_a_restart_goes_on_where_it_stopped():
    """Real processes: the formatter reads the ring the worker created (its inherited memfd);
    killed, it is started again and goes on from the first entry it had not finished (a step
    committed while no formatter ran is read, not skipped), and scores flow again."""
    owner = owner_tag()
    req = engine_id(owner)
    root = tempfile.mkdtemp()
    scores_at = f"ipc://{root}/scores"
    ring = ScoreRing.create({3: (8, 1)}, slots=8)
    publisher = RingPublisher(ring, heartbeat_s=0.2)

    def stage(computed: int, value: float) -> None:
        entry = publisher.reserve()
        ring.scores(entry.slot)[3][0, 0] = value
        ring.mark_landed(entry.slot, entry.ticket)
        layout = StepView([req], np.array([1]), np.array([computed]), np.array([2]))
        message = step_message(ONE_PROBE, layout, None, [])
        message.update(rows=1, slots=ONE_PROBE.buffer_slots())
        publisher.commit(entry, message, kind=STEP)

    async def scenario():
        formatter = FormatterProcess(scores_at, api_server_count=2, ring_fd=ring.fd).start()
        hub = ScoreHub(scores_at, owner=owner)
        hub.start()
        key = external_request_id(req)
        try:
            await until(lambda: hub._formatter is not None)
            stage(2, 0.5)
            await until(lambda: hub.get(key) is not None and 1 in hub.get(key).tokens)
            first_pid = formatter.process.pid
            os.kill(first_pid, signal.SIGKILL)
            await until(lambda: formatter.process.poll() is not None or formatter.process.pid != first_pid)
            stage(3, -1.0)  # while the formatter is down or starting
            # the new formatter takes it from the ring (what it sends before the API server's
            # subscription reaches it is lost on that hop, and the hub reports the restart)
            await until(lambda: formatter.starts == 2 and ring.consumed == publisher.produced)
            await asyncio.sleep(0.5)
            stage(4, 0.25)
            await until(lambda: 3 in hub.get(key).tokens)
            return hub.get(key).tokens, hub.formatter_restarts
        finally:
            formatter.close()
            publisher.close()
            hub._task.cancel()
            hub._silence_task.cancel()
            hub._socket.close()

    tokens, restarts = asyncio.run(scenario())
    assert tokens[1] == (pytest.approx(calibrate(0.5, 2.0, -0.5)),)
    assert tokens[3] == (pytest.approx(calibrate(0.25, 2.0, -0.5)),)
    assert restarts == 1


def test_on_the_cpu_a_prompt_steps_rows_are_copied_as_each_layer_finishes(taps_and_probes):
    """Mid-forward copies without a device: each tapped layer's rows are taken when its op has
    run (`layer_scores_final`), so what the scores buffer holds afterwards is not what is sent."""
    taps, probes = taps_and_probes
    ring = ring_for(taps)
    controller = TapController(taps, served(), RingPublisher(ring, heartbeat_s=0))
    controller.load([str(p) for p in probes])
    layout = StepView(["a"], np.array([4]), np.array([0]), np.array([4]))
    stream = {layer: torch.randn(4, HIDDEN) for layer in taps}
    controller.open_mid_forward_copies(4)
    run_step(taps, stream)
    for layer in taps:
        controller.layer_scores_final(layer)
        taps[layer].scores.fill_(1e9)  # what a later forward would write
    controller.close_mid_forward_copies()
    controller.after_forward(layout)
    assert controller.transfer.mid_forward_steps == 1
    (_, message) = read_all(RingReader(ring))
    (prompt,) = StepReader().read(message).prompt
    w1, b1 = taps[1].weight[0], taps[1].bias[0]
    assert prompt["last_raw"][0] == pytest.approx(float(stream[1][3] @ w1 + b1), rel=1e-5, abs=1e-5)


def test_an_idle_ring_publisher_heartbeats_with_its_last_pause_state():
    from engine_worker.scores.bookkeeping import paused_message

    ring = ScoreRing.create({2: (4, 1)}, slots=8)
    publisher = RingPublisher(ring, heartbeat_s=0.05)
    reader = RingReader(ring)
    try:
        publisher.publish(paused_message(True, 3))
        deadline = time.monotonic() + 5
        messages: list[dict] = []
        while not any(m.get(CONTROL) == "heartbeat" for m in messages):
            assert time.monotonic() < deadline, messages
            messages += read_all(reader)
            time.sleep(0.01)
    finally:
        publisher.close()
    heartbeat = next(m for m in messages if m.get(CONTROL) == "heartbeat")
    assert heartbeat["pause"] == [3, True] and heartbeat[SEQUENCE] == 2
