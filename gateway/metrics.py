"""Prometheus metrics of the gateway (names follow vLLM / LiteLLM style: probex_*)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from gateway.policy import LoadedPolicy

SCORE_BUCKETS = tuple(i / 20 for i in range(1, 21))
JUDGE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("probex_requests_total", "Monitored requests by decision", ["decision", "probe", "tenant"], registry=r)
        self.probe_score = Histogram("probex_probe_score", "Calibrated probe scores", ["probe", "phase"], buckets=SCORE_BUCKETS, registry=r)
        self.overhead = Histogram("probex_gateway_overhead_seconds", "Time spent in the gateway, upstream excluded", buckets=OVERHEAD_BUCKETS, registry=r)
        self.upstream_errors = Counter("probex_upstream_errors_total", "Upstream failures", ["upstream", "kind"], registry=r)
        self.reloads = Counter("probex_policy_reloads_total", "Policy reloads", ["result"], registry=r)
        self.policy_version = Gauge("probex_policy_version", "Active policy (value 1, version as label)", ["version"], registry=r)
        self.retention = Gauge("probex_calibration_retention", "Relative calibration retention per probe", ["probe"], registry=r)
        self.alarm = Gauge("probex_calibration_alarm", "1 when a probe's retention is below the policy threshold", ["probe"], registry=r)
        self.alarm_below = Gauge("probex_calibration_alarm_below", "The policy's calibration_alarm_below (the alarm threshold)", registry=r)
        self.prompt_tokens = Counter("probex_prompt_tokens_total", "Prompt tokens of monitored requests", registry=r)
        self.prompt_tokens_scored = Counter("probex_prompt_tokens_scored_total", "Prompt tokens the probes actually read", registry=r)
        self.scores_missing = Counter("probex_scores_missing_total", "Responses that arrived without probe scores", ["tenant"], registry=r)
        self.audit_events = Counter("probex_audit_events_total", "Audit events by sink and result", ["sink", "result"], registry=r)
        self.audit_backlog = Gauge("probex_audit_backlog", "Audit events waiting for Redis", registry=r)
        self.in_flight = Gauge("probex_requests_in_flight", "Completion requests the gateway is serving now", registry=r)
        # Drift: each rule's own decision on the prompt score (before any judge), per probe and tenant, and the
        # share of benign prompts the policy expects at or above the flag threshold where that was named by a rate.
        self.prompt_decisions = Counter("probex_probe_prompt_decisions_total", "Each probe's decision on the prompt"
                                        " score by its thresholds alone (every monitored request with a score)",
                                        ["probe", "tenant", "decision"], registry=r)
        self.expected_flag_rate = Gauge("probex_expected_flag_rate", "The false-positive rate the prompt flag"
                                        " threshold was resolved from (or the block one's, without a flag threshold)",
                                        ["probe", "tenant"], registry=r)
        # The cascade: prompts in a rule's escalate band asked of the judge.
        self.judge_calls = Counter("probex_judge_calls_total", "Judge calls by result (ok, timeout, error,"
                                   " unparseable)", ["result"], registry=r)
        self.judge_latency = Histogram("probex_judge_latency_seconds", "Time from asking the judge to its verdict"
                                       " (or to giving up)", buckets=JUDGE_BUCKETS, registry=r)
        self.judge_verdicts = Counter("probex_judge_verdicts_total", "Escalated prompts by the probe's own decision"
                                      " and the decision taken (the judge's, or the failure mode's)",
                                      ["probe", "probe_decision", "verdict", "source"], registry=r)
        self.judge_agreement = Counter("probex_judge_agreement_total", "Judge verdicts that agree (or not) with the"
                                       " probe's own decision on the escalated prompt", ["probe", "agree"], registry=r)
        self.upstream_healthy = Gauge("probex_upstream_healthy", "1 when the upstream answers its health check", ["upstream"], registry=r)

        # Labelled children, looked up once: `.labels()` validates and locks on every call.
        self._children: dict[tuple, object] = {}

    def child(self, metric, *values: str):
        """`metric.labels(*values)`, cached (label values here come from the policy: a bounded set)."""
        key = (id(metric), *values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def set_policy_version(self, version: str) -> None:
        self.policy_version.clear()
        self.policy_version.labels(version=version).set(1)

    def set_policy(self, loaded: "LoadedPolicy") -> None:
        """What the active policy exports: its version and the expected flag rate per probe and tenant."""
        self.set_policy_version(loaded.version)
        self.expected_flag_rate.clear()
        for tenant, rules in loaded.rule_sets():
            for rule in rules:
                rate = rule.prompt.expected_flag_rate
                if rate is not None:
                    self.expected_flag_rate.labels(probe=rule.probe, tenant=tenant).set(rate)
