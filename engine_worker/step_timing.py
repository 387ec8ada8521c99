"""The device time of prompt-sized forwards, to tell a prefill's GPU work from the host's (a diagnostic).

On the H200 a lone 1024-token request's TTFT scatters by 10-17% from one request to the
next (4-7 ms of 35-40; `probex bench engine`'s idle pairs), while what the tap adds on the
first token's way is a few tenths of a millisecond of host work: thousands of request pairs
per reading, and no way to tell which part of the path moved. Timing each prompt-sized
forward on the device (two CUDA events around its launch) and taking that span out of each
request's TTFT splits it into the device's part and the host's way in and out, each of which
can be compared with the tap running and paused. (Measured so, session 24: the scatter sits
about evenly in the prefill's span and in the way out, and the tap's cost all on the way
out; docs/benchmark-sessions.md.)

Switched on by PROBEX_STEP_TIMING=1 in the engine's environment; off, the runner adapters
make one attribute check per step. On, a forward of at least `min_rows` rows costs two event
records on the engine thread; the spans are only read (`records`, the worker's
`probex_step_timings` call) when a client asks, between steps. On the CPU backend the
forward runs synchronously, so the host clock times it.
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

ENV_STEP_TIMING = "PROBEX_STEP_TIMING"
# The fewest rows a timed forward has (PROBEX_STEP_TIMING_MIN_ROWS, default DEFAULT_MIN_ROWS):
# steps with fewer are decodes (one row per running request) or short chunks.
ENV_STEP_TIMING_MIN_ROWS = "PROBEX_STEP_TIMING_MIN_ROWS"
DEFAULT_MIN_ROWS = 257


def step_timing_enabled(environ: Any = None) -> bool:
    value = (os.environ if environ is None else environ).get(ENV_STEP_TIMING, "").strip().lower()
    return value in ("1", "on", "true", "yes")


def step_timing_min_rows(environ: Any = None) -> int:
    value = (os.environ if environ is None else environ).get(ENV_STEP_TIMING_MIN_ROWS, "").strip()
    if not value:
        return DEFAULT_MIN_ROWS
    try:
        rows = int(value)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(f"{ENV_STEP_TIMING_MIN_ROWS} must be a positive number of rows, not {value!r}")
    return rows


@dataclass
class _TimedForward:
    rows: int
    request_ids: list[str]
    began_at: float  # time.perf_counter() as the span began (CLOCK_MONOTONIC: other processes' clock too)
    began: Any = None  # the device event the span begins at (none on the CPU: `began_at` times it)
    ended: Any = None
    paused: bool = False
    launched_at: float = 0.0  # time.perf_counter() once the launch returned
    span_ms: float | None = None
    sequence: int = -1  # numbered when it ends: a forward that raised is never kept


class StepTimer:
    """Spans of the forwards of at least `min_rows` rows, the newest `capacity` kept.

    The runner adapter calls `begin` right before a step's forward is enqueued (when `wants`
    its row count) and `end` right after; `records` reads the spans."""

    def __init__(self, device: Any, min_rows: int = DEFAULT_MIN_ROWS, capacity: int = 8192, events=None) -> None:
        """`events`: makes a timing event (tests pass a stand-in); CUDA events on a CUDA device,
        None on the CPU, where the host clock times the synchronous forward."""
        self.min_rows = min_rows
        self.capacity = capacity
        self._events = events
        if events is None and getattr(device, "type", str(device)) == "cuda":
            import torch

            self._events = lambda: torch.cuda.Event(enable_timing=True)
        self._kept: collections.deque[_TimedForward] = collections.deque(maxlen=capacity)
        self.recorded = 0  # forwards timed so far, the number the next one gets

    def wants(self, rows: int) -> bool:
        return rows >= self.min_rows

    def begin(self, rows: int, request_ids: Sequence[str]) -> _TimedForward:
        began_at = time.perf_counter()
        began = self._record_event() if self._events is not None else None
        return _TimedForward(int(rows), list(request_ids), began_at, began)

    def end(self, forward: _TimedForward, paused: bool) -> None:
        forward.launched_at = time.perf_counter()
        if self._events is not None:
            forward.ended = self._record_event()
        else:
            forward.span_ms = (forward.launched_at - forward.began_at) * 1e3
        forward.paused = bool(paused)
        forward.sequence = self.recorded
        self._kept.append(forward)
        self.recorded += 1

    def _record_event(self):
        event = self._events()
        event.record()  # on the current stream: the one the forward is enqueued on
        return event

    def records(self, after: int = -1) -> dict[str, Any]:
        """The kept forwards numbered above `after`, oldest first, each with its span in ms
        (waiting for a forward still on the device), and `next`: the number the next forward
        will get (a client passes next - 1 as `after` to read only what comes later)."""
        out = []
        for forward in list(self._kept):
            if forward.sequence <= after:
                continue
            if forward.span_ms is None:
                forward.ended.synchronize()
                forward.span_ms = float(forward.began.elapsed_time(forward.ended))
                forward.began = forward.ended = None  # the events are not needed again
            out.append({"sequence": forward.sequence, "rows": forward.rows, "requests": forward.request_ids,
                        "span_ms": forward.span_ms, "paused": forward.paused, "began_at": forward.began_at,
                        "launched_at": forward.launched_at})
        return {"min_rows": self.min_rows, "recorded": self.recorded, "capacity": self.capacity,
                "next": self.recorded, "records": out}
