"""GPU check of tensor parallelism: the tap and steering at TP=2 against TP=1 (needs two GPUs).

Runs on the 2-GPU machine (docs/gpu.md). The model has Llama-3.1-8B's architecture with random
weights saved once as a checkpoint that every engine loads: `--load-format dummy` would let each
rank initialise its own shards, so TP=2 and TP=1 would not serve the same weights.

Engines, all with CUDA graphs (vLLM's default FULL_AND_PIECEWISE), started together (TP=1 on GPU 0):

- `v1-tp1`, `v1-tp2`, `v2-tp1`, `v2-tp2`: model runner V1 / V2 forced, one or two GPUs;
- `auto-tp2-sp`: two GPUs, runner left to vLLM, and sequence parallelism plus async TP asked for
  in `--compilation-config`. ProbeX must turn both off before vLLM plans around them (log line),
  so vLLM keeps its default runner and the scores still match TP=1.

Each engine answers the steering smoke's batch (`bench.gpu_steer_smoke`: 8 prompts x plain,
alpha 0, steered, gated, generation-only, one batch) with probes at layers 10 and 20 and the
steering vector at layer 10; the steering strength and gate bias are measured once, by `v2-tp1`.
TP=2 is then compared with TP=1 per runner: tokens, prompt scores, generated scores up to the
first token where the two runs part (bf16 all-reduce sums in another order than one GPU's GEMM),
and where they part, how near a tie each run was (top-2 logprob gap) and whether the gate
decided a generated token differently. The gated requests also capture their prompt rows at
the gate's layer, and the gate probe's score on every prompt row, recomputed from them, is
compared across the two runs (rows within ~1e-4 of the threshold may have gone the other way
on the device).

    python3 -m bench.gpu_tp_smoke --skeleton .gpukit/model --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import numpy as np

from bench.gpu_smoke import run_jobs
from bench.gpu_steer_smoke import GATE_THRESHOLD, VARIANTS, SharedSettings, analyse, build_artifacts, run_engine

# label -> (tensor-parallel size, VLLM_USE_V2_MODEL_RUNNER or None for vLLM's choice, extra worker args)
SEQUENCE_PARALLEL_ASKED = ["--compilation-config", json.dumps({"pass_config": {"enable_sp": True,
                                                                               "fuse_gemm_comms": True}})]
ENGINES: dict[str, tuple[int, str | None, list[str]]] = {
    "v2-tp1": (1, "1", []),
    "v2-tp2": (2, "1", []),
    "v1-tp1": (1, "0", []),
    "v1-tp2": (2, "0", []),
    "auto-tp2-sp": (2, None, SEQUENCE_PARALLEL_ASKED),
}
PAIRS = (("v2-tp1", "v2-tp2"), ("v1-tp1", "v1-tp2"), ("v2-tp1", "auto-tp2-sp"), ("v1-tp2", "v2-tp2"))
LOG_PATTERNS = {
    "sequence_parallel_turned_off": r"probex: turned off .*while tapping",
    "runner_v2": r"Using V2 Model Runner|tap attached to vLLM model runner V2",
    "runner_v2_refused": r"Model Runner V2 does not yet support",
    "taps_built": r"probex: tapping decoder layer",
}


def build_checkpoint(skeleton: Path, dest: Path) -> None:
    """Llama-3.1-8B config + tokenizer of `skeleton` + random bf16 weights (HF initialisation, on the GPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.bench_engine import LLAMA_3_1_8B, write_model_dir

    write_model_dir(LLAMA_3_1_8B, skeleton, dest)
    config = LlamaConfig.from_pretrained(dest)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(dest)  # rewrites config.json with the same values
    del model


def log_facts(path: Path) -> dict:
    text = path.read_text(errors="replace")
    facts: dict = {}
    for key, pattern in LOG_PATTERNS.items():
        lines = [l[-240:] for l in text.splitlines() if re.search(pattern, l)]
        facts[key] = {"count": len(lines), "first": lines[0] if lines else None}
    return facts


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def parting(prompt: int, token: int, a: dict, b: dict) -> dict:
    """Where two runs' greedy tokens part: how near a tie each run was there (top-2 logprob
    gap) and whether the gate (probe a10 > threshold) decided any generated token up to it
    differently. Prompt rows are gated too, but their per-row scores are not delivered."""
    gap = lambda r: (r.get("top2_gap") or [None] * (token + 1))[token]
    ga, gb = a["scores"]["a10"]["generated"][: token + 1], b["scores"]["a10"]["generated"][: token + 1]
    return {"prompt": prompt, "token": token, "top2_gap": [gap(a), gap(b)],
            "gate_decisions_differ_at": [j for j, (x, y) in enumerate(zip(ga, gb))
                                         if (x > GATE_THRESHOLD) != (y > GATE_THRESHOLD)],
            "closest_gate_score_to_threshold": min((abs(x - GATE_THRESHOLD) for x in ga + gb), default=None)}


def gate_row_flips(one: dict, two: dict, variant: str = "gated") -> dict | None:
    """Prompt rows the gate decided differently in two runs (from `gate_prompt_rows`): each
    with both raw scores, against how far the two runs' raw scores are apart anywhere."""
    if "gate_prompt_rows" not in one or "gate_prompt_rows" not in two:
        return None
    threshold = one["gate_prompt_rows"]["threshold_raw"]
    flips, largest_difference, closest = [], 0.0, float("inf")
    for prompt, (a, b) in enumerate(zip(one["gate_prompt_rows"]["raw"][variant], two["gate_prompt_rows"]["raw"][variant])):
        for row, (x, y) in enumerate(zip(a, b)):
            largest_difference = max(largest_difference, abs(x - y))
            closest = min(closest, abs(x - threshold), abs(y - threshold))
            if (x > threshold) != (y > threshold):
                flips.append({"prompt": prompt, "row": row, "raw": [x, y]})
    return {"threshold_raw": threshold, "rows_decided_differently": flips,
            "prompts_with_a_flip": sorted({f["prompt"] for f in flips}),
            "largest_raw_difference": largest_difference, "closest_row_to_threshold": closest}


def compare_tp(one: dict, two: dict) -> dict:
    """TP=1 vs TP=2 per variant: tokens, prompt scores (all read points), generated scores up to divergence."""
    out = {}
    for variant in VARIANTS:
        pairs = list(zip(one["responses"][variant], two["responses"][variant]))
        prompt_diffs, generated_diffs, spread, prefix, partings = [], [], [], [], []
        for i, (a, b) in enumerate(pairs):
            n = common_prefix(a["tokens"], b["tokens"])
            prefix.append(n)
            if n < min(len(a["tokens"]), len(b["tokens"])):
                partings.append(parting(i, n, a, b))
            for name in a["scores"]:
                pa, pb = a["scores"][name]["prompt"], b["scores"][name]["prompt"]
                prompt_diffs += [abs(pa[k] - pb[k]) for k in ("last_raw", "mean", "max")]
                spread.append(pa["last_raw"])
                ga, gb = a["scores"][name]["generated"], b["scores"][name]["generated"]
                upto = min(n + 1, len(ga), len(gb))  # token j's score depends on tokens < j only
                generated_diffs += [abs(x - y) for x, y in zip(ga[:upto], gb[:upto])]
        out[variant] = {
            "identical_sequences": sum(a["tokens"] == b["tokens"] for a, b in pairs),
            "common_prefix_tokens": prefix,
            "max_abs_prompt_score_diff": max(prompt_diffs),
            "max_abs_generated_score_diff": max(generated_diffs, default=0.0),
            "compared_generated_scores": len(generated_diffs),
            "partings": partings,
            # the scale the differences are small against: spread of last-prompt raw scores
            "prompt_last_raw_std": float(np.std(spread)),
        }
    flips = gate_row_flips(one, two)
    if flips is not None:
        out["gated"]["gate_prompt_rows"] = flips
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skeleton", type=Path, help="tokenizer files (config.json is replaced by Llama-3.1-8B's)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/probex-tp-smoke"))
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"subset of {','.join(ENGINES)}")
    parser.add_argument("--attention-backend", default="FLASH_ATTN")
    parser.add_argument("--dtype", default="", help="float32 (with --attention-backend TRITON_ATTN and at most two"
                        " engines, v2-tp1,v2-tp2: 32 GB of weights each): compares tokens without bf16 rounding in the way")
    parser.add_argument("--reanalyze", type=Path, metavar="JSON", help="recompute the tables of a saved gpu_tp_smoke.json")
    args = parser.parse_args()
    if args.reanalyze:
        saved = json.loads(args.reanalyze.read_text())
        saved["tp_pairs"] = tp_pairs(saved["runs"])
        args.reanalyze.write_text(json.dumps(saved, indent=1) + "\n")
        report(saved)
        return
    if not (args.skeleton and args.out):
        parser.error("--skeleton and --out are required unless --reanalyze is given")
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.work / "model"
    if not any(model.glob("*.safetensors")):
        build_checkpoint(args.skeleton, model)
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    probes, vector = build_artifacts(args.work / "artifacts", hidden)
    settings = SharedSettings()
    labels = args.engines.split(",")

    def run(label: str) -> dict:
        tp, runner, extra = ENGINES[label]
        env = dict(os.environ)
        env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        if runner is not None:
            env["VLLM_USE_V2_MODEL_RUNNER"] = runner
        port = 8500 + list(ENGINES).index(label)
        extra = [*extra, "--dtype", args.dtype] if args.dtype else extra
        result = run_engine(label, port, env, ["--tensor-parallel-size", str(tp), *extra], model, probes, vector,
                            args.out, settings, measures=label == labels[0],
                            attention_backend=args.attention_backend, parallel=True, capture_variants=("gated",))
        result["log"] = log_facts(args.out / f"worker-{label}.log")
        return result

    result: dict = {"engines": {l: {"tensor_parallel_size": ENGINES[l][0], "runner_env": ENGINES[l][1],
                                    "extra_args": ENGINES[l][2]} for l in labels}}
    result["runs"] = dict(zip(labels, run_jobs(run, labels, parallel=True)))
    analyse_within(result)
    result["tp_pairs"] = tp_pairs(result["runs"])
    import torch
    import vllm

    result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__,
                          "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    (args.out / "gpu_tp_smoke.json").write_text(json.dumps(result, indent=1) + "\n")
    report(result)


def analyse_within(result: dict) -> None:
    """The steering smoke's checks inside each engine (alpha 0 == plain, gate opens on some tokens, ...)."""
    probe = {"runs": result["runs"]}
    analyse(probe, runners=[], modes=[])
    result["within"] = probe["within"]


def tp_pairs(runs: dict) -> dict:
    return {f"{a} vs {b}": compare_tp(runs[a], runs[b]) for a, b in PAIRS if a in runs and b in runs}


def report(result: dict) -> None:
    for label, run in result["runs"].items():
        log = run.get("log", {})
        print(f"{label}: ready {run['ready_s']} s; log: " + ", ".join(f"{k} x{v['count']}" for k, v in log.items()))
        margin = (run.get("settings") or {}).get("gate_margin")
        if margin is not None:  # runs saved before the gate was placed in a gap have none
            print(f"   gate threshold placed {margin:.3g} (raw score) away from the nearest of the "
                  f"{run['settings'].get('gate_rows')} prompt rows it was calibrated on")
        if label in result.get("within", {}):
            w = result["within"][label]
            print(f"   zero==plain {w['zero_tokens_equal_plain']}/{w['prompts']}, steered differ "
                  f"{w['steered_tokens_differ']}, gate open per prompt {w['gate_open_generated_tokens']}")
    print(f"{'pair':26} {'variant':10} {'same seqs':>9} {'prompt diff':>11} {'gen diff':>9} {'score std':>9}  prefix")
    for pair, per_variant in result["tp_pairs"].items():
        for variant, c in per_variant.items():
            print(f"{pair:26} {variant:10} {c['identical_sequences']:>9} {c['max_abs_prompt_score_diff']:11.2e} "
                  f"{c['max_abs_generated_score_diff']:9.2e} {c['prompt_last_raw_std']:9.2e}  {c['common_prefix_tokens']}")
            for p in c.get("partings", []):
                gaps = ", ".join("n/a" if g is None else f"{g:.2e}" for g in p["top2_gap"])
                print(f"{'':37} prompt {p['prompt']} parts at token {p['token']}: top-2 logprob gap {gaps};"
                      f" gate decisions differ at {p['gate_decisions_differ_at']}")
            rows = c.get("gate_prompt_rows")
            if rows:
                print(f"{'':37} prompt rows the gate decided differently: {len(rows['rows_decided_differently'])}"
                      f" (prompts {rows['prompts_with_a_flip']}), raw scores at most"
                      f" {rows['largest_raw_difference']:.2e} apart; closest row to the threshold"
                      f" {rows['closest_row_to_threshold']:.2e}")
    if "versions" in result:
        print(result["versions"])


if __name__ == "__main__":
    main()
