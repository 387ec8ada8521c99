"""Static buffers of one tapped layer and the probes loaded into them.

A `LayerTap` is an nn.Module attached to a decoder layer when the model is built, so
torch.compile sees its buffers as module state. Their addresses never change once the
engine runs: a live probe swap copies new values into them between steps, which is what
lets compiled graphs and CUDA graphs keep running unchanged.

Inside vLLM the buffers are built on the meta device (shapes only) and given storage by
`materialize` once the weights are loaded: allocated while the model was built, they sat
between one layer's weights and the next one's, so the model's weights would not be
allocated as in plain vLLM.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch import nn

import engine_worker.tap.ops  # noqa: F401  (registers torch.ops.probex.tap)
from engine_worker.tap import kernel as fused_tap
from engine_worker.scores.bookkeeping import ProbeSlot  # noqa: F401  (the host-side record of a slot, torch-free)


class LayerTap(nn.Module):
    def __init__(
        self,
        layer: int,
        hidden_size: int,
        capacity: int,
        max_rows: int,
        capture_rows: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        """`device`: where the buffers are built (the default device if None); "meta" defers
        their storage to `materialize`."""
        super().__init__()
        self.layer = layer
        self.hidden_size = hidden_size
        self.capacity = capacity
        f32 = torch.float32

        def zeros(*shape: int, dtype: torch.dtype = f32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.register_buffer("weight", zeros(capacity, hidden_size), persistent=False)
        self.register_buffer("bias", zeros(capacity), persistent=False)
        self.register_buffer("scores", zeros(max_rows, capacity), persistent=False)
        self.register_buffer("capture_index", zeros(capture_rows, dtype=torch.long), persistent=False)
        self.register_buffer("capture", zeros(capture_rows, hidden_size), persistent=False)
        # Non-zero: the op leaves the scores alone (`set_paused`). Zero, as `materialize` leaves
        # it, is running.
        self.register_buffer("paused", zeros(1, dtype=torch.int32), persistent=False)
        if self.scores.is_meta:
            await_storage(self)

    @property
    def max_rows(self) -> int:
        return self.scores.shape[0]

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        torch.ops.probex.tap(
            hidden, residual, self.weight, self.bias, self.scores, self.capture_index, self.capture, self.paused
        )

    @torch.no_grad()
    def warm_kernels(self, dtype: torch.dtype) -> int:
        """Compile the op's device kernels for this layer's shapes now, with the model's
        activation dtype, instead of on the first request (`fused_tap.warm_up`); returns the
        launches made, 0 off CUDA."""
        return fused_tap.warm_up(self.hidden_size, self.capacity, self.max_rows, dtype, self.scores.device)

    @torch.no_grad()
    def set_paused(self, paused: bool) -> None:
        """Switch the op's work off or on in place (the flag's address kept, as graphs need);
        the next forward enqueued after this sees it."""
        self.paused.fill_(int(paused))

    @torch.no_grad()
    def load(self, weights: np.ndarray, biases: np.ndarray) -> None:
        """Copy k probes into slots 0..k-1 and zero the rest, in place (addresses kept)."""
        k = weights.shape[0]
        if k > self.capacity:
            raise ValueError(f"layer {self.layer}: {k} probes exceed the {self.capacity} slots fixed at startup")
        staged_w = torch.zeros_like(self.weight, device="cpu")
        staged_b = torch.zeros_like(self.bias, device="cpu")
        if k:
            staged_w[:k] = torch.from_numpy(np.asarray(weights, dtype=np.float32))
            staged_b[:k] = torch.from_numpy(np.asarray(biases, dtype=np.float32))
        self.weight.copy_(staged_w)
        self.bias.copy_(staged_b)

    def set_capture_rows(self, rows: np.ndarray) -> None:
        n = min(len(rows), self.capture_index.shape[0])
        staged = torch.zeros(self.capture_index.shape[0], dtype=torch.long)
        staged[:n] = torch.from_numpy(np.asarray(rows[:n], dtype=np.int64))
        self.capture_index.copy_(staged, non_blocking=True)


# Modules built with their buffers on the meta device, until `materialize` gives them storage.
# The runner adapter materializes every one, those of a model it does not walk too (a draft
# model for speculative decoding, built from tapped layer classes), so none is left to fail.
_AWAITING_STORAGE: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def await_storage(module: nn.Module) -> None:
    _AWAITING_STORAGE.add(module)


def awaiting_storage() -> list[nn.Module]:
    """Modules built on the meta device and not materialized yet (this process's)."""
    return [m for m in list(_AWAITING_STORAGE) if any(b.is_meta for b in m.buffers(recurse=False))]


def materialize(module: nn.Module, device: torch.device) -> int:
    """Give `module`'s own buffers that were built on the meta device zeroed storage on
    `device`, same shapes and dtypes; returns how many. Before any graph is traced: the
    compiled graphs and CUDA graphs then keep the addresses given here."""
    count = 0
    for name, buffer in module.named_buffers(recurse=False):
        if buffer is not None and buffer.is_meta:
            module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)
            count += 1
    _AWAITING_STORAGE.discard(module)
    return count


def patch_classes(classes_by_module: dict[str, tuple[str, ...]], patch) -> list[str]:
    """`patch(cls)` for each named class of each module that imports (an engine folder's decoder
    layers: modules this engine build lacks are skipped); the dotted names it patched."""
    import importlib

    patched = []
    for module_name, class_names in classes_by_module.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for class_name in class_names:
            cls = getattr(module, class_name, None)
            if cls is not None and patch(cls):
                patched.append(f"{module_name}.{class_name}")
    return patched
