"""The CUDA driver calls that move a step's score rows into the shared-memory score ring.

Per step the engine thread enqueues, on the stream the forward runs on, one device-to-host
copy per tapped layer straight into the ring slot (registered with the driver once, at
start-up) and a stream memory write of the slot's ticket behind them: the device itself says
when the rows have landed, and nothing on the host waits for it.

The calls go to the driver through ctypes' PyDLL, which keeps the GIL for the microseconds
each takes; going through torch instead releases and retakes the GIL around every call, which
lets the engine process's other Python threads in halfway through the engine thread's hook.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerCopy:
    """One tapped layer's rows, device buffer -> a slot's pinned buffer: tensors and raw addresses."""

    layer: int
    source: torch.Tensor
    target: torch.Tensor
    source_ptr: int
    target_ptr: int
    row_bytes: int


class CudaDriver:
    """The engine thread's per-step driver calls (copy, ticket write), holding the GIL: each
    returns in microseconds (only a full launch queue could make one block; vLLM keeps a
    step or two in flight)."""

    def __init__(self, device: torch.device) -> None:
        """On the engine thread, where torch has made the device's context current."""
        self.device = device
        self._device_index = device.index if device.index is not None else torch.cuda.current_device()
        # The raw handle of the current stream without building a torch Stream object (what
        # torch's own generated code calls); a few µs less per step than current_stream().
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self.lib = ctypes.PyDLL("libcuda.so.1")
        for fn, argtypes in ((self.lib.cuMemcpyDtoHAsync_v2, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]),
                             (self.lib.cuCtxGetCurrent, [ctypes.POINTER(ctypes.c_void_p)])):
            fn.argtypes = argtypes
        with torch.cuda.device(device):
            torch.cuda.current_stream(device).synchronize()  # the device's context exists and is current here
            self.context = ctypes.c_void_p()
            self.check(self.lib.cuCtxGetCurrent(ctypes.byref(self.context)), "cuCtxGetCurrent")
        if not self.context.value:
            raise RuntimeError(f"probex: no CUDA context is current for {device} on the engine thread")

    def check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"probex: {what} failed with CUDA driver error {result}")

    def current_stream(self) -> int:
        """The stream the forward was just enqueued on (the copies must queue behind it)."""
        if self._raw_stream is not None:
            return self._raw_stream(self._device_index)
        return torch.cuda.current_stream(self.device).cuda_stream

    def copy_rows(self, copy: LayerCopy, rows: int, stream: int) -> None:
        self.check(self.lib.cuMemcpyDtoHAsync_v2(copy.target_ptr, copy.source_ptr, rows * copy.row_bytes, stream),
                   "cuMemcpyDtoHAsync")

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
