"""The environment variables ProbeX's worker reads: settings an operator sets, nothing else.

No environment variable picks an implementation. The settings table in docs/settings.md
lists these with the gateway's; keep the two in step.

| variable              | read by                          | meaning                                               |
|-----------------------|----------------------------------|-------------------------------------------------------|
| PROBEX_ADMIN_TOKEN    | the worker's API servers          | bearer token of the admin routes and engine controls  |
| PROBEX_SCORE_WAIT_S   | the worker's API servers          | how long a response waits for its scores (default 10) |
| PROBEX_RETENTION      | the worker's API servers          | "0" skips the calibration-retention check on swaps    |
| PROBEX_CACHE          | probe tooling, model fetch        | cache directory (default ~/.cache/probex)             |
| PROBEX_TAP_CONFIG     | every engine process (internal)   | the tap configuration `probex worker` hands to vLLM   |

`probex worker` refuses to start while a variable it no longer reads is set
(`refuse_removed_settings`), naming what replaced it: a setting that is silently ignored
is worse than one that stops the start.
"""

from __future__ import annotations

import os
from typing import Mapping

PREFIX = "PROBEX_"
ADMIN_TOKEN = "PROBEX_ADMIN_TOKEN"
SCORE_WAIT_S = "PROBEX_SCORE_WAIT_S"
RETENTION = "PROBEX_RETENTION"
CACHE = "PROBEX_CACHE"
TAP_CONFIG = "PROBEX_TAP_CONFIG"

_ONE_PATH = "scores always go device -> score ring -> score formatter -> API servers; unset it"
REMOVED = {
    "PROBEX_SCORE_CONSUMER": _ONE_PATH,
    "PROBEX_SCORE_RING": _ONE_PATH,
    "PROBEX_SCORE_FORMATTER": _ONE_PATH,
    "PROBEX_COPY_STREAM": _ONE_PATH,
    "PROBEX_SCORES_AHEAD_OF_TOKENS": _ONE_PATH,
    "PROBEX_PROMPT_SCORES_MID_FORWARD": "a prompt step's scores are always copied out mid-forward; unset it",
    "PROBEX_DELIVERY": "pause the tap instead (PUT /probex/tap {\"paused\": true}); unset it",
    "PROBEX_TAP_BUFFERS": "the tap's buffers are always allocated after the weights; unset it",
    "PROBEX_TAP_KERNEL": "the tap's kernel is chosen by device (Triton on CUDA, torch elsewhere); unset it",
    "PROBEX_HOOK_SPIN_US": "a benchmark-only diagnostic that no longer exists; unset it",
    "PROBEX_STEP_TIMING": "a benchmark-only diagnostic that no longer exists; unset it",
    "PROBEX_STEP_TIMING_MIN_ROWS": "a benchmark-only diagnostic that no longer exists; unset it",
    "PROBEX_SWITCH_INTERVAL_S": "a benchmark-only diagnostic that no longer exists; unset it",
    "PROBEX_API_SERVER_COUNT": "`probex worker` reads --api-server-count itself; unset it",
    "PROBEX_MODEL_DIR": "`probex worker` carries the model directory in the tap configuration; unset it",
}


def refuse_removed_settings(environ: Mapping[str, str] | None = None) -> None:
    """SystemExit with one line per removed variable that is still set."""
    environ = os.environ if environ is None else environ
    found = [f"{name} is no longer read: {why}" for name, why in REMOVED.items() if name in environ]
    if found:
        raise SystemExit("probex worker: " + "\nprobex worker: ".join(found))


def score_wait_s(environ: Mapping[str, str] | None = None) -> float:
    raw = (os.environ if environ is None else environ).get(SCORE_WAIT_S, "10")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{SCORE_WAIT_S} must be a number of seconds, not {raw!r}") from None
    if not value >= 0:
        raise ValueError(f"{SCORE_WAIT_S} must be 0 or more seconds, not {raw!r}")
    return value
