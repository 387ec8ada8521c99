"""GPU smoke test of the tap: CUDA graphs on (default cudagraph_mode) vs enforce_eager.

Runs on the GPU machine (see docs/gpu.md): builds a randomly initialised model with
SmolLM2-135M's architecture (weights cannot travel; the tokenizer skeleton does), starts
`probex worker` three times with the same probes and capture mode on — graphs on
(default), compiled without CUDA graphs, and `--enforce-eager` — sends the same 8 prompts
concurrently to each, and compares every score and the captured residuals. Graphs vs
compiled-without-graphs isolates graph replay (same kernels); eager adds the kernel
differences between compiled and eager code. Writes `gpu_smoke.json` and the worker logs
to --out and prints a short table.

    python3 -m probex.gpu_smoke --skeleton .gpukit/model --out "$OUT"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from probex.processes import WorkerExited, wait_until_healthy

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "How do I kill a Python process that hangs?",
    "Explain photosynthesis to a ten-year-old in a few sentences please.",
    "List three prime numbers larger than 100.",
    "How do I build a bomb?",
    "Give me a recipe for pancakes with blueberries and maple syrup.",
    "Why is the sky blue?",
]
GRAPH_LOG_PATTERNS = [r"[Cc]apturing CUDA graph", r"Graph capturing finished", r"cudagraph"]


def build_model(skeleton: Path, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(skeleton)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    for f in skeleton.iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)


def build_probes(root: Path, hidden: int) -> list[Path]:
    from probes.artifact import ProbeArtifact, ReadPoint, save_probe

    rng = np.random.default_rng(7)
    specs = [("a10", 10, ReadPoint.LAST_PROMPT_TOKEN), ("b10", 10, ReadPoint.PROMPT_MAX),
             ("c20", 20, ReadPoint.PROMPT_MEAN)]
    return [
        save_probe(ProbeArtifact(name=n, layer=l, read=r, weight=rng.standard_normal(hidden).astype(np.float32)
                                 / np.sqrt(hidden), bias=0.1), root / n)
        for n, l, r in specs
    ]


async def query(url: str, model: str) -> list[dict]:
    import httpx

    async with httpx.AsyncClient(timeout=300) as client:
        async def one(prompt):
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
                    "temperature": 0, "return_token_ids": True, "vllm_xargs": {"probex_capture": True, "probex_recompute": True}}
            r = await client.post(url + "/v1/chat/completions", json=body)
            r.raise_for_status()
            return r.json()

        return await asyncio.gather(*(one(p) for p in PROMPTS))


PAIRS = ("graphs_vs_compiled_no_graphs", "graphs_vs_eager", "compiled_no_graphs_vs_eager")
MODES = {
    "graphs": [],
    "compiled_no_graphs": ["--compilation-config", '{"cudagraph_mode": "NONE"}'],
    "eager": ["--enforce-eager"],
}


def run_mode(name: str, model: Path, probes: list[Path], out: Path, extra: list[str],
             attention_backend: str = "FLASH_ATTN") -> tuple[list[dict], dict]:
    port = 8100 + list(MODES).index(name)
    capture = out / f"capture-{name}"
    log_path = out / f"worker-{name}.log"
    env = dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="0", VLLM_DISABLE_COMPILE_CACHE="1")
    cmd = [sys.executable, "-m", "probex.cli", "worker", "--model", str(model), "--port", str(port),
           *[f"--probe={p}" for p in probes], "--max-model-len", "1024", "--gpu-memory-utilization", os.environ.get("PROBEX_SMOKE_MEMORY", "0.3"),
           "--capture-dir", str(capture), *extra]
    if attention_backend:
        cmd += ["--attention-backend", attention_backend]
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            try:
                wait_until_healthy(proc, url)
            except WorkerExited as exc:
                raise RuntimeError(f"{name} {exc}: " + log_path.read_text()[-3000:]) from None
            ready_s = time.monotonic() - started
            responses = asyncio.run(query(url, str(model)))
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(60)
    text = log_path.read_text(errors="replace")
    graph_lines = [l[-200:] for l in text.splitlines() if any(re.search(p, l) for p in GRAPH_LOG_PATTERNS)]
    from safetensors.numpy import load_file

    for response in responses:
        (path,) = capture.glob(f"{response['id']}-*.safetensors")
        response["_captured"] = load_file(str(path))
    return responses, {"ready_s": round(ready_s, 1), "graph_log_lines": graph_lines[:8]}


def residual_cosines(a: list[dict], b: list[dict]) -> dict:
    if not all("_captured" in r for r in a + b):
        return {}  # a saved run: captures are not stored
    worst_last, worst_any = 1.0, 1.0
    for ra, rb in zip(a, b):
        for key, xa in ra["_captured"].items():
            xb = rb["_captured"][key]
            both_ran = ~(np.isnan(xa).any(1) | np.isnan(xb).any(1))  # prefix-cached rows never ran
            xa, xb = xa[both_ran], xb[both_ran]
            cos = (xa * xb).sum(1) / (np.linalg.norm(xa, axis=1) * np.linalg.norm(xb, axis=1))
            worst_last, worst_any = min(worst_last, float(cos[-1])), min(worst_any, float(cos.min()))
    return {"residual_cos_last_token_min": worst_last, "residual_cos_any_token_min": worst_any}


def compare(first: list[dict], second: list[dict]) -> dict:
    """Worst differences between two runs' scores for the same prompts.

    Generated scores are compared up to the first greedy divergence (+1: token j's score
    depends only on tokens < j). Prompt mean/max are compared only where both runs scored
    the same prompt rows: concurrent requests share the chat template's system prompt, so
    which of them hits the prefix cache depends on scheduling.
    """
    worst = {"prompt_last_raw_abs": 0.0, "prompt_aggregate_abs": 0.0, "generated_abs": 0.0}
    same_sequences = compared_generated = skipped_aggregates = 0
    for a, b in zip(first, second):
        ta, tb = a["choices"][0]["token_ids"], b["choices"][0]["token_ids"]
        common = 0
        while common < min(len(ta), len(tb)) and ta[common] == tb[common]:
            common += 1
        same_sequences += ta == tb
        for name, sa in a["probex"]["scores"].items():
            sb = b["probex"]["scores"][name]
            pa, pb = sa["prompt"], sb["prompt"]
            worst["prompt_last_raw_abs"] = max(worst["prompt_last_raw_abs"], abs(pa["last_raw"] - pb["last_raw"]))
            if pa["tokens_scored"] == pb["tokens_scored"]:
                for key in ("mean", "max"):
                    worst["prompt_aggregate_abs"] = max(worst["prompt_aggregate_abs"], abs(pa[key] - pb[key]))
            else:
                skipped_aggregates += 1
            n = min(common + 1, len(ta), len(tb))
            compared_generated += n
            if n:
                diffs = np.abs(np.subtract(sa["generated"]["scores"][:n], sb["generated"]["scores"][:n]))
                worst["generated_abs"] = max(worst["generated_abs"], float(diffs.max()))
    return {"identical_token_sequences": same_sequences, "compared_generated_scores": compared_generated,
            "aggregates_skipped_for_coverage": skipped_aggregates, **worst, **residual_cosines(first, second)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skeleton", type=Path, help="config.json + tokenizer files")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--reanalyze", type=Path, metavar="JSON",
                        help="recompute the comparison table from a saved gpu_smoke.json (no engine needed)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/probex-smoke"))
    parser.add_argument("--attention-backend", default="FLASH_ATTN", help="'' to let vLLM choose (CPU dry runs)")
    args = parser.parse_args()
    if args.reanalyze:
        saved = json.loads(args.reanalyze.read_text())
        report(saved, {pair: compare(*(saved["responses"][m] for m in pair.split("_vs_"))) for pair in PAIRS})
        return
    if not (args.skeleton and args.out):
        parser.error("--skeleton and --out are required unless --reanalyze is given")
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.work / "model"
    if not (model / "config.json").exists():
        build_model(args.skeleton, model)
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    probes = build_probes(args.work / "probes", hidden)
    runs = {name: run_mode(name, model, probes, args.out, extra, args.attention_backend)
            for name, extra in MODES.items()}
    result = {"modes": {name: info for name, (_, info) in runs.items()}}
    comparisons = {pair: compare(*(runs[m][0] for m in pair.split("_vs_"))) for pair in PAIRS}
    result.update(comparisons)
    for responses, _ in runs.values():
        for response in responses:
            response.pop("_captured")
    result["responses"] = {name: responses for name, (responses, _) in runs.items()}
    import torch
    import vllm

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU dry run)"
    result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__, "gpu": gpu}
    (args.out / "gpu_smoke.json").write_text(json.dumps(result, indent=1))
    report(result, comparisons)


def report(result: dict, comparisons: dict) -> None:
    print(f"versions: {result['versions']}")
    for name, info in result["modes"].items():
        captured = [l for l in info["graph_log_lines"] if "Capturing CUDA graphs" in l or "Graph capturing" in l]
        print(f"{name}: ready in {info['ready_s']} s; CUDA-graph capture log lines: {len(captured)}")
    print(f"{'pair':30} {'same seqs':>9} {'last raw':>9} {'mean/max':>9} {'generated':>9} {'cos last':>9} {'cos any':>9}")
    for pair, c in comparisons.items():
        print(f"{pair:30} {c['identical_token_sequences']:>6}/{len(PROMPTS)} {c['prompt_last_raw_abs']:9.2e} "
              f"{c['prompt_aggregate_abs']:9.2e} {c['generated_abs']:9.2e} {c.get('residual_cos_last_token_min', float('nan')):9.6f}"
              f" {c.get('residual_cos_any_token_min', float('nan')):9.6f}"
              f"  (aggregates skipped for different cache coverage: {c['aggregates_skipped_for_coverage']})")

if __name__ == "__main__":
    main()
