"""Which rows of a step belong to which request, and what each request has been scored.

Engine-agnostic: the engine adapter describes a step as a `StepView` (engine_worker/step.py:
requests in row order, how many rows each got, how many of its tokens were computed before
the step, its prompt length) and hands over the raw probe values of the step's rows;
everything else lives here and is unit-tested without an engine.

Conventions
- Position p of a request is its p-th token (prompt first, then generated tokens).
- A prompt row is a row whose position is < prompt length P. Rows served from the
  prefix cache never run, so they are never scored; `tokens_scored` counts what ran.
- The score of generated token j is the probe read at the row that sampled it, i.e.
  position P - 1 + j: the state that decided to emit token j. Token 0 therefore shares
  its row with the last prompt token, and every generated token has a score the moment
  it is sampled (none waits for a later step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from engine_worker.step import StepView


@dataclass(frozen=True)
class ProbeSlot:
    """Host-side record of the probe living in one row of a layer's weight buffer (here, not in
    tap.py, so the books load without torch: the score formatter's process has no use for it)."""

    name: str
    layer: int
    slot: int
    read: str
    slope: float
    intercept: float


@dataclass(frozen=True)
class ProbeTable:
    """The loaded probe set, in column order, with a version that changes on every swap."""

    version: int
    slots: tuple[ProbeSlot, ...]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]

    def columns_by_layer(self) -> dict[int, list[tuple[int, int]]]:
        """layer -> [(slot in that layer's buffer, column in the full score row)]."""
        out: dict[int, list[tuple[int, int]]] = {}
        for column, slot in enumerate(self.slots):
            out.setdefault(slot.layer, []).append((slot.slot, column))
        return out

    def slot_columns_by_layer(self) -> dict[int, tuple[np.ndarray | slice, np.ndarray | slice]]:
        """layer -> (slots, columns) indexes: one copy per layer per step. Consecutive indexes
        (the usual case: a layer's probes fill its slots in column order) become slices, which
        numpy copies several times faster than an index array."""
        cached = self.__dict__.get("_slot_columns")
        if cached is None:
            cached = {layer: (_as_range(np.array([s for s, _ in pairs])), _as_range(np.array([c for _, c in pairs])))
                      for layer, pairs in self.columns_by_layer().items()}
            object.__setattr__(self, "_slot_columns", cached)  # frozen dataclass: cache once
        return cached

    def buffer_slots(self) -> list[int]:
        """Each probe's column in its layer's score buffer, in table order (with `describe`'s
        layers, what the score formatter gathers a step's columns by from the score ring)."""
        cached = self.__dict__.get("_buffer_slots")
        if cached is None:
            cached = [s.slot for s in self.slots]
            object.__setattr__(self, "_buffer_slots", cached)
        return cached

    def describe(self) -> tuple[tuple, ...]:
        """What the receiving side needs of each slot; built once per table (sent every step)."""
        cached = self.__dict__.get("_described")
        if cached is None:
            cached = tuple((s.name, s.read, s.slope, s.intercept, s.layer) for s in self.slots)
            object.__setattr__(self, "_described", cached)
        return cached


@dataclass
class _PromptAccumulator:
    table_version: int
    raw: np.ndarray  # [P, k] raw scores by position
    ran: np.ndarray | None  # [P] bool: the row was computed (not served from the prefix cache); None: all were
    done: bool = False
    touched: float = field(default_factory=time.monotonic)


_NO_ROWS = np.empty((0, 0), dtype=np.float32)
_NO_RAN = np.empty(0, dtype=bool)


@dataclass
class StepEvents:
    """What one step produced for the requests in it: completed prompts, sampled tokens, ends.

    Sampled tokens are kept as parallel columns (request ids, token indexes, one [n, k]
    array of raw scores) rather than one dict per token: at 64 decoding requests per step
    that is one vectorised calibration in the API server instead of 64 x k scalar ones.
    """

    table: ProbeTable
    prompt: list[dict] = field(default_factory=list)
    token_req_ids: list[str] = field(default_factory=list)
    token_indexes: list[int] = field(default_factory=list)
    token_raw: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    finished: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prompt or self.token_req_ids or self.finished)

    @property
    def tokens(self) -> list[dict]:
        """The sampled tokens one dict each (for reading and tests; the wire uses the columns)."""
        return [{"req": r, "index": i, "raw": row} for r, i, row in
                zip(self.token_req_ids, self.token_indexes, self.token_raw.tolist())]


def gather_scores(table: ProbeTable, step_rows: int, raw_by_layer: dict[int, np.ndarray]) -> np.ndarray:
    """Assemble [rows, k] raw scores in probe-table column order from per-layer buffers."""
    full = np.empty((step_rows, len(table.slots)), dtype=np.float32)
    for layer, (slots, columns) in table.slot_columns_by_layer().items():
        full[:, columns] = raw_by_layer[layer][:step_rows, slots]
    return full


def _as_range(index: np.ndarray) -> np.ndarray | slice:
    """`index` as a slice where it counts up by one, else unchanged."""
    if len(index) and np.array_equal(index, np.arange(index[0], index[0] + len(index))):
        return slice(int(index[0]), int(index[0]) + len(index))
    return index


class ScoreBook:
    """Per-request prompt accumulators, fed one step at a time."""

    def __init__(self) -> None:
        self._prompts: dict[str, _PromptAccumulator] = {}

    def __len__(self) -> int:
        return len(self._prompts)

    def record_step(self, layout: StepView, table: ProbeTable, raw: np.ndarray) -> StepEvents:
        # Runs with an empty probe set too: capture mode still needs to know when prompts end.
        # Vectorised over requests: this runs every step for the whole batch, on the API
        # server's event loop (and in capture mode on the worker's transfer thread too).
        events = StepEvents(table=table)
        if not layout.req_ids:
            return events
        c, n, p = layout.num_computed, layout.num_scheduled, layout.num_prompt
        if len(layout.req_ids) == 1 and self._record_one(layout.req_ids[0], int(c[0]), int(n[0]), int(p[0]),
                                                          table, raw, events):
            return events
        if (n == 1).all() and (c >= p).all():
            # Every request decoding one token, none in its prompt: most steps once prompts
            # are in. Their rows are their sampled tokens, in order; the general path below
            # gives the same with a dozen more numpy calls, on the API server's event loop.
            events.token_req_ids = list(layout.req_ids)
            events.token_indexes = (c + 1 - p).tolist()
            events.token_raw = raw.copy()  # `raw` may be a staging buffer the next step reuses
            return events
        starts = layout.row_starts
        end = c + n  # positions computed once this step has run
        prompt_count = np.minimum(end, p) - c
        for i in np.flatnonzero(prompt_count > 0).tolist():  # requests prefilling this step
            first, count, pos = int(starts[i]), int(prompt_count[i]), int(c[i])
            if pos == 0 and count == n[i] == p[i] and layout.req_ids[i] not in self._prompts:
                # The whole prompt and nothing else in this step (nothing cached, no chunking,
                # not a preempted request recomputing prompt + generated tokens), the usual
                # case: its book is the step's rows themselves, nothing allocated or copied.
                # Its summary goes out below, in this call, so the view never outlives `raw`
                # (on the API server a read-only view of the message).
                self._prompts[layout.req_ids[i]] = _PromptAccumulator(table.version, raw[first : first + count], None)
                continue
            acc = self._accumulator(layout.req_ids[i], table, int(p[i]))
            if acc.done:  # a preempted request recomputing its prompt: its summary went out already
                continue
            acc.raw[pos : pos + count] = raw[first : first + count]
            acc.ran[pos : pos + count] = True
        sampled = np.flatnonzero(end >= p)  # a prefill chunk that stops short samples nothing
        if not len(sampled):
            return events
        indexes = (end - p)[sampled]
        req_ids = layout.req_ids
        events.token_req_ids = [req_ids[i] for i in sampled.tolist()]
        events.token_indexes = indexes.tolist()
        events.token_raw = raw[(starts + n - 1)[sampled]]
        for i in sampled[indexes == 0].tolist():  # first sampled token: the prompt is complete
            acc = self._prompts.get(req_ids[i])
            if acc is not None and not acc.done:
                acc.done = True
                events.prompt.append(_prompt_summary(req_ids[i], acc))
                # Only the marker is needed until the request ends: free its rows now.
                acc.raw, acc.ran = _NO_ROWS, _NO_RAN
        return events

    def _record_one(self, req_id: str, computed: int, scheduled: int, prompt_len: int, table: ProbeTable,
                    raw: np.ndarray, events: StepEvents) -> bool:
        """A step of one request (every step of an engine serving one stream), booked with
        plain ints where it is one of the two usual cases: a decode of one token, or the whole
        prompt, not seen before, in this step. False for anything else, for the general path
        (which gives the same for these two; a dozen numpy calls fewer here, on the way to a
        lone request's first token)."""
        if scheduled == 1 and computed >= prompt_len:
            events.token_req_ids = [req_id]
            events.token_indexes = [computed + 1 - prompt_len]
            events.token_raw = raw.copy()  # `raw` may be a staging buffer the next step reuses
            return True
        if computed == 0 and scheduled == prompt_len and req_id not in self._prompts:
            acc = self._prompts[req_id] = _PromptAccumulator(table.version, raw, None, done=True)
            events.prompt.append(_prompt_summary(req_id, acc))
            acc.raw = _NO_ROWS  # only the marker is needed until the request ends
            events.token_req_ids = [req_id]
            events.token_indexes = [0]
            events.token_raw = raw[scheduled - 1 :].copy()
            return True
        return False

    def _accumulator(self, req_id: str, table: ProbeTable, prompt_len: int) -> _PromptAccumulator:
        acc = self._prompts.get(req_id)
        if acc is None or (acc.table_version != table.version and not acc.done):
            # A swap mid-prefill starts the aggregate afresh: mixing two probe sets' values
            # in one mean would be wrong, and tokens_scored then says what was really scored.
            acc = _PromptAccumulator(table.version, np.zeros((prompt_len, len(table.slots)), np.float32),
                                     np.zeros(prompt_len, dtype=bool))
            self._prompts[req_id] = acc
        acc.touched = time.monotonic()
        return acc

    def forget_stale(self, idle_s: float, now: float | None = None) -> int:
        """Drop books not written for `idle_s`: a prompt being prefilled is written every step
        it runs, so an idle one lost its end (a dropped message) and would hold its [P, k]
        array for good. (A complete prompt's book is only a marker; dropping it just leaves
        its request's end unreported, which nothing waits for.)"""
        now = time.monotonic() if now is None else now
        stale = [req_id for req_id, acc in self._prompts.items() if now - acc.touched > idle_s]
        for req_id in stale:
            del self._prompts[req_id]
        return len(stale)

    def finish(self, req_ids: set[str] | list[str]) -> list[str]:
        done = []
        for req_id in req_ids:
            if self._prompts.pop(req_id, None) is not None:
                done.append(req_id)
        return done


def _prompt_summary(req_id: str, acc: _PromptAccumulator) -> dict:
    # On the API server's event loop, on the way to the request's first chunk: numpy reduces
    # a [P, k] block down its long axis slowly (sum and max along axis 0 of a [1024, 8]
    # array takes tens of microseconds). One transposed copy turns both into reductions
    # along contiguous rows (a few microseconds together); the sum is numpy's pairwise one in float32,
    # accurate to float32 rounding times log2(P) (4e-7 relative seen), divided in float64.
    if acc.ran is None:
        scored, tokens_scored = acc.raw, len(acc.raw)
    else:  # the last prompt row always ran, so this is never empty
        tokens_scored = int(np.count_nonzero(acc.ran))
        scored = acc.raw if tokens_scored == len(acc.ran) else acc.raw[acc.ran]
    by_probe = np.ascontiguousarray(scored.T)
    return {
        "req": req_id,
        "prompt_tokens": int(acc.raw.shape[0]),
        "tokens_scored": tokens_scored,
        "last_raw": acc.raw[-1].tolist(),
        "mean_raw": [total / tokens_scored for total in by_probe.sum(axis=1).tolist()],
        "max_raw": by_probe.max(axis=1).tolist(),
    }


# -- the step on the wire ------------------------------------------------------------------------
#
# The worker sends each step as it came off the GPU: the layout and the [rows, k] raw block.
# The books (prompt accumulators, which row is which token) are kept on the receiving side,
# the API server: the worker's consumer (the engine thread itself, or a transfer thread
# sharing the GIL with it) runs as little Python per step as it can.


# Control messages, published by the worker to every API server process beside the steps:
# the tap paused or running again, a probe set or steering vectors swapped in (so each
# process's cached listings are dropped, whichever process took the swap).
CONTROL = "control"
# The publisher's running count, stamped on every message it sends (the ring's publisher, ring.RingPublisher):
# a receiver that finds one missing knows some scores will never come.
SEQUENCE = "seq"


def paused_message(paused: bool, sequence: int) -> dict:
    """`sequence`: the worker's count of pause changes, so a process applies none older than
    what it has (the reply to its own request and the broadcast can cross others)."""
    return {CONTROL: "paused", "paused": bool(paused), "sequence": int(sequence)}


def pause_of(message: dict) -> tuple[int, bool] | None:
    """The worker's pause state a message carries, (pause changes, paused): a step's or a
    heartbeat's `pause`, or a pause message's own (`paused_message`); None where it carries none."""
    if "pause" in message:
        sequence, paused = message["pause"]
        return int(sequence), bool(paused)
    if message.get(CONTROL) == "paused" and message.get("sequence") is not None:
        return int(message["sequence"]), bool(message["paused"])
    return None


def swapped_message(what: str, version: int, dirs: list[str] | None = None) -> dict:
    """`what`: "probes" (`dirs` the new set's artifact directories, for the retention check)
    or "steering"; `version` the new set's."""
    return {CONTROL: "swapped", "what": what, "version": int(version), "dirs": list(dirs or [])}


def heartbeat_message() -> dict:
    """Sent by an idle publisher now and then: its number alone tells a receiver whether the
    last messages before the pause reached it (a step lost at the end of a burst would
    otherwise go unnoticed until traffic resumes)."""
    return {CONTROL: "heartbeat"}


def send_heartbeats(publish, closed, every_s: float, last_send, last_pause, gone: tuple[type[BaseException], ...]) -> None:
    """A worker publisher's heartbeat thread (ZMQ's and the score ring's): until `closed` is set,
    `publish` a heartbeat whenever nothing was sent for `every_s` (`last_send()`, monotonic),
    repeating the last pause state sent (`last_pause()`) for a receiver that missed the change;
    one of `gone` raised means the publisher's channel is gone, and the thread ends."""
    while not closed.wait(every_s):
        if time.monotonic() - last_send() < every_s:
            continue
        message = heartbeat_message()
        pause = last_pause()
        if pause is not None:
            message["pause"] = list(pause)
        try:
            publish(message)
        except gone:
            return


def lost_message(requests: list[str], finished: list[str]) -> dict:
    """A step whose scores could not be sent: receivers stop waiting for scores of `requests`
    (the step's, where its layout was built; the rest of a response's steps still come);
    `finished`, the requests that ended with the step, end all the same."""
    return {CONTROL: "lost", "requests": list(requests), "finished": list(finished)}


def step_message(table: ProbeTable, layout: StepView, raw: np.ndarray | None, finished: list[str],
                 pause: tuple[int, bool] | None = None) -> dict:
    """One step for the wire: ids as a list, the per-request counts and the scores as raw bytes;
    `pause`, the worker's (pause changes, paused) as it sends, so a receiver that lost a pause
    control message is set right by the next step. `raw` None: the scores travel apart (the
    score ring's slot) and the formatter adds them."""
    message = {
        "v": table.version,
        "probes": table.describe(),
        "step": {
            "req": layout.req_ids,
            "scheduled": np.ascontiguousarray(layout.num_scheduled, dtype=np.int64).tobytes(),
            "computed": np.ascontiguousarray(layout.num_computed, dtype=np.int64).tobytes(),
            "prompt": np.ascontiguousarray(layout.num_prompt, dtype=np.int64).tobytes(),
        },
        "finished": finished,
    }
    if layout.dropped:
        message["dropped"] = list(layout.dropped)
    if raw is not None:
        message["raw"] = np.ascontiguousarray(raw, dtype=np.float32).tobytes()
    if pause is not None:
        message["pause"] = [int(pause[0]), bool(pause[1])]
    return message


class StepReader:
    """Receiving side of `step_message`: keeps the books and turns each step into its events."""

    def __init__(self) -> None:
        self.book = ScoreBook()
        self._tables: dict[int, ProbeTable] = {}

    def read(self, message: dict, owner_marker: str | None = None) -> StepEvents:
        """`owner_marker`: with several API server processes, what this process's request ids
        hold (and no other's); the others' rows and ends are left out before any book is
        touched. None: every request."""
        table = self._table(message["v"], message["probes"])
        step = message["step"]
        layout = StepView(
            req_ids=list(step["req"]),
            num_scheduled=np.frombuffer(step["scheduled"], dtype=np.int64),
            num_computed=np.frombuffer(step["computed"], dtype=np.int64),
            num_prompt=np.frombuffer(step["prompt"], dtype=np.int64),
        )
        raw = np.frombuffer(message["raw"], dtype=np.float32).reshape(layout.num_rows, len(table.slots))
        finished = message.get("finished", ())
        dropped = message.get("dropped", ())
        if finished or dropped:
            layout, raw = _without_rows_of(layout, raw, [*finished, *dropped])
        if owner_marker is not None:
            layout, raw = _owned_rows(layout, raw, owner_marker)
            finished = [req for req in finished if owner_marker in req]
        events = self.book.record_step(layout, table, raw)
        events.finished = self.book.finish(finished)
        return events

    def _table(self, version: int, described: list[list]) -> ProbeTable:
        table = self._tables.get(version)
        if table is None:
            # The receiving side needs names, read points and calibration; which buffer slot
            # a probe sat in stays with the worker.
            slots = tuple(ProbeSlot(name=name, layer=layer, slot=column, read=read, slope=slope, intercept=intercept)
                          for column, (name, read, slope, intercept, layer) in enumerate(described))
            table = self._tables[version] = ProbeTable(version=version, slots=slots)
        return table


def _without_rows_of(layout: StepView, raw: np.ndarray, finished) -> tuple[StepView, np.ndarray]:
    """The step without the rows of requests it lists as finished or dropped: an engine that
    schedules a step ahead (SGLang's overlap scheduler) computes rows for a request that had
    already ended, and they are no tokens of its; a dropped request's rows deliver nothing
    (engine_worker/step.py). A request that ends with a step is listed in a later step's
    `finished`, so its own rows are never dropped here."""
    ended = set(finished)
    if not any(req in ended for req in layout.req_ids):
        return layout, raw
    return _kept_rows(layout, raw, [req not in ended for req in layout.req_ids])


def _owned_rows(layout: StepView, raw: np.ndarray, owner_marker: str) -> tuple[StepView, np.ndarray]:
    """The step's requests whose ids hold `owner_marker`, and their rows (each request's rows
    are contiguous, `num_scheduled` of them, in request order). Runs on the API server's
    event loop for every step, in every process: a comprehension with `in`, no call per id."""
    flags = [owner_marker in req for req in layout.req_ids]
    if all(flags):
        return layout, raw
    return _kept_rows(layout, raw, flags)


def _kept_rows(layout: StepView, raw: np.ndarray, flags: list[bool]) -> tuple[StepView, np.ndarray]:
    mine = np.array(flags, dtype=bool)
    kept = StepView(req_ids=[req for req, keep in zip(layout.req_ids, flags) if keep],
                      num_scheduled=layout.num_scheduled[mine], num_computed=layout.num_computed[mine],
                      num_prompt=layout.num_prompt[mine])
    return kept, raw[np.repeat(mine, layout.num_scheduled)]
