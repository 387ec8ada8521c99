"""Choosing the demo probe's layer and logistic-regression C on the contrast validation split,
and per-source numbers of a chosen probe (`python -m probes.demo`).

The contrast validation split is the harmful questions and the benign hard negatives of the
validation split (probes.demo_data.contrast_part): a probe that separates harmful requests
from benign ones of the same form that use the same alarming words ranks first. The general
validation AUROC (which also counts the easy benign prompts) breaks ties.

The served layer is SERVED_LAYER (the layer the documented worker commands tap): another
layer is chosen only when its best contrast AUROC beats the served layer's best by more than
LAYER_MARGIN, since a different layer changes what every worker must tap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from probes.artifact import ReadPoint
from probes.demo_data import CLASS_WEIGHT, LOGREG_CS
from probes.evaluate import auroc
from probes.extract_hf import LayerActivations
from probes.train import Calibration, ProbeKind, SweepCell, readout_raw_scores, sweep

CONTRAST_VALIDATION = "contrast validation split"
SERVED_LAYER = 22
LAYER_MARGIN = 0.01


@dataclass(frozen=True)
class Candidate:
    cell: SweepCell
    c: float | None  # the logistic regression's C; None for a difference of means
    contrast_auroc: float

    def key(self) -> tuple[float, float, float]:
        return (round(self.contrast_auroc, 12), round(self.cell.validation_auroc, 12), self.cell.validation_separation)


@dataclass(frozen=True)
class Selection:
    candidates: list[Candidate]
    best: Candidate

    def as_rows(self) -> list[dict[str, Any]]:
        return [{"layer": k.cell.layer, "read": k.cell.read.value, "kind": k.cell.kind.value, "logreg_c": k.c,
                 "contrast_validation_auroc": k.contrast_auroc, "validation_auroc": k.cell.validation_auroc,
                 "validation_separation": k.cell.validation_separation} for k in self.candidates]


def select_on_contrast(acts: dict[int, LayerActivations], labels: np.ndarray, index: dict[str, np.ndarray],
                       reads: Sequence[ReadPoint]) -> Selection:
    """Fit every layer x readout x C (and a difference of means) on train; keep the best contrast AUROC."""
    train, validation, contrast = index["train"], index["validation"], index[CONTRAST_VALIDATION]
    runs: list[tuple[float | None, ProbeKind]] = [(None, ProbeKind.DIFF_OF_MEANS)]
    runs += [(c, ProbeKind.LOGISTIC_REGRESSION) for c in LOGREG_CS]
    candidates = []
    for c, kind in runs:
        cells = sweep(acts, labels, train, validation, reads=reads, kinds=[kind], logreg_c=c or LOGREG_CS[0],
                      class_weight=CLASS_WEIGHT)
        for cell in cells:
            raw = readout_raw_scores(cell.probe, acts[cell.layer].subset(contrast), cell.read)
            candidates.append(Candidate(cell, c, auroc(raw, labels[contrast])))
    # max keeps the first of equal keys: remaining ties go to the lower C, then the lower layer.
    best = max(candidates, key=Candidate.key)
    served = [k for k in candidates if k.cell.layer == SERVED_LAYER]
    if served:
        best_served = max(served, key=Candidate.key)
        if best.contrast_auroc - best_served.contrast_auroc <= LAYER_MARGIN:
            best = best_served
    return Selection(candidates, best)


def per_source(raw: np.ndarray, labels: np.ndarray, sources: Sequence[str], calibration: Calibration,
               threshold: float = 0.5) -> dict[str, dict[str, Any]]:
    """Per source of an evaluation set: count, label, mean calibrated score, share at or above
    `threshold`, and the AUROC of that source against every prompt of the other label in the set."""
    raw, labels = np.asarray(raw, dtype=np.float64), np.asarray(labels)
    scores = calibration.apply(raw)
    sources_arr = np.asarray(sources)
    out = {}
    for source in sorted(set(sources)):
        mine = sources_arr == source
        label = int(labels[mine][0])
        other = labels != label
        both = mine | other
        value = auroc(raw[both], labels[both]) if other.any() else float("nan")
        out[source] = {"count": int(mine.sum()), "label": label, "mean_score": float(scores[mine].mean()),
                       "share_at_or_above": float((scores[mine] >= threshold).mean()), "threshold": threshold,
                       "auroc_vs_other_label": value}
    return out
