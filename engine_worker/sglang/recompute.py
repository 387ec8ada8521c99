"""Forced recompute per request: `custom_params: {"probex_recompute": true}` reads no prefix
from SGLang's radix cache for that request; every other request keeps the cache.

SGLang 0.5.14 caps every prefix match of a request by `Req._compute_max_prefix_len(input_len)`
(schedule_batch.py): the radix match itself (`RadixKey(limit=...)`, honoured whenever it is
not None), the scheduling policy's estimate of the match and the hierarchical cache's
prefetch all ask it. Returning 0 for a recompute request makes each of them see no prefix, so
its whole prompt runs and is scored; its KV is still inserted for others to read. The chunks
of a chunked prefill continue from their own KV without a match, so they are unaffected.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger("probex.sglang.recompute")

RECOMPUTE_KEY = "probex_recompute"
_PATCHED_MARK = "_probex_recompute_patched"


def wants_recompute(custom_params: Any) -> bool:
    """Whether a request's `custom_params` ask for a forced recompute (the middleware writes
    true/false as 1/0; the strings a client may send directly are read too)."""
    if not isinstance(custom_params, dict):
        return False
    value = custom_params.get(RECOMPUTE_KEY)
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1")
    return value is not None and not isinstance(value, (dict, list)) and bool(value)


def custom_params_of(req: Any) -> Any:
    params = getattr(req, "sampling_params", None)
    return getattr(params, "custom_params", None)


def max_prefix_len(original: int, req: Any) -> int:
    """The prefix a request may read from the radix cache: none for a recompute request."""
    return 0 if wants_recompute(custom_params_of(req)) else original


def patch_radix_prefix_bypass() -> bool:
    """Patch SGLang's `Req` (in an SGLang process). True if it patched now."""
    from sglang.srt.managers.schedule_batch import Req

    return patch_req_class(Req)


def patch_req_class(cls: type) -> bool:
    if cls.__dict__.get(_PATCHED_MARK):
        return False
    original = cls._compute_max_prefix_len

    @functools.wraps(original)
    def _compute_max_prefix_len(self, input_len: int, *args, **kwargs) -> int:
        return max_prefix_len(original(self, input_len, *args, **kwargs), self)

    cls._compute_max_prefix_len = _compute_max_prefix_len
    setattr(cls, _PATCHED_MARK, True)
    return True
