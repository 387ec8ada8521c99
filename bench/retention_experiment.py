"""The retention experiment: does one label-free scalar catch a quantization that broke the probe?

For the demo probe and the demo model this writes fake-quantized variants (`probex quantize`),
computes relative calibration retention on each (`probex calibrate`) and, for comparison,
the probe's AUROC (with a bootstrap 95% CI) on its held-out-source set — the labelled
measurement the retention scalar is meant to stand in for.

    .venv/bin/python -m bench.retention_experiment --out docs/results/retention.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from probes.retention import compute_retention
from probes.models import fetch_model
from probex.quantize import quantize_model

# (label, method, group size, compute dtype)
VARIANTS = [("original, fp32 compute", None, None, "float32"),
            ("original, bf16 compute", None, None, "bfloat16"),
            ("int8-rtn, groups of 64", "int8-rtn", 64, "float32"),
            ("int4-rtn, groups of 64", "int4-rtn", 64, "float32"),
            ("int4-rtn, one scale per row", "int4-rtn", 0, "float32"),
            ("int4-rtn, one scale per matrix", "int4-rtn", -1, "float32")]
PROBE = Path("config/probes/harmful-request")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results/retention.json"))
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "probex" / "quantized")
    args = parser.parse_args()
    base = fetch_model("smollm2-135m-instruct")
    rows = []
    for label, method, group, dtype in VARIANTS:
        model = base
        summary = {}
        if method:
            model = args.work / f"{method}-g{group}"
            if not (model / "probex-quantization.json").exists():
                quantize_model(base, method, group, model)
            summary = json.loads((model / "probex-quantization.json").read_text())
        result = compute_retention(model, [PROBE], eval_split="held_out", dtype=dtype)["harmful-request"]
        rows.append({"variant": label, "method": method, "group_size": group, "dtype": dtype,
                     "relative_weight_error": summary.get("relative_weight_error", 0.0), **result})
        print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print("| variant | weight error (rel.) | retention | held-out AUROC [95% CI] |")
    print("|---|---:|---:|---|")
    for r in rows:
        a = r["auroc_held_out"]
        print(f"| {r['variant']} | {r['relative_weight_error']:.3f} | {r['retention']:.3f} | "
              f"{a['auroc']:.3f} [{a['ci_low']:.3f}, {a['ci_high']:.3f}] |")


if __name__ == "__main__":
    main()
