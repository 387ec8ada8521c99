"""The op and its buffers under torch.compile, without an engine."""

import numpy as np
import torch
from torch import nn

from engine_worker.tap import LayerTap

H, K = 16, 3


class TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, H)
        self.probex_tap = LayerTap(layer=0, hidden_size=H, capacity=K, max_rows=32, capture_rows=4)

    def forward(self, hidden, residual):
        hidden = self.proj(hidden)
        self.probex_tap(hidden, residual)
        return hidden + residual


def reference(block, hidden, residual):
    with torch.no_grad():
        stream = block.proj(hidden) + residual
    return stream, stream @ block.probex_tap.weight.t() + block.probex_tap.bias


def test_compiled_op_writes_scores_for_every_row_and_follows_live_swaps():
    torch.manual_seed(0)
    block = TinyBlock()
    rng = np.random.default_rng(0)
    block.probex_tap.load(rng.standard_normal((2, H)).astype(np.float32), np.array([0.5, -1], np.float32))
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    for rows in (5, 9):
        hidden, residual = torch.randn(rows, H), torch.randn(rows, H)
        compiled(hidden, residual)
        _, expected = reference(block, hidden, residual)
        torch.testing.assert_close(block.probex_tap.scores[:rows], expected, rtol=1e-5, atol=1e-5)
    # Swap weights in place: the compiled graph must see them without recompiling.
    weight_address = block.probex_tap.weight.data_ptr()
    block.probex_tap.load(rng.standard_normal((1, H)).astype(np.float32), np.array([2.0], np.float32))
    assert block.probex_tap.weight.data_ptr() == weight_address
    hidden, residual = torch.randn(7, H), torch.randn(7, H)
    compiled(hidden, residual)
    _, expected = reference(block, hidden, residual)
    torch.testing.assert_close(block.probex_tap.scores[:7], expected, rtol=1e-5, atol=1e-5)
    assert torch.all(block.probex_tap.scores[:7, 1:] == 0)  # emptied slots score exactly zero


def test_capture_copies_the_selected_rows():
    block = TinyBlock()
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    block.probex_tap.set_capture_rows(np.array([4, 0, 2]))
    hidden, residual = torch.randn(6, H), torch.randn(6, H)
    compiled(hidden, residual)
    stream, _ = reference(block, hidden, residual)
    torch.testing.assert_close(block.probex_tap.capture[:3], stream[[4, 0, 2]])


def test_too_many_probes_for_the_slots_is_an_error():
    tap = LayerTap(layer=0, hidden_size=H, capacity=2, max_rows=4)
    try:
        tap.load(np.zeros((3, H), np.float32), np.zeros(3, np.float32))
    except ValueError as exc:
        assert "3 probes exceed the 2 slots" in str(exc)
    else:
        raise AssertionError("expected a refusal")


def test_op_reads_hidden_plus_residual_in_fp32_and_leaves_its_inputs_alone():
    tap = LayerTap(layer=0, hidden_size=H, capacity=K, max_rows=8)
    rng = np.random.default_rng(5)
    tap.load(rng.normal(size=(K, H)).astype(np.float32), rng.normal(size=K).astype(np.float32))
    for dtype in (torch.bfloat16, torch.float32):
        hidden, residual = torch.randn(5, H).to(dtype), torch.randn(5, H).to(dtype)
        before_h, before_r = hidden.clone(), residual.clone()
        tap(hidden, residual)
        stream = hidden.float() + residual.float()
        expected = stream @ tap.weight.t() + tap.bias
        torch.testing.assert_close(tap.scores[:5], expected, rtol=0, atol=1e-5)
        assert torch.equal(hidden, before_h) and torch.equal(residual, before_r), dtype
