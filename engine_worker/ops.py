"""The ProbeX custom op, `torch.ops.probex.tap`.

One call per tapped layer and step. It reads the residual stream after the layer
(hidden + residual, which equals HF `output_hidden_states[layer + 1]`) for every row
of the step and

- writes the raw values of all probes of that layer (one matmul) into `scores_out`,
  a static fp32 buffer of `[max_rows, capacity]`;
- copies the rows named by `capture_index` into `capture_out` (capture mode; both are
  zero-sized when capture is off, which makes that half free).

The op mutates only its declared buffers, never reads a value back to the host and
allocates nothing that outlives the call, so torch.compile keeps it inside the
compiled graph and CUDA graphs can replay it. Plain torch: the same code runs on CPU
and CUDA.
"""

from __future__ import annotations

import torch

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
) -> None:
    rows = hidden.shape[0]
    stream = hidden.float() + residual.float()
    torch.addmm(bias, stream, weight.t(), out=scores_out[:rows])
    if capture_out.shape[0] > 0:
        # Indices past this step's rows (stale or padding) are clamped instead of checked on
        # the host; the adapter only reads back the entries it asked for.
        safe_index = capture_index.clamp(min=0, max=rows - 1)
        torch.index_select(stream, 0, safe_index, out=capture_out)


@tap.register_fake
def _tap_fake(hidden, residual, weight, bias, scores_out, capture_index, capture_out) -> None:
    return None


def residual_stream(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The quantity the op reads, for reference implementations and tests."""
    return hidden.float() if residual is None else hidden.float() + residual.float()
