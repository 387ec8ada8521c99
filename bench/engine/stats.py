"""The engine benchmark's statistics: overheads in percent, Student's t intervals, and the
paired readings of tap-toggle (phase pairs under load, request pairs at an idle engine)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np


def overhead_pct(value: float, base: float) -> float:
    """How much larger `value` is than `base`, in percent (negative: smaller)."""
    if not (math.isfinite(value) and math.isfinite(base)) or base == 0:
        return math.nan
    return (value / base - 1.0) * 100.0


def toggled_pairs(ttft_ms: Sequence[float], paused: Sequence[bool]) -> list[tuple[float, float]]:
    """(running, paused) TTFT of each pair of neighbouring toggled idle requests (requests
    2i and 2i + 1, one of each state, as `idle_toggle_paused` sends them)."""
    if len(ttft_ms) != len(paused) or len(paused) % 2:
        raise ValueError(f"toggled idle requests come in pairs: {len(ttft_ms)} TTFTs, {len(paused)} states")
    pairs = []
    for i in range(0, len(paused), 2):
        if paused[i] == paused[i + 1]:
            raise ValueError(f"toggled idle requests {i} and {i + 1} ran in the same state (paused={paused[i]})")
        pairs.append((ttft_ms[i + 1], ttft_ms[i]) if paused[i] else (ttft_ms[i], ttft_ms[i + 1]))
    return pairs


PAIRED_TTFT_HALF_WIDTH_PCT = 0.5  # the interval a TTFT <= +1% claim needs around a point near +0.5%


def paired_overhead(pairs: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """TTFT with the tap running over paused from (running, paused) pairs of neighbouring
    requests, in percent: the mean difference over the paused mean, with a 95% interval from
    the pairs' differences (Student's t); pairs with a failed request are left out. Also the
    differences' scatter (SD, percent of the paused mean) and how many pairs like these a 95%
    interval of ±PAIRED_TTFT_HALF_WIDTH_PCT would take: what a run aiming at the TTFT goal needs."""
    kept = [(r, p) for r, p in pairs if math.isfinite(r) and math.isfinite(p)]
    out: dict[str, Any] = {"pairs": len(kept)}
    if len(kept) < 2:
        return out
    running, paused = np.array(kept).T
    differences = running - paused
    base = float(paused.mean())
    mean = float(differences.mean())
    sd = float(differences.std(ddof=1))
    se = sd / math.sqrt(len(kept))
    t = _t_975(len(kept) - 1)
    sd_pct = sd / base * 100.0
    out.update(running_mean_ms=float(running.mean()), paused_mean_ms=base, difference_mean_ms=mean,
               pct=mean / base * 100.0, ci95_pct=[(mean - t * se) / base * 100.0, (mean + t * se) / base * 100.0],
               median_difference_pct=float(np.median(differences / paused)) * 100.0,
               difference_sd_pct=sd_pct,
               pairs_for_half_width=math.ceil((1.96 * sd_pct / PAIRED_TTFT_HALF_WIDTH_PCT) ** 2))
    shift, (low, high) = hodges_lehmann_shift(differences)
    out["hodges_lehmann"] = {"difference_ms": shift, "pct": shift / base * 100.0,
                             "ci95_pct": [low / base * 100.0, high / base * 100.0]}
    return out


def _signed_rank_sum(differences: np.ndarray, shift: float) -> float:
    """Wilcoxon's signed-rank statistic of `differences - shift`: the sum of the ranks of the
    absolute values of the positive ones (ties of absolute value share their mean rank)."""
    centred = differences - shift
    magnitudes = np.abs(centred)
    order = np.argsort(magnitudes, kind="stable")
    _, first, counts = np.unique(magnitudes[order], return_index=True, return_counts=True)
    ranks = np.empty(len(centred))
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)  # ties of magnitude share their mean rank
    return float(ranks[centred > 0].sum() + 0.5 * ranks[centred == 0].sum())


def hodges_lehmann_shift(differences: Sequence[float] | np.ndarray, iterations: int = 80) -> tuple[float, tuple[float, float]]:
    """The pairs' shift by Hodges and Lehmann (the median of the pairwise means of the
    differences) with its 95% interval from Wilcoxon's signed-rank test, found by inverting
    that test (bisection on the shift; the same numbers as sorting all n(n+1)/2 pairwise
    means, without them).

    Why beside the mean: idle pairs are neighbouring requests, and a lone request's host
    sometimes sits in a slower state for several requests; a pair that straddles a change carries that
    jump whole into its difference. Those pairs widen a mean's interval but move a rank
    statistic by one rank. The estimate is the shift the tap gives a pair where the noise
    is symmetric about it, which the ABBA order (`idle_toggle_paused`: the running request
    first in half of the pairs) makes so for noise that comes with the order in a pair."""
    values = np.asarray([d for d in differences if math.isfinite(d)], dtype=float)
    n = len(values)
    centre = n * (n + 1) / 4.0
    spread = math.sqrt(n * (n + 1) * (2 * n + 1) / 24.0)
    if centre - 1.96 * spread < 1:  # under 6 pairs even the extremes are inside a 95% interval: no reading
        return math.nan, (math.nan, math.nan)

    def shift_where(target: float, reached: bool = False) -> float:
        # The statistic falls in steps as the shift grows: the shift where it drops below
        # `target` (with `reached`, where it drops below reaching it).
        low, high = float(values.min()), float(values.max())
        for _ in range(iterations):
            middle = (low + high) / 2.0
            statistic = _signed_rank_sum(values, middle)
            if statistic > target or (reached and statistic == target):
                low = middle
            else:
                high = middle
        return (low + high) / 2.0

    # An even count of pairwise means has two middle ones, the statistic at the centre between them
    estimate = (shift_where(centre) + shift_where(centre, reached=True)) / 2.0
    return estimate, (shift_where(centre + 1.96 * spread), shift_where(centre - 1.96 * spread))


# Student's t, two-sided 95%, by degrees of freedom (30 stands for 30 and more).
_T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
          15: 2.13, 20: 2.09, 30: 2.04}
def t_half_width(values: np.ndarray) -> float:
    """Half the width of a 95% interval for the mean of `values` (two or more): Student's t
    at len − 1 degrees of freedom times their standard error."""
    return _t_975(len(values) - 1) * float(values.std(ddof=1)) / math.sqrt(len(values))


def _t_975(df: float) -> float:
    """Student's t for a two-sided 95% interval at `df` degrees of freedom: the table's entry
    at the nearest df below (a wider interval, never a narrower one); infinite below 1."""
    tabulated = [k for k in _T_975 if k <= df]
    return _T_975[max(tabulated)] if tabulated else math.inf


def ms_difference(differences: Sequence[float]) -> dict[str, Any]:
    """Phase pairs' running − paused differences (ms; NaN where a phase lacks the figure): their
    mean and 95% interval (Student's t over pairs; none with fewer than two)."""
    values = np.asarray([v for v in differences if math.isfinite(v)], dtype=float)
    out: dict[str, Any] = {"pairs": len(values)}
    if len(values):
        out["difference_mean_ms"] = float(values.mean())
    if len(values) >= 2:
        half = t_half_width(values)
        out["ci95_ms"] = [out["difference_mean_ms"] - half, out["difference_mean_ms"] + half]
    return out


def phase_pair_interval(estimate: float, pair_pcts: Sequence[float]) -> list[float] | None:
    """A 95% interval around `estimate` (tap-toggle's running over paused) from the scatter of
    its phase pairs' own readings: ± Student's t at pairs − 1 degrees of freedom times their
    standard error. None with fewer than two finite pairs: one pair has no scatter to read.
    Phases, not requests, are the samples: requests in one phase share its steps and its
    arrival pattern, and phases of one state differ by more than their requests' scatter says
    (at 64 streams on the H200 one pair's TTFT p50 reading scatters by about 10 points)."""
    values = np.asarray([v for v in pair_pcts if math.isfinite(v)], dtype=float)
    if len(values) < 2 or not math.isfinite(estimate):
        return None
    half = t_half_width(values)
    return [estimate - half, estimate + half]


def pairs_to_clear(goal: float, estimate: float, pair_pcts: Sequence[float]) -> int | None:
    """About how many phase pairs would put a 95% interval (as `phase_pair_interval` draws it)
    wholly on one side of `goal` if the estimate and the pairs' scatter held; None where the
    scatter cannot be read or the estimate sits on the goal."""
    values = np.asarray([v for v in pair_pcts if math.isfinite(v)], dtype=float)
    margin = abs(goal - estimate)
    if len(values) < 2 or not math.isfinite(margin) or margin == 0:
        return None
    spread = float(values.std(ddof=1))
    largest_df = max(_T_975)  # from there on t is constant, and the count has a closed form
    for n in range(2, largest_df + 2):
        if _t_975(n - 1) * spread / math.sqrt(n) <= margin:
            return n
    return math.ceil((_T_975[largest_df] * spread / margin) ** 2)


def ratio_interval(values: np.ndarray, base: np.ndarray) -> dict[str, float]:
    """(mean(values) / mean(base) − 1) in percent with its 95% interval (see overhead_over_starts)."""
    mean, base_mean = float(values.mean()), float(base.mean())
    rel_var = values.var(ddof=1) / len(values) / mean**2  # squared relative standard errors
    base_rel_var = base.var(ddof=1) / len(base) / base_mean**2
    ratio = mean / base_mean
    se_pct = ratio * math.sqrt(rel_var + base_rel_var) * 100.0
    spread = rel_var**2 / (len(values) - 1) + base_rel_var**2 / (len(base) - 1)
    df = (rel_var + base_rel_var) ** 2 / spread if spread > 0 else math.inf  # inf: no spread at all
    t = _t_975(df)
    pct = (ratio - 1.0) * 100.0
    return {"pct": pct, "se_pct": se_pct, "ci95_pct": [pct - t * se_pct, pct + t * se_pct],
            "df": df if math.isfinite(df) else None}  # JSON has no infinity
