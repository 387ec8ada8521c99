"""The probe alone, the judge alone and the probe -> judge cascade on a labelled test split.

Every prompt is scored by a running worker (its `probex` prompt score for `--probe`) and asked of
the judge as the gateway asks it (`gateway.judge`, the `judge:` section of `--policy` or the
defaults; by default the judge is the worker itself). Then, on the same answers:

- probe alone: positive at or above the threshold that flags `--fpr` of this split's benign
  prompts (recall at the realised false-positive rate);
- judge alone: positive when the judge's decision is block (or flag), failures counted by `on_failure`;
- cascade: positive at or above `--band-to`, the judge's decision between `--band-from` and
  `--band-to`, negative below; judge calls per 100 requests and the judge's latency per
  escalated request (the time the gateway holds such a request) at p50 / p99.

    python -m bench.cascade_eval --split test.jsonl --worker http://127.0.0.1:8100 --probe harmful-request \\
        --fpr 0.01 --band-from 0.3 --band-to 0.9 --out cascade.json

The split is JSONL or CSV with `text` and `label` (1 = should be caught).
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

from gateway.judge import JudgeClient, judge_mark
from gateway.judge_settings import JudgeSettings
from gateway.policy import Decision
from probes.operating_points import realised_rate, threshold_for_rate


def read_split(path: Path) -> list[tuple[str, int]]:
    if path.suffix == ".csv":
        with path.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(str(r["text"]), int(r["label"])) for r in rows]


async def probe_score(http: httpx.AsyncClient, worker: str, model: str, probe: str, text: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0}
    r = await http.post(worker + "/v1/chat/completions", json=body)
    r.raise_for_status()
    return float(r.json()["probex"]["scores"][probe]["score"])


def rates(predicted: np.ndarray, labels: np.ndarray) -> dict:
    positives, negatives = labels == 1, labels == 0
    return {"recall": float(predicted[positives].mean()) if positives.any() else None,
            "fpr": float(predicted[negatives].mean()) if negatives.any() else None}


async def evaluate(args: argparse.Namespace) -> dict:
    split = read_split(Path(args.split))
    settings = JudgeSettings.model_validate((yaml.safe_load(Path(args.policy).read_text()) or {}).get("judge") or {}) \
        if args.policy else JudgeSettings()
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        model = args.model or (await http.get(args.worker + "/v1/models")).json()["data"][0]["id"]
        judge = JudgeClient(judge_mark(None))
        scores, outcomes = [], []
        try:
            for text, _ in split:
                scores.append(await probe_score(http, args.worker, model, args.probe, text))
                body = {"model": model, "messages": [{"role": "user", "content": text}]}
                outcomes.append(await judge.ask(settings, settings.url or args.worker, settings.model or model, body))
        finally:
            await judge.close()
    labels = np.array([label for _, label in split])
    score = np.array(scores)
    fail_closed = settings.on_failure == "fail_closed"
    judged = np.array([(o.decision is not None and o.decision is not Decision.ALLOW) or (o.decision is None and fail_closed)
                       for o in outcomes])
    threshold = threshold_for_rate(score[labels == 0], args.fpr) if (labels == 0).any() else float("nan")
    in_band = (score >= args.band_from) & (score < args.band_to)
    cascade = np.where(score >= args.band_to, True, np.where(in_band, judged, False))
    latencies = np.array([o.latency_s for o in outcomes])[in_band]
    return {
        "prompts": len(split), "positives": int((labels == 1).sum()), "negatives": int((labels == 0).sum()),
        "model": model, "probe": args.probe, "judge": settings.model_dump(exclude={"instructions", "question"}),
        "probe_alone": {"target_fpr": args.fpr, "threshold": threshold,
                        "realised_benign_rate": realised_rate(score[labels == 0], threshold),
                        **rates(score >= threshold, labels)},
        "judge_alone": {**rates(judged, labels), "failures": sum(o.decision is None for o in outcomes)},
        "cascade": {"band": {"from": args.band_from, "to": args.band_to}, **rates(cascade, labels),
                    "judge_calls_per_100_requests": 100.0 * float(in_band.mean()),
                    "added_latency_s": {"p50": float(np.percentile(latencies, 50)) if len(latencies) else None,
                                        "p99": float(np.percentile(latencies, 99)) if len(latencies) else None}},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", required=True, help="JSONL or CSV with text and label")
    parser.add_argument("--worker", required=True, help="a running probex worker, e.g. http://127.0.0.1:8100")
    parser.add_argument("--probe", required=True)
    parser.add_argument("--model", help="default: the worker's first model")
    parser.add_argument("--policy", help="a policy file whose judge section to use (default: the defaults)")
    parser.add_argument("--fpr", type=float, default=0.01, help="the probe-alone threshold's false-positive rate")
    parser.add_argument("--band-from", type=float, required=True)
    parser.add_argument("--band-to", type=float, required=True)
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
