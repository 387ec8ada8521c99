"""`probex thresholds --policy`: only the probe's prompt thresholds change; comments, other rules and
tenants' rules stay as written (probex/policy_thresholds.py)."""

from pathlib import Path

import pytest
import yaml

from probex.policy_thresholds import PolicyEditError, set_prompt_thresholds

ROOT = Path(__file__).resolve().parent.parent

POLICY = """\
# The operator's header comment.
probes:
  harmful-request: {path: probes/harmful-request}   # where it lives
  other: {path: probes/other}

rules:
  - probe: harmful-request
    prompt: {flag: 0.5, block: 0.8}      # judged once
    generated: {flag: 0.6, block: 0.9}
  - probe: other
    prompt:
      flag: 0.7   # other's flag
  - probe: harmful-request
    prompt:
      flag: 0.4   # block-style rule
    steer: {vector: refusal, alpha: 8.0}

tenants:
  red-team:
    rules:
      - probe: harmful-request
        prompt: {flag: 0.5}
"""


def test_only_the_probes_top_level_prompt_thresholds_change():
    new, count = set_prompt_thresholds(POLICY, "harmful-request", {"flag": 0.61, "block": 0.93}, "flag at FPR 0.01")
    assert count == 2
    old_data, new_data = yaml.safe_load(POLICY), yaml.safe_load(new)
    assert new_data["rules"][0]["prompt"] == {"flag": 0.61, "block": 0.93}
    assert new_data["rules"][2]["prompt"] == {"flag": 0.61, "block": 0.93}
    for data in (old_data, new_data):
        for i in (0, 2):
            data["rules"][i].pop("prompt")
    assert new_data == old_data  # other rules, generated thresholds, steering, tenants, probes: unchanged
    for line in ("# The operator's header comment.", "  harmful-request: {path: probes/harmful-request}   # where it lives",
                 "    generated: {flag: 0.6, block: 0.9}",
                 "      flag: 0.7   # other's flag", "      flag: 0.61   # block-style rule", "        prompt: {flag: 0.5}"):
        assert line in new.splitlines()
    assert new.count("# probex thresholds: flag at FPR 0.01") == 2
    assert "    prompt: {flag: 0.61, block: 0.93}      # judged once" in new.splitlines()


def test_a_second_run_replaces_its_own_comment_and_keeps_the_block_it_was_not_given():
    first, _ = set_prompt_thresholds(POLICY, "harmful-request", {"flag": 0.61, "block": 0.93}, "first")
    second, _ = set_prompt_thresholds(first, "harmful-request", {"flag": 0.66}, "second")
    assert "first" not in second and second.count("# probex thresholds: second") == 2
    assert yaml.safe_load(second)["rules"][0]["prompt"] == {"flag": 0.66, "block": 0.93}
    assert len(second.splitlines()) == len(first.splitlines())


def test_a_rule_without_prompt_thresholds_gets_them(tmp_path):
    text = "rules:\n  - probe: p\n    generated: {flag: 0.9}\n  - {probe: p}\n"
    new, count = set_prompt_thresholds(text, "p", {"flag": 0.2}, "c")
    assert count == 2
    assert yaml.safe_load(new)["rules"] == [{"probe": "p", "generated": {"flag": 0.9}, "prompt": {"flag": 0.2}},
                                            {"probe": "p", "prompt": {"flag": 0.2}}]


def test_the_shipped_policy_keeps_its_comments():
    path = ROOT / "config" / "policy.yaml"
    text = path.read_text()
    new, _ = set_prompt_thresholds(text, "harmful-request", {"flag": 0.7, "block": 0.95}, "c")
    removed = set(text.splitlines()) - set(new.splitlines())
    assert removed == {"    prompt: {flag: 0.5, block: 0.8}"}


@pytest.mark.parametrize("text, values, message", [
    ("rules: []\n", {"flag": 0.5}, "no rule under `rules:` is for probe 'p'"),
    ("probes: {}\n", {"flag": 0.5}, "it has no `rules:` list"),
    ("rules:\n  - probe: p\n    prompt: {block: 0.3}\n", {"flag": 0.5}, "would flag at 0.5, above its block threshold 0.3"),
    ("rules: [\n", {"flag": 0.5}, "not valid YAML"),
    ("rules:\n  - probe: p\n", {"flag": 1.5}, r"must be a number in \[0, 1\]"),
])
def test_refusals(text, values, message):
    with pytest.raises(PolicyEditError, match=message):
        set_prompt_thresholds(text, "p", values, "c")
