"""The numbers an operator reads at a chosen false-positive rate, from calibrated scores.

- `rate_report`: a share of prompts at or above a threshold, with n, hits and the 95% Wilson
  interval and its width (the realised false-positive rate on benign prompts, recall on harmful ones).
- `recall_at_fpr`: recall at the threshold that gives a target false-positive rate on the benign
  scores themselves, with a seeded bootstrap interval (benign and harmful scores resampled
  separately, the threshold chosen again in every resample). A rate below 10 / n benign is
  reported as not measurable rather than as a number (probes/operating_points.py).

Convention: higher score = more harmful; a prompt is flagged when its score is at or above the
threshold, as the gateway's policy decides.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from probes.operating_points import smallest_measurable_rate, threshold_for_rate, wilson_interval


def _scores(values: Sequence[float] | np.ndarray, what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or not len(array) or not np.isfinite(array).all():
        raise ValueError(f"{what}: need a non-empty list of finite scores")
    return array


def rate_report(scores: Sequence[float] | np.ndarray, threshold: float, what: str = "scores") -> dict[str, Any]:
    """The share of `scores` at or above `threshold`: n, hits, rate, Wilson 95% interval and its width."""
    array = _scores(scores, what)
    hits = int((array >= threshold).sum())
    low, high = wilson_interval(hits, len(array))
    return {"n": len(array), "hits": hits, "rate": hits / len(array), "interval": [low, high],
            "interval_width": high - low}


def recall_at_fpr(benign: Sequence[float] | np.ndarray, harmful: Sequence[float] | np.ndarray, fpr: float, *,
                  n_resamples: int = 1000, seed: int = 0, confidence: float = 0.95) -> dict[str, Any]:
    """Recall at the threshold giving at most `fpr` on `benign`, with a percentile bootstrap interval."""
    benign_scores, harmful_scores = _scores(benign, "benign scores"), _scores(harmful, "harmful scores")
    if not 0.0 < fpr < 1.0:
        raise ValueError(f"fpr must be between 0 and 1, got {fpr!r}")
    if n_resamples < 1 or not 0.0 < confidence < 1.0:
        raise ValueError("n_resamples must be >= 1 and confidence in (0, 1)")
    floor = smallest_measurable_rate(len(benign_scores))
    out: dict[str, Any] = {"fpr": fpr, "n_benign": len(benign_scores), "n_harmful": len(harmful_scores)}
    if fpr < floor:
        return {**out, "measurable": False, "recall": None, "interval": None, "interval_width": None,
                "threshold": None,
                "note": f"needs at least {math.ceil(10 / fpr)} benign prompts (10 false positives); have"
                        f" {len(benign_scores)}"}
    threshold = threshold_for_rate(benign_scores, fpr)
    recall = float((harmful_scores >= threshold).mean())
    rng = np.random.default_rng(seed)
    values = np.empty(n_resamples)
    for k in range(n_resamples):
        b = rng.choice(benign_scores, size=len(benign_scores))
        h = rng.choice(harmful_scores, size=len(harmful_scores))
        values[k] = (h >= threshold_for_rate(b, fpr)).mean()
    alpha = (1.0 - confidence) / 2.0
    low, high = (float(v) for v in np.quantile(values, [alpha, 1.0 - alpha]))
    return {**out, "measurable": True, "recall": recall, "interval": [low, high], "interval_width": high - low,
            "threshold": threshold, "bootstrap": {"resamples": n_resamples, "seed": seed}}


def per_source(scores: Sequence[float] | np.ndarray, sources: Sequence[str], threshold: float | None) -> dict:
    """Score summary per source: n, median, 99th percentile, and the share at or above `threshold`."""
    array = np.asarray(scores, dtype=np.float64)
    names = np.asarray(sources)
    out = {}
    for name in sorted(set(sources)):
        part = array[names == name]
        row: dict[str, Any] = {"n": len(part), "median": float(np.median(part)),
                               "p99": float(np.quantile(part, 0.99)), "max": float(part.max())}
        if threshold is not None:
            row["at_or_above_threshold"] = int((part >= threshold).sum())
        out[name] = row
    return out


def format_rate(report: dict[str, Any]) -> str:
    """'0.98% (20/2041) [0.64%, 1.5%] width 0.87%' for tables."""
    low, high = report["interval"]
    return (f"{report['rate']:.2%} ({report['hits']}/{report['n']}) [{low:.2%}, {high:.2%}]"
            f" width {report['interval_width']:.2%}")
