"""Decoder-layer patches: the only place ProbeX touches SGLang model classes.

SGLang 0.5.14's Llama and Qwen2 decoder layers (Mistral is served by `MistralForCausalLM`,
a `LlamaForCausalLM`, so by Llama's layer) take `(positions, hidden_states, forward_batch,
residual)` and return `(hidden_states, residual)` with the add deferred to the next layer's
fused add + RMSNorm: hidden + residual after layer L is HF `output_hidden_states[L + 1]`, the
point every probe reads. That norm overwrites both tensors in place, so the tap consumes them
inside layer L: each tapped layer gets a `LayerTap` child module when it is built and a
forward that feeds its output pair to `torch.ops.probex.tap` before returning it unchanged.

The forward never reads `forward_batch` (Dynamo would guard on it and compile again per
batch layout): the op is layout-free, so it stays inside SGLang's torch.compile'd prefill
pieces and its CUDA graphs, prefill and decode alike, and runs on every replay. Rows past a
step's real tokens (graph padding) get scores nobody reads.

The buffers are built on the meta device and given storage by runner.py once the weights are
in, before any graph is captured (engine_worker/tap/layer.py says why).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re

from engine_worker.settings import TAP_CONFIG
from engine_worker.tap.config import TapConfig
from engine_worker.tap.layer import LayerTap, patch_classes

log = logging.getLogger("probex.sglang.models")

# module path -> decoder-layer classes whose forward returns (hidden_states, residual)
SUPPORTED_DECODER_LAYERS = {
    "sglang.srt.models.llama": ("LlamaDecoderLayer",),  # Llama, and Mistral through MistralForCausalLM
    "sglang.srt.models.qwen2": ("Qwen2DecoderLayer",),
}
# SGLang caps its own default of concurrent requests at this (model_runner_kv_cache_mixin.py).
DEFAULT_MAX_RUNNING_REQUESTS = 4096

_PATCHED_MARK = "_probex_patched"
_LAYER_IN_PREFIX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def patch_decoder_layers() -> list[str]:
    return patch_classes(SUPPORTED_DECODER_LAYERS, patch_class)


def patch_class(cls: type, settings=None) -> bool:
    """Give `cls` the tap. `settings`: a function returning (tap config, rows per step) for the
    process, or None where there is no tap (default: `engine_settings`, read from the
    environment and SGLang's server arguments)."""
    if cls.__dict__.get(_PATCHED_MARK):
        return False
    original_init = cls.__init__
    init_signature = inspect.signature(original_init)
    settings = settings or engine_settings

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        bound = init_signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        index = layer_index(arguments.get("layer_id"), arguments.get("prefix", ""))
        found = settings()
        if found is not None and index is not None:
            attach_tap(self, index, *found, config=arguments.get("config"))

    cls.__init__ = __init__
    original_forward = cls.forward

    @functools.wraps(original_forward)
    def forward(self, positions, hidden_states, forward_batch, residual, *args, **kwargs):
        hidden_states, residual = original_forward(self, positions, hidden_states, forward_batch, residual,
                                                   *args, **kwargs)
        tap = getattr(self, "probex_tap", None)
        if tap is not None:
            tap(hidden_states, residual)
        return hidden_states, residual

    cls.forward = forward
    setattr(cls, _PATCHED_MARK, True)
    return True


def layer_index(layer_id, prefix: str = "") -> int | None:
    """The decoder layer's index: its `layer_id` argument, else the `layers.N` in its prefix."""
    if isinstance(layer_id, int) and not isinstance(layer_id, bool) and layer_id >= 0:
        return layer_id
    match = _LAYER_IN_PREFIX.search(prefix or "")
    return int(match.group(1)) if match else None


def max_rows_for(chunked_prefill_size, max_prefill_tokens=None, max_running_requests=None,
                 cuda_graph_max_bs=None, prefill_graph_max_tokens=None) -> int:
    """Rows the tap's buffers must hold: a step's tokens (a prefill chunk, with running
    requests mixed in, or one row per running request; graph padding included: a decode
    batch is padded up to a captured batch size <= `cuda_graph_max_bs`, a prefill up to a
    captured token count <= `prefill_graph_max_tokens`).

    A prefill batch's tokens stay within the chunk size; without chunking one prompt may be
    as long as the context, so chunked prefill must be on."""
    if chunked_prefill_size is None or int(chunked_prefill_size) <= 0:
        raise RuntimeError("probex: SGLang's chunked prefill is off (--chunked-prefill-size <= 0); the tap needs"
                           " a bound on a step's tokens: give --chunked-prefill-size N")
    prefill = max(int(chunked_prefill_size), int(max_prefill_tokens or 0), int(prefill_graph_max_tokens or 0))
    running = max(int(max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS), int(cuda_graph_max_bs or 0))
    return prefill + running


def graph_max_sizes(args) -> tuple[int | None, int | None]:
    """(decode graphs' largest batch, prefill graphs' largest token count) from SGLang's
    server arguments: 0.5.14 keeps them in `cuda_graph_config` (`decode.max_bs`,
    `prefill.max_bs`, filled in by ServerArgs.__post_init__ from `--cuda-graph-max-bs-decode` /
    `--cuda-graph-max-bs-prefill`, read directly where the config is not filled in yet)."""
    config = getattr(args, "cuda_graph_config", None)
    decode = getattr(getattr(config, "decode", None), "max_bs", None)
    prefill = getattr(getattr(config, "prefill", None), "max_bs", None)
    if decode is None:
        decode = getattr(args, "cuda_graph_max_bs_decode", None)
    if prefill is None:
        prefill = getattr(args, "cuda_graph_max_bs_prefill", None)
    return decode, prefill


def engine_settings() -> tuple[TapConfig, int] | None:
    """(tap configuration, rows per step) in an SGLang process started by `probex worker`;
    None anywhere else (no PROBEX_TAP_CONFIG)."""
    raw = os.environ.get(TAP_CONFIG)
    if not raw:
        return None
    tap_config = TapConfig.from_json(raw)
    if tap_config is None:
        return None
    from sglang.srt.server_args import get_global_server_args

    args = get_global_server_args()
    decode_graph_bs, prefill_graph_tokens = graph_max_sizes(args)
    return tap_config, max_rows_for(args.chunked_prefill_size, args.max_prefill_tokens, args.max_running_requests,
                                    decode_graph_bs, prefill_graph_tokens)


def attach_tap(layer, index: int, tap_config: TapConfig, max_rows: int, config=None) -> LayerTap | None:
    """A `LayerTap` on `layer` if `index` is tapped (buffers on the meta device)."""
    if tap_config.steer_layers:
        raise RuntimeError("probex: steering is not available on SGLang; start without --steer-layer/--steer-vector")
    if index not in tap_config.layers or getattr(layer, "probex_tap", None) is not None:
        return None
    hidden_size = getattr(layer, "hidden_size", None) or getattr(config, "hidden_size", None)
    if not hidden_size:
        raise RuntimeError(f"probex: cannot tell the hidden size of decoder layer {index} ({type(layer).__name__})")
    capture_rows = min(tap_config.capture_rows, max_rows) if tap_config.capture_enabled else 0
    layer.probex_tap = LayerTap(index, int(hidden_size), tap_config.probes_per_layer, max_rows, capture_rows,
                                device="meta")
    log.info("probex: tapping decoder layer %d (%s), %d probe slots, %d rows", index, type(layer).__name__,
             tap_config.probes_per_layer, max_rows)
    return layer.probex_tap
