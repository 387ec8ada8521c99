"""bench/serve_compare.py: `probex worker` against `vllm serve`, separate starts alternated and
loaded by `vllm bench serve`: the order, the comparison, and (engine) its CPU smoke mode."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import serve_compare as sc

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    """This checkout first on the path (`python -m bench...` from the repository root)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def test_starts_alternate_and_end_with_the_noise_pair():
    assert sc.start_order(2, True) == [("plain#1", "plain"), ("probex#1", "probex"), ("plain#2", "plain"),
                                       ("probex#2", "probex"), ("noise-a", "plain"), ("noise-b", "plain")]
    assert [side for _, side in sc.start_order(1, False)] == ["plain", "probex"]


def test_both_sides_get_the_same_vllm_arguments():
    plain = sc.plain_server_argv("/m", ["--max-model-len", "512"], 9000)
    probex = sc.probex_worker_argv("/m", ["/p1", "/p2"], ["--max-model-len", "512"], 9001)
    assert plain[-2:] == probex[-2:] == ["--max-model-len", "512"]
    assert "/m" in plain and probex[1:4] == ["-m", "probex.cli", "worker"]
    assert "--probe=/p1" in probex and "--probe=/p2" in probex


def _start(label: str, side: str, tpot: float) -> dict:
    entry = {f"{m}_ms": {"p50": tpot * k, "mean": tpot * k, "p99": tpot * k} for m, k in (("ttft", 10), ("tpot", 1),
                                                                                        ("itl", 1))}
    return {"label": label, "side": side, "results": {"1": entry}}


def test_the_comparison_is_the_mean_of_each_sides_medians_against_the_noise_floor():
    starts = [_start("plain#1", "plain", 10.0), _start("probex#1", "probex", 10.3), _start("plain#2", "plain", 10.2),
              _start("probex#2", "probex", 10.5), _start("noise-a", "plain", 10.0), _start("noise-b", "plain", 10.1)]
    row = sc.compare(starts, [1])["1"]["tpot"]
    assert row["plain_ms"] == pytest.approx(10.1) and row["probex_ms"] == pytest.approx(10.4)
    assert row["diff_pct"] == pytest.approx((10.4 / 10.1 - 1) * 100)
    assert row["noise_pct"] == pytest.approx(1.0) and row["plain_starts"] == row["probex_starts"] == 2
    table = sc.markdown_table(sc.compare(starts, [1]), gateway=False)
    assert "| 1 | TPOT p50 | 10.10 | 10.40 | +2.97% | +1.00% |" in table
    failed = sc.compare([_start("plain#1", "plain", 10.0), {"label": "probex#1", "side": "probex", "results": {}}], [1])
    assert math.isnan(failed["1"]["tpot"]["diff_pct"]) and "noise_pct" not in failed["1"]["tpot"]


def test_the_gateway_policy_names_the_probes_and_no_rule():
    import yaml

    policy = yaml.safe_load(sc.permissive_policy([str(ROOT / "config" / "probes" / "harmful-request")]))
    assert policy["rules"] == [] and list(policy["probes"]) == ["harmful-request"]
    assert Path(policy["probes"]["harmful-request"]["path"]).is_absolute()


def test_the_engine_tap_side_is_the_worker_command_without_the_middleware():
    from probes.models import fetch_model

    model = str(fetch_model("smollm2-135m-instruct"))
    probe = str(ROOT / "config" / "probes" / "harmful-request")
    argv, env = sc.engine_tap_argv(model, [probe], ["--max-model-len", "512"], 9002)
    assert "--middleware" not in argv and "--additional-config" in argv and argv[-2:] == ["--max-model-len", "512"]
    assert "PROBEX_TAP_CONFIG" in env
    assert [side for _, side in sc.start_order(1, False, ("plain", "probex", "engine-tap"))] == [
        "plain", "probex", "engine-tap"]
    with pytest.raises(SystemExit):
        sc.parse_args(["--model", model, "--probe", probe, "--sides", "probex,tap"])


def test_engine_means_are_per_request_over_the_call():
    before = {"ttft": (1.0, 10.0), "prefill": (0.5, 10.0)}
    after = {"ttft": (1.5, 20.0), "prefill": (0.5, 10.0), "queue": (0.02, 4.0)}
    assert sc.engine_means(before, after) == pytest.approx({"ttft_mean_ms": 50.0, "queue_mean_ms": 5.0})
    starts = [{"label": "plain#1", "side": "plain",
               "results": {"1": {"ttft_ms": {"mean": 52.0}, "engine": {"ttft_mean_ms": 50.0, "queue_mean_ms": 1.0,
                                                                       "prefill_mean_ms": 30.0}}}}]
    assert "| plain#1 | 1 | 52.00 | 50.00 | 2.00 | 1.00 | 30.00 |" in sc.engine_table(starts, [1])


@pytest.mark.engine
def test_smoke_mode_compares_one_start_of_each_on_the_cpu(tmp_path):
    out = tmp_path / "compare.json"
    proc = subprocess.run([sys.executable, "-m", "bench.serve_compare", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=1200, cwd=ROOT,
                          env=_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert [s["label"] for s in result["starts"]] == ["plain#1", "probex#1"]
    assert result["versions"]["torch"] and result["workload"]["client"] == "vllm bench serve"
    for start in result["starts"]:
        assert "error" not in start and set(start["results"]) == {"2"}
        for c, entry in start["results"].items():
            assert entry["completed"] == 2 * int(c) and entry["failed"] == 0 and entry["tpot_ms"]["p50"] > 0
            assert "bench" in entry["command"] and entry["vllm_bench"]["max_concurrency"] == int(c)
    assert result["starts"][1]["command"][1:4] == ["-m", "probex.cli", "worker"]
    health = result["starts"][1]["worker_health"]
    assert health["score_messages_lost"] == 0 and health["score_waits"]["prompt"]["calls"] > 0, health
    assert set(result["comparison"]) == {"2"} and "| 2 | TPOT p50 |" in proc.stdout
