"""Score math shared by the worker, the gateway and offline evaluation."""

from __future__ import annotations

import math

import numpy as np


def calibrate(raw: float, slope: float, intercept: float) -> float:
    """Platt-style calibration: sigmoid(slope * raw + intercept), overflow-safe."""
    z = slope * raw + intercept
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def calibrate_array(raw: np.ndarray, slope, intercept) -> np.ndarray:
    """`calibrate` over arrays (slope and intercept broadcast, e.g. one per column), float64.

    Same branches as the scalar version, so every element equals what `calibrate` returns.
    """
    z = np.asarray(raw, dtype=np.float64) * slope + intercept
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
