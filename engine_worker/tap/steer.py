"""Static buffers of one steered layer: the vector table and the per-row steering values.

A `LayerSteer` is attached to a decoder layer when the model is built (like `LayerTap`),
so its buffers live on the model's device with addresses that never change:

- `vectors` [capacity, hidden] fp32: the loaded steering vectors of this layer (replaced
  in place between steps by the admin API — no recompile, no recapture);
- `row_params` [max_rows, 3] fp32: per row alpha, gate threshold (raw), gate enabled (0/1);
- `row_index` [max_rows, 2] int64: per row vector slot, gate column.

Rows are the leading dimension so that a step's first `count` rows are one contiguous
block: the host→device copy of a prefix is then a single pinned, truly asynchronous copy.

The per-row values are filled every step by the controller from the requests' settings.
They travel from a small ring of (pinned, on CUDA) host staging buffers with
non-blocking copies queued before the forward, so no step waits for the device; a
staging slot is reused only after the copy that read it has completed (an event per
slot, long since passed by then).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import engine_worker.tap.ops  # noqa: F401  (registers torch.ops.probex.steer)
from engine_worker.tap.layer import LayerTap, await_storage

ALPHA, THRESHOLD, GATE_ENABLED = 0, 1, 2
VECTOR_SLOT, GATE_COLUMN = 0, 1


class RowValues:
    """Host-side per-row steering values of one step for one layer (all rows off by default)."""

    def __init__(self, max_rows: int) -> None:
        self.params = np.zeros((max_rows, 3), dtype=np.float32)
        self.index = np.zeros((max_rows, 2), dtype=np.int64)
        self.used = 0  # rows [0, used) may be non-zero

    def set(self, rows: np.ndarray, alpha: float, slot: int, gate_column: int | None, raw_threshold: float) -> None:
        if not len(rows):
            return
        self.params[rows, ALPHA] = alpha
        self.index[rows, VECTOR_SLOT] = slot
        if gate_column is not None:
            self.params[rows, THRESHOLD] = raw_threshold
            self.params[rows, GATE_ENABLED] = 1.0
            self.index[rows, GATE_COLUMN] = gate_column
        self.used = max(self.used, int(rows.max()) + 1)


class _Staging:
    def __init__(self, max_rows: int, pin: bool) -> None:
        self.params = torch.zeros(max_rows, 3, dtype=torch.float32, pin_memory=pin)
        self.index = torch.zeros(max_rows, 2, dtype=torch.long, pin_memory=pin)
        self.done: torch.cuda.Event | None = None


class LayerSteer(nn.Module):
    def __init__(self, layer: int, hidden_size: int, capacity: int, max_rows: int,
                 gate_taps: list[LayerTap] | tuple[LayerTap, ...] = (), staging_depth: int = 4,
                 device: torch.device | str | None = None) -> None:
        """`device`: as for `LayerTap` ("meta" defers the buffers' storage to `tap.materialize`)."""
        super().__init__()
        if capacity < 1:
            raise ValueError("LayerSteer needs room for at least one vector")
        self.layer = layer
        self.hidden_size = hidden_size
        self.capacity = capacity
        f32 = torch.float32
        self.register_buffer("vectors", torch.zeros(capacity, hidden_size, dtype=f32, device=device), persistent=False)
        self.register_buffer("row_params", torch.zeros(max_rows, 3, dtype=f32, device=device), persistent=False)
        self.register_buffer("row_index", torch.zeros(max_rows, 2, dtype=torch.long, device=device), persistent=False)
        if self.vectors.is_meta:
            await_storage(self)
        ordered = tuple(sorted(gate_taps, key=lambda t: t.layer))
        if any(t.layer > layer for t in ordered):
            raise ValueError(f"layer {layer}: a gate can only read taps at this layer or earlier ones")
        # Plain attribute, not submodules: each tap belongs to (and is registered under) its own layer.
        object.__setattr__(self, "_gate_taps", ordered)
        self._staging_depth = staging_depth
        self._staging: list[_Staging] | None = None
        self._next = 0
        self._device_used = 0  # rows [0, _device_used) of the device buffers may be non-zero

    @property
    def max_rows(self) -> int:
        return self.row_params.shape[0]

    @property
    def gate_layers(self) -> list[int]:
        return [t.layer for t in self._gate_taps]

    def gate_column(self, layer: int, slot: int) -> int | None:
        """Column of probe `slot` at tapped `layer` in the concatenated gate scores; None if not readable here."""
        offset = 0
        for tap in self._gate_taps:
            if tap.layer == layer:
                return offset + slot if 0 <= slot < tap.capacity else None
            offset += tap.capacity
        return None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.probex.steer(
            hidden, self.vectors, self.row_params[:, ALPHA], self.row_index[:, VECTOR_SLOT],
            [tap.scores for tap in self._gate_taps], self.row_index[:, GATE_COLUMN],
            self.row_params[:, THRESHOLD], self.row_params[:, GATE_ENABLED],
        )

    @torch.no_grad()
    def load(self, vectors: np.ndarray) -> None:
        """Copy k vectors into slots 0..k-1 and zero the rest, in place (addresses kept)."""
        k = vectors.shape[0]
        if k > self.capacity:
            raise ValueError(f"layer {self.layer}: {k} steering vectors exceed the {self.capacity} slots"
                             " fixed at startup")
        staged = torch.zeros_like(self.vectors, device="cpu")
        if k:
            staged[:k] = torch.from_numpy(np.asarray(vectors, dtype=np.float32))
        self.vectors.copy_(staged)

    @torch.no_grad()
    def stage_rows(self, values: RowValues | None, step_rows: int) -> bool:
        """Queue this step's per-row values; returns whether a copy was queued.

        Nothing is copied while no row is steered and the device buffers are already
        clear, so an idle steering layer costs no host work and no transfer at all.
        """
        used = values.used if values is not None else 0
        if used == 0 and self._device_used == 0:
            return False
        # Clear whatever an earlier step left on the device, and cover this step's rows
        # (CUDA-graph padding rows included) so none of them reads a stale alpha.
        count = min(self.max_rows, max(used, self._device_used, step_rows))
        slot = self._take_staging()
        if values is not None:
            slot.params[:count].copy_(torch.from_numpy(values.params[:count]))
            slot.index[:count].copy_(torch.from_numpy(values.index[:count]))
        else:
            slot.params[:count].zero_()
            slot.index[:count].zero_()
        cuda = self.row_params.device.type == "cuda"
        self.row_params[:count].copy_(slot.params[:count], non_blocking=cuda)
        self.row_index[:count].copy_(slot.index[:count], non_blocking=cuda)
        if cuda:
            slot.done = torch.cuda.Event()
            slot.done.record()
        self._device_used = used
        return True

    def _take_staging(self) -> _Staging:
        if self._staging is None:
            pin = self.row_params.device.type == "cuda"
            self._staging = [_Staging(self.max_rows, pin) for _ in range(self._staging_depth)]
        slot = self._staging[self._next]
        self._next = (self._next + 1) % len(self._staging)
        if slot.done is not None:
            slot.done.synchronize()  # queued `depth` steps ago: already complete in practice
            slot.done = None
        return slot
