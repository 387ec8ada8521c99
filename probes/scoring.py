"""Score math shared by the worker, the gateway and offline evaluation."""

from __future__ import annotations

import math


def calibrate(raw: float, slope: float, intercept: float) -> float:
    """Platt-style calibration: sigmoid(slope * raw + intercept), overflow-safe."""
    z = slope * raw + intercept
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)
