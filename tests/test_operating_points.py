"""Thresholds by false-positive rate: measured from benign scores, stored in probe.yaml, resolved back."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pathlib import Path

from probes.artifact import ProbeFormatError, load_probe, save_probe
DEMO = Path(__file__).resolve().parents[1] / "config" / "probes" / "harmful-request"

from probes.operating_points import (OperatingPointError, OperatingPoints, realised_rate, threshold_for_rate,
                                     wilson_interval)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1, allow_nan=False), min_size=1, max_size=400), st.floats(0.001, 0.999))
def test_threshold_flags_at_most_the_rate(scores, fpr):
    scores = np.asarray(scores)
    t = threshold_for_rate(scores, fpr)
    assert realised_rate(scores, t) <= fpr + 1e-12
    # and it is the lowest such threshold: any score below it that was excluded would break the bound
    below = scores[scores < t]
    if len(below):
        assert realised_rate(scores, below.max()) > fpr or below.max() == t


def test_rates_below_ten_false_positives_are_refused():
    points = OperatingPoints.measure(np.linspace(0, 1, 1000))
    assert [r for r, _ in points.thresholds][-1] == 0.01  # 10 / 1000
    assert points.threshold_at(0.01) == pytest.approx(0.99, abs=0.002)
    with pytest.raises(OperatingPointError, match="cannot be measured on 1000 benign prompts"):
        points.threshold_at(0.001)


def test_a_rate_between_measured_ones_takes_the_lower_rates_threshold():
    points = OperatingPoints.measure(np.random.default_rng(0).random(5000))
    assert points.threshold_at(0.03) == points.threshold_at(0.02)
    assert points.threshold_at(0.02) > points.threshold_at(0.05)


def test_the_table_round_trips_through_probe_yaml(tmp_path):
    probe = load_probe(DEMO)
    points = OperatingPoints.measure(np.random.default_rng(1).random(2000), sources={"own": 2000})
    probe.extra["operating_points"] = points.to_metadata()
    save_probe(probe, tmp_path / "p")
    assert load_probe(tmp_path / "p").operating_points == points


def test_a_malformed_table_is_refused_naming_the_file(tmp_path):
    probe = load_probe(DEMO)
    probe.extra["operating_points"] = {"benign": {"count": 100},
                                       "thresholds": [{"fpr": 0.1, "threshold": 0.9}, {"fpr": 0.2, "threshold": 0.95}]}
    save_probe(probe, tmp_path / "p")
    with pytest.raises(ProbeFormatError, match=r"probe.yaml: operating_points: the threshold for 0.1"):
        load_probe(tmp_path / "p")


def test_wilson_interval_is_sensible_at_zero():
    low, high = wilson_interval(0, 1000)
    assert low == 0.0 and 0.0 < high < 0.005
