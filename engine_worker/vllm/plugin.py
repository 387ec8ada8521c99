"""`vllm.general_plugins` entry point: registration only.

vLLM calls `register()` once in every process it starts (API server, engine core,
workers) before any model is built. It must stay cheap and idempotent and must not
initialise CUDA: it registers the op and patches classes; whether anything is tapped
is decided later from the engine's `additional_config`.
"""

from __future__ import annotations

import logging

log = logging.getLogger("probex.plugin")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    import engine_worker.tap.ops  # noqa: F401  (torch.ops.probex.tap)
    from engine_worker.vllm.models import patch_decoder_layers, patch_engine_config
    from engine_worker.vllm.v1_runner import patch_v1_runner
    from engine_worker.vllm.v2_runner import patch_v2_runner
    from engine_worker.vllm.worker import patch_prefix_cache_bypass

    patch_engine_config()  # before any VllmConfig exists in this process
    patch_decoder_layers()
    patch_v1_runner()
    patch_v2_runner()  # a no-op where vLLM has no V2 runner (the CPU backend)
    patch_prefix_cache_bypass()
    _registered = True
