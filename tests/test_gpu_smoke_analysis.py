"""The GPU smokes' analysis runs on the CPU too (`--reanalyze`); its comparisons are checked here on made-up runs."""

from __future__ import annotations

import numpy as np
import pytest

from bench.gpu_tp_smoke import compare_tp, gate_row_flips


def run(tokens, a10_generated, gate_rows=None, gap=None):
    response = {"tokens": tokens, "top2_gap": gap or [1.0] * len(tokens),
                "scores": {"a10": {"prompt": {"last_raw": 0.5, "mean": 0.1, "max": 1.0}, "generated": a10_generated}}}
    out = {"responses": {v: [response] for v in ("plain", "zero", "steered", "gated", "generation")}}
    if gate_rows is not None:
        out["gate_prompt_rows"] = {"threshold_raw": 0.0, "raw": {"gated": [gate_rows]}}
    return out


def test_a_prompt_row_on_the_other_side_of_the_gate_threshold_is_named():
    one = run([1, 2, 3], [0.9, 0.1, 0.9], gate_rows=[-2.0, 0.004, 3.0])
    two = run([1, 2, 4], [0.9, 0.1, 0.9], gate_rows=[-2.01, -0.003, 3.01], gap=[1.0, 1.0, 0.02])
    flips = gate_row_flips(one, two)
    assert flips["rows_decided_differently"] == [{"prompt": 0, "row": 1, "raw": [0.004, -0.003]}]
    assert flips["prompts_with_a_flip"] == [0] and abs(flips["largest_raw_difference"] - 0.01) < 1e-12
    gated = compare_tp(one, two)["gated"]
    assert gated["gate_prompt_rows"] == flips
    # where the tokens part, and that no generated-token gate decision differed up to there
    (parting,) = gated["partings"]
    assert parting["token"] == 2 and parting["top2_gap"] == [1.0, 0.02] and parting["gate_decisions_differ_at"] == []


def test_runs_without_captured_rows_are_compared_without_them():
    one, two = run([1, 2], [0.9, 0.1]), run([1, 2], [0.9, 0.1])
    assert gate_row_flips(one, two) is None
    assert "gate_prompt_rows" not in compare_tp(one, two)["gated"]


def test_a_generated_token_gate_decision_counts_up_to_and_including_the_parting_token():
    # token 2 is where the runs part; the gate decided differently at token 1 (0.6 vs 0.4)
    one = run([1, 2, 3, 9], [0.9, 0.6, 0.1, 0.9])
    two = run([1, 2, 4, 9], [0.9, 0.4, 0.1, 0.2])
    (parting,) = compare_tp(one, two)["gated"]["partings"]
    assert parting["gate_decisions_differ_at"] == [1]
    assert abs(parting["closest_gate_score_to_threshold"] - 0.1) < 1e-12  # 0.6 / 0.4, both runs looked at
    # a difference only after the parting (token 3) is not part of it
    later = run([1, 2, 4, 9], [0.9, 0.6, 0.1, 0.2])
    (parting,) = compare_tp(one, later)["gated"]["partings"]
    assert parting["gate_decisions_differ_at"] == []


def test_the_gate_threshold_sits_in_the_widest_gap_of_the_middle_half_of_the_prompt_rows():
    from bench.gpu_steer_smoke import gate_bias_with_margin

    # middle half (rows 2..5 of 8 sorted): 1.0, 1.1, 2.0, 2.05 -> widest gap 1.1..2.0
    raw = np.array([2.05, -5.0, 1.1, 9.0, 1.0, 8.5, -4.0, 2.0])
    bias, margin = gate_bias_with_margin(raw)
    assert bias == pytest.approx(-1.55) and margin == pytest.approx(0.45)
    # with the bias, the gate is open on some rows and shut on others, none within the margin
    shifted = raw + bias
    assert (shifted > 0).any() and (shifted < 0).any()
    assert np.abs(shifted).min() == pytest.approx(margin)
    with pytest.raises(ValueError):
        gate_bias_with_margin(np.array([1.0]))
    # two rows: the threshold between them
    assert gate_bias_with_margin(np.array([0.0, 1.0])) == (pytest.approx(-0.5), pytest.approx(0.5))
    # a gate whose raw threshold is not 0 (a calibrated probe): the gap is moved onto it
    bias, margin = gate_bias_with_margin(raw, threshold_raw=2.0)
    assert bias == pytest.approx(0.45) and np.abs(raw + bias - 2.0).min() == pytest.approx(margin)
    with pytest.raises(ValueError, match="single value"):
        gate_bias_with_margin(np.full(8, 3.0))


def _smoke_response(tokens: list[int], generated: list[float], last_raw: float) -> dict:
    prompt = {"last_raw": last_raw, "tokens_scored": 5, "mean": 0.1, "max": 0.4}
    return {"choices": [{"token_ids": tokens}],
            "probex": {"scores": {"p": {"prompt": prompt, "generated": {"scores": generated}}}}}


def test_a_reanalyzed_smoke_recomputes_score_differences_and_keeps_the_saved_residual_cosines():
    from bench.gpu_smoke import reanalyzed_comparisons

    saved = {
        # the sequences part at their third token: its score is compared (it depends on the two
        # before it), the fourth's is not
        "responses": {"v1-graphs": [_smoke_response([1, 2, 3, 5], [0.5, 0.5, 0.0, 0.0], 1.0)],
                      "v1-eager": [_smoke_response([1, 2, 4, 6], [0.5, 0.5, 0.25, 9.0], 1.25)]},
        # what the live run measured from the captured residuals, which the file does not hold
        "comparisons": {"v1: graphs_vs_eager": {"residual_cos_last_token_min": 0.99993,
                                                "residual_cos_any_token_min": 0.99986,
                                                "generated_abs": 123.0}},
    }
    pair = reanalyzed_comparisons(saved)["v1: graphs_vs_eager"]
    assert pair["identical_token_sequences"] == 0
    assert pair["generated_abs"] == 0.25  # recomputed, not the saved 123.0
    assert pair["prompt_last_raw_abs"] == 0.25
    assert (pair["residual_cos_last_token_min"], pair["residual_cos_any_token_min"]) == (0.99993, 0.99986)
