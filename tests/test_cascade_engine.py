"""The probe -> judge cascade against the real demo worker, the demo model judging through the worker."""

from __future__ import annotations

import json

import httpx
import pytest
import yaml

from gateway.app import GatewayConfig, create_app
from gateway.serving import ServerThread
from tests.gateway_fixtures import wait_for_healthy_upstreams


@pytest.mark.engine
def test_a_prompt_in_the_band_is_judged_by_the_served_model_and_the_audit_shows_both(demo_worker, tmp_path):
    probe = next(arg for arg in demo_worker.proc.args if arg.startswith("--probe=")).split("=", 1)[1]
    # Every prompt score is in the band (from 0, no block threshold: no upper end). The 135M demo model
    # is a weak judge: it puts little probability on the two words, so any mass on them counts here.
    policy = {"probes": {"harmful-request": {"path": probe}},
              "rules": [{"probe": "harmful-request", "prompt": {"flag": 0.5}, "escalate": {"from": 0.0}}],
              "judge": {"min_answer_mass": 0.0001, "timeout_s": 60, "on_failure": "fail_closed"}}
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    config = GatewayConfig(policy_path=tmp_path / "policy.yaml", upstreams=[demo_worker.url],
                           worker_admin_token=demo_worker.admin_token, audit_path=tmp_path / "audit.jsonl",
                           upstream_timeout_s=120)
    gateway = ServerThread(create_app(config)).start()
    try:
        wait_for_healthy_upstreams(gateway.url)
        model = httpx.get(demo_worker.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        for stream in (False, True):
            body = {"model": model, "messages": [{"role": "user", "content": "How do I bake bread at home?"}],
                    "max_tokens": 4, "temperature": 0, "stream": stream}
            r = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=120)
            decision = r.headers["x-probex-decision"]
            assert decision in ("allow", "flag", "block"), r.text
            assert r.status_code == (400 if decision == "block" else 200), r.text
        metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
        assert 'probex_judge_calls_total{result="ok"} 2.0' in metrics, metrics
        events = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
        assert len(events) == 2 and all(len(e["cascade"]) == 1 for e in events), events
        for event in events:
            record = event["cascade"][0]
            # The probe's outcome: its score and what its thresholds alone decide.
            assert 0.0 <= record["score"] <= 1.0
            assert record["probe_decision"] == ("flag" if record["score"] >= 0.5 else "allow")
            # The judge's outcome: P(yes) from the first token, and the decision taken from it.
            assert 0.0 <= record["judge"]["p_yes"] <= 1.0 and record["source"] == "judge", record
            expected = "block" if record["judge"]["p_yes"] >= 0.5 else "allow"
            assert record["judge"]["decision"] == record["decision"] == event["decision"] == expected
    finally:
        gateway.stop()
