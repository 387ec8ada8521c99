"""Relative calibration retention: one label-free scalar per probe that says whether the model moved.

retention = cos(frozen w, fresh difference of means over the probe's retention set) / reference cosine

The retention set (refs to labelled prompts) and the reference cosine are recorded in
probe.yaml at training time (`retention: {reference_cosine, set, features}`); the fresh
difference of means is taken on the model being served now, over the per-prompt vectors the
reference was measured on (`ProbeArtifact.features`: the last token, or a mean over the rows
the probe's read covers). Near 1: the direction still points where the classes separate.
Far below 1: the model changed under the probe (e.g. a broken quantization).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np

from probes.artifact import ProbeArtifact, load_probe
from probes.datasets import load_all_known, resolve_refs
from probes.probe_prompts import load_probe_prompts
from probes.train import feature_vectors, readout_raw_scores, retention_reference


class NoRetentionReference(ValueError):
    """The probe was not saved with a retention reference, so retention cannot be computed."""


def retention_set(probe: ProbeArtifact, known=None) -> tuple[list[str], np.ndarray]:
    """(texts, labels) of the probe's retention set: its refs resolved in the artifact's own
    prompts.jsonl first, then in `known` (the built-in sets, or a function returning them)."""
    info = probe.extra.get("retention") or {}
    refs = info.get("set")
    if not refs or "reference_cosine" not in info:
        raise NoRetentionReference(f"{probe.source}/probe.yaml has no retention reference "
                                   "(retention.reference_cosine and retention.set)")
    grouped: dict[str, list[str]] = {}
    for ref in refs:
        file_ref, _, row = ref.rpartition("#")
        grouped.setdefault(file_ref, []).append(row)
    examples = resolve_refs({k: ",".join(v) for k, v in grouped.items()},
                            known if known is not None else load_all_known, local=load_probe_prompts(probe.source))
    return [e.text for e in examples], np.asarray([e.label for e in examples])


def relative_retention(weight: np.ndarray, features: np.ndarray, labels: np.ndarray, reference: float) -> float:
    """The training-time measurement (retention_reference) repeated now, relative to its recorded value."""
    if not (isinstance(reference, (int, float)) and np.isfinite(reference) and reference != 0):
        raise ValueError(f"retention: the reference cosine must be a non-zero finite number, got {reference!r}")
    return retention_reference(weight, features, labels) / reference


_ROWS = re.compile(r"[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*")


def split_refs(probe: ProbeArtifact, split: str) -> dict[str, str]:
    """The refs of a split recorded in probe.yaml (`splits.<split>.refs`), or a ValueError naming those there are."""
    splits = probe.extra.get("splits")
    recorded = splits.get(split) if isinstance(splits, dict) else None
    if not isinstance(recorded, dict):
        names = [k for k, v in splits.items() if isinstance(v, dict) and "refs" in v] if isinstance(splits, dict) else []
        raise ValueError(f"{probe.source}/probe.yaml records no split {split!r}"
                         f" (splits with refs: {', '.join(sorted(map(str, names))) or 'none'})")
    refs = recorded.get("refs")
    if not (isinstance(refs, dict) and refs and all(isinstance(k, str) and isinstance(v, str) and _ROWS.fullmatch(v)
                                                     for k, v in refs.items())):
        raise ValueError(f"{probe.source}/probe.yaml: splits.{split}.refs must map file refs to row lists"
                         f" such as '1-3,17', got {refs!r:.80}")
    return refs


def compute_retention(model_dir: Path, probe_dirs: list[Path | str], eval_split: str | None = None,
                      dtype: str = "float32") -> dict:
    """{probe name: {"retention": r, "retention_prompts": n[, "auroc_<split>": {...}]}} on `model_dir`.

    Activations come from HF transformers on the model directory the engine serves (the tap
    equals HF at cosine >= 0.9999 in float32, tests/test_engine_fp32.py). Probes without a
    retention reference get {"retention": None, "reason": ...}.
    """
    from probes.evaluate import evaluate_scores
    from probes.extract_hf import extract_activations

    # The built-in sets are fetched (it may download wheels) only if some ref is not in a probe's own prompts.
    known = functools.cache(load_all_known)
    results: dict = {}
    for probe_dir in probe_dirs:
        probe = load_probe(probe_dir)
        if not (probe.extra.get("retention") or {}).get("set"):
            results[probe.name] = {"retention": None, "reason": f"{probe.source}/probe.yaml has no retention reference"}
            continue
        try:
            texts, labels = retention_set(probe, known)
        except NoRetentionReference as exc:
            results[probe.name] = {"retention": None, "reason": str(exc)}
            continue
        eval_refs = split_refs(probe, eval_split) if eval_split else None  # refused before the slow part
        acts = extract_activations(texts, model_dir, [probe.layer], show_progress=False, dtype=dtype)[probe.layer]
        # The reference was measured on the vectors the probe was fitted on; any others give another cosine.
        entry = {"retention": relative_retention(probe.weight, feature_vectors(acts, probe.features), labels,
                                                 float(probe.extra["retention"]["reference_cosine"])),
                 "retention_prompts": len(texts)}
        if eval_refs is not None:
            examples = resolve_refs(eval_refs, known, local=load_probe_prompts(probe.source))
            x = extract_activations([e.text for e in examples], model_dir, [probe.layer], show_progress=False,
                                    dtype=dtype)[probe.layer]
            raw = readout_raw_scores(probe, x, probe.read, probe.features)
            entry[f"auroc_{eval_split}"] = evaluate_scores(raw, np.asarray([e.label for e in examples])).as_dict()
        results[probe.name] = entry
    return results
