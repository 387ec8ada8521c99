"""Moving each step's raw probe scores to the host without stalling the engine loop.

Reading a device buffer with `.cpu()` right after the forward waits for the whole
forward to finish: the engine loop then cannot prepare the next step while the GPU
works, which costs more than the probes themselves. Instead, after each forward the
engine thread only *enqueues* a device→host copy of the step's few score floats into a
pinned staging buffer, records a CUDA event and hands the step to a single background
thread. That thread waits on the event, then runs the bookkeeping and publishes, in step
order.

The wait must not compete with the engine thread for the GIL. `Event.query()` holds the
GIL, so polling it (even with sleeps between polls) wakes the thread thousands of times a
second and each wake-up takes the GIL from the engine loop — measured on the H200 as a few
percent of decode speed at batch 8. `Event.synchronize()` releases the GIL, and events
created with `blocking=True` make the driver put the waiting thread to sleep instead of
spinning: one GIL acquisition per step, after the scores have landed.

Staging buffers come from a fixed pool, so nothing is allocated per step. If every
buffer is still in use (the background thread fell `depth` steps behind), `submit`
waits for one: bounded memory and back-pressure rather than silently dropping scores.

On the CPU there is no asynchrony to gain: the copy is a memcpy, and the same thread
keeps the engine-facing behaviour identical to the GPU path (and tested).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

log = logging.getLogger("probex.transfer")

@dataclass
class StagedStep:
    """One step's scores on their way to the host, plus whatever the consumer needs with them."""

    rows: int
    context: Any
    _slot: "_StagingSlot"
    _ready: torch.cuda.Event | None
    submitted: float = 0.0  # time.perf_counter() on the engine thread

    def scores(self) -> dict[int, np.ndarray]:
        """layer -> [rows, capacity] host scores. Valid until the step is released."""
        return {layer: buf[: self.rows].numpy() for layer, buf in self._slot.buffers.items()}


class _StagingSlot:
    def __init__(self, sources: dict[int, torch.Tensor], pin: bool) -> None:
        self.buffers = {
            layer: torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            for layer, src in sources.items()
        }
        # One event per slot, re-recorded each use: creating a CUDA event every step costs
        # engine-thread time for nothing. blocking=True: the waiter sleeps, it does not spin.
        self.ready = torch.cuda.Event(blocking=True) if pin else None


class ScoreTransfer:
    """Copies `sources[layer][:rows]` to the host each step and calls `consume` off-thread.

    `consume(step)` runs on the transfer thread, one step at a time in submission order;
    `step.scores()` is only valid during that call.
    """

    def __init__(
        self,
        sources: dict[int, torch.Tensor],
        consume: Callable[[StagedStep], None],
        depth: int = 8,
        threaded: bool = True,
    ) -> None:
        if depth < 1:
            raise ValueError("ScoreTransfer needs at least one staging buffer")
        self._sources = sources
        self._consume = consume
        device = next(iter(sources.values())).device if sources else torch.device("cpu")
        self._cuda = device.type == "cuda"
        self.depth = depth
        self._free: queue.Queue[_StagingSlot] = queue.Queue()
        for _ in range(depth):
            self._free.put(_StagingSlot(sources, pin=self._cuda))
        self._work: queue.Queue[StagedStep | None] = queue.Queue()
        self._threaded = threaded
        self._thread: threading.Thread | None = None
        self.waits_for_staging = 0  # submits that found every buffer busy
        # Engine-thread time in submit, split: enqueueing the copies and the event (`stage`)
        # versus handing the step to the transfer thread (`handoff`, waits for a free buffer included).
        self.stage_s = 0.0
        self.handoff_s = 0.0
        self.consume_errors = 0
        self.stats = TransferStats()
        if threaded:
            self._thread = threading.Thread(target=self._run, name="probex-score-transfer", daemon=True)
            self._thread.start()

    def submit(self, rows: int, context: Any) -> None:
        """Called on the engine thread right after the forward was enqueued."""
        started = time.perf_counter()
        try:
            slot = self._free.get_nowait()
        except queue.Empty:
            self.waits_for_staging += 1
            if self.waits_for_staging in (1, 10, 100) or self.waits_for_staging % 1000 == 0:
                log.warning("probex: all %d score staging buffers are in use; the engine waits for the transfer"
                            " thread (%d times so far)", self.depth, self.waits_for_staging)
            slot = self._free.get()
        staging = time.perf_counter()
        for layer, src in self._sources.items():
            slot.buffers[layer][:rows].copy_(src[:rows], non_blocking=self._cuda)
        ready = slot.ready
        if ready is not None:
            ready.record()
        staged = time.perf_counter()
        step = StagedStep(rows=rows, context=context, _slot=slot, _ready=ready, submitted=staged)
        if self._threaded:
            self._work.put(step)
            self.handoff_s += (staging - started) + (time.perf_counter() - staged)
        else:
            self._process(step)
        self.stage_s += staged - staging

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted step was consumed (tests, shutdown). True if drained."""
        if not self._threaded:
            return True
        deadline = time.monotonic() + timeout
        while self._work.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._work.put(None)
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            step = self._work.get()
            try:
                if step is None:
                    return
                self._process(step)
            finally:
                self._work.task_done()

    def _process(self, step: StagedStep) -> None:
        try:
            if step._ready is not None:
                step._ready.synchronize()  # releases the GIL while it waits
            landed = time.perf_counter()
            self._consume(step)
            self.stats.add(landed - step.submitted, time.perf_counter() - landed)
        except Exception:  # a bad step must not stop delivery for every later one
            self.consume_errors += 1
            log.exception("probex: processing a step's scores failed")
        finally:
            self._free.put(step._slot)

    def describe(self) -> dict[str, Any]:
        return {"depth": self.depth, "waits_for_staging": self.waits_for_staging,
                "consume_errors": self.consume_errors, "stage_s": self.stage_s, "handoff_s": self.handoff_s,
                **self.stats.as_dict()}


class TransferStats:
    """Where a step's scores spend their time before they are published, for benchmarks.

    `landed` is submit → the copy seen complete on the host (the rest of the forward and of
    any step still ahead of it on the GPU, the driver's wake-up, and any wait for earlier
    steps' bookkeeping); `consume` is the
    bookkeeping and publish after it, all on the transfer thread. Sums and maxima only:
    cheap enough to keep on in production, and readers take differences between snapshots.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.landed_s = 0.0
        self.landed_max_s = 0.0
        self.consume_s = 0.0
        self.consume_max_s = 0.0

    def add(self, landed: float, consume: float) -> None:
        self.steps += 1
        self.landed_s += landed
        self.consume_s += consume
        if landed > self.landed_max_s:
            self.landed_max_s = landed
        if consume > self.consume_max_s:
            self.consume_max_s = consume

    def as_dict(self) -> dict[str, float | int]:
        return {"steps": self.steps, "landed_s": self.landed_s, "landed_max_s": self.landed_max_s,
                "consume_s": self.consume_s, "consume_max_s": self.consume_max_s}
