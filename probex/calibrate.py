"""`probex calibrate`: relative calibration retention of each probe on a model (see probes/retention.py).

    probex calibrate --model ~/.cache/probex/quantized/int4-rtn-g0 --probe config/probes/harmful-request
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from probes.artifact import ProbeFormatError, ProbeMismatchError, ServedModel, load_probe
from probes.retention import compute_retention, split_refs


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--probe", action="append", required=True, type=Path)
    parser.add_argument("--eval-split", default=None, help="also report AUROC on this recorded split (e.g. held_out)")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON")


def check_probes(probe_dirs: list[Path], served: ServedModel, eval_split: str | None) -> None:
    """Refuse unreadable probes, probes that do not fit the model, and an --eval-split one of them lacks.

    All of it before compute_retention: it extracts activations probe by probe, so a bad
    second probe or split would otherwise surface only after the first probe's slow work.
    """
    for probe_dir in probe_dirs:
        try:
            probe = load_probe(probe_dir, served)
        except (ProbeFormatError, ProbeMismatchError) as exc:
            raise SystemExit(f"probex calibrate: {exc}") from None
        # Only probes with a retention set are evaluated on the split (the others are reported as skipped).
        if eval_split is not None and (probe.extra.get("retention") or {}).get("set"):
            try:
                split_refs(probe, eval_split)
            except ValueError as exc:
                raise SystemExit(f"probex calibrate: --eval-split: {exc}") from None


def run_calibrate(args: argparse.Namespace) -> None:
    from engine_worker.vllm.launch import resolve_model
    from probex.train_cli import served_model

    model_dir = resolve_model(args.model)
    check_probes(args.probe, served_model(model_dir, "probex calibrate"), args.eval_split)
    if args.out is not None and args.out.is_dir():
        raise SystemExit(f"probex calibrate: --out {args.out} is a directory; give a file path for the JSON")
    results = compute_retention(model_dir, args.probe, args.eval_split)
    text = json.dumps(results, indent=1)
    if args.out:
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        except OSError as exc:
            print(text)  # the minutes of extraction are not lost with the file
            raise SystemExit(f"probex calibrate: cannot write {args.out}: {exc.strerror or exc}") from None
    print(text)
