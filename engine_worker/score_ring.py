"""Each step's raw probe scores from the worker process to the API server, through shared memory.

Why not a thread and a socket. The scores of a step are on the GPU until the forward
finishes; someone has to wait for that and then send them. A Python thread in the worker
that does it competes with the engine loop for the GIL, and it loses the engine loop time
at the worst moment: the scores land when the step ends, which is exactly when the engine
thread wakes to schedule the next one, and every torch call on the engine thread releases
the GIL, handing it to the waiting thread for its whole turn. On the H200 that cost the
engine about 0.1 ms per step at 8 requests — as much as everything else the tap does.

So nothing in the worker waits. Per step the engine thread

1. writes the step's layout (request ids, rows per request, ...) into the next free slot of
   a ring in shared memory (`/dev/shm`);
2. enqueues one device-to-host copy per tapped layer straight into that slot (the file is
   registered with CUDA, so the copies are asynchronous DMA into the other process's view);
3. records an event on the compute stream and has a side stream wait for it and then run
   `sem_post` on a semaphore that lives in the same file — as a CUDA host function, which
   the driver calls from its own thread (C, no GIL) once the copies are in host memory;

and returns. The API server's reader thread blocks in `sem_wait` (ctypes releases the GIL)
and wakes its event loop, which reads slots in order and frees each by advancing
`consumed`. On the CPU the copy is a memcpy and the semaphore is posted directly: the same
ring and reader, so tests cover everything but the two CUDA calls.

A full ring (the API server `slots` steps behind) makes the engine wait a little, then drop
steps — counted and logged — rather than stall generation behind a dead reader.

The file: a 4 KiB header (geometry, `consumed`, counters, the semaphore), then `slots`
slots of [64-byte slot header | meta (msgpack) | one [max_rows, capacity] float32 block per
tapped layer]. The consumer unlinks the path once it has mapped the file, so nothing is
left behind in /dev/shm once both sides have it open.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import struct
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

log = logging.getLogger("probex.score_ring")

MAGIC = int.from_bytes(b"PROBEXR1", "little")
KIND_STEP, KIND_TABLE = 1, 2

_HEADER_BYTES = 4096
_SLOT_HEADER_BYTES = 64
_MAX_LAYERS = 256
# header offsets
_O_MAGIC, _O_SLOTS, _O_LAYERS_N, _O_SLOT_BYTES, _O_META_BYTES, _O_ROWS, _O_CAPACITY = 0, 8, 12, 16, 24, 32, 36
_O_CONSUMED, _O_PUBLISHED, _O_DROPPED = 64, 72, 80
_O_SEMAPHORE = 128  # sem_t is 32 bytes on x86-64 and aarch64 glibc; 64 reserved
_O_LAYERS = 256
# slot header: seq u64, kind u32, meta length u32, rows u32, pad u32, submitted (CLOCK_MONOTONIC ns) u64
_SLOT_HEADER = struct.Struct("<QIIIIQ")


def default_ring_path() -> str:
    """A fresh path for one worker's ring: in /dev/shm (RAM) where there is one."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return str(base / f"probex-scores-{uuid.uuid4().hex[:12]}.ring")


class RingError(RuntimeError):
    """The ring cannot be created or read (bad file, CUDA refused the registration, ...)."""


@dataclass(frozen=True)
class RingGeometry:
    slots: int
    meta_bytes: int
    max_rows: int
    capacity: int
    layers: tuple[int, ...]

    @property
    def raw_offset(self) -> int:  # within a slot, 64-byte aligned
        return _SLOT_HEADER_BYTES + (self.meta_bytes + 63) // 64 * 64

    @property
    def layer_bytes(self) -> int:
        return self.max_rows * self.capacity * 4

    @property
    def slot_bytes(self) -> int:
        raw_end = self.raw_offset + self.layer_bytes * len(self.layers)
        return (raw_end + 4095) // 4096 * 4096  # page-aligned slots

    @property
    def file_bytes(self) -> int:
        return _HEADER_BYTES + self.slots * self.slot_bytes

    def slot_offset(self, seq: int) -> int:
        return _HEADER_BYTES + ((seq - 1) % self.slots) * self.slot_bytes


class _Semaphore:
    """A process-shared POSIX semaphore living at a fixed address of the ring's mapping."""

    _libc = None

    @classmethod
    def libc(cls):
        if cls._libc is None:
            cls._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            cls._libc.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        return cls._libc

    def __init__(self, address: int) -> None:
        self.address = address
        self._arg = ctypes.c_void_p(address)

    def init(self) -> None:
        if self.libc().sem_init(self._arg, 1, 0) != 0:
            raise RingError(f"sem_init failed: {os.strerror(ctypes.get_errno())}")

    def post(self) -> None:
        self.libc().sem_post(self._arg)

    def wait(self, timeout_s: float) -> int:
        """Block (GIL released) until at least one post; returns how many posts were taken (0 = timeout)."""
        libc = self.libc()
        deadline = time.time() + timeout_s
        spec = (ctypes.c_long * 2)(int(deadline), int((deadline % 1) * 1e9))
        while libc.sem_timedwait(self._arg, spec) != 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err == errno.ETIMEDOUT:
                return 0
            raise RingError(f"sem_timedwait failed: {os.strerror(err)}")
        taken = 1
        while libc.sem_trywait(self._arg) == 0:  # posts that piled up: one wake-up for all of them
            taken += 1
        return taken

    @property
    def function_pointer(self) -> int:
        return ctypes.cast(self.libc().sem_post, ctypes.c_void_p).value


class _CudaDriver:
    """The handful of CUDA driver calls the writer makes per step, through ctypes: each costs
    about a microsecond, against several for the same thing through torch's dispatcher."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise RingError(f"scores are on a CUDA device but libcuda.so.1 cannot be loaded: {exc}") from None
        self.lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self.lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.lib.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self.lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self.lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        self.lib.cuEventCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]

    def check(self, result: int, what: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(name))
            raise RingError(f"{what} failed: {name.value.decode() if name.value else result}")

    def event(self) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        self.check(self.lib.cuEventCreate(ctypes.byref(handle), 2), "cuEventCreate")  # 2: CU_EVENT_DISABLE_TIMING
        return handle


class ScoreRingWriter:
    """Worker side. `sources`: tapped layer -> its static [max_rows, capacity] float32 score buffer."""

    def __init__(self, path: str, sources: dict[int, Any], slots: int = 16, meta_bytes: int = 256 * 1024,
                 full_wait_s: float = 1.0) -> None:
        import torch

        if not sources:
            raise ValueError("ScoreRingWriter needs at least one score buffer")
        if slots < 2:
            raise ValueError("the score ring needs at least two slots")
        shapes = {tuple(t.shape) for t in sources.values()}
        if len(shapes) != 1 or any(t.dtype != torch.float32 or not t.is_contiguous() for t in sources.values()):
            raise ValueError("score buffers must be contiguous float32 tensors of one shape")
        if len(sources) > _MAX_LAYERS:
            raise ValueError(f"at most {_MAX_LAYERS} tapped layers")
        (max_rows, capacity), = shapes
        self.path = path
        self.geometry = RingGeometry(slots, meta_bytes, max_rows, capacity, tuple(sorted(sources)))
        self._sources = [sources[layer] for layer in self.geometry.layers]
        self.full_wait_s = full_wait_s
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._stalled = False
        self.published = 0
        self.dropped = 0
        self.waits_for_space = 0
        self.stage_s = 0.0  # engine-thread time in publish: meta, copies, post

        g = self.geometry
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        try:
            try:
                # Reserve the pages now: on a full tmpfs a sparse file would fail later, as SIGBUS mid-step.
                os.posix_fallocate(fd, 0, g.file_bytes)
            except OSError as exc:
                os.unlink(path)
                raise RingError(f"cannot reserve {g.file_bytes / 2**20:.1f} MiB for the score ring {path}: {exc}"
                                " (in a container, give it more shared memory, e.g. docker --shm-size)") from None
            self._map = mmap.mmap(fd, g.file_bytes)
        finally:
            os.close(fd)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._u64 = np.ndarray((_HEADER_BYTES // 8,), dtype=np.uint64, buffer=self._map)
        struct.pack_into("<IIQQII", self._map, _O_SLOTS, g.slots, len(g.layers), g.slot_bytes, g.meta_bytes,
                         g.max_rows, g.capacity)
        struct.pack_into(f"<{len(g.layers)}I", self._map, _O_LAYERS, *g.layers)
        self._semaphore = _Semaphore(self._base + _O_SEMAPHORE)
        self._semaphore.init()
        # Per slot and layer: where the layer's block starts, as an address (GPU copies) and an array (CPU).
        self._slot_blocks = [
            [g.slot_offset(seq) + g.raw_offset + j * g.layer_bytes for j in range(len(g.layers))]
            for seq in range(1, g.slots + 1)
        ]
        self._cuda = self._sources[0].is_cuda
        if self._cuda:
            self._driver = _CudaDriver()
            torch.cuda.current_stream().synchronize()  # the context exists and is current on this thread
            self._driver.check(self._driver.lib.cuMemHostRegister_v2(self._base, g.file_bytes, 0),
                               f"registering the score ring {path} with CUDA (cuMemHostRegister)")
            self._event = self._driver.event()
            self._side_stream = torch.cuda.Stream()  # waits for the copies, then posts: never the compute stream
            self._side_handle = ctypes.c_void_p(self._side_stream.cuda_stream)
            self._post_fn = ctypes.c_void_p(self._semaphore.function_pointer)
            self._post_arg = ctypes.c_void_p(self._semaphore.address)
            self._source_ptrs = [t.data_ptr() for t in self._sources]
        self._u64[_O_MAGIC // 8] = MAGIC  # last: a reader that sees the magic sees a complete header

    # -- per step (engine thread) -----------------------------------------------------------------

    def publish_step(self, rows: int, meta: dict) -> bool:
        """Queue one step: `meta` now, the first `rows` rows of every score buffer once the
        forward that fills them has run. Never waits for the device. False if dropped."""
        started = time.perf_counter()
        try:
            return self._publish(KIND_STEP, rows, meta)
        finally:
            self.stage_s += time.perf_counter() - started

    def publish_table(self, meta: dict) -> bool:
        """A probe-table description; ordered with the steps around it."""
        return self._publish(KIND_TABLE, 0, meta)

    def _publish(self, kind: int, rows: int, meta: dict) -> bool:
        if rows > self.geometry.max_rows:
            raise ValueError(f"{rows} rows exceed the score ring's {self.geometry.max_rows}")
        encoded = self._encoder.encode(meta)
        if len(encoded) > self.geometry.meta_bytes:
            return self._drop(f"a step's description ({len(encoded)} bytes) does not fit the ring's"
                              f" {self.geometry.meta_bytes}-byte slots")
        seq = self._seq + 1
        if not self._has_space(seq):
            return self._drop("the API server is not reading scores")
        offset = self.geometry.slot_offset(seq)
        start = offset + _SLOT_HEADER_BYTES
        self._map[start : start + len(encoded)] = encoded
        _SLOT_HEADER.pack_into(self._map, offset, seq, kind, len(encoded), rows, 0, time.monotonic_ns())
        blocks = self._slot_blocks[(seq - 1) % self.geometry.slots]
        if self._cuda:
            self._post_after_device(blocks, rows)
        else:
            for block, source in zip(blocks, self._sources):
                if rows:
                    ctypes.memmove(self._base + block, source.data_ptr(), rows * self.geometry.capacity * 4)
            self._semaphore.post()
        self._seq = seq
        self._u64[_O_PUBLISHED // 8] = seq
        self.published += 1
        return True

    def _post_after_device(self, blocks: list[int], rows: int) -> None:
        import torch

        lib, check = self._driver.lib, self._driver.check
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if rows:
            nbytes = rows * self.geometry.capacity * 4
            for block, source in zip(blocks, self._source_ptrs):
                check(lib.cuMemcpyDtoHAsync_v2(self._base + block, source, nbytes, stream), "cuMemcpyDtoHAsync")
        check(lib.cuEventRecord(self._event, stream), "cuEventRecord")
        check(lib.cuStreamWaitEvent(self._side_handle, self._event, 0), "cuStreamWaitEvent")
        check(lib.cuLaunchHostFunc(self._side_handle, self._post_fn, self._post_arg), "cuLaunchHostFunc")

    def _has_space(self, seq: int) -> bool:
        consumed = int(self._u64[_O_CONSUMED // 8])
        if seq - consumed <= self.geometry.slots:
            self._stalled = False
            return True
        if self._stalled:  # already dropping: do not make every step wait for a reader that is gone
            return False
        self.waits_for_space += 1
        deadline = time.monotonic() + self.full_wait_s
        while time.monotonic() < deadline:
            time.sleep(0.0002)
            if seq - int(self._u64[_O_CONSUMED // 8]) <= self.geometry.slots:
                return True
        self._stalled = True
        return False

    def _drop(self, why: str) -> bool:
        self.dropped += 1
        self._u64[_O_DROPPED // 8] = self.dropped
        if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
            log.warning("probex: %d score steps dropped: %s", self.dropped, why)
        return False

    def flush(self) -> None:
        """Wait until every queued step is visible to the reader (tests, shutdown)."""
        if self._cuda:
            import torch

            torch.cuda.current_stream().synchronize()
            self._side_stream.synchronize()

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "slots": self.geometry.slots, "published": self.published,
                "dropped": self.dropped, "waits_for_space": self.waits_for_space, "stage_s": self.stage_s}


@dataclass
class RingRecord:
    """One slot as read: its sequence number, kind, decoded meta and, for steps, each layer's
    raw rows (views into shared memory, valid until `ScoreRingReader.release`)."""

    seq: int
    kind: int
    meta: Any
    rows: int
    raw_by_layer: dict[int, np.ndarray]
    submitted_ns: int


class ScoreRingReader:
    """API-server side: maps the ring a worker created and reads its slots in order."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._map: mmap.mmap | None = None
        self._decoder = msgspec.msgpack.Decoder()
        self.next_seq = 1

    def attach(self, unlink: bool = True) -> bool:
        """Map the file if the worker has finished creating it. `unlink`: remove the path once
        mapped (the mapping keeps the memory alive; nothing is left in /dev/shm)."""
        if self._map is not None:
            return True
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER_BYTES:
                return False
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if struct.unpack_from("<Q", mapped, _O_MAGIC)[0] != MAGIC:
            mapped.close()
            return False
        slots, n_layers, slot_bytes, meta_bytes, max_rows, capacity = struct.unpack_from("<IIQQII", mapped, _O_SLOTS)
        layers = struct.unpack_from(f"<{n_layers}I", mapped, _O_LAYERS)
        self.geometry = RingGeometry(slots, meta_bytes, max_rows, capacity, tuple(layers))
        if self.geometry.slot_bytes != slot_bytes or self.geometry.file_bytes > size:
            mapped.close()
            raise RingError(f"{self.path}: ring geometry does not match its size (another ProbeX version?)")
        self._map = mapped
        self._u64 = np.ndarray((_HEADER_BYTES // 8,), dtype=np.uint64, buffer=mapped)
        self._semaphore = _Semaphore(ctypes.addressof(ctypes.c_char.from_buffer(mapped)) + _O_SEMAPHORE)
        self.next_seq = int(self._u64[_O_CONSUMED // 8]) + 1
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        return True

    @property
    def attached(self) -> bool:
        return self._map is not None

    def wait(self, timeout_s: float) -> int:
        """Block until the worker posts (GIL released); how many slots became readable (0 = timeout)."""
        return self._semaphore.wait(timeout_s)

    def read(self) -> RingRecord:
        """The next slot, which the caller knows is posted (from `wait`)."""
        g = self.geometry
        offset = g.slot_offset(self.next_seq)
        seq, kind, meta_len, rows, _, submitted = _SLOT_HEADER.unpack_from(self._map, offset)
        if seq != self.next_seq:
            raise RingError(f"score ring out of step: expected slot {self.next_seq}, found {seq}")
        start = offset + _SLOT_HEADER_BYTES
        meta = self._decoder.decode(self._map[start : start + meta_len])
        raw_by_layer = {}
        if rows:
            for j, layer in enumerate(g.layers):
                raw_by_layer[layer] = np.ndarray((rows, g.capacity), dtype=np.float32, buffer=self._map,
                                                 offset=offset + g.raw_offset + j * g.layer_bytes)
        return RingRecord(seq, kind, meta, rows, raw_by_layer, submitted)

    def release(self, record: RingRecord) -> None:
        """The slot may be reused: the caller has copied what it keeps."""
        self._u64[_O_CONSUMED // 8] = record.seq
        self.next_seq = record.seq + 1

    @property
    def dropped(self) -> int:
        return int(self._u64[_O_DROPPED // 8]) if self._map is not None else 0


class RingFollower:
    """A daemon thread that waits on the ring's semaphore and tells `on_posted(count)` — which
    it calls through `notify`, e.g. `loop.call_soon_threadsafe` — how many slots became readable."""

    def __init__(self, reader: ScoreRingReader, notify, on_posted, poll_s: float = 1.0) -> None:
        self._reader, self._notify, self._on_posted, self._poll_s = reader, notify, on_posted, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probex-score-ring", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                count = self._reader.wait(self._poll_s)
            except RingError:
                log.exception("probex: waiting on the score ring failed; scores stop here")
                return
            if count:
                try:
                    self._notify(self._on_posted, count)
                except RuntimeError:  # the event loop closed: the server is shutting down
                    return

    def stop(self) -> None:
        self._stop.set()
