"""Training linear probes on cached activations: fit, calibrate, sweep, package.

A probe is `raw = w · x + b` on the residual stream `x` at one layer, plus Platt
calibration `score = sigmoid(slope * raw + intercept)` (docs/probe-format.md). Two ways
to get `w, b`:

- difference of means: `w` is the unit vector from the benign mean to the harmful mean,
  `b` puts 0 half-way between the two means. No hyperparameters, hard to overfit.
- logistic regression: L2-regularised, fitted on standardised features (activations have
  a few dimensions hundreds of times larger than the rest), then folded back so the
  artifact applies to raw activations like every other probe.

Readouts (where a prompt's score is read):
- `last_prompt_token`: fitted and scored on the last prompt token's vector;
- `prompt_mean`: fitted and scored on the mean over the user's message tokens;
- `prompt_max`: fitted on that same mean, scored as the max over the user's message tokens
  of w·x+b. (Fitting on single tokens would label "the" in a harmful prompt harmful.)

The mean and max exclude the chat template's tokens (see probes/extract_hf.py for why).

No torch here: everything works on numpy arrays from probes.extract_hf. scikit-learn is
imported inside the logistic-regression fit only.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from probes.artifact import READ_SPAN_USER_MESSAGE, Features, ProbeArtifact, ReadPoint, features_for
from probes.datasets import EmptyDatasetError, SingleClassError
from probes.evaluate import auroc, check_labels
from probes.scoring import calibrate_array
from probes.extract_hf import LayerActivations


class ProbeKind(str, enum.Enum):
    DIFF_OF_MEANS = "diff_of_means"
    LOGISTIC_REGRESSION = "logistic_regression"


@dataclass(frozen=True)
class LinearProbe:
    kind: ProbeKind
    weight: np.ndarray  # float64 [H], applies to raw (unstandardised) activations
    bias: float

    def raw(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float64) @ self.weight + self.bias


@dataclass(frozen=True)
class Calibration:
    slope: float
    intercept: float

    def apply(self, raw: np.ndarray) -> np.ndarray:
        """sigmoid(slope * raw + intercept), vectorised: probes.scoring.calibrate_array."""
        return calibrate_array(raw, self.slope, self.intercept)


# --------------------------------------------------------------------------- checks


def check_training_data(x: np.ndarray, y: np.ndarray, what: str = "training data") -> tuple[np.ndarray, np.ndarray]:
    """Refuse data a probe cannot be fitted on, with a message that says why."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y)
    if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise ValueError(f"{what}: expected x [n, hidden] and y [n], got {x.shape} and {y.shape}")
    if x.shape[0] == 0:
        raise EmptyDatasetError(f"{what}: no examples")
    if not set(np.unique(y).tolist()) <= {0, 1}:
        raise ValueError(f"{what}: labels must be 0 or 1, got {sorted(set(np.unique(y).tolist()))}")
    if (y == 1).sum() == 0 or (y == 0).sum() == 0:
        only = "harmful (1)" if (y == 1).all() else "benign (0)"
        raise SingleClassError(f"{what}: all {len(y)} examples are {only}; a probe needs both classes")
    if not np.isfinite(x).all():
        raise ValueError(f"{what}: activations hold NaN or inf")
    return x, y


# --------------------------------------------------------------------------- fitting


def fit_diff_of_means(x: np.ndarray, y: np.ndarray) -> LinearProbe:
    """Unit direction from the benign mean to the harmful mean; raw 0 at the midpoint."""
    x, y = check_training_data(x, y)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below, as a refusal
        mu_harmful, mu_benign = x[y == 1].mean(axis=0), x[y == 0].mean(axis=0)
        direction = mu_harmful - mu_benign
        norm = float(np.linalg.norm(direction))
        if norm == 0.0:
            raise ValueError("difference of means is zero: the two classes have identical mean activations")
        weight = direction / norm
        bias = -float(weight @ (mu_harmful + mu_benign) / 2.0)
    return checked_probe(LinearProbe(ProbeKind.DIFF_OF_MEANS, weight, bias))


def fit_logistic_regression(x: np.ndarray, y: np.ndarray, *, c: float = 0.1, seed: int = 0,
                            class_weight: str | None = None) -> LinearProbe:
    """L2 logistic regression on standardised features, folded back to raw activation space.

    `class_weight="balanced"` weighs each class inversely to its count (scikit-learn's rule),
    so a pool with many more benign than harmful prompts still fits both equally.
    """
    from sklearn.linear_model import LogisticRegression

    x, y = check_training_data(x, y)
    with np.errstate(over="ignore", invalid="ignore"):
        mean = x.mean(axis=0)
        scale = x.std(axis=0)
    if not (np.isfinite(mean).all() and np.isfinite(scale).all()):
        raise ValueError("logistic regression: the activations are too large to standardise"
                         " (their mean or spread overflows float64)")
    scale[scale == 0] = 1.0  # a constant dimension carries nothing; avoid dividing by 0
    model = LogisticRegression(C=c, max_iter=5000, random_state=seed, class_weight=class_weight)
    model.fit((x - mean) / scale, y)
    coef = model.coef_[0] / scale
    # w·((x - mean) / scale) + b0  ==  (coef)·x + (b0 - coef·mean)
    with np.errstate(over="ignore", invalid="ignore"):
        bias = float(model.intercept_[0] - coef @ mean)
    return checked_probe(LinearProbe(ProbeKind.LOGISTIC_REGRESSION, coef, bias))


def checked_probe(probe: LinearProbe) -> LinearProbe:
    """Refuse a fit that came out non-finite (activations near float64's limit) instead of returning it."""
    if not (np.isfinite(probe.weight).all() and math.isfinite(probe.bias)):
        raise ValueError(f"{probe.kind.value}: the fitted weights or bias are not finite"
                         " (the activations are too large for float64 arithmetic)")
    return probe


def fit_probe(kind: ProbeKind, x: np.ndarray, y: np.ndarray, *, logreg_c: float = 0.1,
              class_weight: str | None = None) -> LinearProbe:
    if kind is ProbeKind.DIFF_OF_MEANS:
        return fit_diff_of_means(x, y)  # the two class means: balanced by construction
    return fit_logistic_regression(x, y, c=logreg_c, class_weight=class_weight)


def fit_platt(raw: np.ndarray, y: np.ndarray, *, max_iter: int = 100) -> Calibration:
    """Platt scaling: slope, intercept minimising log loss of sigmoid(slope * raw + intercept).

    Uses Platt's smoothed targets (N+ + 1)/(N+ + 2) and 1/(N- + 2) instead of 1 and 0, so a
    validation set the probe separates perfectly still gives a finite slope. Newton's
    method on standardised raw scores, converted back at the end.
    """
    raw = np.asarray(raw, dtype=np.float64)
    y = np.asarray(y)
    if raw.ndim != 1 or raw.shape != y.shape:
        raise ValueError(f"calibration: raw scores and labels must be 1-D and the same length, got {raw.shape} and {y.shape}")
    check_labels(y, "calibration")
    n_pos, n_neg = int((y == 1).sum()), int((y == 0).sum())
    if n_pos == 0 or n_neg == 0:
        raise SingleClassError(f"calibration: needs both classes in the validation set, got {n_pos} harmful and {n_neg} benign")
    if not np.isfinite(raw).all():
        raise ValueError("calibration: raw scores hold NaN or inf")
    target = np.where(y == 1, (n_pos + 1.0) / (n_pos + 2.0), 1.0 / (n_neg + 2.0))

    with np.errstate(over="ignore", invalid="ignore"):
        center, spread = raw.mean(), raw.std()
    # An overflowing spread would make z all 0 and "fit" slope 0: a calibration that hides the problem.
    if not (math.isfinite(center) and math.isfinite(spread)):
        raise ValueError("calibration: raw scores too large to calibrate (their mean or spread overflows float64)")
    spread = spread if spread > 0 else 1.0
    z = (raw - center) / spread
    a, b = 0.0, 0.0  # fitting sigmoid(a * z + b)

    def loss(a_: float, b_: float) -> float:
        t = a_ * z + b_
        # log(1 + e^t) - target * t, the logistic log loss written to avoid overflow
        return float(np.sum(np.logaddexp(0.0, t) - target * t))

    for _ in range(max_iter):
        p = 0.5 * (1.0 + np.tanh(0.5 * (a * z + b)))
        grad = np.array([np.sum((p - target) * z), np.sum(p - target)])
        w = p * (1.0 - p)
        hess = np.array([[np.sum(w * z * z), np.sum(w * z)], [np.sum(w * z), np.sum(w)]]) + 1e-12 * np.eye(2)
        step = np.linalg.solve(hess, grad)
        # Backtracking keeps every step a descent step (plain Newton can overshoot).
        current, t = loss(a, b), 1.0
        while loss(a - t * step[0], b - t * step[1]) > current and t > 1e-8:
            t /= 2.0
        a, b = a - t * step[0], b - t * step[1]
        if np.max(np.abs(t * step)) < 1e-10:
            break
    slope = a / spread
    intercept = b - a * center / spread
    if not (math.isfinite(slope) and math.isfinite(intercept)):
        raise ValueError("calibration diverged (non-finite slope or intercept)")
    return Calibration(float(slope), float(intercept))


# --------------------------------------------------------------------------- readouts


def feature_vectors(acts: LayerActivations, features: Features) -> np.ndarray:
    """The [N, hidden] per-prompt vectors that `features` names."""
    if features is Features.LAST_PROMPT_TOKEN:
        return acts.last
    if features is Features.USER_MESSAGE_MEAN:
        return acts.user_mean
    return acts.all_mean


def fitting_features(acts: LayerActivations, read: ReadPoint,
                     read_span: str | None = READ_SPAN_USER_MESSAGE) -> np.ndarray:
    """The per-prompt vectors a probe for `read` is fitted on (by default over the user's message, as the sweep)."""
    return feature_vectors(acts, features_for(read, read_span))


def readout_raw_scores(probe: LinearProbe | ProbeArtifact, acts: LayerActivations, read: ReadPoint,
                       features: Features | None = None) -> np.ndarray:
    """Per-prompt raw scores as the engine reads them for `read`, over the rows `features` names.

    `features` defaults to the user-message span, as the sweep fits; pass a probe artifact's
    `features` to score it on what it was trained on.
    """
    features = features if features is not None else features_for(read, READ_SPAN_USER_MESSAGE)
    if (features is Features.LAST_PROMPT_TOKEN) != (read is ReadPoint.LAST_PROMPT_TOKEN):
        raise ValueError(f"read {read.value!r} is not read from the {features.value}")
    if read is ReadPoint.PROMPT_MAX:
        if features is not Features.USER_MESSAGE_MEAN:
            # Cached activations keep the user's tokens only, so a max over the template's rows cannot be taken.
            raise ValueError(f"prompt_max over the {features.value} cannot be computed from cached activations"
                             " (they keep the user-message tokens only)")
        return acts.max_of_raw(probe.weight, probe.bias)
    # w·mean(x) + b == mean(w·x + b): scoring the mean vector is scoring the mean raw.
    x = np.asarray(feature_vectors(acts, features), dtype=np.float64)
    return x @ np.asarray(probe.weight, dtype=np.float64) + float(probe.bias)


# --------------------------------------------------------------------------- sweep


@dataclass(frozen=True)
class SweepCell:
    layer: int
    read: ReadPoint
    kind: ProbeKind
    probe: LinearProbe
    validation_auroc: float
    validation_separation: float  # tie-breaker, see separation()


def separation(raw: np.ndarray, labels: np.ndarray) -> float:
    """Fisher separation (mean_harmful - mean_benign) / pooled std of raw scores.

    AUROC saturates at 1.0 once validation is separated, which happens at many cells;
    this says how far apart the classes are, and is scale-free so probes compare fairly.
    """
    raw, labels = np.asarray(raw, dtype=np.float64), np.asarray(labels)
    if raw.ndim != 1 or raw.shape != labels.shape:
        raise ValueError(f"separation: raw scores and labels must be 1-D and the same length,"
                         f" got {raw.shape} and {labels.shape}")
    check_labels(labels, "separation")
    pos, neg = raw[labels == 1], raw[labels == 0]
    if pos.size == 0 or neg.size == 0:
        raise SingleClassError(f"separation: needs both classes, got {pos.size} harmful and {neg.size} benign")
    gap = float(pos.mean() - neg.mean())
    pooled = math.sqrt((pos.var() + neg.var()) / 2.0)
    if pooled > 0:
        return gap / pooled
    # Both classes constant: infinitely far apart in the gap's direction, or not apart at all.
    return math.copysign(math.inf, gap) if gap != 0 else 0.0


def sweep(
    acts_by_layer: dict[int, LayerActivations],
    labels: np.ndarray,
    train_index: np.ndarray,
    validation_index: np.ndarray,
    *,
    reads: Sequence[ReadPoint] = tuple(ReadPoint),
    kinds: Sequence[ProbeKind] = tuple(ProbeKind),
    logreg_c: float = 0.1,
    class_weight: str | None = None,
) -> list[SweepCell]:
    """Fit every (layer, readout, kind) on the training rows and score it on the validation rows."""
    labels = np.asarray(labels)
    cells = []
    for layer in sorted(acts_by_layer):
        train = acts_by_layer[layer].subset(train_index)
        validation = acts_by_layer[layer].subset(validation_index)
        for read in reads:
            x = fitting_features(train, read)
            for kind in kinds:
                probe = fit_probe(kind, x, labels[train_index], logreg_c=logreg_c, class_weight=class_weight)
                raw = readout_raw_scores(probe, validation, read)
                y_val = labels[validation_index]
                cells.append(SweepCell(layer, read, kind, probe, auroc(raw, y_val), separation(raw, y_val)))
    return cells


def choose_best(cells: Sequence[SweepCell]) -> SweepCell:
    """Highest validation AUROC; ties broken by validation separation, then by the earlier cell."""
    if not cells:
        raise EmptyDatasetError("sweep produced no cells")
    # Python's max keeps the first of equal keys, so remaining ties go to the earlier cell.
    return max(cells, key=lambda c: (round(c.validation_auroc, 12), c.validation_separation))


# --------------------------------------------------------------------------- retention and packaging


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        raise ValueError("cosine of a zero vector is undefined")
    return float(np.dot(a, b) / (na * nb))


def retention_reference(weight: np.ndarray, features: np.ndarray, labels: np.ndarray) -> float:
    """Cosine between a frozen probe direction and the difference of means on a retention set.

    Recorded at training time; recomputing it later on the same prompts (after a model
    update, a new engine build, ...) and finding a much lower value says the direction no
    longer points where the classes separate.
    """
    x, y = check_training_data(features, labels, "retention set")
    return cosine(weight, x[y == 1].mean(axis=0) - x[y == 0].mean(axis=0))


def to_artifact(
    name: str,
    layer: int,
    read: ReadPoint,
    probe: LinearProbe,
    calibration: Calibration,
    *,
    model: dict[str, Any],
    extra: dict[str, Any],
) -> ProbeArtifact:
    # The artifact stores float32: a probe that only float64 can hold would be saved as inf or 0.
    with np.errstate(over="ignore"):
        weight, bias = probe.weight.astype(np.float32), np.float32(probe.bias)
    if not (np.isfinite(weight).all() and np.isfinite(bias)) or not weight.any():
        raise ValueError(f"probe {name!r}: weights or bias do not fit float32 (the artifact's format)")
    return ProbeArtifact(
        name=name,
        layer=layer,
        read=read,
        weight=weight,
        bias=float(probe.bias),
        slope=calibration.slope,
        intercept=calibration.intercept,
        model=model,
        extra=extra,
    )
