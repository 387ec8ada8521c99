"""Each step's scores handed to the score formatter's process through the shared-memory ring.

The engine-thread side of engine_worker/scores/ring.py. Per step, on the engine thread:
take the ring's next entry, enqueue the copies of the step's score rows from the device
straight into its slot and a stream memory write of the entry's ticket behind them (the
device says when the rows are there), build the step's message (request ids and token counts,
no scores) and commit it. Nothing waits for the device, nothing is gathered, encoded twice or
sent over a socket here: the formatter does that once the rows have landed.

A prompt step's rows may leave mid-forward: `reserve_step` takes the
entry before the forward, `copy_layer_now` enqueues each tapped layer's copy as soon as its
tap op is enqueued, and the ticket's write after the last.

On the CPU backend (`synchronous`), and for a step submitted with `host_copy` (capture mode's
steps with captured rows: it keeps books in the worker), the rows are copied before `submit`
returns and the engine thread writes the ticket itself; the message is built with the scores
at hand (`message_of`'s third argument).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from engine_worker.scores.ring import MESSAGE, STEP, RingEntry, RingPublisher
from engine_worker.tap.cuda_driver import CudaDriver, LayerCopy

log = logging.getLogger("probex.transfer")

# (rows, context, host scores by layer where the copies were synchronous, else None) -> the
# step's message without scores, or None where it has nothing to say
MessageOf = Callable[[int, Any, "dict[int, np.ndarray] | None"], "dict | None"]


@dataclass
class _Reservation:
    entry: RingEntry
    rows: int
    copied: set[int] = field(default_factory=set)


class RingTransfer:
    consumer = "formatter"

    def __init__(self, sources: dict[int, torch.Tensor], publisher: RingPublisher, message_of: MessageOf,
                 driver=None) -> None:
        """`driver`: the device calls (tests pass a recording stand-in); made from libcuda when
        the sources are on a CUDA device and the copies are not `synchronous`."""
        ring = publisher.ring
        for layer, source in sources.items():
            if source.dtype != torch.float32 or not source.is_contiguous():
                raise ValueError("score buffers must be contiguous float32 tensors (a step's rows are copied as one block)")
            if layer not in ring.layers or ring.layers[layer][:2] != tuple(source.shape):
                raise ValueError(f"the score ring has no room shaped like layer {layer}'s scores {tuple(source.shape)}")
        self.publisher = publisher
        self.ring = ring
        self._message_of = message_of
        device = next(iter(sources.values())).device
        # A driver given (tests: a recording stand-in) makes the copies its calls on any device.
        self.synchronous = device.type != "cuda" and driver is None
        self.max_rows = min(source.shape[0] for source in sources.values())
        self._copies = [[LayerCopy(layer, source, torch.from_numpy(ring.scores(slot)[layer]), source.data_ptr(),
                                    ring.address + ring.scores_offset(slot, layer), source.stride(0) * 4)
                         for layer, source in sources.items()] for slot in range(ring.slots)]
        self._copy_of = [{copy.layer: copy for copy in copies} for copies in self._copies]
        self._driver = None
        self._landed_at: list[int] = []
        if not self.synchronous:
            self._driver = driver if driver is not None else CudaDriver(device)
            base = self._driver.register_host_memory(ring.address, ring.size)
            self._landed_at = [base + ring.landed_offset(slot) for slot in range(ring.slots)]
        self._early: _Reservation | None = None
        self.submitted_steps = 0
        self.dropped_steps = 0  # the ring stayed full (the formatter behind or gone)
        self.message_errors = 0
        self.host_copied_steps = 0  # copied synchronously on a device (`host_copy`)
        self.mid_forward_steps = 0
        self.mid_forward_layer_copies = 0
        self.mismatched_reservations = 0

    def submit(self, rows: int, context: Any, host_copy: bool = False) -> None:
        """On the engine thread right after the forward was enqueued. `host_copy`: copy the rows
        now, waiting for the forward, and build the message with them (capture mode's steps)."""
        if not 0 <= rows <= self.max_rows:
            raise ValueError(f"a step of {rows} rows does not fit the {self.max_rows}-row score buffers")
        early = self._early if rows else None  # a step without rows leaves the reservation to its step
        if early is not None:
            self._early = None
            if early.rows != rows:  # not the step reserved for (an adapter bug)
                self.mismatched_reservations += 1
                self.publisher.skip(early.entry)
                early = None
        entry = early.entry if early is not None else self.publisher.reserve()
        self.submitted_steps += 1
        if entry is None:
            self.dropped_steps += 1  # its number is skipped: the formatter reports the loss
            return
        scores = None
        try:
            if rows:
                copied = early.copied if early is not None else ()
                complete = early is not None and len(early.copied) == len(self._copies[entry.slot])
                if complete:
                    self.mid_forward_steps += 1  # every layer's rows were copied during the forward
                if self._driver is not None and not host_copy:
                    if not complete:  # (a complete step's ticket was enqueued after its last copy)
                        stream = self._driver.current_stream()
                        for copy in self._copies[entry.slot]:
                            if copy.layer not in copied:
                                self._driver.copy_rows(copy, rows, stream)
                        self._driver.write_value(self._landed_at[entry.slot], entry.ticket, stream)
                else:
                    if self._driver is not None:
                        self.host_copied_steps += 1
                    for copy in self._copies[entry.slot]:
                        if copy.layer not in copied:
                            copy.target[:rows].copy_(copy.source[:rows])  # from a device: waits for the forward
                    self.ring.mark_landed(entry.slot, entry.ticket)
                    scores = {layer: array[:rows] for layer, array in self.ring.scores(entry.slot).items()}
        except BaseException:
            self.publisher.skip(entry)  # the step is lost, its place in the order is not
            raise
        try:
            message = self._message_of(rows, context, scores)
        except Exception:  # the message builder reports its own failures; this is a bug in it
            self.message_errors += 1
            log.exception("probex: building a step's score message failed")
            message = None
        if message is None:
            self.publisher.skip(entry)
        else:
            self.publisher.commit(entry, message, STEP if rows else MESSAGE)

    def reserve_step(self, rows: int) -> bool:
        """Before a prompt step's forward: take its entry now, so its layers' rows can be copied
        out mid-forward (`copy_layer_now`). False where there is nothing to copy or the ring is
        full. (Not for a step to be submitted with `host_copy`: its copies wait for the forward.)"""
        if not 0 < rows <= self.max_rows:
            return False
        if self._early is not None:  # a reservation no step took (the forward failed): its entry again
            self._early = _Reservation(self._early.entry, rows)
            return True
        entry = self.publisher.reserve()
        if entry is None:
            return False
        self._early = _Reservation(entry, rows)
        return True

    def copy_layer_now(self, layer: int) -> bool:
        """Mid-forward, once `layer`'s scores for the reserved step are final: enqueue its rows'
        copy, and after the last tapped layer's, the ticket's write. True if it copied."""
        early = self._early
        if early is None or layer in early.copied:
            return False
        copy = self._copy_of[early.entry.slot].get(layer)
        if copy is None:
            return False
        if self._driver is None:  # the CPU: the forward has run up to here, the rows are final
            copy.target[:early.rows].copy_(copy.source[:early.rows])
            early.copied.add(layer)
        else:
            stream = self._driver.current_stream()
            self._driver.copy_rows(copy, early.rows, stream)
            early.copied.add(layer)
            if len(early.copied) == len(self._copies[early.entry.slot]):
                self._driver.write_value(self._landed_at[early.entry.slot], early.entry.ticket, stream)
        self.mid_forward_layer_copies += 1
        return True

    def release_reservation(self) -> None:
        early, self._early = self._early, None
        if early is not None:
            self.publisher.skip(early.entry)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the formatter has taken everything committed (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while not self.publisher.drained():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def close(self) -> None:
        self.flush(timeout=2.0)

    def describe(self) -> dict[str, Any]:
        return {"depth": self.ring.slots, "consumer": self.consumer, "synchronous": self.synchronous, "submitted_steps": self.submitted_steps,
                "host_copied_steps": self.host_copied_steps,
                "dropped_steps": self.dropped_steps, "ring_dropped_messages": self.publisher.dropped,
                "ring_oversized_messages": self.publisher.oversized, "message_errors": self.message_errors,
                "mid_forward_steps": self.mid_forward_steps, "mid_forward_layer_copies": self.mid_forward_layer_copies,
                "mismatched_reservations": self.mismatched_reservations}


def start_score_ring(tap_config, taps: dict) -> RingPublisher:
    """The shared-memory ring a delivering rank's steps go through, and the score formatter's
    process that reads it (engine_worker/scores/formatter.py) and serves the API server
    processes at the tap's score address. `taps`: layer -> its `LayerTap`, buffers on their
    device already."""
    if not tap_config.score_address:
        raise RuntimeError("probex: the tap has no score address; start the engine through `probex worker`")
    if not hasattr(os, "memfd_create"):
        raise RuntimeError("probex: the score ring needs Linux (memfd_create)")
    device = next(iter(taps.values())).scores.device
    if device.type == "cuda":
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            raise RuntimeError("probex: the score ring needs the CUDA driver library (libcuda.so.1) on a GPU") from None
    from engine_worker.scores.formatter import FormatterProcess
    from engine_worker.scores.ring import ScoreRing

    ring = ScoreRing.create({layer: tuple(tap.scores.shape) for layer, tap in taps.items()})
    FormatterProcess(tap_config.score_address, tap_config.api_server_count, ring_fd=ring.fd).start()
    log.info("probex: scores go to the score formatter through a %d-slot shared-memory ring (%.1f MiB)",
             ring.slots, ring.size / 2**20)
    return RingPublisher(ring)
