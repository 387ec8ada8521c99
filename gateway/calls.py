"""One monitored request's book-keeping: its verdict, metrics and audit event."""

from __future__ import annotations

import json
import time

from gateway.audit import AuditSink, audit_event
from gateway.decisions import Verdict, generated_scores, judge_generated, judge_prompt
from gateway.metrics import GatewayMetrics
from gateway.policy import Decision, LoadedPolicy, TenantView


class Call:
    """Book-keeping of one monitored request, for metrics and audit."""

    __slots__ = ("request_id", "tenant", "policy", "is_admin", "raw_body", "started", "upstream_s", "judged")

    def __init__(self, request_id: str, tenant: TenantView, policy: LoadedPolicy, is_admin: bool,
                 raw_body: bytes | None, started: float, upstream_s: float = 0.0, judged: bytes | None = None) -> None:
        self.request_id, self.tenant, self.policy, self.is_admin = request_id, tenant, policy, is_admin
        self.raw_body = raw_body  # kept only when the audit records prompts
        self.started = started
        self.upstream_s = upstream_s  # waiting for the worker, not the gateway's own time
        # The request body, kept when a prompt score in an escalate band would take it to the judge
        # (None: this request is never escalated).
        self.judged = judged

    @property
    def expose_scores(self) -> bool:
        return self.is_admin or self.tenant.expose_scores

    @property
    def prompt_text(self) -> str | None:
        return None if self.raw_body is None else prompt_text_of(json.loads(self.raw_body))

    def headers(self, decision: Decision) -> list[tuple[bytes, bytes]]:
        return [(b"x-probex-decision", decision.value.encode()),
                (b"x-probex-policy-version", self.policy.version.encode("latin-1")),
                (b"x-request-id", self.request_id.encode())]


def prompt_text_of(body: dict) -> str:
    if "messages" in body:
        return json.dumps(body["messages"])[:4000]
    return str(body.get("prompt"))[:4000]


def judge_whole(call: Call, probex: dict | None, metrics: GatewayMetrics) -> Verdict:
    fail_closed = call.policy.policy.missing_scores == "fail_closed"
    if not probex or not probex.get("scores"):
        metrics.child(metrics.scores_missing, call.tenant.name).inc()
    record_scores(probex, metrics)
    prompt = judge_prompt(call.tenant, probex, fail_closed, escalate=call.judged is not None)
    return prompt.merge(judge_generated(call.tenant, generated_scores(probex)))


def record_scores(probex: dict | None, metrics: GatewayMetrics) -> None:
    for name, entry in ((probex or {}).get("scores") or {}).items():
        if entry.get("score") is not None:
            metrics.child(metrics.probe_score, name, "prompt").observe(entry["score"])
        prompt = entry.get("prompt")
        if prompt:
            metrics.prompt_tokens.inc(prompt.get("prompt_tokens", 0))
            metrics.prompt_tokens_scored.inc(prompt.get("tokens_scored", 0))
            break  # token counts are per request, not per probe
    for name, entry in ((probex or {}).get("scores") or {}).items():
        values = [v for v in (entry.get("generated") or {}).get("scores") or () if v is not None]
        if values:
            metrics.child(metrics.probe_score, name, "generated").observe(max(values))


async def account(call: Call, verdict: Verdict, metrics: GatewayMetrics, audit: AuditSink) -> None:
    tenant = call.tenant.name
    metrics.child(metrics.requests, verdict.decision.value, verdict.probe or "", tenant).inc()
    for probe, decision in verdict.prompt_decisions.items():
        metrics.child(metrics.prompt_decisions, probe, tenant, decision.value).inc()
    if verdict.decision is not Decision.ALLOW or verdict.cascade:  # an escalated request is audited whatever the verdict
        extra: dict = {}
        rule = call.tenant.rule_for(verdict.probe) if verdict.phase in ("prompt", "generated") else None
        if rule is not None:
            extra["thresholds"] = getattr(rule, verdict.phase).describe()
        if verdict.cascade:
            extra["cascade"] = verdict.cascade
        await audit.record(audit_event(request_id=call.request_id, tenant=tenant,
                                       decision=verdict.decision.value, probe=verdict.probe, phase=verdict.phase,
                                       scores=verdict.scores, policy_version=call.policy.version,
                                       prompt=call.prompt_text, **extra))


def observe_overhead(call: Call, metrics: GatewayMetrics) -> None:
    metrics.overhead.observe(max(0.0, time.perf_counter() - call.started - call.upstream_s))


def record_generated(generated: dict, metrics: GatewayMetrics) -> None:
    for name, values in generated.items():
        child = metrics.child(metrics.probe_score, name, "generated")
        for v in values:
            if v is not None:
                child.observe(v)

