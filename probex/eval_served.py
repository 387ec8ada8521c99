"""`probex eval`: a probe's metrics from scores the worker served vs from offline activations, side by side.

The offline side is HF transformers on the same weights (float32, chat template as the
chat endpoint renders it); the served side is `prompt.last_raw` returned by a running
`probex worker` for the same prompts. Splits come from the refs recorded in probe.yaml.

    probex eval --probe config/probes/harmful-request --worker http://127.0.0.1:8100 --out out/eval.json
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import httpx
import numpy as np

from probes.artifact import ProbeFormatError, ReadPoint, load_probe
from probes.datasets import LabelledPrompt, load_all_known, resolve_refs
from probes.evaluate import evaluate_scores
from probes.probe_prompts import load_probe_prompts
from probex.served_scores import worker_failed, worker_model  # noqa: F401  (importable from here too)


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--probe", required=True, type=Path)
    parser.add_argument("--worker", required=True, help="URL of a probex worker serving this probe")
    parser.add_argument("--split", action="append", default=[], help="splits from probe.yaml (default: test, held_out)")
    parser.add_argument("--model-dir", type=Path, default=None, help="HF directory for the offline side")
    parser.add_argument("--out", type=Path, default=Path("out/eval-served.json"))
    parser.add_argument("--plots", type=Path, default=None,
                        help="write ROC curves and score histograms per class (PNG) into this directory")
    from probex.eval_operating import add_operating_arguments

    add_operating_arguments(parser)  # --benign ...: rates and recall at chosen false-positive rates


def served_raw(worker: str, texts: list[str], probe_name: str, model: str | None = None) -> np.ndarray:
    with httpx.Client(timeout=300) as client:
        model = model or worker_model(client, worker)
        values = []
        for text in texts:
            try:
                r = client.post(worker + "/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
                    "temperature": 0})
                r.raise_for_status()
            except httpx.HTTPError as exc:
                raise worker_failed(worker, exc) from None
            try:
                values.append(r.json()["probex"]["scores"][probe_name]["prompt"]["last_raw"])
            except (ValueError, LookupError, TypeError):
                raise SystemExit(f"probex eval: {worker} returned no prompt score for probe {probe_name!r}:"
                                 " is the worker serving this probe?") from None
    return np.asarray(values, dtype=np.float64)


def compare(probe_dir: Path, worker: str, splits: list[str], model_dir: Path) -> dict:
    from probes.extract_hf import extract_activations
    from probes.retention import split_refs

    try:
        probe = load_probe(probe_dir)
    except ProbeFormatError as exc:
        raise SystemExit(f"probex eval: {exc}") from None
    if probe.read is not ReadPoint.LAST_PROMPT_TOKEN:
        raise SystemExit("probex eval: served-vs-offline comparison is implemented for last_prompt_token probes")
    # Every refusal below comes before the offline extraction, which takes minutes.
    refs = {}
    for split in splits:
        try:
            refs[split] = split_refs(probe, split)
        except ValueError as exc:
            raise SystemExit(f"probex eval: {exc}") from None
    local = load_probe_prompts(probe_dir)
    worker = worker.rstrip("/")
    with httpx.Client(timeout=30) as client:
        model = worker_model(client, worker)
    # The built-in sets are fetched only if some ref is not in the probe's own prompts.jsonl.
    known = functools.cache(load_all_known)
    report: dict = {"probe": probe.name, "layer": probe.layer, "splits": {}}
    for split in splits:
        examples: list[LabelledPrompt] = resolve_refs(refs[split], known, local=local)
        texts, labels = [e.text for e in examples], np.asarray([e.label for e in examples])
        offline = probe.raw_score(extract_activations(texts, model_dir, [probe.layer], show_progress=False)[probe.layer].last)
        served = served_raw(worker, texts, probe.name, model)
        rel = np.abs(served - offline) / np.maximum(np.abs(offline), 1e-3)
        off_eval, srv_eval = evaluate_scores(offline, labels), evaluate_scores(served, labels)
        report.setdefault("_scores", {})[split] = (offline, served, labels)
        report["splits"][split] = {
            "prompts": len(texts),
            "offline": off_eval.as_dict(),
            "served": srv_eval.as_dict(),
            "auroc_abs_diff": abs(off_eval.auroc - srv_eval.auroc),
            "raw_max_rel_diff": float(rel.max()),
            "raw_max_abs_diff": float(np.abs(served - offline).max()),
        }
    return report


def plot(report: dict, probe_dir: Path, out_dir: Path) -> list[Path]:
    """Per split: ROC curves (served and offline) and histograms of served scores per class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from probes.evaluate import roc_curve
    from probes.scoring import calibrate

    probe = load_probe(probe_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for split, (offline, served, labels) in report["_scores"].items():
        fig, (roc, hist) = plt.subplots(1, 2, figsize=(11, 4.5), constrained_layout=True)
        for name, raw, style in (("offline (HF)", offline, "-"), ("served (worker)", served, "--")):
            fpr, tpr = roc_curve(raw, labels)
            roc.plot(fpr, tpr, style, lw=1.6, label=f"{name} AUROC {report['splits'][split][name.split()[0]]['auroc']:.4f}")
        roc.plot([0, 1], [0, 1], color="grey", lw=0.8, ls=":")
        roc.set_xlabel("false positive rate")
        roc.set_ylabel("true positive rate")
        roc.legend(fontsize=8, loc="lower right")
        scores = np.array([calibrate(r, probe.slope, probe.intercept) for r in served])
        bins = np.linspace(0, 1, 26)
        hist.hist(scores[labels == 0], bins=bins, alpha=0.6, label=f"benign ({(labels == 0).sum()})")
        hist.hist(scores[labels == 1], bins=bins, alpha=0.6, label=f"harmful ({(labels == 1).sum()})")
        hist.set_xlabel("served calibrated score")
        hist.set_ylabel("prompts")
        hist.legend(fontsize=8)
        fig.suptitle(f"{probe.name}: {split} split", fontsize=10)
        path = out_dir / f"eval-{probe.name}-{split}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def run_eval(args: argparse.Namespace) -> None:
    if args.benign:
        return run_eval_operating(args)
    from probes.models import fetch_model
    from probex.train_cli import served_model

    model_dir = args.model_dir or fetch_model("smollm2-135m-instruct")
    served_model(model_dir, "probex eval")  # a --model-dir that is no model is refused before any work
    if args.out.is_dir():
        raise SystemExit(f"probex eval: --out {args.out} is a directory; give a file path for the JSON")
    report = compare(args.probe, args.worker, args.split or ["test", "held_out"], model_dir)
    if args.plots:
        for path in plot(report, args.probe, args.plots):
            print(f"plot: {path}")
    report.pop("_scores")
    text = json.dumps(report, indent=1)
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    except OSError as exc:
        print(text)  # the served and offline scoring is not lost with the file
        raise SystemExit(f"probex eval: cannot write {args.out}: {exc.strerror or exc}") from None
    print("| split | prompts | AUROC offline | AUROC served | abs diff | max raw rel diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for split, r in report["splits"].items():
        print(f"| {split} | {r['prompts']} | {r['offline']['auroc']:.4f} | {r['served']['auroc']:.4f} "
              f"| {r['auroc_abs_diff']:.1e} | {r['raw_max_rel_diff']:.1e} |")
    print(f"JSON: {args.out}")


def run_eval_operating(args: argparse.Namespace) -> None:
    """`--benign` given: false-positive rates and recall from served scores; the offline side only with --split."""
    from probex.eval_operating import plot_sources, print_operating, run_operating

    if args.out.is_dir():
        raise SystemExit(f"probex eval: --out {args.out} is a directory; give a file path for the JSON")
    try:
        probe = load_probe(args.probe)
    except ProbeFormatError as exc:
        raise SystemExit(f"probex eval: {exc}") from None
    report = run_operating(args, probe)
    if args.split:
        from probes.models import fetch_model

        offline = compare(args.probe, args.worker, args.split, args.model_dir or fetch_model("smollm2-135m-instruct"))
        offline.pop("_scores")
        report["served_vs_offline"] = offline["splits"]
    if args.plots:
        print(f"plot: {plot_sources(report, args.plots)}")
    report.pop("_scores")
    write_report(args.out, report)
    print_operating(report)
    print(f"JSON: {args.out}")


def write_report(out: Path, report: dict) -> None:
    text = json.dumps(report, indent=1)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as exc:
        print(text)  # the scoring is not lost with the file
        raise SystemExit(f"probex eval: cannot write {out}: {exc.strerror or exc}") from None
