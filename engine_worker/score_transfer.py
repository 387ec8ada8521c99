"""Moving each step's raw probe scores to the host without stalling the engine loop.

Reading a device buffer with `.cpu()` right after the forward waits for the whole
forward to finish: the engine loop then cannot prepare the next step while the GPU
works, which costs more than the probes themselves. Instead, after each forward the
engine thread only *enqueues* a device→host copy of the step's few score floats into a
pinned staging buffer, records a CUDA event and hands the step to a single background
thread. That thread polls the event, sleeping between polls (a sleep always releases the
GIL, so the engine thread is never kept waiting while the GPU works), then runs the
bookkeeping and publishes, in step order.

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

# How often the transfer thread checks whether a step's copy has landed: a few per decode
# step of a large model, far below the time a client notices.
_POLL_S = 0.0002


@dataclass
class StagedStep:
    """One step's scores on their way to the host, plus whatever the consumer needs with them."""

    rows: int
    context: Any
    _slot: "_StagingSlot"
    _ready: torch.cuda.Event | None

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
        # engine-thread time for nothing.
        self.ready = torch.cuda.Event() if pin else None


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
        self.consume_errors = 0
        if threaded:
            self._thread = threading.Thread(target=self._run, name="probex-score-transfer", daemon=True)
            self._thread.start()

    def submit(self, rows: int, context: Any) -> None:
        """Called on the engine thread right after the forward was enqueued."""
        try:
            slot = self._free.get_nowait()
        except queue.Empty:
            self.waits_for_staging += 1
            if self.waits_for_staging in (1, 10, 100) or self.waits_for_staging % 1000 == 0:
                log.warning("probex: all %d score staging buffers are in use; the engine waits for the transfer"
                            " thread (%d times so far)", self.depth, self.waits_for_staging)
            slot = self._free.get()
        for layer, src in self._sources.items():
            slot.buffers[layer][:rows].copy_(src[:rows], non_blocking=self._cuda)
        ready = slot.ready
        if ready is not None:
            ready.record()
        step = StagedStep(rows=rows, context=context, _slot=slot, _ready=ready)
        if self._threaded:
            self._work.put(step)
        else:
            self._process(step)

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
                while not step._ready.query():
                    time.sleep(_POLL_S)
            self._consume(step)
        except Exception:  # a bad step must not stop delivery for every later one
            self.consume_errors += 1
            log.exception("probex: processing a step's scores failed")
        finally:
            self._free.put(step._slot)
