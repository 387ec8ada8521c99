"""Turning the worker's `probex` scores into allow / flag / steer / block, per tenant. Pure functions.

A steer rule never blocks: the worker already steered in-graph, so where the rule would
block (or where its gate opened at the read point) the decision is `steer` and the
response is relayed.

A rule with an `escalate` band leaves a prompt score inside the band undecided: the verdict
carries an `Escalation` instead, for `gateway.cascade` to settle with the judge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.policy import Decision, Rule, TenantView


@dataclass
class Escalation:
    """A prompt score in a rule's escalate band, waiting for the judge."""

    rule: Rule
    score: float
    probe_decision: Decision  # what the rule decides from the probe's score alone


@dataclass
class Verdict:
    decision: Decision = Decision.ALLOW
    probe: str | None = None
    phase: str | None = None  # "prompt", "generated", "missing" or "judge"
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> probe -> score
    escalations: list[Escalation] = field(default_factory=list)  # prompt scores for the judge to decide
    # Each rule's decision on the prompt by its thresholds alone, judge or not (the live flag rate per probe).
    prompt_decisions: dict[str, Decision] = field(default_factory=dict)
    cascade: list[dict] = field(default_factory=list)  # what the judge said, per escalated rule (for the audit)

    def merge(self, other: "Verdict") -> "Verdict":
        """The stricter of two verdicts (ties keep the earlier reason); scores are combined per phase."""
        winner = other if other.decision.rank > self.decision.rank else self
        scores = {phase: dict(values) for phase, values in self.scores.items()}
        for phase, values in other.scores.items():
            merged = scores.setdefault(phase, {})
            for probe, value in values.items():
                merged[probe] = max(value, merged.get(probe, value))
        return Verdict(winner.decision, winner.probe, winner.phase, scores, self.escalations + other.escalations,
                       {**self.prompt_decisions, **other.prompt_decisions}, self.cascade + other.cascade)


def judge_prompt(tenant: TenantView, probex: dict | None, fail_closed: bool, escalate: bool = True) -> Verdict:
    """Decide on the prompt scores (the `score` of each probe, per its read point).

    With `escalate`, a score in a rule's escalate band is left to the judge (`Verdict.escalations`)."""
    scores = (probex or {}).get("scores") or {}
    verdict = Verdict()
    decisions: dict[str, Decision] = {}
    escalations: list[Escalation] = []
    for rule in tenant.rules:
        entry = scores.get(rule.probe)
        if entry is None or entry.get("score") is None:
            if fail_closed:
                verdict = verdict.merge(Verdict(Decision.BLOCK, rule.probe, "missing"))
            continue
        score = float(entry["score"])
        decisions[rule.probe] = rule.prompt.decide(score)
        band = rule.escalate
        if escalate and band is not None and band.contains(score):
            escalations.append(Escalation(rule, score, rule.decide(rule.prompt, score)))
            verdict = verdict.merge(Verdict(scores={"prompt": {rule.probe: score}}))
            continue
        verdict = verdict.merge(Verdict(rule.decide(rule.prompt, score), rule.probe, "prompt", {"prompt": {rule.probe: score}}))
    verdict.prompt_decisions = decisions
    verdict.escalations = escalations
    return verdict


def judge_generated(tenant: TenantView, generated: dict[str, list[float | None]]) -> Verdict:
    """Decide on newly generated tokens' scores (a chunk's, or a whole response's)."""
    verdict = Verdict()
    for rule in tenant.rules:
        values = [v for v in generated.get(rule.probe, ()) if v is not None]
        if not values:
            continue
        peak = max(values)
        verdict = verdict.merge(Verdict(rule.decide(rule.generated, peak), rule.probe, "generated", {"generated": {rule.probe: peak}}))
    return verdict


def generated_scores(probex: dict | None) -> dict[str, list[float | None]]:
    """Per-probe generated-token scores from a response body or a stream chunk."""
    out: dict[str, list[float | None]] = {}
    for name, entry in ((probex or {}).get("scores") or {}).items():
        values = (entry.get("generated") or {}).get("scores")
        if values:
            out[name] = values
    return out


class StreamJudge:
    """Judges a stream chunk by chunk, starting from the prompt's verdict.

    Gives the same verdict as `verdict.merge(judge_generated(tenant, chunk_scores))` over every
    chunk, without building and merging a `Verdict` per rule and per chunk.
    """

    __slots__ = ("rules", "decision", "probe", "phase", "rank", "scores", "start")

    def __init__(self, tenant: TenantView, start: Verdict) -> None:
        self.start = start
        self.rules = [(rule.probe, rule) for rule in tenant.rules]
        self.decision, self.probe, self.phase = start.decision, start.probe, start.phase
        self.rank = start.decision.rank
        self.scores = {phase: dict(values) for phase, values in start.scores.items()}

    def step(self, generated: dict[str, list[float | None]]) -> Decision:
        """Take one chunk's generated scores; returns the decision on this chunk alone."""
        decision, probe, rank = Decision.ALLOW, None, 0
        peaks = None
        for name, rule in self.rules:
            values = generated.get(name)
            if not values:
                continue
            peak = None
            for v in values:
                if v is not None and (peak is None or v > peak):
                    peak = v
            if peak is None:
                continue
            if peaks is None:
                peaks = self.scores.setdefault("generated", {})
            if name not in peaks or peak > peaks[name]:
                peaks[name] = peak
            d = rule.decide(rule.generated, peak)
            if d.rank > rank:
                decision, probe, rank = d, name, d.rank
        if rank > self.rank:
            self.decision, self.probe, self.phase, self.rank = decision, probe, "generated", rank
        return decision

    @property
    def verdict(self) -> Verdict:
        start = self.start
        return Verdict(self.decision, self.probe, self.phase, self.scores, start.escalations, start.prompt_decisions,
                       start.cascade)
