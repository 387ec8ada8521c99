"""Moving each step's raw probe scores to the host without stalling the engine loop.

Reading a device buffer with `.cpu()` right after the forward waits for the whole
forward to finish: the engine loop then cannot prepare the next step while the GPU
works, which costs more than the probes themselves. Instead, after each forward the
engine thread only *enqueues* a device→host copy of the step's few score floats into a
pinned staging buffer and records a CUDA event. The step is consumed (bookkeeping and
publishing, in step order) once the event has completed: by a background transfer thread
that waits on it, or by the engine thread where it finds it complete (`consumer`, below).

The wait must not compete with the engine thread for the GIL. `Event.query()` holds the
GIL, so polling it (even with sleeps between polls) wakes the thread thousands of times a
second and each wake-up takes the GIL from the engine loop — measured on the H200 as a few
percent of decode speed at batch 8. Waiting in the driver (`cuEventSynchronize`) releases
the GIL, and events created with CU_EVENT_BLOCKING_SYNC put the waiting thread to sleep
instead of spinning: one GIL acquisition per step, after the scores have landed. (Spinning
instead, so a prompt step's consume would start with no wake-up, was measured on the H200 in
session 27: the consume was no quicker and the first token no sooner, while a core spun through
every forward; see docs/benchmark-sessions.md.)

The copies and the event go to the CUDA driver directly (`_CudaDriver`), not through
torch: on the H200 host the engine thread spent two thirds of its hook in these calls,
73-81 µs per step through torch (two `copy_`, one `Event.record`), which releases the GIL
around every call and so lets vLLM's own I/O threads in halfway through the hook. Called
through ctypes' PyDLL they keep the GIL for the microseconds they take. (Made after that
measurement; not yet measured on the GPU itself.)

A prompt step's copies can leave earlier than that (PROBEX_PROMPT_SCORES_MID_FORWARD, on by
default): the adapter reserves a staging buffer before such a step's forward (`reserve_step`),
and the model's hook (engine_worker/vllm_models.py) enqueues each tapped layer's copy as soon
as the forward has enqueued that layer's tap op (`copy_layer_now`), the ready event after the
last one; the step's `submit` then enqueues nothing. Its scores land while the rest of the
forward runs, so their consume (layout, gather, publish) is done before the step's tokens are
sampled instead of after. Decode steps replay whole CUDA graphs, with no host code mid-forward:
they keep the copies behind the forward.

Staging buffers come from a fixed pool, so nothing is allocated per step. If every
buffer is still in use (the background thread fell `depth` steps behind), `submit`
waits for one: bounded memory and back-pressure rather than silently dropping scores.

On the CPU there is no asynchrony to gain: the copy is a memcpy, and the same thread
keeps the engine-facing behaviour identical to the GPU path (and tested).

`copy_stream="side"` (PROBEX_COPY_STREAM=side; an experiment, off by default) moves the
copies off the engine's stream: the engine stream records an event after the forward, a
side stream waits for it and copies, and the next forward's stream waits for the copy
before it can overwrite the score buffers (`before_next_forward`, which the runner
adapters call before every forward). The copies' device latency then overlaps sampling
instead of preceding it, for two more driver calls per step on the host.

`consumer="engine"` (the default on one GPU where the runner reads a step's tokens through an
async output: V2, and V1 with async scheduling; `TapController`
takes it from the adapter, PROBEX_SCORE_CONSUMER overrides) takes the transfer thread out of
the per-step path. The engine thread consumes the pending steps, in order: where the engine
is about to wait for a step's sampled tokens, the adapters' shared wrapper
(`vllm_worker.scores_with_sampled_tokens`) calls `consume_through`, which
waits (`cuEventSynchronize`, GIL released) for the copies of the steps up to that one —
queued ahead of its sampling, they land first, so its scores leave ahead of its tokens
while the device samples — then, after the tokens, `consume_landed`; and at the end of
each hook, after staging its own step, it takes what has landed without waiting (a
non-blocking `cuEventQuery`). With side-stream copies (which may land after the tokens)
`consume_through` does nothing, so scores are consumed after their tokens. A step without
rows (requests ending, the engine about to idle) consumes everything still pending,
waiting if it must; so does a hook that finds every staging buffer pending (the oldest
only). A watchdog thread, waking every `stale_after_s`, consumes what has landed once the
engine has not come by for that long (an engine that stopped calling the hook); it waits
for the device outside the lock, so an engine that comes back never waits for it. On the H200 the two consumers measured
the same speed (docs/benchmark-sessions.md, session 8); the engine consumer wakes no second
thread per step.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

log = logging.getLogger("probex.transfer")

@dataclass(frozen=True)
class _LayerCopy:
    """One tapped layer's rows, device buffer -> a slot's pinned buffer: tensors and raw addresses."""

    layer: int
    source: torch.Tensor
    target: torch.Tensor
    source_ptr: int
    target_ptr: int
    row_bytes: int


class _CudaDriver:
    """The per-step CUDA calls of the hand-off, made on the driver API through ctypes.

    `lib` issues the engine thread's calls (copy, event record) holding the GIL: each
    returns in microseconds, and releasing the GIL around it, as ctypes.CDLL and torch do,
    lets other Python threads in the engine process in between. (Only a full CUDA launch
    queue could make one block, with the GIL held; vLLM keeps a step or two in flight.)
    `waiting` waits for an event with the GIL released, for the transfer thread.
    """

    CU_EVENT_BLOCKING_SYNC = 0x1  # the waiter sleeps in the driver instead of spinning
    CU_EVENT_DISABLE_TIMING = 0x2

    def __init__(self, device: torch.device) -> None:
        """On the engine thread, where torch has made the device's context current."""
        self.device = device
        self._device_index = device.index if device.index is not None else torch.cuda.current_device()
        # The raw handle of the current stream without building a torch Stream object (what
        # torch's own generated code calls); a few µs less per step than current_stream().
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self.lib = ctypes.PyDLL("libcuda.so.1")
        self.waiting = ctypes.CDLL("libcuda.so.1")
        for fn, argtypes in ((self.lib.cuMemcpyDtoHAsync_v2, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]),
                             (self.lib.cuEventRecord, [ctypes.c_void_p, ctypes.c_void_p]),
                             (self.lib.cuEventCreate, [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]),
                             (self.lib.cuCtxGetCurrent, [ctypes.POINTER(ctypes.c_void_p)]),
                             (self.lib.cuCtxSetCurrent, [ctypes.c_void_p]),
                             (self.lib.cuStreamCreate, [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]),
                             (self.lib.cuStreamWaitEvent, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]),
                             (self.lib.cuEventQuery, [ctypes.c_void_p]),
                             (self.waiting.cuEventSynchronize, [ctypes.c_void_p])):
            fn.argtypes = argtypes
        with torch.cuda.device(device):
            torch.cuda.current_stream(device).synchronize()  # the device's context exists and is current here
            self.context = ctypes.c_void_p()
            self.check(self.lib.cuCtxGetCurrent(ctypes.byref(self.context)), "cuCtxGetCurrent")
        if not self.context.value:
            raise RuntimeError(f"probex: no CUDA context is current for {device} on the engine thread")

    def bind_thread(self) -> None:
        """Make the engine's context current on the calling (transfer) thread."""
        self.check(self.lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"probex: {what} failed with CUDA driver error {result}")

    CU_STREAM_NON_BLOCKING = 0x1  # no implicit ordering with the legacy default stream

    def event(self, blocking: bool = True) -> ctypes.c_void_p:
        """`blocking`: a host thread waits for it (sleeping); otherwise only streams do."""
        handle = ctypes.c_void_p()
        flags = self.CU_EVENT_DISABLE_TIMING | (self.CU_EVENT_BLOCKING_SYNC if blocking else 0)
        self.check(self.lib.cuEventCreate(ctypes.byref(handle), flags), "cuEventCreate")
        return handle

    def stream(self) -> ctypes.c_void_p:
        with torch.cuda.device(self.device):  # the engine's context, current on this thread
            handle = ctypes.c_void_p()
            self.check(self.lib.cuStreamCreate(ctypes.byref(handle), self.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        return handle

    def wait_event(self, stream, event: ctypes.c_void_p) -> None:
        """Work enqueued on `stream` after this waits for `event` (on the device; the host goes on)."""
        self.check(self.lib.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")

    def current_stream(self) -> int:
        """The stream the forward was just enqueued on (the copies must queue behind it)."""
        if self._raw_stream is not None:
            return self._raw_stream(self._device_index)
        return torch.cuda.current_stream(self.device).cuda_stream

    def copy_rows(self, copy: _LayerCopy, rows: int, stream: int) -> None:
        self.check(self.lib.cuMemcpyDtoHAsync_v2(copy.target_ptr, copy.source_ptr, rows * copy.row_bytes, stream),
                   "cuMemcpyDtoHAsync")

    def record(self, event: ctypes.c_void_p, stream: int) -> None:
        self.check(self.lib.cuEventRecord(event, stream), "cuEventRecord")

    def synchronize(self, event: ctypes.c_void_p) -> None:
        self.check(self.waiting.cuEventSynchronize(event), "cuEventSynchronize")

    CU_MEMHOSTREGISTER_PORTABLE = 0x1
    CU_MEMHOSTREGISTER_DEVICEMAP = 0x2

    def register_host_memory(self, address: int, size: int) -> int:
        """Pin `size` bytes of this process's memory at `address` (the score ring's shared
        mapping) for the device to write by DMA and by stream memory writes; returns the
        device address of `address`. Once, at start-up, on the engine thread."""
        lib = self.lib
        lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        with torch.cuda.device(self.device):
            self.check(lib.cuMemHostRegister_v2(address, size, self.CU_MEMHOSTREGISTER_PORTABLE
                                                | self.CU_MEMHOSTREGISTER_DEVICEMAP), "cuMemHostRegister")
            device_address = ctypes.c_uint64()
            self.check(lib.cuMemHostGetDevicePointer_v2(ctypes.byref(device_address), address, 0),
                       "cuMemHostGetDevicePointer")
        # The V2 entry point of stream memory operations (CUDA 11.7 on) needs no driver
        # module option, unlike the first one.
        write = getattr(lib, "cuStreamWriteValue32_v2", None) or lib.cuStreamWriteValue32
        write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._write_value = write
        return device_address.value

    def write_value(self, device_address: int, value: int, stream: int) -> None:
        """Enqueue a write of `value` to `device_address` behind the stream's work so far (with
        a memory fence: what the stream wrote before is visible first)."""
        self.check(self._write_value(stream, device_address, value & 0xFFFFFFFF, 0), "cuStreamWriteValue32")

    CUDA_ERROR_NOT_READY = 600

    def query(self, event: ctypes.c_void_p) -> bool:
        """Has the work before `event` finished? Never waits (engine thread, GIL held)."""
        result = self.lib.cuEventQuery(event)
        if result == self.CUDA_ERROR_NOT_READY:
            return False
        self.check(result, "cuEventQuery")
        return True


class _TorchCopies:
    """The same calls through torch, for a CUDA-type device without libcuda.so.1 (ROCm's HIP
    builds report their GPUs as "cuda"): correct, with torch's per-call cost."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def bind_thread(self) -> None:
        pass

    def event(self, blocking: bool = True) -> torch.cuda.Event:
        return torch.cuda.Event(blocking=blocking)  # a blocking waiter sleeps instead of spinning

    def stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def copy_rows(self, copy: _LayerCopy, rows: int, stream) -> None:
        with torch.cuda.stream(stream):
            copy.target[:rows].copy_(copy.source[:rows], non_blocking=True)

    def record(self, event: torch.cuda.Event, stream) -> None:
        event.record(stream)

    def query(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()  # releases the GIL while it waits


def _device_calls(device: torch.device):
    try:
        return _CudaDriver(device)
    except OSError as exc:  # no libcuda.so.1
        log.warning("probex: CUDA driver library not loadable (%s); copying scores through torch", exc)
        return _TorchCopies(device)


class _DeviceEvent:
    """A slot's CUDA event as its consumers see it: something to wait for (asleep)."""

    def __init__(self, driver) -> None:
        self.driver = driver
        self.handle = driver.event()

    def synchronize(self) -> None:
        self.driver.synchronize(self.handle)  # releases the GIL while it waits

    def done(self) -> bool:
        return self.driver.query(self.handle)


@dataclass
class StagedStep:
    """One step's scores on their way to the host, plus whatever the consumer needs with them."""

    rows: int
    context: Any
    _slot: "_StagingSlot"
    _ready: _DeviceEvent | None
    submitted: float = 0.0  # time.perf_counter() on the engine thread

    def scores(self) -> dict[int, np.ndarray]:
        """layer -> [rows, capacity] host scores. Valid until the step is released."""
        rows = self.rows
        return {layer: array[:rows] for layer, array in self._slot.arrays.items()}


@dataclass
class _Reservation:
    """A staging buffer set aside for the next step, and the layers already copied into it."""

    slot: "_StagingSlot"
    rows: int
    copied: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        """Every tapped layer's rows are copied (and the step's event recorded after them)."""
        return len(self.copied) == len(self.slot.copies)


class _StagingSlot:
    def __init__(self, sources: dict[int, torch.Tensor], driver, pin: bool, side_stream: bool = False) -> None:
        # Pinned: the device writes into them by DMA, and an asynchronous copy needs that.
        self.buffers = {
            layer: torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            for layer, src in sources.items()
        }
        # numpy views of the same memory, made once: slicing a torch tensor and converting it
        # every step cost the consumer ~10 µs a step, a numpy slice well under one.
        self.arrays = {layer: buf.numpy() for layer, buf in self.buffers.items()}
        self.copies = [_LayerCopy(layer, src, self.buffers[layer], src.data_ptr(), self.buffers[layer].data_ptr(),
                                  src.stride(0) * src.element_size()) for layer, src in sources.items()]
        self.copy_of = {copy.layer: copy for copy in self.copies}
        # One event per slot, re-recorded each use: creating a CUDA event every step costs
        # engine-thread time for nothing.
        self.ready = _DeviceEvent(driver) if driver is not None else None
        # side-stream copies: marks the forward's end on the engine stream, for the side stream to wait on
        self.launched = driver.event(blocking=False) if driver is not None and side_stream else None


class ScoreTransfer:
    """Copies `sources[layer][:rows]` to the host each step and calls `consume` once they land.

    `consume(step)` runs one step at a time in submission order, on the transfer thread or
    (consumer="engine") on the engine thread or the watchdog; `step.scores()` is only valid
    during that call.
    """

    def __init__(
        self,
        sources: dict[int, torch.Tensor],
        consume: Callable[[StagedStep], None],
        depth: int = 8,
        threaded: bool = True,
        driver=None,
        copy_stream: str = "same",
        consumer: str = "thread",
        stale_after_s: float = 0.05,
    ) -> None:
        """`driver`: the device calls (tests pass a recording stand-in); made from libcuda
        when the sources are on a CUDA device. `copy_stream`: "same" (the engine's stream)
        or "side" (see the module docstring; a device only). `consumer`: "thread" (the
        transfer thread consumes every step) or "engine" (the engine thread consumes landed
        steps, a watchdog those left longer than `stale_after_s`; see the module docstring)."""
        if depth < 1:
            raise ValueError("ScoreTransfer needs at least one staging buffer")
        if copy_stream not in ("same", "side"):
            raise ValueError(f"copy_stream must be 'same' or 'side', not {copy_stream!r}")
        if consumer not in ("thread", "engine"):
            raise ValueError(f"consumer must be 'thread' or 'engine', not {consumer!r}")
        self.consumer = consumer
        self._consume = consume
        device = next(iter(sources.values())).device if sources else torch.device("cpu")
        self._cuda = device.type == "cuda"
        if any(s.dtype != torch.float32 or not s.is_contiguous() for s in sources.values()):
            raise ValueError("score buffers must be contiguous float32 tensors (a step's rows are copied as one block)")
        self.max_rows = min((s.shape[0] for s in sources.values()), default=0)
        self._driver = driver if driver is not None else (_device_calls(device) if self._cuda else None)
        self._side = self._driver.stream() if copy_stream == "side" and self._driver is not None else None
        self._unguarded = None  # the last side-stream copy's event, until a forward's stream waits for it
        self._early: _Reservation | None = None  # the buffer set aside for the next step (`reserve_step`)
        self.mid_forward_steps = 0  # steps whose every row was copied during their forward
        self.mid_forward_layer_copies = 0
        self.mismatched_reservations = 0  # a submit of other rows than reserved for (an adapter bug)
        self.unguarded_forwards = 0  # submits that found the previous copy not waited for (an adapter bug)
        self._failed: BaseException | None = None  # the transfer thread could not start
        self.depth = depth
        # SimpleQueue (C, no Python-level lock or condition): a put and a get cost ~0.1 µs on
        # the engine thread instead of ~3 µs for queue.Queue.
        self._free: queue.SimpleQueue[_StagingSlot] = queue.SimpleQueue()
        for _ in range(depth):
            self._free.put(_StagingSlot(sources, self._driver, pin=self._cuda, side_stream=self._side is not None))
        self._work: queue.SimpleQueue[StagedStep | None] = queue.SimpleQueue()
        self._submitted = 0  # steps handed to the transfer thread (engine thread writes)
        self._processed = 0  # steps it has finished with (transfer thread writes)
        self._threaded = threaded
        self._thread: threading.Thread | None = None
        self.waits_for_staging = 0  # submits that found every buffer busy
        # Engine-thread time in submit, split: enqueueing the copies and the event (`stage`)
        # versus handing the step to the transfer thread (`handoff`, waits for a free buffer included).
        self.stage_s = 0.0
        self.handoff_s = 0.0
        self.consume_errors = 0
        # Time spent waiting for copies to land (GIL released), on whichever thread consumed:
        # the engine consumer's waits ahead of each step's tokens (time vLLM would spend
        # waiting for those tokens anyway), plus, on the engine thread, waits at a step without
        # rows, for a full staging pool and in `flush`; with consumer="thread", the transfer
        # thread's waits.
        self.device_wait_s = 0.0
        self.stats = TransferStats()
        self.last_consumed_rows = 0  # the rows of the step consumed last (or being consumed)
        # consumer="engine": steps staged and not yet consumed, oldest first; the lock keeps
        # the engine thread and the watchdog from consuming the same step (order is kept).
        self._pending: collections.deque[StagedStep] = collections.deque()
        self._pending_lock = threading.Lock()
        self._closing = threading.Event()
        self.stale_after_s = stale_after_s
        self.stale_steps = 0  # steps the watchdog consumed (nobody else came by in time)
        self.query_errors = 0
        self._last_submit = time.perf_counter()  # consumer="engine": when the engine last came by
        if threaded:
            target, name = ((self._run, "probex-score-transfer") if consumer == "thread"
                            else (self._watch, "probex-score-watchdog"))
            self._thread = threading.Thread(target=target, name=name, daemon=True)
            self._thread.start()

    def submit(self, rows: int, context: Any) -> None:
        """Called on the engine thread right after the forward was enqueued."""
        self._raise_if_failed()
        if not 0 <= rows <= self.max_rows:
            raise ValueError(f"a step of {rows} rows does not fit the {self.max_rows}-row score buffers")
        started = self._last_submit = time.perf_counter()
        # A step without rows (requests ending) leaves a reservation to the step it was made for.
        early = self._early if rows else None
        if early is not None:
            self._early = None
            if early.rows != rows:  # not the step reserved for (an adapter bug): the usual path
                self.mismatched_reservations += 1
                self._free.put(early.slot)
                early = None
        slot = early.slot if early is not None else self._take_slot()
        staging = time.perf_counter()
        # A step without rows copies nothing, so it has nothing of its own to wait for on the
        # device: an event recorded behind the forward just enqueued would make the engine
        # thread wait for that whole forward (below), losing the overlap of the next step's
        # scheduling with this one's forward at every step that ends a request.
        ready = slot.ready if rows else None
        copied = early.copied if early is not None else ()
        copied_mid_forward = early is not None and early.complete
        try:
            if copied_mid_forward:
                self.mid_forward_steps += 1  # every layer's rows and the event were enqueued during the forward
            elif ready is not None:
                driver = self._driver
                stream = driver.current_stream()
                side = self._side is not None
                if side:
                    if self._unguarded is not None:
                        self.unguarded_forwards += 1
                        if self.unguarded_forwards in (1, 100) or self.unguarded_forwards % 10000 == 0:
                            log.warning("probex: a forward ran without waiting for the previous step's score copy"
                                        " (%d times); its scores may be overwritten", self.unguarded_forwards)
                    driver.record(slot.launched, stream)
                    driver.wait_event(self._side, slot.launched)
                    stream = self._side
                for copy in slot.copies:
                    if copy.layer not in copied:
                        driver.copy_rows(copy, rows, stream)
                driver.record(ready.handle, stream)
                if side:
                    self._unguarded = ready.handle
            elif rows:
                for copy in slot.copies:
                    if copy.layer not in copied:
                        copy.target[:rows].copy_(copy.source[:rows])
        except BaseException:
            self._free.put(slot)  # the step is lost, its buffer is not
            raise
        staged = time.perf_counter()
        step = StagedStep(rows=rows, context=context, _slot=slot, _ready=ready, submitted=staged)
        if self.consumer == "engine":
            with self._pending_lock:
                self._submitted += 1
                self._pending.append(step)
                # A step without rows ends requests, and the engine may go idle after it: wait
                # for what is left, or the last tokens' scores would wait for the watchdog.
                self._consume_pending(wait=rows == 0)
            self.handoff_s += (staging - started) + (time.perf_counter() - staged)
        elif self._threaded:
            self._submitted += 1
            self._work.put(step)
            self.handoff_s += (staging - started) + (time.perf_counter() - staged)
        else:
            self._process(step)
        self.stage_s += staged - staging

    def _take_slot(self) -> _StagingSlot:
        """A free staging buffer; with every one in use, waits for one (the engine consumer
        consumes the oldest step now, waiting for its copies)."""
        if self.consumer == "engine" and self._free.empty():
            self.waits_for_staging += 1
            with self._pending_lock:  # every buffer waits to be consumed: consume the oldest now
                self._consume_pending(wait=True, limit=1)
        try:
            return self._free.get_nowait()
        except queue.Empty:
            self.waits_for_staging += 1
            if self.waits_for_staging in (1, 10, 100) or self.waits_for_staging % 1000 == 0:
                log.warning("probex: all %d score staging buffers are in use; the engine waits for the transfer"
                            " thread (%d times so far)", self.depth, self.waits_for_staging)
            while True:
                try:
                    return self._free.get(timeout=1.0)
                except queue.Empty:
                    self._raise_if_failed()  # then nobody will give a buffer back

    def reserve_step(self, rows: int) -> bool:
        """On the engine thread, before a forward of `rows` rows is enqueued: set a staging
        buffer aside for it, so each tapped layer's rows can be copied out as soon as that
        layer's scores are final (`copy_layer_now`, called mid-forward) instead of behind the
        whole forward. The next `submit` (that step's, with the same rows) takes the buffer
        and enqueues only what was not copied yet. False, nothing reserved, where copies are
        made on the side stream (their ordering is kept by `before_next_forward`, for whole
        steps) or there is nothing to copy."""
        if self._side is not None or not 0 < rows <= self.max_rows:
            return False
        self._raise_if_failed()
        if self._early is not None:  # a reservation no step took (the forward failed): reuse its buffer
            slot = self._early.slot
        else:
            slot = self._take_slot()
        self._early = _Reservation(slot, rows)
        return True

    def copy_layer_now(self, layer: int) -> bool:
        """On the engine thread, mid-forward, once `layer`'s scores for the reserved step are
        final (the tap op that writes them is enqueued): enqueue the copy of its rows on the
        engine's stream, and after the last tapped layer's, the step's ready event. Copies
        nothing without a reservation or for a layer already copied; True if it copied."""
        early = self._early
        if early is None or layer in early.copied:
            return False
        copy = early.slot.copy_of.get(layer)
        if copy is None:
            return False
        driver = self._driver
        if driver is not None:
            stream = driver.current_stream()
            driver.copy_rows(copy, early.rows, stream)
            early.copied.add(layer)
            if early.complete:
                driver.record(early.slot.ready.handle, stream)
        else:  # CPU: the forward runs as it is called, so the rows are there now
            copy.target[:early.rows].copy_(copy.source[:early.rows])
            early.copied.add(layer)
        self.mid_forward_layer_copies += 1
        return True

    def release_reservation(self) -> None:
        """The reserved step will not be submitted (its forward failed): its buffer goes back."""
        early, self._early = self._early, None
        if early is not None:
            self._free.put(early.slot)

    def before_next_forward(self) -> None:
        """On the engine thread, before a forward is enqueued: with side-stream copies, the
        forward's stream waits (on the device) for the last copy out of the score buffers it is
        about to overwrite. Nothing to do otherwise: the copies are on that stream already."""
        if self._unguarded is None:
            return
        started = time.perf_counter()
        self._driver.wait_event(self._driver.current_stream(), self._unguarded)
        self._unguarded = None
        self.stage_s += time.perf_counter() - started

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"probex: the score transfer thread failed to start: {self._failed}")

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted step was consumed (tests, shutdown). True if drained."""
        if self.consumer == "engine":  # waits on the device events themselves, GIL released: no timeout
            with self._pending_lock:
                self._consume_pending(wait=True)
            return True
        if not self._threaded:
            return True
        deadline = time.monotonic() + timeout
        while self._processed < self._submitted:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def close(self) -> None:
        if self.consumer == "engine":
            self.flush()  # what is pending is consumed here; the watchdog only stops
        self._closing.set()
        if self._thread is not None and self._thread.is_alive():
            self._work.put(None)
            self._thread.join(timeout=5)

    def consume_landed(self) -> None:
        """consumer="engine": consume, in order, the pending steps whose copies have landed
        (the runner adapter calls this where the engine has just read a step's sampled
        tokens, whose copy was ordered after that step's same-stream score copies). Never
        waits for the device; it may wait for the lock while another thread consumes."""
        if self.consumer != "engine":
            return
        with self._pending_lock:
            self._consume_pending(wait=False)

    @property
    def submitted_steps(self) -> int:
        """How many steps have been submitted: the number of the latest, for `consume_through`."""
        return self._submitted

    def consume_through(self, step_number: int) -> None:
        """consumer="engine": consume, in order, the pending steps up to the `step_number`-th
        submitted, waiting for their copies with the GIL released.

        The runner adapter calls this where the engine is about to wait for a step's sampled
        tokens. That step's score copies went onto the engine's stream right behind its
        forward, ahead of its logits and sampling, so they land first: consumed here, they
        are booked and sent while the device still samples, and leave ahead of the tokens
        instead of after them. With side-stream copies, which may land after the tokens, it
        does nothing (the adapter's `consume_landed` after the tokens takes them)."""
        if self.consumer != "engine" or self._side is not None:
            return
        # The engine is here: the watchdog stands down (a prefill forward can outlast its
        # interval). Called from another thread (vLLM's output-copy thread at TP > 1 with
        # PROBEX_SCORE_CONSUMER=engine, not a default), this waits holding the lock, so the
        # engine thread's next submit waits for these copies too.
        self._last_submit = time.perf_counter()
        with self._pending_lock:
            self._consume_pending(wait=True, limit=step_number - self._processed)

    def _consume_pending(self, wait: bool, limit: int | None = None) -> None:
        """consumer="engine", with the lock held: consume pending steps in order while their
        copies have landed (with `wait`, waiting for them), at most `limit`."""
        consumed = 0
        while self._pending and (limit is None or consumed < limit):
            step = self._pending[0]
            landed = step._ready is None or self._landed(step._ready)
            if not landed and not wait:
                return
            self._pending.popleft()
            try:
                # A landed step needs no wait: skipping it keeps the engine thread from
                # releasing the GIL (cuEventSynchronize does) in the middle of its hook.
                self._process(step, already_landed=landed)
            finally:
                self._processed += 1
            consumed += 1

    def _landed(self, ready: _DeviceEvent) -> bool:
        """A failing query counts as not landed: the step is then waited for (and a failing
        wait is counted and logged by `_process`, which gives the buffer back) instead of
        raising inside vLLM's step at every later hook."""
        try:
            return ready.done()
        except Exception:
            self.query_errors += 1
            if self.query_errors in (1, 100) or self.query_errors % 10000 == 0:
                log.exception("probex: querying a score copy's event failed (%d times)", self.query_errors)
            return False

    def _watch(self) -> None:
        """consumer="engine": the safety net for steps nobody else consumes in time."""
        if self._driver is not None:
            try:
                self._driver.bind_thread()
            except Exception:
                # The engine thread still consumes every step; only the net is gone.
                log.exception("probex: the score watchdog cannot use the engine's CUDA context; steps are "
                              "consumed by the engine thread only")
                return
        while not self._closing.wait(self.stale_after_s):
            try:
                self._consume_if_engine_away()
            except Exception:
                log.exception("probex: the score watchdog failed a round; it goes on")

    def _consume_if_engine_away(self) -> None:
        if time.perf_counter() - self._last_submit <= self.stale_after_s:
            return  # the engine comes by: it consumes its own steps
        try:
            head = self._pending[0]  # unlocked peek: the engine thread may consume it meanwhile
        except IndexError:
            return
        if head._ready is not None:
            # Outside the lock, so an engine that comes back meanwhile never waits for this.
            # (Should the engine consume the step and reuse its buffer, this waits for that
            # buffer's next copy instead: harmless.)
            head._ready.synchronize()
        with self._pending_lock:
            if time.perf_counter() - self._last_submit <= self.stale_after_s:
                return
            before = self._processed
            self._consume_pending(wait=False)
            self.stale_steps += self._processed - before

    def _run(self) -> None:
        if self._driver is not None:
            try:
                self._driver.bind_thread()
            except Exception as exc:  # without the context no step can be waited for: say so at the next submit
                self._failed = exc
                log.exception("probex: the score transfer thread cannot use the engine's CUDA context")
                return
        while True:
            step = self._work.get()
            if step is None:
                return
            try:
                self._process(step)
            finally:
                self._processed += 1

    def _process(self, step: StagedStep, already_landed: bool = False) -> None:
        try:
            if step._ready is not None and not already_landed:
                waiting = time.perf_counter()
                step._ready.synchronize()  # releases the GIL while it waits
                self.device_wait_s += time.perf_counter() - waiting
            landed = time.perf_counter()
            self.last_consumed_rows = step.rows
            self._consume(step)
            self.stats.add(landed - step.submitted, time.perf_counter() - landed, step.rows)
        except Exception:  # a bad step must not stop delivery for every later one
            self.consume_errors += 1
            log.exception("probex: processing a step's scores failed")
        finally:
            self._free.put(step._slot)

    def describe(self) -> dict[str, Any]:
        return {"depth": self.depth, "copy_stream": "side" if self._side is not None else "same",
                "consumer": self.consumer, "stale_steps": self.stale_steps, "query_errors": self.query_errors,
                "unguarded_forwards": self.unguarded_forwards, "mid_forward_steps": self.mid_forward_steps,
                "mid_forward_layer_copies": self.mid_forward_layer_copies,
                "mismatched_reservations": self.mismatched_reservations, "waits_for_staging": self.waits_for_staging,
                "consume_errors": self.consume_errors, "stage_s": self.stage_s, "handoff_s": self.handoff_s,
                "device_wait_s": self.device_wait_s,
                **self.stats.as_dict()}


# Steps of more rows than this carry prefill chunks (a decode step has one row per running
# request); their scores are on the way to a first token, so they are timed apart too.
LARGE_STEP_ROWS = 256


class TransferStats:
    """Where a step's scores spend their time before they are published, for benchmarks.

    `landed` is submit → the copy seen complete on the host (the rest of the forward and of
    any step still ahead of it on the GPU, the driver's wake-up, and any wait for earlier
    steps' bookkeeping); `consume` is the bookkeeping and publish after it, on whichever
    thread consumes; `large_*` counts the consume of steps of more than LARGE_STEP_ROWS rows
    (prefill chunks) apart. Sums and maxima only: cheap enough to keep on in production, and
    readers take differences between snapshots.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.landed_s = 0.0
        self.landed_max_s = 0.0
        self.consume_s = 0.0
        self.consume_max_s = 0.0
        self.large_steps = 0
        self.large_consume_s = 0.0
        self.large_consume_max_s = 0.0

    def add(self, landed: float, consume: float, rows: int = 0) -> None:
        self.steps += 1
        self.landed_s += landed
        self.consume_s += consume
        if landed > self.landed_max_s:
            self.landed_max_s = landed
        if consume > self.consume_max_s:
            self.consume_max_s = consume
        if rows > LARGE_STEP_ROWS:
            self.large_steps += 1
            self.large_consume_s += consume
            if consume > self.large_consume_max_s:
                self.large_consume_max_s = consume

    def as_dict(self) -> dict[str, float | int]:
        return {"steps": self.steps, "landed_s": self.landed_s, "landed_max_s": self.landed_max_s,
                "consume_s": self.consume_s, "consume_max_s": self.consume_max_s,
                "large_steps": self.large_steps, "large_consume_s": self.large_consume_s,
                "large_consume_max_s": self.large_consume_max_s}
