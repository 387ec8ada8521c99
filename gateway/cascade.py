"""The probe → judge cascade: settling a verdict's escalated prompt scores with the judge's answer.

A prompt score in a rule's `escalate` band leaves that rule undecided (`decisions.judge_prompt`).
Before anything is relayed, the judge is asked once for the request (`gateway.judge`), and its
decision stands for every escalated rule. Without a verdict (timeout, error, an answer that is not
yes or no) the judge's `on_failure` decides: `fail_open` takes the probe's own decision,
`fail_closed` blocks. Each escalated rule leaves a record for the audit: the probe's score and
decision, the judge's P(yes) or failure, and the decision taken.
"""

from __future__ import annotations

import json

from gateway.calls import Call
from gateway.decisions import Verdict
from gateway.judge import JudgeClient, JudgeOutcome
from gateway.metrics import GatewayMetrics
from gateway.policy import Decision
from gateway.upstreams import NoHealthyUpstream, UpstreamPool


class Cascade:
    def __init__(self, pool: UpstreamPool, metrics: GatewayMetrics, judge: JudgeClient) -> None:
        self.pool, self.metrics, self.judge = pool, metrics, judge

    async def close(self) -> None:
        await self.judge.close()

    async def settle(self, call: Call, verdict: Verdict) -> Verdict:
        """The verdict with its escalations decided (at once when it has none)."""
        escalations = verdict.escalations
        if not escalations:
            return verdict
        if verdict.decision is Decision.BLOCK:  # another rule blocks already: no verdict could change that
            verdict.escalations = []
            return verdict
        policy = call.policy.policy
        settings = policy.judge
        body = json.loads(call.judged)
        model = settings.model or body.get("model") or ""
        metrics = self.metrics
        try:
            base_url = settings.url or self.pool.pick().url
        except NoHealthyUpstream:
            outcome = JudgeOutcome(None, None, "error: no healthy worker to ask", 0.0, model)
        else:
            outcome = await self.judge.ask(settings, base_url, model, body)
        result = "ok" if outcome.decision is not None else outcome.error.split(":", 1)[0]
        metrics.child(metrics.judge_calls, result).inc()
        metrics.judge_latency.observe(outcome.latency_s)
        fail_closed = (settings.on_failure or policy.missing_scores) == "fail_closed"
        settled = Verdict(verdict.decision, verdict.probe, verdict.phase, verdict.scores, [],
                          verdict.prompt_decisions, list(verdict.cascade))
        for escalation in escalations:
            probe, own = escalation.rule.probe, escalation.probe_decision
            if outcome.decision is not None:
                decision, source = outcome.decision, "judge"
                metrics.child(metrics.judge_agreement, probe, "yes" if decision is own else "no").inc()
            elif fail_closed:
                decision, source = Decision.BLOCK, "fail_closed"
            else:
                decision, source = own, "fail_open"
            metrics.child(metrics.judge_verdicts, probe, own.value, decision.value, source).inc()
            record = {"probe": probe, "score": escalation.score, "band": escalation.rule.escalate.describe(),
                      "thresholds": escalation.rule.prompt.describe(), "probe_decision": own.value,
                      "judge": outcome.describe(), "decision": decision.value, "source": source}
            settled = settled.merge(Verdict(decision, probe, "judge", cascade=[record]))
        return settled
