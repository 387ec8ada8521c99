"""TapController and the score ring without an engine: LayerTaps on the CPU, steps described by hand,
the ring read back the way the API server reads it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_worker.bookkeeping import StepLayout, StepReader
from engine_worker.controller import TapController
from engine_worker.score_ring import KIND_TABLE, ScoreRingReader, ScoreRingWriter
from engine_worker.tap import LayerTap
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


class RingFollowerForTests:
    """Reads what the worker posted, as the API server's hub does, into a StepReader's events."""

    def __init__(self, path: Path) -> None:
        self.ring = ScoreRingReader(str(path))
        assert self.ring.attach()
        self.reader = StepReader()
        self.tables = 0

    def read_posted(self) -> list:
        events = []
        while count := self.ring.wait(0.05):
            for _ in range(count):
                record = self.ring.read()
                if record.kind == KIND_TABLE:
                    self.reader.read_table(record.meta)
                    self.tables += 1
                else:
                    events.append(self.reader.read_step(record.meta, record.raw_by_layer))
                self.ring.release(record)
        return events


@pytest.fixture
def setup(tmp_path):
    taps = {1: LayerTap(1, HIDDEN, capacity=2, max_rows=32), 3: LayerTap(3, HIDDEN, capacity=2, max_rows=32)}
    probes = [
        make_probe(tmp_path, "first", 1, ReadPoint.LAST_PROMPT_TOKEN, 0),
        make_probe(tmp_path, "second", 3, ReadPoint.PROMPT_MEAN, 1),
    ]
    return taps, probes, tmp_path / "scores.ring"


def test_steps_are_scored_published_in_order_and_match_w_dot_x(setup):
    taps, probes, ring_path = setup
    controller = TapController(taps, served(), str(ring_path))
    follower = RingFollowerForTests(ring_path)
    controller.load([str(p) for p in probes])
    rng = torch.Generator().manual_seed(3)
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
        controller.after_forward(layout)
    # Overwriting the device buffers after the steps were queued must not change what is read.
    for tap in taps.values():
        tap.scores.fill_(1e9)
    controller.flush()
    events = follower.read_posted()
    assert follower.tables == 1
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
    assert controller.listing()["ring"]["published"] == 4  # the table, then three steps


def test_the_worker_starts_no_thread_to_deliver_scores(setup):
    taps, probes, ring_path = setup
    before = {t.name for t in threading.enumerate()}
    controller = TapController(taps, served(), str(ring_path))
    controller.load([str(p) for p in probes])
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})
    controller.after_forward(StepLayout(["a"], np.array([2]), np.array([0]), np.array([2])))
    assert {t.name for t in threading.enumerate()} == before
    assert len(RingFollowerForTests(ring_path).read_posted()) == 1


def test_a_probe_swap_reaches_the_reader_between_the_steps_it_separates(setup, tmp_path):
    taps, probes, ring_path = setup
    controller = TapController(taps, served(), str(ring_path))
    follower = RingFollowerForTests(ring_path)
    controller.load([str(p) for p in probes])
    layout = StepLayout(["a"], np.array([1]), np.array([4]), np.array([3]))
    run_step(taps, {l: torch.randn(1, HIDDEN) for l in taps})
    controller.after_forward(layout)
    controller.load([str(probes[0])])  # one probe now
    run_step(taps, {l: torch.randn(1, HIDDEN) for l in taps})
    controller.after_forward(StepLayout(["a"], np.array([1]), np.array([5]), np.array([3])))
    events = follower.read_posted()
    assert [e.table.version for e in events] == [1, 2]
    assert [e.token_raw.shape[1] for e in events] == [2, 1]


def test_idle_step_releases_finished_requests(setup):
    taps, probes, ring_path = setup
    controller = TapController(taps, served(), str(ring_path))
    follower = RingFollowerForTests(ring_path)
    controller.load([str(p) for p in probes])
    run_step(taps, {l: torch.randn(3, HIDDEN) for l in taps})
    # a 6-token prompt, half prefilled: an open accumulator
    controller.after_forward(StepLayout(["a"], np.array([3]), np.array([0]), np.array([6])))
    [half] = follower.read_posted()
    assert not half and len(follower.reader.book) == 1
    controller.after_idle_step(["a"])
    [idle] = follower.read_posted()
    assert idle.finished == ["a"] and len(follower.reader.book) == 0
    assert controller.steps == 1  # the idle step ran no forward


def test_a_rank_that_neither_delivers_nor_captures_copies_no_scores(setup):
    """Tensor-parallel ranks other than the delivering one score the same rows; they have no
    ring and skip the device-to-host copy entirely (steering still runs there)."""
    taps, probes, _ = setup
    controller = TapController(taps, served(), None)
    controller.load([str(p) for p in probes])
    assert not controller.reads_scores and controller.ring is None
    run_step(taps, {l: torch.randn(2, HIDDEN) for l in taps})
    controller.after_forward(StepLayout(["a"], np.array([2]), np.array([0]), np.array([2])))
    controller.after_idle_step(["a"])
    assert controller.steps == 1 and controller.listing()["ring"] is None


def test_a_full_ring_waits_briefly_then_drops_steps_without_stalling_every_later_one(tmp_path):
    source = torch.zeros(4, 1)
    writer = ScoreRingWriter(str(tmp_path / "r.ring"), {0: source}, slots=2, full_wait_s=0.2)
    reader = ScoreRingReader(str(tmp_path / "r.ring"))
    assert reader.attach()
    assert writer.publish_step(1, {"n": 1}) and writer.publish_step(1, {"n": 2})
    started = time.monotonic()
    assert not writer.publish_step(1, {"n": 3})  # nobody read: waited, then dropped
    assert time.monotonic() - started >= 0.2
    started = time.monotonic()
    assert not writer.publish_step(1, {"n": 4})  # still nobody: dropped at once
    assert time.monotonic() - started < 0.1
    assert writer.dropped == 2 and reader.dropped == 2 and writer.waits_for_space == 1
    assert reader.wait(1.0) == 2
    for expected in (1, 2):
        record = reader.read()
        assert record.meta == {"n": expected}
        reader.release(record)
    assert writer.publish_step(1, {"n": 5})  # the reader caught up: steps flow again
    assert reader.wait(1.0) == 1 and reader.read().meta == {"n": 5}


def test_the_ring_is_read_across_processes_and_the_reader_leaves_nothing_in_the_filesystem(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "x.ring"
    source = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    writer = ScoreRingWriter(str(path), {5: source}, slots=4)
    writer.publish_step(3, {"req": ["a"]})
    code = (
        "import sys; from engine_worker.score_ring import ScoreRingReader as R\n"
        "r = R(sys.argv[1]); assert r.attach(); assert r.wait(5) == 1; x = r.read()\n"
        "print(x.meta['req'], x.raw_by_layer[5].tolist()); r.release(x)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['a'] [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]"
    assert not path.exists()
    assert writer.publish_step(1, {"req": ["b"]})  # the slot was released by the other process


def test_a_step_whose_description_does_not_fit_is_dropped_with_a_count(tmp_path):
    writer = ScoreRingWriter(str(tmp_path / "r.ring"), {0: torch.zeros(4, 1)}, slots=2, meta_bytes=64)
    assert not writer.publish_step(1, {"req": ["x" * 100]})
    assert writer.dropped == 1 and writer.published == 0


def test_the_writer_refuses_buffers_it_cannot_copy_as_one_block(tmp_path):
    with pytest.raises(ValueError, match="contiguous float32"):
        ScoreRingWriter(str(tmp_path / "r.ring"), {0: torch.zeros(4, 2).t()})
    with pytest.raises(ValueError, match="contiguous float32"):
        ScoreRingWriter(str(tmp_path / "r.ring"), {0: torch.zeros(4, 2, dtype=torch.float64)})
