"""The tap's arithmetic as one Triton kernel per layer and step, for CUDA.

`torch.ops.probex.tap` computes `(hidden + residual) @ weight.T + bias` in fp32 for every
row of the step. Written in torch that is a cast, an add and a GEMM (three or four kernels),
and cuBLAS picks a slow split kernel for the decode shapes (a few rows against 8 probes of
4096): on an H200 (`python -m bench.tap_op`, two layers, inside a CUDA
graph) 18 µs per step at 1 row and 54 µs at 8 rows, against 11 µs for this kernel at both.

A program takes one row and a group of probe slots: it reads the row's hidden and residual
in blocks, adds them in fp32 (bf16 to fp32 is exact, as in the torch version) and
accumulates the dot products with its slots at once; then adds the bias and writes those
scores. Steps of many rows (prefill) give each program all the slots, so the row is read
once and the weights (slots x hidden, fp32) stay in L2 across rows. Decode steps of few rows
give each program one slot: in the served model the weights come back from HBM every step
(the model's own GEMMs evict them from L2), and one program per row fetched a layer's
128 KB of them from one SM (about 10 µs per layer and step on an H200); one program per slot
fetches them from `slots` SMs at once.

`use_kernel = False` (a module attribute, for comparisons in tests and benchmarks) turns it
off: the torch version runs everywhere.
"""

from __future__ import annotations

import torch

use_kernel = True  # False: the torch version everywhere (a seam for tests and benchmarks)
MAX_BLOCK = 1024  # hidden elements per iteration at one slot per program; 512 at 8 slots
# Steps of fewer rows than this get one program per (row, slot) instead of one per row.
ONE_SLOT_PER_PROGRAM_BELOW_ROWS = 128

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds without Triton: the torch version is used
    triton = None


if triton is not None:

    @triton.jit
    def _tap_rows(hidden_ptr, residual_ptr, weight_ptr, bias_ptr, out_ptr, paused_ptr, width, hidden_stride,
                  residual_stride, out_stride, n_slots, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
        if tl.load(paused_ptr) != 0:  # the tap switched off at run time: nothing read, nothing written
            return
        row = tl.program_id(0)
        slots = tl.program_id(1) * SLOTS + tl.arange(0, SLOTS)
        slot_ok = slots < n_slots
        acc = tl.zeros([SLOTS, BLOCK], dtype=tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            col_ok = cols < width
            stream = (tl.load(hidden_ptr + row * hidden_stride + cols, mask=col_ok, other=0.0).to(tl.float32)
                      + tl.load(residual_ptr + row * residual_stride + cols, mask=col_ok, other=0.0).to(tl.float32))
            w = tl.load(weight_ptr + slots[:, None] * width + cols[None, :],
                        mask=slot_ok[:, None] & col_ok[None, :], other=0.0)
            acc += w * stream[None, :]
        scores = tl.sum(acc, axis=1) + tl.load(bias_ptr + slots, mask=slot_ok, other=0.0)
        tl.store(out_ptr + row * out_stride + slots, scores, mask=slot_ok)


def enabled() -> bool:
    return triton is not None and use_kernel


def applies(hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
            scores_out: torch.Tensor, paused: torch.Tensor) -> bool:
    """Whether the op should run `scores`: the kernel is on, the tensors are on a CUDA device
    and laid out as the kernel indexes them (`layout_fits`), the pause flag an int32 there."""
    return (enabled() and hidden.is_cuda and layout_fits(hidden, residual, weight, bias, scores_out)
            and paused.dtype == torch.int32 and paused.device == hidden.device)


def layout_fits(hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                scores_out: torch.Tensor) -> bool:
    """The kernel reads row r of hidden / residual at r x row stride (elements contiguous), the
    weights as [slots, width] rows packed back to back, one bias per slot, and writes
    scores_out[r, :slots] for r < rows. Anything else goes to the torch version."""
    if hidden.dim() != 2 or weight.dim() != 2 or bias.dim() != 1 or scores_out.dim() != 2:
        return False
    rows, width = hidden.shape
    slots = weight.shape[0]
    return (
        hidden.stride(1) == 1
        and residual.shape == hidden.shape
        and residual.stride(1) == 1
        and residual.device == hidden.device
        and weight.shape[1] == width
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and bias.dtype == torch.float32
        and bias.shape[0] == slots
        and bias.stride(0) == 1
        and scores_out.dtype == torch.float32
        and scores_out.is_contiguous()
        and scores_out.shape[1] == slots
        and scores_out.shape[0] >= rows
    )


def block_for(slots: int) -> int:
    """Hidden elements per iteration: the accumulator holds slots x block fp32 values, so more
    slots per program take narrower blocks (1 slot: 1024; 8: 512; 64: 64) and the kernel
    stays in registers."""
    return max(32, min(MAX_BLOCK, 4096 // triton.next_power_of_2(slots)))


def slots_per_program(rows: int, slots: int) -> int:
    """One slot per program for steps of few rows (decode), all of them for many (see the
    module docstring); a power of two, as Triton's block shapes must be."""
    return 1 if rows < ONE_SLOT_PER_PROGRAM_BELOW_ROWS else triton.next_power_of_2(slots)


def scores(hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
           scores_out: torch.Tensor, paused: torch.Tensor) -> None:
    """scores_out[:rows] = (hidden + residual) @ weight.T + bias, in fp32, unless `paused[0]`
    is non-zero (read by the kernel; see `applies`)."""
    rows, width = hidden.shape
    if rows == 0:
        return
    n_slots = weight.shape[0]
    group = slots_per_program(rows, n_slots)
    _tap_rows[(rows, triton.cdiv(n_slots, group))](
        hidden, residual, weight, bias, scores_out, paused, width, hidden.stride(0), residual.stride(0),
        scores_out.stride(0), n_slots, SLOTS=group, BLOCK=block_for(group))


def warm_up(width: int, slots: int, max_rows: int, dtype: torch.dtype, device: torch.device) -> int:
    """Compile the kernel's variants for one layer's shapes before the first request; returns
    how many launches it made (0 where the kernel does not run).

    Triton compiles a variant on its first launch, one per slots-per-program group
    (`slots_per_program`: a decode step's and a prefill's). Under CUDA graphs vLLM's capture
    launches both before serving; with `enforce_eager` nothing does, so the first decode step
    of the first request paid the compile (vLLM's JIT monitor warned of it in the GPU smoke's
    eager workers). These launches use tensors of their own, laid out as the served ones,
    with the pause flag set, so the kernel returns at once and the layer's buffers are never
    touched."""
    if not enabled():
        return 0
    weight = torch.zeros(slots, width, dtype=torch.float32, device=device)
    bias = torch.zeros(slots, dtype=torch.float32, device=device)
    paused = torch.ones(1, dtype=torch.int32, device=device)
    launches = 0
    for rows in sorted({1, min(max_rows, ONE_SLOT_PER_PROGRAM_BELOW_ROWS)}):
        stream = torch.zeros(rows, width, dtype=dtype, device=device)
        scores_out = torch.zeros(rows, slots, dtype=torch.float32, device=device)
        if applies(stream, stream, weight, bias, scores_out, paused):  # not off CUDA
            scores(stream, stream, weight, bias, scores_out, paused)
            launches += 1
    return launches



