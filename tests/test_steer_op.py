"""The steering op and its buffers on the CPU, eager and under torch.compile, without an engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from engine_worker.tap.steer import LayerSteer, RowValues
from engine_worker.tap.layer import LayerTap

H, ROWS = 16, 32


class TwoBlocks(nn.Module):
    """Block 0 is tapped; block 1 is tapped and steered, gating on either tap."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.proj0, self.proj1 = nn.Linear(H, H).to(dtype), nn.Linear(H, H).to(dtype)
        self.tap0 = LayerTap(0, H, capacity=2, max_rows=ROWS)
        self.tap1 = LayerTap(1, H, capacity=2, max_rows=ROWS)
        self.steer1 = LayerSteer(1, H, capacity=3, max_rows=ROWS, gate_taps=[self.tap1, self.tap0])

    def forward(self, hidden, residual):
        hidden = self.proj0(hidden)
        self.tap0(hidden, residual)
        hidden = self.proj1(hidden)
        self.tap1(hidden, residual)
        hidden = self.steer1(hidden)
        return hidden, residual


def setup_block(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    block = TwoBlocks(dtype)
    rng = np.random.default_rng(seed)
    block.tap0.load(rng.standard_normal((2, H)).astype(np.float32), np.zeros(2, np.float32))
    block.tap1.load(rng.standard_normal((1, H)).astype(np.float32), np.array([0.5], np.float32))
    vectors = rng.standard_normal((2, H)).astype(np.float32)
    block.steer1.load(vectors)
    return block, torch.from_numpy(vectors)


def stage(block, step_rows, rows_alpha_slot, gate=None):
    values = RowValues(ROWS)
    for rows, alpha, slot in rows_alpha_slot:
        column, threshold = gate if gate else (None, 0.0)
        values.set(np.asarray(rows), alpha, slot, column, threshold)
    block.steer1.stage_rows(values, step_rows)


@pytest.mark.parametrize("compiled", [False, True])
def test_written_rows_get_alpha_v_and_the_rest_are_bit_identical(compiled):
    block, vectors = setup_block()
    run = torch.compile(block, fullgraph=True, dynamic=True) if compiled else block
    for rows in (6, 9):
        hidden, residual = torch.randn(rows, H), torch.randn(rows, H)
        stage(block, rows, [([1, 3], 2.5, 1), ([4], -1.0, 0)])
        with torch.no_grad():
            out, _ = run(hidden, residual)
            plain = block.proj1(block.proj0(hidden))
        expected = plain.clone()
        expected[[1, 3]] += 2.5 * vectors[1]
        expected[4] += -1.0 * vectors[0]
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        untouched = [r for r in range(rows) if r not in (1, 3, 4)]
        assert torch.equal(out[untouched], plain[untouched])  # bit for bit, not approximately


def test_alpha_zero_everywhere_is_bit_identical_in_bf16_too():
    block, _ = setup_block(torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    hidden, residual = torch.randn(7, H, dtype=torch.bfloat16), torch.randn(7, H, dtype=torch.bfloat16)
    stage(block, 7, [([0, 1, 2], 0.0, 1)])  # set but zero alpha
    with torch.no_grad():
        out, _ = compiled(hidden, residual)
        plain = block.proj1(block.proj0(hidden))
    assert out.dtype == torch.bfloat16 and torch.equal(out, plain)


@pytest.mark.parametrize("compiled", [False, True])
def test_gate_reads_this_forwards_tap_scores_in_graph(compiled):
    block, vectors = setup_block()
    run = torch.compile(block, fullgraph=True, dynamic=True) if compiled else block
    rows = 12
    hidden, residual = torch.randn(rows, H), torch.randn(rows, H)
    with torch.no_grad():
        h0 = block.proj0(hidden)
        h1 = block.proj1(h0)
        score0 = (h0 + residual) @ block.tap0.weight[1] + block.tap0.bias[1]  # layer 0, slot 1
        score1 = (h1 + residual) @ block.tap1.weight[0] + block.tap1.bias[0]  # layer 1, slot 0
    for layer, slot, score in ((0, 1, score0), (1, 0, score1)):
        threshold = float(score.median())
        column = block.steer1.gate_column(layer, slot)
        stage(block, rows, [(range(rows), 3.0, 0)], gate=(column, threshold))
        with torch.no_grad():
            out, _ = run(hidden, residual)
        fires = score > threshold
        assert 0 < int(fires.sum()) < rows  # both sides of the threshold are exercised
        torch.testing.assert_close(out[fires], h1[fires] + 3.0 * vectors[0], rtol=1e-6, atol=1e-6)
        assert torch.equal(out[~fires], h1[~fires])


def test_gate_columns_follow_the_tap_order_and_refuse_later_layers():
    block, _ = setup_block()
    assert block.steer1.gate_layers == [0, 1]
    assert block.steer1.gate_column(0, 1) == 1 and block.steer1.gate_column(1, 0) == 2
    assert block.steer1.gate_column(2, 0) is None and block.steer1.gate_column(0, 5) is None
    with pytest.raises(ValueError, match="this layer or earlier"):
        LayerSteer(0, H, 1, ROWS, gate_taps=[block.tap1])


def test_vector_swap_keeps_addresses_and_stale_rows_are_cleared():
    block, _ = setup_block()
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    address = block.steer1.vectors.data_ptr()
    new = np.full((1, H), 2.0, np.float32)
    block.steer1.load(new)
    assert block.steer1.vectors.data_ptr() == address
    assert torch.all(block.steer1.vectors[1:] == 0)
    hidden, residual = torch.randn(8, H), torch.randn(8, H)
    stage(block, 8, [([7], 1.0, 0)])
    with torch.no_grad():
        out, _ = compiled(hidden, residual)
        plain = block.proj1(block.proj0(hidden))
    torch.testing.assert_close(out[7], plain[7] + 2.0)
    # Next step steers nothing: the row 7 left on the device must be cleared, once.
    assert block.steer1.stage_rows(None, 8)
    assert torch.all(block.steer1.row_params == 0)
    assert not block.steer1.stage_rows(None, 8)  # idle: no copy at all
    with torch.no_grad():
        out, _ = compiled(hidden, residual)
    assert torch.equal(out, plain)
