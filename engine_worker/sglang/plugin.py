"""`sglang.srt.plugins` entry point: registration only.

SGLang 0.5.14 calls `register()` through `load_plugins()` in every process it starts (the
server's, and each scheduler process before its model is built). It must stay cheap and
idempotent and must not initialise CUDA: it registers the op and patches classes; whether
anything is tapped is decided later, from PROBEX_TAP_CONFIG, which `probex worker --engine
sglang` sets.
"""

from __future__ import annotations

import logging

log = logging.getLogger("probex.sglang.plugin")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    import engine_worker.tap.ops  # noqa: F401  (torch.ops.probex.tap)
    from engine_worker.sglang.models import patch_decoder_layers
    from engine_worker.sglang.recompute import patch_radix_prefix_bypass
    from engine_worker.sglang.runner import patch_sglang

    patched = patch_decoder_layers()
    patch_sglang()
    patch_radix_prefix_bypass()
    log.debug("probex: patched %s", ", ".join(patched) or "no decoder layer")
    _registered = True
