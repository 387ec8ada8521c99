"""Operating points: score thresholds chosen by the false-positive rate they give on benign prompts.

A probe's `probe.yaml` may hold the thresholds measured on a set of the operator's benign
prompts, scored through the served model:

    operating_points:
      score: calibrated          # the score the policy compares (calibration.slope/intercept applied)
      benign:
        count: 1200              # benign prompts scored
        sources: {alpaca: 900, own-benign/computing: 300}
      thresholds:                # false-positive rate -> the threshold that flags at most that share
        - {fpr: 0.01, threshold: 0.8123}
        - {fpr: 0.001, threshold: 0.9571}

A threshold `t` for a rate `f` is the lowest score such that at most `floor(f * count)` of the
benign prompts score at or above it (the policy flags and blocks at or above a threshold). A
rate measured on `count` prompts means something only if it counts some false positives:
rates below `MIN_FALSE_POSITIVES / count` are refused as unmeasurable, here and in the gateway,
which resolves a policy's `{fpr: f}` from this table (it has no engine to score with). A rate
between two measured ones resolves to the threshold of the next lower measured rate: the
realised rate is then at most the one asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

MIN_FALSE_POSITIVES = 10
# The rates `measure` tables unless asked for others: from one in two to one in ten thousand.
STANDARD_RATES = (0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001, 0.0005, 0.0002, 0.0001)
SCORE = "calibrated"


class OperatingPointError(ValueError):
    """A rate that the measured table cannot answer, or a malformed table."""


def smallest_measurable_rate(count: int) -> float:
    return MIN_FALSE_POSITIVES / count if count > 0 else math.inf


def check_measurable(fpr: float, count: int, what: str = "") -> None:
    """Refuse a target rate that `count` benign prompts cannot measure."""
    if not (isinstance(fpr, (int, float)) and not isinstance(fpr, bool) and 0.0 < fpr < 1.0):
        raise OperatingPointError(f"{what}false-positive rate must be a number between 0 and 1, got {fpr!r}")
    floor = smallest_measurable_rate(count)
    if fpr < floor:
        raise OperatingPointError(
            f"{what}a false-positive rate of {fpr:g} cannot be measured on {count} benign prompts: at least"
            f" {MIN_FALSE_POSITIVES} false positives are needed, so the lowest measurable rate is {floor:.2g};"
            f" score at least {math.ceil(MIN_FALSE_POSITIVES / fpr)} benign prompts for it")


def threshold_for_rate(scores: np.ndarray, fpr: float) -> float:
    """The lowest threshold at which at most floor(fpr * n) of `scores` are at or above it."""
    ordered = np.sort(np.asarray(scores, dtype=np.float64))[::-1]
    allowed = int(math.floor(fpr * len(ordered) + 1e-9))
    if allowed >= len(ordered):
        return float(ordered[-1])
    # Just above the (allowed + 1)-th highest score: it and everything below stay under.
    return float(np.nextafter(ordered[allowed], math.inf))


def realised_rate(scores: np.ndarray, threshold: float) -> float:
    values = np.asarray(scores, dtype=np.float64)
    return float((values >= threshold).mean()) if len(values) else math.nan


def wilson_interval(hits: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval of a rate of `hits` out of `n` (sensible near 0, unlike the normal one)."""
    if n <= 0:
        return (math.nan, math.nan)
    p = hits / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    low = 0.0 if hits == 0 else max(0.0, centre - half)  # exactly 0 and 1 at the ends, not rounding residue
    return (low, 1.0 if hits == n else min(1.0, centre + half))


@dataclass(frozen=True)
class OperatingPoints:
    benign_count: int
    thresholds: tuple[tuple[float, float], ...]  # (fpr, threshold), rates descending
    sources: dict[str, int] = field(default_factory=dict)
    score: str = SCORE

    @classmethod
    def measure(cls, benign_scores: Sequence[float] | np.ndarray, rates: Iterable[float] = STANDARD_RATES,
                sources: dict[str, int] | None = None) -> "OperatingPoints":
        """The table for `rates` (those measurable on this many prompts) from calibrated benign scores."""
        scores = np.asarray(benign_scores, dtype=np.float64)
        if scores.ndim != 1 or not len(scores) or not np.isfinite(scores).all():
            raise OperatingPointError("benign scores must be a non-empty list of finite numbers")
        kept = sorted({float(r) for r in rates if smallest_measurable_rate(len(scores)) <= r < 1.0}, reverse=True)
        if not kept:
            raise OperatingPointError(f"none of the rates can be measured on {len(scores)} benign prompts"
                                      f" (the lowest measurable is {smallest_measurable_rate(len(scores)):.2g})")
        return cls(len(scores), tuple((r, threshold_for_rate(scores, r)) for r in kept), dict(sources or {}))

    def threshold_at(self, fpr: float, what: str = "") -> float:
        """The threshold for a target rate: the measured one, else that of the next lower measured rate."""
        check_measurable(fpr, self.benign_count, what)
        for rate, threshold in self.thresholds:  # descending rates
            if rate <= fpr * (1 + 1e-9):
                return threshold
        lowest = self.thresholds[-1][0]
        raise OperatingPointError(f"{what}no threshold was measured for a false-positive rate of {fpr:g} or below"
                                  f" (the lowest measured is {lowest:g}); measure the probe's operating points"
                                  " again with that rate")

    def to_metadata(self) -> dict[str, Any]:
        return {"score": self.score, "benign": {"count": self.benign_count, "sources": dict(self.sources)},
                "thresholds": [{"fpr": rate, "threshold": threshold} for rate, threshold in self.thresholds]}

    @classmethod
    def from_metadata(cls, data: Any, where: str = "operating_points") -> "OperatingPoints":
        """Read the table as probe.yaml holds it; every problem named with `where`."""
        def bad(message: str) -> OperatingPointError:
            return OperatingPointError(f"{where}: {message}")

        if not isinstance(data, dict):
            raise bad("must be a mapping")
        score = data.get("score", SCORE)
        if score != SCORE:
            raise bad(f"score must be {SCORE!r} (thresholds on the calibrated score), got {score!r}")
        benign = data.get("benign")
        if not isinstance(benign, dict):
            raise bad("benign must be a mapping with count")
        count = benign.get("count")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise bad(f"benign.count must be a positive whole number, got {count!r}")
        sources = benign.get("sources") or {}
        if not isinstance(sources, dict):
            raise bad("benign.sources must be a mapping of source -> count")
        rows = data.get("thresholds")
        if not isinstance(rows, list) or not rows:
            raise bad("thresholds must be a non-empty list of {fpr, threshold}")
        table = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or set(row) != {"fpr", "threshold"}:
                raise bad(f"thresholds[{i}] must be {{fpr, threshold}}")
            rate, threshold = row["fpr"], row["threshold"]
            for name, value in (("fpr", rate), ("threshold", threshold)):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise bad(f"thresholds[{i}].{name} must be a finite number, got {value!r}")
            if not 0.0 < rate < 1.0:
                raise bad(f"thresholds[{i}].fpr must be between 0 and 1, got {rate!r}")
            table.append((float(rate), float(threshold)))
        table.sort(reverse=True)
        for (high_rate, low_threshold), (low_rate, high_threshold) in zip(table, table[1:]):
            if high_rate == low_rate:
                raise bad(f"the rate {high_rate:g} is listed twice")
            if high_threshold < low_threshold:
                raise bad(f"the threshold for {low_rate:g} ({high_threshold:g}) is below the one for {high_rate:g}"
                          f" ({low_threshold:g}): a lower rate needs a higher threshold")
        return cls(count, tuple(table), {str(k): v for k, v in sources.items()}, score)
