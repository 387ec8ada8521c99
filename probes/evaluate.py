"""Evaluation metrics for a probe's scores: AUROC, a bootstrap CI for it, TPR at a fixed FPR.

Convention everywhere: label 1 = harmful (positive), label 0 = benign; higher score = more
harmful. Implemented with numpy only so that the numbers do not depend on which
scikit-learn version is installed; the unit tests check them against hand-computed values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from probes.datasets import EmptyDatasetError, SingleClassError


def check_labels(labels: np.ndarray, what: str) -> None:
    """Labels are 1 (harmful) or 0 (benign); anything else would be silently left out of both classes."""
    labels = np.asarray(labels)
    if labels.dtype.kind not in "biuf":
        raise ValueError(f"{what}: labels must be 0 (benign) or 1 (harmful), got values of type {labels.dtype}")
    values = np.unique(labels).tolist()
    others = [v for v in values if v not in (0, 1)]  # NaN is no label either: NaN != 0 and != 1
    if others:
        shown = others[:5] + (["..."] if len(others) > 5 else [])
        raise ValueError(f"{what}: labels must be 0 (benign) or 1 (harmful), got {shown}")


def _split_by_label(scores: np.ndarray, labels: np.ndarray, what: str = "scores") -> tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels)
    if scores.shape != labels.shape or scores.ndim != 1:
        raise ValueError(f"{what}: scores and labels must be 1-D and the same length, got {scores.shape} and {labels.shape}")
    if scores.size == 0:
        raise EmptyDatasetError(f"{what}: nothing to evaluate")
    if not np.isfinite(scores).all():
        raise ValueError(f"{what}: scores hold NaN or inf")
    check_labels(labels, what)
    pos, neg = scores[labels == 1], scores[labels == 0]
    if pos.size == 0 or neg.size == 0:
        raise SingleClassError(f"{what}: AUROC needs both harmful (1) and benign (0) examples, got {pos.size} and {neg.size}")
    return pos, neg


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing the average of the ranks they span."""
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    # Boundaries of runs of equal values.
    starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
    ends = np.r_[starts[1:], len(values)]
    avg = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def auroc_from_groups(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(score of a random positive > score of a random negative), ties counting one half.

    Computed from ranks (the Mann-Whitney U statistic), O(n log n).
    """
    ranks = _average_ranks(np.concatenate([pos, neg]))
    rank_sum_pos = ranks[: len(pos)].sum()
    u = rank_sum_pos - len(pos) * (len(pos) + 1) / 2.0
    return float(u / (len(pos) * len(neg)))


def auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    pos, neg = _split_by_label(scores, labels)
    return auroc_from_groups(pos, neg)


def bootstrap_auroc_ci(
    scores: np.ndarray, labels: np.ndarray, *, n_resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap CI of AUROC.

    Positives and negatives are resampled separately (stratified), so every resample
    has both classes and the class balance of the evaluation set is kept.
    """
    if isinstance(n_resamples, bool) or not isinstance(n_resamples, (int, np.integer)) or n_resamples < 1:
        raise ValueError(f"bootstrap: n_resamples must be an integer >= 1, got {n_resamples!r}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"bootstrap: confidence must be in (0, 1), got {confidence!r}")
    pos, neg = _split_by_label(scores, labels)
    rng = np.random.default_rng(seed)
    values = np.empty(n_resamples)
    for k in range(n_resamples):
        values[k] = auroc_from_groups(rng.choice(pos, size=pos.size), rng.choice(neg, size=neg.size))
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(values, [alpha, 1.0 - alpha])
    return float(low), float(high)


def tpr_at_fpr(scores: np.ndarray, labels: np.ndarray, max_fpr: float) -> float:
    """Best TPR of the rule `score > t` over thresholds whose FPR is at most `max_fpr`.

    With n negatives, at most floor(max_fpr * n) of them may score above t; so t is the
    (k+1)-th highest negative score and a positive counts only if strictly above it.
    (With fewer than 100 negatives, FPR 1% therefore allows no false positive at all.)
    """
    if not 0.0 <= max_fpr < 1.0:
        raise ValueError(f"max_fpr must be in [0, 1), got {max_fpr}")
    pos, neg = _split_by_label(scores, labels)
    allowed = int(np.floor(max_fpr * neg.size + 1e-9))
    threshold = np.sort(neg)[::-1][allowed]
    return float((pos > threshold).mean())


def roc_curve(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(FPR, TPR) at every distinct threshold, from (0, 0) to (1, 1), for plotting."""
    pos, neg = _split_by_label(scores, labels)
    thresholds = np.unique(np.concatenate([pos, neg]))[::-1]
    fpr = np.array([0.0] + [(neg >= t).mean() for t in thresholds])
    tpr = np.array([0.0] + [(pos >= t).mean() for t in thresholds])
    return fpr, tpr


@dataclass(frozen=True)
class Evaluation:
    auroc: float
    ci_low: float
    ci_high: float
    tpr_at_fpr_1: float
    tpr_at_fpr_5: float
    n_harmful: int
    n_benign: int

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def evaluate_scores(scores: np.ndarray, labels: np.ndarray, *, seed: int = 0, n_resamples: int = 1000) -> Evaluation:
    """All headline numbers for one evaluation set."""
    labels = np.asarray(labels)
    low, high = bootstrap_auroc_ci(scores, labels, n_resamples=n_resamples, seed=seed)
    return Evaluation(
        auroc=auroc(scores, labels),
        ci_low=low,
        ci_high=high,
        tpr_at_fpr_1=tpr_at_fpr(scores, labels, 0.01),
        tpr_at_fpr_5=tpr_at_fpr(scores, labels, 0.05),
        n_harmful=int((labels == 1).sum()),
        n_benign=int((labels == 0).sum()),
    )
