"""`probex calibrate`: relative calibration retention of each probe on a model (see probes/retention.py).

    probex calibrate --model ~/.cache/probex/quantized/int4-rtn-g0 --probe config/probes/harmful-request
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from probes.retention import compute_retention


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--probe", action="append", required=True, type=Path)
    parser.add_argument("--eval-split", default=None, help="also report AUROC on this recorded split (e.g. held_out)")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON")


def run_calibrate(args: argparse.Namespace) -> None:
    from engine_worker.launch import resolve_model

    results = compute_retention(resolve_model(args.model), args.probe, args.eval_split)
    text = json.dumps(results, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
