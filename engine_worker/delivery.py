"""Scores from the worker process to the API-server process, and the hub there.

The worker (rank 0) queues each step in a shared-memory ring (`score_ring`); the API
server's `ScoreHub` follows the ring, keeps the books (`bookkeeping.StepReader`) and keeps,
per request, what has arrived, waking whoever is waiting to attach scores to a response or
stream chunk. Requests are keyed by their external id: the engine appends "-<8 hex>" to the
id the API server chose, and we strip that suffix so the middleware can ask by the id it
put in `X-Request-Id`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

import numpy as np

from engine_worker.bookkeeping import ProbeTable, StepReader
from engine_worker.score_ring import KIND_TABLE, RingFollower, RingRecord, ScoreRingReader
from probes.scoring import calibrate_array

log = logging.getLogger("probex.delivery")

_ENGINE_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def external_request_id(engine_request_id: str) -> str:
    return _ENGINE_SUFFIX.sub("", engine_request_id)


@dataclass
class ProbeInfo:
    name: str
    read: str
    slope: float
    intercept: float
    layer: int


@dataclass
class RequestScores:
    """Everything that arrived for one request (one prompt of one API call)."""

    prompt: dict | None = None
    prompt_probes: list[ProbeInfo] | None = None
    tokens: dict[int, tuple[list[float], list[ProbeInfo]]] = field(default_factory=dict)  # calibrated
    contiguous: int = 0  # tokens 0..contiguous-1 are all in: O(1) answers for every stream chunk
    finished: bool = False
    touched: float = field(default_factory=time.monotonic)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add_token(self, index: int, scores: list[float], probes: list[ProbeInfo]) -> None:
        """`scores`: calibrated, one per probe of `probes` (the set that scored this token)."""
        self.tokens[index] = (scores, probes)
        while self.contiguous in self.tokens:
            self.contiguous += 1

    def has_tokens_below(self, count: int) -> bool:
        return self.contiguous >= count


class _ProbeSet:
    """One probe-table version as the hub sees it: names and calibration, vectorised."""

    def __init__(self, table: ProbeTable) -> None:
        self.probes = [ProbeInfo(s.name, s.read, s.slope, s.intercept, s.layer) for s in table.slots]
        self._slope = np.array([p.slope for p in self.probes], dtype=np.float64)
        self._intercept = np.array([p.intercept for p in self.probes], dtype=np.float64)

    def calibrate(self, raw: np.ndarray) -> np.ndarray:
        """[n, k] raw -> calibrated, each column with its own probe's slope and intercept."""
        return calibrate_array(raw, self._slope, self._intercept)


class ScoreHub:
    """API-server side: follows the worker's score ring and answers "are request X's scores here yet?"."""

    def __init__(self, ring_path: str, retention_s: float = 300.0) -> None:
        self.ring_path = ring_path
        self.retention_s = retention_s
        self._requests: dict[str, RequestScores] = {}
        self._tables: dict[int, _ProbeSet] = {}
        self._task: asyncio.Task | None = None
        self._reader: ScoreRingReader | None = None
        self._follower: RingFollower | None = None
        self._posted = 0  # slots the worker has posted that are not read yet
        self._last_sweep = time.monotonic()
        self.messages_received = 0
        self.ingest_errors = 0
        self._external_ids: dict[str, str] = {}  # engine request id -> ours, saves a regex per token
        self._steps = StepReader()  # the books of every request's prompt, fed by the worker's steps
        self.ring_stats = RingStats()
        # How long responses were held back waiting for scores (the cost the tap adds to
        # latency, if any), split by first chunk (prompt summary) and later tokens.
        self.waits = {"prompt": WaitStats(), "tokens": WaitStats()}

    def start(self) -> None:
        if self._task is not None:
            return
        self._task = asyncio.get_running_loop().create_task(self._attach())

    async def _attach(self) -> None:
        """The worker creates the ring while its engine starts; wait for it, then follow it."""
        reader = ScoreRingReader(self.ring_path)
        waited = 0.0
        while not reader.attach():
            await asyncio.sleep(0.05)
            waited += 0.05
            if waited in (30.0, 300.0):
                log.warning("probex: still waiting for the worker's score ring %s", self.ring_path)
        self._reader = reader
        loop = asyncio.get_running_loop()
        self._follower = RingFollower(reader, loop.call_soon_threadsafe, self._on_posted)
        log.info("probex: reading scores from %s", self.ring_path)

    def _on_posted(self, count: int) -> None:
        """On the event loop: `count` more slots are readable; read them all, in order."""
        self._posted += count
        reader = self._reader
        while self._posted:
            record = reader.read()
            try:
                self.ingest(record)
            except Exception:  # a malformed step must not stop delivery for everyone
                self.ingest_errors += 1
                log.exception("probex: could not ingest score slot %d", record.seq)
            finally:
                reader.release(record)
                self._posted -= 1
        now = time.monotonic()
        if now - self._last_sweep > 10:
            self.sweep(now)
            self._last_sweep = now

    def ingest(self, record: RingRecord) -> None:
        """One slot of the ring: a probe table, or a worker step read through the books into
        prompt summaries, sampled-token scores and request ends."""
        started = time.perf_counter()
        self.messages_received += 1
        if record.kind == KIND_TABLE:
            table = self._steps.read_table(record.meta)
            self._tables[table.version] = _ProbeSet(table)
            for old in [v for v in self._tables if v not in self._steps.tables]:
                del self._tables[old]
            return
        events = self._steps.read_step(record.meta, record.raw_by_layer)
        probes = (table := self._tables[events.table.version]).probes
        if len(self._external_ids) > 100_000:  # ids are never reused: forgetting them all is safe
            self._external_ids.clear()
        for event in events.prompt:
            state = self._state(self._external_id(event["req"]))
            state.prompt, state.prompt_probes = event, probes
            state.changed.set()
        if events.token_req_ids:
            # One vectorised calibration per step instead of one math.exp per token and
            # probe later, on the event loop that also relays every chunk.
            scores = table.calibrate(events.token_raw).tolist()
            for req, index, values in zip(events.token_req_ids, events.token_indexes, scores):
                state = self._state(self._external_id(req))
                state.add_token(index, values, probes)
                state.changed.set()
        for req in events.finished:
            state = self._requests.get(self._external_id(req))
            if state is not None:
                state.finished = True
                state.changed.set()
        self.ring_stats.add(time.monotonic_ns() - record.submitted_ns, time.perf_counter() - started)

    def ring_status(self) -> dict:
        return {"attached": self._reader is not None, "ingest_errors": self.ingest_errors,
                "dropped_by_worker": self._reader.dropped if self._reader else 0, **self.ring_stats.as_dict()}

    def _external_id(self, engine_request_id: str) -> str:
        key = self._external_ids.get(engine_request_id)
        if key is None:
            key = self._external_ids[engine_request_id] = external_request_id(engine_request_id)
        return key

    def _state(self, key: str) -> RequestScores:
        state = self._requests.get(key)
        if state is None:
            state = self._requests[key] = RequestScores()
        state.touched = time.monotonic()
        return state

    def get(self, key: str) -> RequestScores:
        return self._state(key)

    def release(self, key: str) -> None:
        self._requests.pop(key, None)

    def sweep(self, now: float | None = None) -> None:
        """Forget requests nobody asked about (e.g. sent straight to the engine)."""
        now = time.monotonic() if now is None else now
        stale = [k for k, s in self._requests.items() if now - s.touched > self.retention_s]
        for key in stale:
            del self._requests[key]
        # A prompt still being prefilled is written every step it runs; one untouched for the
        # whole retention window lost its end (a dropped message).
        self._steps.book.forget_stale(self.retention_s, now)

    @property
    def open_prompt_books(self) -> int:
        """Requests whose books are still open (prompt accumulators kept until they end)."""
        return len(self._steps.book)

    def __len__(self) -> int:
        return len(self._requests)

    async def wait_for(self, key: str, *, prompt: bool, tokens: int, timeout: float) -> bool:
        """Wait until the prompt summary (if asked) and tokens [0, tokens) are in; False on timeout."""
        state = self._state(key)
        stats = self.waits["prompt" if prompt else "tokens"]
        stats.calls += 1
        if (state.prompt is not None or not prompt) and state.has_tokens_below(tokens):
            return True
        start = time.monotonic()
        deadline = start + timeout
        try:
            while not ((state.prompt is not None or not prompt) and state.has_tokens_below(tokens)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                state.changed.clear()
                try:
                    await asyncio.wait_for(state.changed.wait(), remaining)
                except asyncio.TimeoutError:
                    return False
            return True
        finally:
            stats.add(time.monotonic() - start)

    def wait_stats(self) -> dict[str, dict[str, float | int]]:
        return {kind: stats.as_dict() for kind, stats in self.waits.items()}


@dataclass
class RingStats:
    """Per worker step read from the ring, summed: `landed` is the worker's publish -> the API
    server reading it (the rest of the forward, the copy, the driver's post, this event
    loop's wake-up); `ingest` is the books and per-request updates here."""

    steps: int = 0
    landed_s: float = 0.0
    landed_max_s: float = 0.0
    ingest_s: float = 0.0

    def add(self, landed_ns: int, ingest_s: float) -> None:
        landed = landed_ns / 1e9
        self.steps += 1
        self.landed_s += landed
        self.landed_max_s = max(self.landed_max_s, landed)
        self.ingest_s += ingest_s

    def as_dict(self) -> dict[str, float | int]:
        return {"steps": self.steps, "landed_s": self.landed_s, "landed_max_s": self.landed_max_s,
                "ingest_s": self.ingest_s}


@dataclass
class WaitStats:
    calls: int = 0  # every wait_for, including those whose scores were already in
    waited: int = 0  # those that had to wait
    waited_s: float = 0.0
    max_s: float = 0.0

    def add(self, seconds: float) -> None:
        self.waited += 1
        self.waited_s += seconds
        self.max_s = max(self.max_s, seconds)

    def as_dict(self) -> dict[str, float | int]:
        return {"calls": self.calls, "waited": self.waited, "waited_s": self.waited_s, "max_s": self.max_s}
