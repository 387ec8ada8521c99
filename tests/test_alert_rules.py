"""`promtool test rules`: the alert rules of dashboards/alerts.yml against the synthetic series of
dashboards/alerts.test.yml (no Prometheus server; tests/test_observability.py runs a real one)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.test_observability import RULES_FILE, alert_rules, promtool

RULES_TEST_FILE = Path(__file__).resolve().parents[1] / "dashboards" / "alerts.test.yml"


def test_promtool_unit_tests_of_the_alert_rules_pass():
    result = subprocess.run([promtool(), "test", "rules", str(RULES_TEST_FILE)], capture_output=True, text=True)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_the_unit_tests_read_the_rules_file_and_cover_the_drift_alert():
    tests = yaml.safe_load(RULES_TEST_FILE.read_text())
    assert tests["rule_files"] == [RULES_FILE.name]
    covered = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]}
    assert "ProbexProbeFlagRateDrift" in covered and covered <= {r["alert"] for r in alert_rules()}


def test_the_drift_test_fails_on_a_rule_without_its_minimum_count(tmp_path):
    """The quiet tenant's 6 flags an hour must not fire: a rule without the minimum would."""
    rules = yaml.safe_load(RULES_FILE.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "ProbexProbeFlagRateDrift":
                rule["expr"] = rule["expr"].split("and on (probe, tenant)")[0]
    (tmp_path / RULES_FILE.name).write_text(yaml.safe_dump(rules, sort_keys=False))
    (tmp_path / RULES_TEST_FILE.name).write_text(RULES_TEST_FILE.read_text())
    result = subprocess.run([promtool(), "test", "rules", str(tmp_path / RULES_TEST_FILE.name)], capture_output=True,
                            text=True)
    assert result.returncode != 0 and "quiet" in result.stdout + result.stderr, result.stdout + result.stderr
