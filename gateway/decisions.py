"""Turning the worker's `probex` scores into allow / flag / steer / block, per tenant. Pure functions.

A steer rule never blocks: the worker already steered in-graph, so where the rule would
block (or where its gate opened at the read point) the decision is `steer` and the
response is relayed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.policy import Decision, TenantView


@dataclass
class Verdict:
    decision: Decision = Decision.ALLOW
    probe: str | None = None
    phase: str | None = None  # "prompt", "generated" or "missing"
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> probe -> score

    def merge(self, other: "Verdict") -> "Verdict":
        """The stricter of two verdicts (ties keep the earlier reason); scores are combined per phase."""
        winner = other if other.decision.rank > self.decision.rank else self
        scores = {phase: dict(values) for phase, values in self.scores.items()}
        for phase, values in other.scores.items():
            merged = scores.setdefault(phase, {})
            for probe, value in values.items():
                merged[probe] = max(value, merged.get(probe, value))
        return Verdict(winner.decision, winner.probe, winner.phase, scores)


def judge_prompt(tenant: TenantView, probex: dict | None, fail_closed: bool) -> Verdict:
    """Decide on the prompt scores (the `score` of each probe, per its read point)."""
    scores = (probex or {}).get("scores") or {}
    verdict = Verdict()
    for rule in tenant.rules:
        entry = scores.get(rule.probe)
        if entry is None or entry.get("score") is None:
            if fail_closed:
                verdict = verdict.merge(Verdict(Decision.BLOCK, rule.probe, "missing"))
            continue
        score = float(entry["score"])
        verdict = verdict.merge(Verdict(rule.decide(rule.prompt, score), rule.probe, "prompt", {"prompt": {rule.probe: score}}))
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

    __slots__ = ("rules", "decision", "probe", "phase", "rank", "scores")

    def __init__(self, tenant: TenantView, start: Verdict) -> None:
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
        return Verdict(self.decision, self.probe, self.phase, self.scores)
