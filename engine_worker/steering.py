"""Per-request steering settings: the `probex_steer*` vllm_xargs, checked and turned into per-row values.

Torch-free and engine-agnostic: the middleware validates requests with it (in the API
server process) and the controller uses it to fill the steering buffers each step.

Semantics (docs/steering.md):
- `probex_steer` names a loaded steering vector; the vector's own layer L says where it
  is added (the residual stream at the output of decoder block L).
- `probex_steer_alpha` multiplies it (any finite float; 0 = no write, bit-identical).
- `probex_steer_gate` (optional) names a loaded probe at a tapped layer <= L. The write
  at a token happens only if that probe's score at *that token*, computed in the same
  forward pass, is above `probex_steer_threshold`.
- `probex_steer_threshold` is a calibrated probability in (0, 1), the same units as the
  `score` the worker returns and the gateway's policy thresholds. The worker turns it
  into a raw threshold with the probe's calibration (raw > (logit(t) - intercept) / slope,
  for slope > 0), so the device compares raw scores and never runs a sigmoid.
- `probex_steer_window`: "all" (default), "prompt" (positions < prompt length) or
  "generation" (positions >= prompt length, i.e. generated tokens fed back in). The
  last prompt token, which samples generated token 0, is a prompt position.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np

XARG_VECTOR = "probex_steer"
XARG_ALPHA = "probex_steer_alpha"
XARG_GATE = "probex_steer_gate"
XARG_THRESHOLD = "probex_steer_threshold"
XARG_WINDOW = "probex_steer_window"
STEERING_XARGS = (XARG_VECTOR, XARG_ALPHA, XARG_GATE, XARG_THRESHOLD, XARG_WINDOW)
WINDOWS = ("all", "prompt", "generation")


class SteeringError(ValueError):
    """A malformed steering request; `param` names the vllm_xargs key at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SteerRequest:
    vector: str
    alpha: float
    gate: str | None = None
    threshold: float | None = None  # calibrated probability in (0, 1); set iff gate is
    window: str = "all"

    def config_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise SteeringError(f"vllm_xargs.{key} must be a number, got {value!r}", f"vllm_xargs.{key}")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise SteeringError(f"vllm_xargs.{key} must be a number, got {value!r}", f"vllm_xargs.{key}") from None
    if not isinstance(value, (int, float)):
        raise SteeringError(f"vllm_xargs.{key} must be a number, got {value!r}", f"vllm_xargs.{key}")
    value = float(value)
    if not math.isfinite(value):
        raise SteeringError(f"vllm_xargs.{key} must be finite, got {value!r}", f"vllm_xargs.{key}")
    return value


def _name(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SteeringError(f"vllm_xargs.{key} must be a non-empty name, got {value!r}", f"vllm_xargs.{key}")
    return value


def steering_from_xargs(xargs: Mapping[str, Any] | None) -> SteerRequest | None:
    """The request's steering settings, None when it asks for none; SteeringError when malformed."""
    xargs = xargs or {}
    present = [k for k in STEERING_XARGS if k in xargs]
    if not present:
        return None
    if XARG_VECTOR not in xargs:
        raise SteeringError(f"vllm_xargs.{present[0]} needs vllm_xargs.{XARG_VECTOR} (the vector's name)",
                            f"vllm_xargs.{XARG_VECTOR}")
    vector = _name(XARG_VECTOR, xargs[XARG_VECTOR])
    if XARG_ALPHA not in xargs:
        raise SteeringError(f"vllm_xargs.{XARG_VECTOR} needs vllm_xargs.{XARG_ALPHA} (a finite number)",
                            f"vllm_xargs.{XARG_ALPHA}")
    alpha = _number(XARG_ALPHA, xargs[XARG_ALPHA])
    gate = threshold = None
    if XARG_GATE in xargs:
        gate = _name(XARG_GATE, xargs[XARG_GATE])
        if XARG_THRESHOLD not in xargs:
            raise SteeringError(f"vllm_xargs.{XARG_GATE} needs vllm_xargs.{XARG_THRESHOLD} (a calibrated probability"
                                " in (0, 1))", f"vllm_xargs.{XARG_THRESHOLD}")
        threshold = _number(XARG_THRESHOLD, xargs[XARG_THRESHOLD])
        if not 0.0 < threshold < 1.0:
            raise SteeringError(f"vllm_xargs.{XARG_THRESHOLD} is a calibrated probability and must lie strictly"
                                f" between 0 and 1, got {threshold!r}", f"vllm_xargs.{XARG_THRESHOLD}")
    elif XARG_THRESHOLD in xargs:
        raise SteeringError(f"vllm_xargs.{XARG_THRESHOLD} without vllm_xargs.{XARG_GATE}: name the gate probe",
                            f"vllm_xargs.{XARG_GATE}")
    window = xargs.get(XARG_WINDOW, "all")
    if window not in WINDOWS:
        raise SteeringError(f"vllm_xargs.{XARG_WINDOW} must be one of {', '.join(WINDOWS)}, got {window!r}",
                            f"vllm_xargs.{XARG_WINDOW}")
    return SteerRequest(vector=vector, alpha=alpha, gate=gate, threshold=threshold, window=window)


def raw_threshold(probability: float, slope: float, intercept: float) -> float:
    """The raw score above which sigmoid(slope * raw + intercept) exceeds `probability` (slope > 0)."""
    if not slope > 0:
        raise ValueError(f"a gate probe needs a positive calibration slope, got {slope}")
    return (math.log(probability / (1.0 - probability)) - intercept) / slope


def cache_salt(request: SteerRequest, vector_digest: str, client_salt: str | None = None) -> str:
    """A prefix-cache namespace for one steering configuration (and the vector's exact values).

    Steered requests write different KV than unsteered ones for the same tokens; a salt
    derived from everything that changes the KV keeps their blocks apart, while two
    requests with the same steering still share theirs.
    """
    h = hashlib.sha256(request.config_json().encode())
    h.update(vector_digest.encode())
    if client_salt:
        h.update(b"\0" + client_salt.encode())
    return f"probex-steer-{h.hexdigest()[:32]}"


def window_rows(window: str, start: int, computed: int, scheduled: int, prompt_len: int) -> np.ndarray:
    """Rows (absolute in the step) of one request that its window covers.

    Row `start + k` holds position `computed + k`; prompt positions are < prompt_len.
    """
    positions = computed + np.arange(scheduled, dtype=np.int64)
    if window == "prompt":
        keep = positions < prompt_len
    elif window == "generation":
        keep = positions >= prompt_len
    else:
        keep = np.ones(scheduled, dtype=bool)
    return start + np.flatnonzero(keep)
