"""A shared-memory ring from the worker's engine thread to the score formatter's process.

Why: when the engine thread runs behind the device, every microsecond of ProbeX work on it
lands on the next first token. So the engine process never waits for a step's copies, gathers
probe columns, encodes or sends anything; through this ring the engine thread only stages
the step:

1. it takes the ring's next entry (`RingPublisher.reserve`), which fixes the step's place in
   the order of everything the worker sends and its message number;
2. it enqueues the copies of the step's score rows from the device straight into the entry's
   slot (this memory is registered with the CUDA driver, so the copy engine writes it), and
   behind them a stream memory write of the entry's ticket into the slot's `landed` word: the
   device itself says when the rows are there, and no host thread waits on an event;
3. it writes the step's description (request ids and token counts, msgpack, no scores) and,
   last, the entry's ticket into the slot's `committed` word (`RingPublisher.commit`).

The formatter polls the next entry: once it is committed, and for a step once its rows have
landed, it gathers the probe columns, keeps the books and sends every API server its part,
then counts the entry done (`consumed`), which frees the slot. On the CPU backend the engine
thread copies synchronously and writes `landed` itself.

Control messages (pause, swap, a lost step, the worker's heartbeats) take entries too, so the
formatter reads everything in the order the worker sent it, with one running message number.
The ring is a memfd: the formatter inherits its descriptor, so nothing is left in /dev/shm
when the worker dies, and a formatter started again attaches to the same ring and goes on
from the first entry not counted done.

Layout (native byte order; x86's store order is what makes `committed` safe to write last):

    header, HEADER_BYTES: magic, format, slots, slot bytes, meta capacity, layer count, then per
        layer (layer, rows, width, offset in a slot); CONSUMED_WORD: entries done (formatter)
    slot i at HEADER_BYTES + i * slot_bytes:
        +0 committed ticket (int64)   +8 kind (int64)   +16 meta length (int64)
        +64 landed ticket (uint32: the ticket's low 32 bits)
        +128 meta (msgpack), then each layer's scores [rows, width] float32

Entry n (from 0) lives in slot n % slots and has ticket n + 1. No torch and no vLLM here.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass

import msgspec
import numpy as np

from engine_worker.scores.bookkeeping import CONTROL, SEQUENCE, heartbeat_message, lost_message, pause_of, send_heartbeats

log = logging.getLogger("probex.score_ring")

MAGIC = 0x50524258_52494E47  # "PRBXRING"
FORMAT = 1
HEADER_BYTES = 4096
CONSUMED_WORD = 256  # int64 index into the header: entries the formatter has finished
_LAYERS_WORD = 8  # per-layer geometry starts here, 4 words a layer
MAX_LAYERS = (CONSUMED_WORD - _LAYERS_WORD) // 4
_LANDED_OFFSET = 64
_META_OFFSET = 128
_ALIGN = 64

MESSAGE = 1  # a complete message (control, or a step without rows)
STEP = 2  # a step whose scores are in the slot once `landed` holds its ticket


class MetaTooLarge(ValueError):
    pass


def _aligned(n: int, to: int = _ALIGN) -> int:
    return (n + to - 1) // to * to


class ScoreRing:
    """The mapped ring, for either side: geometry, views and the raw word accesses."""

    def __init__(self, fd: int, owner: bool) -> None:
        self.fd = fd
        self._owner = owner
        size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.size = size
        self._words = np.frombuffer(self._map, dtype=np.int64)
        self._u32 = np.frombuffer(self._map, dtype=np.uint32)
        if int(self._words[0]) != MAGIC or int(self._words[1]) != FORMAT:
            raise ValueError("probex: not a score ring of this format")
        self.slots, self.slot_bytes, self.meta_capacity, count = (int(w) for w in self._words[2:6])
        self.layers: dict[int, tuple[int, int, int]] = {}  # layer -> (rows, width, offset in a slot)
        for i in range(count):
            layer, rows, width, offset = (int(w) for w in self._words[_LAYERS_WORD + 4 * i:_LAYERS_WORD + 4 * i + 4])
            self.layers[layer] = (rows, width, offset)
        # Per slot and layer, the scores as numpy views of the mapping, made once.
        self._scores = [{layer: np.ndarray((rows, width), dtype=np.float32, buffer=self._map,
                                           offset=self.slot_offset(slot) + offset)
                         for layer, (rows, width, offset) in self.layers.items()} for slot in range(self.slots)]

    @classmethod
    def create(cls, layers: dict[int, tuple[int, int]], slots: int = 16, meta_capacity: int = 1 << 18) -> "ScoreRing":
        """A new ring in a memfd: `layers` maps each tapped layer to its score buffer's (rows, width)."""
        if slots < 2:
            raise ValueError("a score ring needs at least two slots")
        if not 0 < len(layers) <= MAX_LAYERS:
            raise ValueError(f"a score ring holds 1 to {MAX_LAYERS} layers, not {len(layers)}")
        offset = _aligned(_META_OFFSET + meta_capacity)
        geometry = []
        for layer, (rows, width) in sorted(layers.items()):
            geometry.append((layer, rows, width, offset))
            offset = _aligned(offset + rows * width * 4)
        slot_bytes = _aligned(offset, mmap.PAGESIZE)
        fd = os.memfd_create("probex-score-ring")  # close-on-exec: the formatter gets it through pass_fds
        try:
            os.ftruncate(fd, HEADER_BYTES + slots * slot_bytes)
            header = mmap.mmap(fd, HEADER_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            words = np.frombuffer(header, dtype=np.int64)
            words[:6] = (MAGIC, FORMAT, slots, slot_bytes, meta_capacity, len(geometry))
            for i, entry in enumerate(geometry):
                words[_LAYERS_WORD + 4 * i:_LAYERS_WORD + 4 * i + 4] = entry
            del words
            header.close()
            return cls(fd, owner=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int) -> "ScoreRing":
        return cls(fd, owner=False)

    # -- geometry ----------------------------------------------------------------------------

    @property
    def address(self) -> int:
        """The mapping's address in this process (for registering it with the CUDA driver)."""
        return self._words.ctypes.data

    def slot_offset(self, slot: int) -> int:
        return HEADER_BYTES + slot * self.slot_bytes

    def landed_offset(self, slot: int) -> int:
        return self.slot_offset(slot) + _LANDED_OFFSET

    def scores_offset(self, slot: int, layer: int) -> int:
        return self.slot_offset(slot) + self.layers[layer][2]

    def scores(self, slot: int) -> dict[int, np.ndarray]:
        """layer -> [rows, width] float32 view of the slot's score area."""
        return self._scores[slot]

    # -- words ------------------------------------------------------------------------------

    @property
    def consumed(self) -> int:
        return int(self._words[CONSUMED_WORD])

    def count_consumed(self, consumed: int) -> None:
        """The formatter: entries below `consumed` are done, their slots free."""
        self._words[CONSUMED_WORD] = consumed

    def committed(self, slot: int) -> int:
        return int(self._words[self.slot_offset(slot) // 8])

    def landed(self, slot: int) -> int:
        return int(self._u32[self.landed_offset(slot) // 4])

    def mark_landed(self, slot: int, ticket: int) -> None:
        """Where no device writes it (the CPU backend, synchronous copies): after the copies."""
        self._u32[self.landed_offset(slot) // 4] = ticket & 0xFFFFFFFF

    def write_entry(self, slot: int, ticket: int, kind: int, meta: bytes) -> None:
        """The producer: the entry's message, then its kind and length, its ticket last."""
        if len(meta) > self.meta_capacity:
            raise MetaTooLarge(f"a {len(meta)}-byte message does not fit a score ring slot's {self.meta_capacity}")
        base = self.slot_offset(slot)
        self._map[base + _META_OFFSET:base + _META_OFFSET + len(meta)] = meta
        word = base // 8
        self._words[word + 1] = kind
        self._words[word + 2] = len(meta)
        self._words[word] = ticket  # last: the formatter reads nothing of the entry before it

    def entry(self, slot: int) -> tuple[int, bytes]:
        """(kind, message) of a committed entry."""
        word = self.slot_offset(slot) // 8
        kind, length = int(self._words[word + 1]), int(self._words[word + 2])
        start = self.slot_offset(slot) + _META_OFFSET
        return kind, self._map[start:start + length]

    def close(self) -> None:
        self._scores = []
        del self._words, self._u32
        try:
            self._map.close()
        except BufferError:  # a view is still held somewhere; the mapping goes with the process
            pass
        if self._owner:
            os.close(self.fd)


@dataclass(frozen=True)
class RingEntry:
    """A reserved place in the ring: its slot, ticket and message number."""

    slot: int
    ticket: int
    sequence: int


class RingPublisher:
    """The worker's side of the ring: every message
    numbered (`SEQUENCE`), a heartbeat each `heartbeat_s` while nothing else is sent, the last
    pause state repeated in it — with a step's entry reserved before its copies are enqueued.

    A full ring (the formatter that far behind, or gone while it is started again) is waited
    for up to `full_wait_s`; past that the message is dropped, its number skipped, and the
    formatter, finding the gap, tells every API server process so (their responses stop
    waiting for those scores) rather than the engine waiting on another process. Once one is
    dropped, later ones are dropped without waiting until the ring has room again: a formatter
    that is gone for a second costs the engine one wait, not one per step."""

    def __init__(self, ring: ScoreRing, heartbeat_s: float = 1.0, full_wait_s: float = 0.1) -> None:
        self.ring = ring
        self.full_wait_s = full_wait_s
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()  # the engine thread and the heartbeat thread both reserve
        self.sequence = 0
        self.produced = 0  # entries reserved
        self.dropped = 0  # messages the full ring had no room for
        self.oversized = 0  # messages too large for a slot (sent as a loss)
        self._pause: tuple[int, bool] | None = None
        self._last_send = time.monotonic()
        self._dropping = False  # the last reservation found the ring full: the next does not wait
        self._closed = threading.Event()
        if heartbeat_s > 0:
            threading.Thread(target=self._heartbeats, args=(heartbeat_s,), name="probex-ring-heartbeat",
                             daemon=True).start()

    def reserve(self) -> RingEntry | None:
        """The next entry, or None where the ring stayed full for `full_wait_s` (the message's
        number is used up all the same: the formatter sees the gap)."""
        deadline = None
        while True:
            with self._lock:
                if self.produced - self.ring.consumed < self.ring.slots:
                    self.sequence += 1
                    entry = RingEntry(self.produced % self.ring.slots, self.produced + 1, self.sequence)
                    self.produced += 1
                    self._last_send = time.monotonic()
                    self._dropping = False
                    return entry
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self.full_wait_s
                if now >= deadline or self._dropping:
                    self._dropping = True
                    self.sequence += 1
                    self.dropped += 1
                    if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                        log.error("probex: the score ring stayed full for %.0f ms (the score formatter is behind or "
                                  "gone); %d messages dropped so far", self.full_wait_s * 1e3, self.dropped)
                    return None
            time.sleep(0.0005)

    def commit(self, entry: RingEntry, message: dict, kind: int = MESSAGE) -> None:
        """The entry's message (a step's, `STEP`, without its scores: they are in the slot)."""
        pause = pause_of(message)
        if pause is not None:
            self._pause = pause
        message[SEQUENCE] = entry.sequence
        try:
            meta = self._encoder.encode(message)
            self.ring.write_entry(entry.slot, entry.ticket, kind, meta)
        except MetaTooLarge:
            self.oversized += 1
            log.error("probex: a score message was too large for the ring (%d times); sent as lost", self.oversized)
            step = message.get("step") or {}
            lost = lost_message(list(step.get("req", ())), list(message.get("finished", ())))
            lost[SEQUENCE] = entry.sequence
            meta = self._encoder.encode(lost)
            if len(meta) > self.ring.meta_capacity:
                meta = self._encoder.encode({CONTROL: "lost", "requests": [], "finished": [], SEQUENCE: entry.sequence})
            self.ring.write_entry(entry.slot, entry.ticket, MESSAGE, meta)

    def skip(self, entry: RingEntry) -> None:
        """A reserved entry that carries nothing after all (a step that never ran): a heartbeat
        in its place keeps the order and the count."""
        self.commit(entry, heartbeat_message())

    def publish(self, message: dict) -> None:
        entry = self.reserve()
        if entry is not None:
            self.commit(entry, message)

    def drained(self) -> bool:
        return self.ring.consumed >= self.produced

    def close(self) -> None:
        self._closed.set()

    def _heartbeats(self, every_s: float) -> None:
        # any error: the ring is gone with the worker
        send_heartbeats(self.publish, self._closed, every_s, lambda: self._last_send, lambda: self._pause,
                        (Exception,))


class RingReader:
    """The formatter's side: the next entry once it is committed (and, for a step, landed)."""

    def __init__(self, ring: ScoreRing) -> None:
        self.ring = ring
        self.next = ring.consumed  # a formatter started again goes on where the last one stopped

    def poll(self) -> tuple[int, bytes, dict[int, np.ndarray]] | None:
        """(kind, message, the slot's scores) of the next entry if it is ready; None if not yet
        (not committed, or a step whose rows have not landed)."""
        slot = self.next % self.ring.slots
        ticket = self.next + 1
        if self.ring.committed(slot) != ticket:
            return None
        kind, meta = self.ring.entry(slot)
        if kind == STEP and self.ring.landed(slot) != ticket & 0xFFFFFFFF:
            return None
        return kind, meta, self.ring.scores(slot)

    def waiting_for_device(self) -> bool:
        """The next entry is a step whose rows are still on their way: it will be ready soon."""
        slot = self.next % self.ring.slots
        return self.ring.committed(slot) == self.next + 1

    def done(self) -> None:
        """The entry `poll` returned is finished with: its slot may be reused."""
        self.next += 1
        self.ring.count_consumed(self.next)
