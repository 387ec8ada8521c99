"""HF transformers in fp32 on the TP smoke's checkpoint: how far each engine's bf16 scores are from exact.

TP=1 and TP=2 in bf16 differ from each other; the question is whether TP=2 is further from the
exact computation than TP=1. Run on the GPU machine after `bench.gpu_tp_smoke` (same --work):

    python3 -m bench.gpu_tp_reference --smoke-json gpu_tp_smoke.json --out reference.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bench.gpu_smoke import PROMPTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke-json", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/probex-tp-smoke"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reanalyze", action="store_true",
                        help="recompute the errors from the reference already in --out (no model, no GPU)")
    args = parser.parse_args()
    smoke = json.loads(args.smoke_json.read_text())
    if args.reanalyze:
        result = json.loads(args.out.read_text())
        result["max_abs_error_vs_fp32"] = errors_against(result["reference_fp32"], smoke)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        report(result)
        return
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from probes.artifact import load_probe
    from probes.steering import load_vector

    model_dir = args.work / "model"
    probes = {n: load_probe(args.work / "artifacts" / n) for n in ("a10", "c20")}
    vector = load_vector(args.work / "artifacts" / "rand10")
    alpha = smoke["runs"][next(iter(smoke["runs"]))]["settings"]["alpha"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).to("cuda").eval()
    delta = torch.tensor(alpha * np.asarray(vector.vector, dtype=np.float32), device="cuda")
    steering = {"on": False}

    def add_delta(_module, _inputs, output):
        if not steering["on"]:
            return output
        if isinstance(output, tuple):
            return (output[0] + delta,) + tuple(output[1:])
        return output + delta

    model.model.layers[vector.layer].register_forward_hook(add_delta)
    reference: dict[str, list[float]] = {}
    for variant in ("plain", "steered"):
        steering["on"] = variant == "steered"
        for name in probes:
            reference[f"{variant}/{name}"] = []
        for prompt in PROMPTS:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            with torch.no_grad():
                out = model(torch.tensor([ids], device="cuda"), output_hidden_states=True)
            for name, probe in probes.items():
                h = out.hidden_states[probe.layer + 1][0, -1].double().cpu().numpy()
                reference[f"{variant}/{name}"].append(float(h @ probe.weight.astype(np.float64) + probe.bias))
    for name, probe in probes.items():
        if probe.layer <= vector.layer:  # read before the write: steering does not move it
            reference[f"steered/{name}"] = reference[f"plain/{name}"]
    result = {"reference_fp32": reference, "alpha": alpha,
              "score_std": {k: float(np.std(v)) for k, v in reference.items()},
              "max_abs_error_vs_fp32": errors_against(reference, smoke)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    report(result)


def errors_against(reference: dict[str, list[float]], smoke: dict) -> dict[str, dict[str, float]]:
    """Per engine and variant/probe: max over prompts of |served last-prompt raw score - fp32 reference|."""
    errors: dict[str, dict[str, float]] = {}
    for label, run in smoke["runs"].items():
        errors[label] = {}
        for key, want in reference.items():
            variant, name = key.split("/")
            got = [r["scores"][name]["prompt"]["last_raw"] for r in run["responses"][variant]]
            errors[label][key] = float(np.max(np.abs(np.subtract(got, want))))
    return errors


def report(result: dict) -> None:
    print("max |served last_raw - HF fp32| per engine; spread (std) of the reference scores:",
          {k: round(v, 2) for k, v in result["score_std"].items()})
    for label, e in result["max_abs_error_vs_fp32"].items():
        print(f"{label:12}", "  ".join(f"{k} {v:.3f}" for k, v in e.items()))


if __name__ == "__main__":
    main()
