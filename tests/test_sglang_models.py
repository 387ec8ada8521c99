"""The SGLang decoder-layer patch (engine_worker/sglang/models.py) on a stand-in layer with
SGLang 0.5.14's signatures: which layers get a tap, where it reads, what it never touches."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from engine_worker.sglang import models
from engine_worker.tap.config import TapConfig
from engine_worker.tap.layer import materialize


class Untouchable:
    """A forward batch the patched forward must not read (Dynamo would guard on it)."""

    def __getattr__(self, name):
        raise AssertionError(f"the tap read forward_batch.{name}")


def make_layer_class():
    class DecoderLayer(nn.Module):
        """Llama's shape: (positions, hidden, forward_batch, residual) -> (hidden, residual),
        the add left to the next layer's fused add + norm."""

        def __init__(self, config, layer_id: int = 0, quant_config=None, prefix: str = "") -> None:
            super().__init__()
            self.hidden_size = config.hidden_size
            self.scale = float(layer_id + 2)

        def forward(self, positions, hidden_states, forward_batch, residual):
            if residual is None:
                residual = hidden_states
            else:
                residual = hidden_states + residual  # the fused add of this layer's input norm
            return residual * self.scale - residual, residual  # (block output, stream before it)

    return DecoderLayer


CONFIG = SimpleNamespace(hidden_size=4)


def settings(layers=(1,), rows=16, **extra):
    return lambda: (TapConfig(layers=tuple(layers), **extra), rows)


def test_the_supported_classes_are_llamas_and_qwen2s_decoder_layers():
    assert models.SUPPORTED_DECODER_LAYERS == {"sglang.srt.models.llama": ("LlamaDecoderLayer",),
                                              "sglang.srt.models.qwen2": ("Qwen2DecoderLayer",)}
    assert models.patch_decoder_layers() == []  # no sglang here: nothing imported, nothing patched


def test_only_tapped_layers_get_a_tap_with_buffers_awaiting_storage():
    cls = make_layer_class()
    assert models.patch_class(cls, settings((1, 2))) is True
    assert models.patch_class(cls, settings((1, 2))) is False
    layers = [cls(CONFIG, layer_id=i, prefix=f"model.layers.{i}") for i in range(3)]
    assert getattr(layers[0], "probex_tap", None) is None
    tap = layers[1].probex_tap
    assert tap.layer == 1 and tap.hidden_size == 4 and tap.scores.is_meta and tap.max_rows == 16
    assert layers[2].probex_tap.layer == 2


def test_the_layer_index_comes_from_layer_id_or_the_prefix():
    assert models.layer_index(3, "model.layers.7") == 3
    assert models.layer_index(None, "model.layers.7.mlp") == 7
    assert models.layer_index(None, "lm_head") is None
    cls = make_layer_class()
    models.patch_class(cls, settings((0,)))
    assert cls(CONFIG).probex_tap.layer == 0  # layer_id's default


def test_no_tap_configuration_leaves_layers_alone():
    cls = make_layer_class()
    models.patch_class(cls, lambda: None)
    layer = cls(CONFIG, layer_id=1)
    assert getattr(layer, "probex_tap", None) is None
    hidden, residual = layer(None, torch.ones(2, 4), Untouchable(), torch.ones(2, 4))
    assert torch.equal(residual, torch.full((2, 4), 2.0))


def test_the_tap_reads_hidden_plus_residual_after_the_layer_and_returns_both_unchanged():
    """hidden + residual after layer L is what layer L+1 (or the final norm) adds first: HF's
    output_hidden_states[L + 1]."""
    cls = make_layer_class()
    models.patch_class(cls, settings((1,)))
    layers = [cls(CONFIG, layer_id=i) for i in range(2)]
    tap = layers[1].probex_tap
    materialize(tap, torch.device("cpu"))
    weight = np.arange(8, dtype=np.float32).reshape(2, 4) / 10
    tap.load(weight, np.array([0.5, -1.0], dtype=np.float32))
    x = torch.randn(3, 4)
    hidden, residual = layers[0](None, x, Untouchable(), None)
    hidden, residual = layers[1](None, hidden, Untouchable(), residual)
    stream = (hidden + residual).numpy()  # the next layer's input stream
    expected = stream @ weight.T + np.array([0.5, -1.0])
    np.testing.assert_allclose(tap.scores[:3, :2].numpy(), expected, rtol=1e-5, atol=1e-5)
    unpatched = make_layer_class()
    h0, r0 = unpatched(CONFIG, layer_id=0)(None, x, None, None)
    h1, r1 = unpatched(CONFIG, layer_id=1)(None, h0, None, r0)
    assert torch.equal(h1, hidden) and torch.equal(r1, residual)


def test_rows_per_step_cover_a_prefill_chunk_and_every_running_request():
    assert models.max_rows_for(8192, 16384, 256, 512) == 16384 + 512
    assert models.max_rows_for(2048, None, None, None) == 2048 + models.DEFAULT_MAX_RUNNING_REQUESTS
    with pytest.raises(RuntimeError, match="chunked prefill is off"):
        models.max_rows_for(-1, 16384, 64, 64)
    # a prefill graph captured past the chunk size pads a chunk up to its capture size
    assert models.max_rows_for(4096, 4096, 8, 256, 32768) == 32768 + 256


def test_graph_sizes_come_from_sglangs_cuda_graph_config():
    """0.5.14's ServerArgs keeps the captured sizes in cuda_graph_config (decode.max_bs,
    prefill.max_bs) and has no cuda_graph_max_bs attribute."""
    args = SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(max_bs=512),
                                                             prefill=SimpleNamespace(max_bs=8192)),
                           cuda_graph_max_bs_decode=None, cuda_graph_max_bs_prefill=None)
    assert models.graph_max_sizes(args) == (512, 8192)
    assert models.graph_max_sizes(SimpleNamespace(cuda_graph_config=None, cuda_graph_max_bs_decode=48,
                                                  cuda_graph_max_bs_prefill=None)) == (48, None)


def test_steering_configuration_is_refused_on_sglang():
    cls = make_layer_class()
    models.patch_class(cls, settings((1,), steer_layers=(1,)))
    with pytest.raises(RuntimeError, match="steering is not available on SGLang"):
        cls(CONFIG, layer_id=1)


def test_engine_settings_size_the_buffers_from_the_parsed_server_arguments(monkeypatch):
    import sys
    import types

    args = SimpleNamespace(chunked_prefill_size=2048, max_prefill_tokens=16384, max_running_requests=None,
                           cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(max_bs=256),
                                                             prefill=SimpleNamespace(max_bs=32768)))
    fake = types.ModuleType("sglang.srt.server_args")
    fake.get_global_server_args = lambda: args
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", fake)
    monkeypatch.setenv(models.TAP_CONFIG, TapConfig(layers=(1,)).to_json())
    tap_config, rows = models.engine_settings()
    assert tap_config.layers == (1,) and rows == 32768 + models.DEFAULT_MAX_RUNNING_REQUESTS
