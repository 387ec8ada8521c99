"""The ProbeX custom ops, `torch.ops.probex.tap` and `torch.ops.probex.steer`.

One call per tapped layer and step. It reads the residual stream after the layer
(hidden + residual, which equals HF `output_hidden_states[layer + 1]`) for every row
of the step and

- writes the raw values of all probes of that layer (one matmul) into `scores_out`,
  a static fp32 buffer of `[max_rows, capacity]`;
- copies the rows named by `capture_index` into `capture_out` (capture mode; both are
  zero-sized when capture is off, which makes that half free).

While `paused` (a one-element int32 buffer) is non-zero the scores are left as they are and
the kernel returns at once: the tap switched off at run time, within one start
(`TapController.set_paused`). The flag is read on the device, so CUDA graphs replay
unchanged; the torch version reads it on the host, which only the CPU may (the GPU's torch
version, a diagnostic, computes the scores anyway). Capture rows are still gathered on CUDA
(in capture mode only); nothing captured while paused is ever written.

The op mutates only its declared buffers, never reads a value back to the host and
allocates nothing that outlives the call, so torch.compile keeps it inside the
compiled graph and CUDA graphs can replay it. On CUDA the scores come from one Triton
kernel (`kernel.py`; capture rows, if any, are gathered with torch next to it); on CPU
(and with `kernel.use_kernel` off) everything comes from plain torch (`tap_torch`), the same
arithmetic.
"""

from __future__ import annotations

import torch

from engine_worker.tap import kernel as fused_tap

_LIBRARY = "probex"


@torch.library.custom_op(f"{_LIBRARY}::tap", mutates_args=("scores_out", "capture_out"))
def tap(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    scores_out: torch.Tensor,
    capture_index: torch.Tensor,
    capture_out: torch.Tensor,
    paused: torch.Tensor,
) -> None:
    rows = hidden.shape[0]
    if fused_tap.applies(hidden, residual, weight, bias, scores_out, paused):
        fused_tap.scores(hidden, residual, weight, bias, scores_out, paused)  # one kernel on CUDA
        if capture_out.shape[0] > 0 and rows > 0:
            # Only the selected rows' stream is formed (clamped as in tap_torch), the same fp32 sum.
            safe_index = capture_index.clamp(min=0, max=rows - 1)
            torch.add(hidden.index_select(0, safe_index).float(), residual.index_select(0, safe_index),
                      out=capture_out)
        return
    if paused.device.type == "cpu" and int(paused[0]) != 0:
        return
    tap_torch(hidden, residual, weight, bias, scores_out, capture_index, capture_out)


def tap_torch(hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
              scores_out: torch.Tensor, capture_index: torch.Tensor, capture_out: torch.Tensor) -> None:
    """The tap in plain torch: CPU, layouts the kernel does not take, `kernel.use_kernel` off,
    and the reference for the fused kernel."""
    rows = hidden.shape[0]
    if hidden.dtype == torch.float32:
        stream = hidden + residual.float()  # never in place: `hidden` is the model's own tensor
    else:
        # `.float()` made a fresh copy, so adding into it is safe; the add promotes the
        # residual exactly (bf16 -> fp32 loses nothing). One kernel fewer per layer and step
        # than casting both, which is most of the op's cost at decode, where rows are few.
        stream = hidden.float().add_(residual)
    torch.addmm(bias, stream, weight.t(), out=scores_out[:rows])
    if capture_out.shape[0] > 0:
        # Indices past this step's rows (stale or padding) are clamped instead of checked on
        # the host; the adapter only reads back the entries it asked for.
        safe_index = capture_index.clamp(min=0, max=rows - 1)
        torch.index_select(stream, 0, safe_index, out=capture_out)


@tap.register_fake
def _tap_fake(hidden, residual, weight, bias, scores_out, capture_index, capture_out, paused) -> None:
    return None


@torch.library.custom_op(f"{_LIBRARY}::steer", mutates_args=())
def steer(
    hidden: torch.Tensor,
    vectors: torch.Tensor,
    alpha: torch.Tensor,
    index: torch.Tensor,
    gate_scores: list[torch.Tensor],
    gate_column: torch.Tensor,
    gate_threshold: torch.Tensor,
    gate_enabled: torch.Tensor,
) -> torch.Tensor:
    """`hidden` plus alpha[row] * vectors[index[row]] on every row whose write is open.

    A row is written when alpha != 0 and either its gate is off (`gate_enabled` 0, fp32)
    or its gate score exceeds its threshold. The gate score of a row is column
    `gate_column[row]` of the step's probe scores at the gate layers: `gate_scores` holds
    the tap score buffers of those layers ([max_rows, capacity] each, concatenated
    column-wise), which the tap ops earlier in this same forward have just filled — so
    the decision is made on the device, in-graph, with no host round trip.

    Functional: returns a new tensor and never touches `hidden`. Rows that are not
    written are copied with `torch.where`, so they come out bit-identical to `hidden`
    (an `h + 0 * v` would not be: -0.0, NaN/inf in v). The sum is formed in float32 and
    rounded once to the model's dtype.
    """
    rows = hidden.shape[0]
    row_alpha = alpha[:rows]
    gate_open = gate_enabled[:rows] == 0
    if len(gate_scores) > 0:  # static: the list length is fixed when the model is built
        scores = gate_scores[0][:rows] if len(gate_scores) == 1 else torch.cat([s[:rows] for s in gate_scores], 1)
        # Columns past the buffers (never set by the controller) are clamped instead of checked on the host.
        column = gate_column[:rows].clamp(min=0, max=scores.shape[1] - 1)
        gate_value = torch.gather(scores, 1, column.unsqueeze(1)).squeeze(1)
        gate_open = gate_open | (gate_value > gate_threshold[:rows])
    write = (row_alpha != 0) & gate_open
    safe_index = index[:rows].clamp(min=0, max=vectors.shape[0] - 1)
    delta = torch.index_select(vectors, 0, safe_index) * row_alpha.unsqueeze(1)
    steered = (hidden.float() + delta).to(hidden.dtype)
    return torch.where(write.unsqueeze(1), steered, hidden)


@steer.register_fake
def _steer_fake(hidden, vectors, alpha, index, gate_scores, gate_column, gate_threshold, gate_enabled) -> torch.Tensor:
    return torch.empty_like(hidden)


def residual_stream(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The quantity the op reads, for reference implementations and tests."""
    return hidden.float() if residual is None else hidden.float() + residual.float()
