"""The gateway policy: what to monitor, when to flag or block, and who may see what.

Policies are YAML files validated by these pydantic models; `probex policy-schema`
writes the JSON Schema to config/policy.schema.json for editors and CI. Probe paths are
resolved relative to the policy file and read with `probes.artifact` (numpy + YAML,
never torch), so the gateway can refuse a bad probe before any worker sees it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal, Union, get_args

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator,
                      model_validator)

from gateway.judge_settings import JudgeSettings
from probes.artifact import (METADATA_FILE, WEIGHTS_FILE, ProbeArtifact, ProbeFormatError, check_probe_set,
                             load_probe)
from probes.operating_points import OperatingPointError


class PolicyError(ValueError):
    """A policy (or a probe it names) that cannot be served; the previous one stays active."""


class Decision(str, Enum):
    ALLOW = "allow"
    FLAG = "flag"
    STEER = "steer"
    BLOCK = "block"

    @property
    def rank(self) -> int:
        return _RANK[self]


# A steer rule steers where it would otherwise block, so STEER outranks FLAG; a BLOCK from
# any other rule still wins.
_RANK = {Decision.ALLOW: 0, Decision.FLAG: 1, Decision.STEER: 2, Decision.BLOCK: 3}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Rate(_Strict):
    """A threshold named by the false-positive rate it gives on benign prompts.

    Resolved when the policy loads, from the operating points in the probe's `probe.yaml`
    (probes/operating_points.py): the decisions use the threshold measured for that rate.
    """

    fpr: float = Field(gt=0.0, lt=1.0, description="false-positive rate on the probe's benign prompts")


Score = Annotated[float, Field(ge=0.0, le=1.0)]
# A number is a calibrated probability; {fpr: f} is resolved to one from the probe's operating points.
Level = Union[Score, Rate]


class Thresholds(_Strict):
    """Scores are calibrated probabilities; at or above `flag` flags, at or above `block` blocks.

    Either may be named by a rate, `{fpr: 0.01}`, resolved on load from the probe's operating
    points; `rates` then says which rate each number came from.
    """

    flag: Level | None = None
    block: Level | None = None
    _fpr: dict[str, float] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _ordered(self) -> "Thresholds":
        flag, block = self.flag, self.block
        if isinstance(flag, Rate) and isinstance(block, Rate) and flag.fpr < block.fpr:
            raise ValueError(f"flag rate {flag.fpr:g} is below block rate {block.fpr:g} (a lower rate is a higher"
                             " threshold, so this flags above the block threshold)")
        if isinstance(flag, float) and isinstance(block, float) and flag > block:
            raise ValueError(f"flag threshold {flag} is above block threshold {block}")
        return self

    @property
    def rates(self) -> dict[str, float]:
        """Which thresholds were named by a false-positive rate, and which rate."""
        return self._fpr

    @property
    def expected_flag_rate(self) -> float | None:
        """The share of benign prompts expected at or above the flag threshold (or the block one
        when there is no flag threshold), when that threshold was named by a rate."""
        if self.flag is not None:
            return self._fpr.get("flag")
        return self._fpr.get("block")

    def describe(self) -> dict:
        """The thresholds in force, each with the rate it was resolved from (admin view, audit)."""
        out = {}
        for name in ("flag", "block"):
            value = getattr(self, name)
            if value is not None:
                out[name] = {"threshold": value, **({"fpr": self._fpr[name]} if name in self._fpr else {})}
        return out

    def decide(self, score: float | None) -> Decision:
        if score is None:
            return Decision.ALLOW
        if self.block is not None and score >= self.block:
            return Decision.BLOCK
        if self.flag is not None and score >= self.flag:
            return Decision.FLAG
        return Decision.ALLOW


class EscalateBand(_Strict):
    """Prompt scores at or above `from` and below `to` go to the judge, whose verdict decides for the rule.

    `to` defaults to the rule's prompt block threshold (scores at or above it are blocked by the
    probe alone), or to no upper bound. Either end may be a rate, `{fpr: 0.05}`, like thresholds.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    low: Level = Field(alias="from")
    high: Level | None = Field(default=None, alias="to")
    _fpr: dict[str, float] = PrivateAttr(default_factory=dict)

    def contains(self, score: float) -> bool:
        return score >= self.low and (self.high is None or score < self.high)

    def describe(self) -> dict:
        out = {}
        for key, name in (("from", "low"), ("to", "high")):
            value = getattr(self, name)
            if value is not None:
                out[key] = {"threshold": value, **({"fpr": self._fpr[name]} if name in self._fpr else {})}
        return out


class SteerAction(_Strict):
    """Instead of blocking, steer: the worker adds alpha * vector in-graph (docs/steering.md).

    With `gated` (the default) the write happens only at tokens where the rule's probe
    scores above `threshold` — decided on the device, per token, in the same forward
    pass. `threshold` is a calibrated probability like every policy threshold; it
    defaults to the rule's prompt block threshold.
    """

    vector: str = Field(min_length=1, description="name of a steering vector loaded on the workers")
    alpha: float
    gated: bool = True
    threshold: float | None = Field(default=None, gt=0.0, lt=1.0)
    window: Literal["all", "prompt", "generation"] = "all"

    @model_validator(mode="after")
    def _finite(self) -> "SteerAction":
        if not math.isfinite(self.alpha):
            raise ValueError(f"steer.alpha must be finite, got {self.alpha}")
        return self


class Rule(_Strict):
    probe: str
    prompt: Thresholds = Field(default_factory=Thresholds)
    generated: Thresholds = Field(default_factory=Thresholds)
    steer: SteerAction | None = None
    escalate: EscalateBand | None = Field(default=None, description="prompt scores in this band go to the judge"
                                          " (the policy's `judge` section), whose verdict decides for this rule")

    @model_validator(mode="after")
    def _steer_threshold(self) -> "Rule":
        if isinstance(self.generated.flag, Rate) or isinstance(self.generated.block, Rate):
            raise ValueError(f"rule for {self.probe!r}: generated thresholds must be numbers; operating points are"
                             " measured on prompt scores, so {fpr: ...} applies to prompt thresholds only")
        if self.steer is not None and self.escalate is not None:
            raise ValueError(f"rule for {self.probe!r}: a steer rule cannot escalate (the worker steers before"
                             " any judge could answer)")
        if isinstance(self.prompt.block, Rate):
            return self  # a gated steer's default threshold is set once the rate is resolved
        if self.steer is not None and self.steer.gated and self.steer.threshold is None:
            if self.prompt.block is None or not 0.0 < self.prompt.block < 1.0:
                raise ValueError(f"rule for {self.probe!r}: a gated steer needs steer.threshold (or a prompt block"
                                 " threshold strictly between 0 and 1 to default to)")
            self.steer = self.steer.model_copy(update={"threshold": self.prompt.block})
        return self

    def decide(self, thresholds: Thresholds, score: float | None) -> Decision:
        """This rule's decision on one score: a steer rule steers instead of blocking, and
        reports `steer` wherever its in-graph gate would have opened at this read point."""
        decision = thresholds.decide(score)
        if self.steer is None:
            return decision
        if not self.steer.gated or decision is Decision.BLOCK or (
                score is not None and score > (self.steer.threshold or 1.0)):
            return Decision.STEER
        return decision

    def steering_xargs(self) -> dict:
        """The vllm_xargs that make a worker apply this rule's steering."""
        assert self.steer is not None
        xargs = {"probex_steer": self.steer.vector, "probex_steer_alpha": self.steer.alpha,
                 "probex_steer_window": self.steer.window}
        if self.steer.gated:
            xargs.update({"probex_steer_gate": self.probe, "probex_steer_threshold": self.steer.threshold})
        return xargs


class ProbeRef(_Strict):
    path: str

    @field_validator("path")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        # The OS cannot name such a file, and pathlib raises a bare ValueError on it.
        if "\0" in value:
            raise ValueError(f"probe path {value!r} contains a NUL character")
        return value


class AuditSettings(_Strict):
    include_prompt: bool = False
    maxlen: int = Field(default=100_000, ge=100)


# Engine controls a tenant may be granted (`gateway.controls` says which request fields each covers).
Control = Literal[
    # ProbeX's own, in vllm_xargs
    "recompute",  # probex_recompute: bypass the prefix cache (engine work)
    "steer",  # probex_steer and probex_steer_*: write a vector into the residual stream
    "capture",  # probex_capture: save activations on the worker
    # vLLM's: the rendered prompt (and so the token a probe reads), the KV cache, the inputs
    "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "cache_salt", "kv_transfer_params", "prompt_embeds",
    # SGLang's: request ids, per-request hooks and hidden-state output
    "custom_params", "rid", "return_hidden_states", "custom_logit_processor",
]


class TenantSettings(_Strict):
    """Per-tenant overrides of the policy's defaults."""

    rules: list[Rule] | None = None
    on_block: Literal["error", "refusal"] | None = None
    expose_scores: bool | None = None
    allow: list[Control] = Field(default_factory=list, description="engine controls this tenant's requests may"
                                 " carry (none by default; admin keys may use them all)")


class Policy(_Strict):
    probes: dict[str, ProbeRef] = Field(default_factory=dict)
    rules: list[Rule] = Field(default_factory=list)
    on_block: Literal["error", "refusal"] = "error"
    refusal_message: str = "I can't help with that request."
    missing_scores: Literal["fail_open", "fail_closed"] = "fail_open"
    expose_scores: bool = False
    calibration_alarm_below: float = Field(default=0.5, ge=0.0, le=1.0)
    audit: AuditSettings = AuditSettings()
    tenants: dict[str, TenantSettings] = Field(default_factory=dict)
    forward_fields: list[str] = Field(
        default_factory=list, description="further top-level request fields to forward for every caller (fields"
        " this deployment's workers understand and that leave monitoring intact); engine controls cannot be"
        " listed here, they are granted per tenant with tenants.<name>.allow")
    api_keys: dict[str, str] = Field(default_factory=dict, description="API key -> tenant name")
    judge: JudgeSettings = Field(default_factory=JudgeSettings, description="the second opinion asked for prompts"
                                 " whose score falls in a rule's `escalate` band")
    admin_keys: list[str] | dict[str, str] = Field(
        default_factory=list, description="admin keys: a list, or name -> key (the audit records the name). Keys"
        " can also come from PROBEX_ADMIN_KEYS / PROBEX_ADMIN_KEYS_FILE, which keeps them out of this file")

    @model_validator(mode="after")
    def _consistent(self) -> "Policy":
        rules = list(self.rules) + [r for t in self.tenants.values() for r in (t.rules or [])]
        for rule in rules:
            if rule.probe not in self.probes:
                raise ValueError(f"rule refers to probe {rule.probe!r}, which is not listed under probes")
        for owner, rule_set in [("rules", self.rules)] + [(f"tenants.{n}.rules", t.rules or []) for n, t in self.tenants.items()]:
            steering = [r.probe for r in rule_set if r.steer is not None]
            if len(steering) > 1:
                raise ValueError(f"{owner}: rules for {steering} all steer; a request carries one steering"
                                 " configuration, so at most one rule per rule set may steer")
        controls = set(get_args(Control)) | {"vllm_xargs"}
        for name in self.forward_fields:
            if name in controls or name.startswith("probex"):
                raise ValueError(f"forward_fields: {name!r} is an engine control; grant it per tenant with"
                                 f" tenants.<name>.allow instead")
        for key, tenant in self.api_keys.items():
            if tenant != "default" and tenant not in self.tenants:
                raise ValueError(f"api key {key[:4]}... maps to unknown tenant {tenant!r}")
        return self


@dataclass(frozen=True)
class TenantView:
    """The effective settings for one tenant (defaults merged with its overrides)."""

    name: str
    rules: tuple[Rule, ...]
    on_block: str
    expose_scores: bool
    granted: frozenset[str] = frozenset()

    @cached_property
    def steering_xargs(self) -> dict | None:
        """The xargs every request of this tenant is forwarded with, if one of its rules steers."""
        return next((r.steering_xargs() for r in self.rules if r.steer is not None), None)

    @cached_property
    def escalates(self) -> bool:
        """Whether any of this tenant's rules may ask the judge."""
        return any(r.escalate is not None for r in self.rules)

    def rule_for(self, probe: str | None) -> Rule | None:
        return next((r for r in self.rules if r.probe == probe), None)


@dataclass(frozen=True)
class LoadedPolicy:
    policy: Policy
    version: str  # of the text and the probe files: a probe retrained in place is a new policy
    source: Path | None
    probes: dict[str, ProbeArtifact]
    probe_digests: dict[str, str] = field(default_factory=dict)  # which probes a reload must push again

    @property
    def probe_dirs(self) -> list[str]:
        return [str(p.source) for p in self.probes.values()]

    @cached_property
    def needs_recompute(self) -> bool:
        """Interior reads see only recomputed prompt rows; bypass the prefix cache for them."""
        return any(p.read.reads_interior_tokens for p in self.probes.values())

    @cached_property
    def forward_fields(self) -> frozenset[str]:
        return frozenset(self.policy.forward_fields)

    @cached_property
    def _tenant_views(self) -> dict[str, TenantView]:
        return {}

    def rule_sets(self) -> list[tuple[str, list[Rule]]]:
        """(tenant, its effective rules) for every tenant this policy knows: "default" and those listed."""
        return [("default", list(self.policy.rules))] + [
            (name, list(self.tenant(name).rules)) for name in self.policy.tenants if name != "default"]

    def describe_rules(self) -> dict:
        """The thresholds and escalation bands in force, per tenant, each with the rate it came from."""
        out = {}
        for tenant, rules in self.rule_sets():
            out[tenant] = [{"probe": r.probe, "prompt": r.prompt.describe(), "generated": r.generated.describe(),
                            **({"escalate": r.escalate.describe()} if r.escalate is not None else {})} for r in rules]
        return out

    def tenant(self, name: str) -> TenantView:
        """The effective settings of a tenant (built once per policy and tenant: this is on every request)."""
        view = self._tenant_views.get(name)
        if view is None:
            view = self._tenant_views[name] = self._build_tenant(name)
        return view

    def _build_tenant(self, name: str) -> TenantView:
        overrides = self.policy.tenants.get(name, TenantSettings())
        return TenantView(
            name=name,
            rules=tuple(overrides.rules if overrides.rules is not None else self.policy.rules),
            on_block=overrides.on_block or self.policy.on_block,
            expose_scores=overrides.expose_scores if overrides.expose_scores is not None else self.policy.expose_scores,
            granted=frozenset(overrides.allow),
        )


def parse_policy(text: str, source: Path | None = None) -> LoadedPolicy:
    where = source or "<policy>"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyError(f"{where}: not valid YAML ({exc})") from None
    except RecursionError:
        raise PolicyError(f"{where}: not a usable policy (YAML nested too deeply to parse)") from None
    if data is None:
        # An editor's truncated save reads as an empty document; serving it would silently turn
        # off every rule, so emptiness has to be said explicitly.
        raise PolicyError(f"{where}: policy file is empty (no document, or only comments); to serve a policy"
                          " with no probes and no rules on purpose, write an explicit empty mapping: {}")
    if not isinstance(data, dict):
        raise PolicyError(f"{where}: expected a mapping at the top level")
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}" for e in exc.errors())
        raise PolicyError(f"{where}: {problems}") from None
    except RecursionError:
        raise PolicyError(f"{where}: not a usable policy (nested too deeply to validate)") from None
    base = source.parent if source else Path.cwd()
    probes: dict[str, ProbeArtifact] = {}
    digests: dict[str, str] = {}
    try:
        for name, ref in policy.probes.items():
            directory = _probe_directory(base, ref.path, f"{where}: probes.{name}.path")
            # Digest before loading: a probe rewritten in between then differs from this digest on
            # the next reload, instead of going unnoticed.
            digests[name] = _artifact_digest(directory)
            probe = load_probe(directory)
            if probe.name != name:
                raise PolicyError(f"{where}: probes.{name} points at a probe named {probe.name!r}; names must match")
            probes[name] = probe
        check_probe_set(list(probes.values()))
    except ProbeFormatError as exc:
        raise PolicyError(f"{where}: {exc}") from None
    resolve_rates(policy, probes, str(where))
    return LoadedPolicy(policy=policy, version=_version(text, digests), source=source, probes=probes,
                        probe_digests=digests)


def resolve_rates(policy: Policy, probes: dict[str, ProbeArtifact], where: str) -> None:
    """Turn every `{fpr: f}` of the policy's rules into the threshold the probe's operating points
    give for that rate (in place, remembering the rate); PolicyError naming the rule if it cannot."""
    owners = [("rules", policy.rules)] + [(f"tenants.{n}.rules", t.rules) for n, t in policy.tenants.items()
                                          if t.rules is not None]
    for owner, rules in owners:
        for i, rule in enumerate(rules):
            what = f"{where}: {owner}[{i}] (probe {rule.probe!r})"

            def resolve(holder, name: str, label: str) -> None:
                value = getattr(holder, name)
                if not isinstance(value, Rate):
                    return
                probe = probes[rule.probe]
                try:
                    points = probe.operating_points
                except OperatingPointError as exc:
                    raise PolicyError(f"{what}: {label}: {exc}") from None
                if points is None:
                    raise PolicyError(f"{what}: {label} is {{fpr: {value.fpr:g}}}, but the probe at {probe.source}"
                                      " has no operating points in its probe.yaml to resolve a rate from; measure"
                                      " them on benign prompts, or give the threshold as a number")
                try:
                    threshold = points.threshold_at(value.fpr)
                except OperatingPointError as exc:
                    raise PolicyError(f"{what}: {label}: {exc}") from None
                setattr(holder, name, threshold)
                holder._fpr[name] = value.fpr

            resolve(rule.prompt, "flag", "prompt.flag")
            resolve(rule.prompt, "block", "prompt.block")
            flag, block = rule.prompt.flag, rule.prompt.block
            if flag is not None and block is not None and flag > block:
                raise PolicyError(f"{what}: the prompt flag threshold {flag:g} is above the block threshold"
                                  f" {block:g} (as resolved: {rule.prompt.describe()})")
            steer = rule.steer
            if steer is not None and steer.gated and steer.threshold is None:
                if block is None or not 0.0 < block < 1.0:
                    raise PolicyError(f"{what}: a gated steer needs steer.threshold (or a prompt block threshold"
                                      " strictly between 0 and 1 to default to)")
                rule.steer = steer.model_copy(update={"threshold": block})
            band = rule.escalate
            if band is not None:
                resolve(band, "low", "escalate.from")
                resolve(band, "high", "escalate.to")
                if band.high is None and block is not None:
                    band.high = block
                if band.high is not None and band.low >= band.high:
                    raise PolicyError(f"{what}: the escalate band is empty (from {band.low:g}, to {band.high:g}:"
                                      f" {band.describe()})")


def _probe_directory(base: Path, ref_path: str, what: str) -> Path:
    path = Path(ref_path)
    if path.is_absolute():
        return path
    try:
        return (base / path).resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: a symlink loop, before Python 3.13
        raise PolicyError(f"{what}: cannot resolve {ref_path!r} ({exc})") from None


def _artifact_digest(directory: Path) -> str:
    """Covers everything a worker reads from the probe directory (weights and every metadata field)."""
    digest = hashlib.sha256()
    for file_name in (METADATA_FILE, WEIGHTS_FILE):
        try:
            content = (directory / file_name).read_bytes()
        except (OSError, ValueError):
            content = b""  # load_probe refuses the directory with a precise message
        digest.update(hashlib.sha256(content).digest())
    return digest.hexdigest()


def _version(text: str, probe_digests: dict[str, str]) -> str:
    # Fixed-length parts, so that no two different (text, probes) pairs hash the same bytes.
    digest = hashlib.sha256(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())
    for name, probe_digest in probe_digests.items():
        digest.update(hashlib.sha256(name.encode("utf-8", "surrogatepass")).digest() + bytes.fromhex(probe_digest))
    return digest.hexdigest()[:12]


def load_policy(path: str | Path) -> LoadedPolicy:
    try:
        path = Path(path).resolve()
        raw = path.read_bytes()
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read policy ({exc.strerror or exc})") from None
    except (ValueError, RuntimeError) as exc:  # a NUL in the path; a symlink loop before Python 3.13
        raise PolicyError(f"{path}: cannot read policy ({exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(f"{path}: policy is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return parse_policy(text, path)


def policy_json_schema() -> dict:
    schema = Policy.model_json_schema()
    schema["title"] = "ProbeX gateway policy"
    return schema
