"""GPU smoke test of the tap: CUDA graphs on (default cudagraph_mode) vs enforce_eager.

Runs on the GPU machine (see docs/gpu.md): builds a randomly initialised model with
SmolLM2-135M's architecture (weights cannot travel; the tokenizer skeleton does), starts
`probex worker` twice with the same probes — graphs on, then `--enforce-eager` — sends
the same 8 prompts concurrently to each, and compares every score. Writes
`gpu_smoke.json` and both worker logs to --out and prints a short table.

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
                    "temperature": 0, "return_token_ids": True}
            r = await client.post(url + "/v1/chat/completions", json=body)
            r.raise_for_status()
            return r.json()

        return await asyncio.gather(*(one(p) for p in PROMPTS))


def run_mode(name: str, model: Path, probes: list[Path], out: Path, extra: list[str]) -> tuple[list[dict], dict]:
    import httpx

    port = 8100 + (1 if name == "eager" else 0)
    log_path = out / f"worker-{name}.log"
    env = dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="0", VLLM_DISABLE_COMPILE_CACHE="1")
    cmd = [sys.executable, "-m", "probex.cli", "worker", "--model", str(model), "--port", str(port),
           *[f"--probe={p}" for p in probes], "--max-model-len", "1024", "--gpu-memory-utilization", "0.3",
           "--attention-backend", "FLASH_ATTN", *extra]
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} worker exited: " + log_path.read_text()[-3000:])
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(2)
            ready_s = time.monotonic() - started
            responses = asyncio.run(query(url, str(model)))
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(60)
    text = log_path.read_text(errors="replace")
    graph_lines = [l for l in text.splitlines() if any(re.search(p, l) for p in GRAPH_LOG_PATTERNS)]
    return responses, {"ready_s": round(ready_s, 1), "graph_log_lines": graph_lines[:8]}


def compare(graphs: list[dict], eager: list[dict]) -> dict:
    worst = {"prompt_rel": 0.0, "generated_abs": 0.0}
    same_tokens = 0
    compared_generated = 0
    for g, e in zip(graphs, eager):
        gt, et = g["choices"][0]["token_ids"], e["choices"][0]["token_ids"]
        common = 0
        while common < min(len(gt), len(et)) and gt[common] == et[common]:
            common += 1
        same_tokens += gt == et
        for name, gs in g["probex"]["scores"].items():
            es = e["probex"]["scores"][name]
            for key in ("last_raw",):
                a, b = gs["prompt"][key], es["prompt"][key]
                worst["prompt_rel"] = max(worst["prompt_rel"], abs(a - b) / max(abs(b), 1e-3))
            for key in ("mean", "max", "last"):
                worst["generated_abs"] = max(worst["generated_abs"], abs(gs["prompt"][key] - es["prompt"][key]))
            # Scores of token j depend only on tokens < j: comparable up to the first divergence + 1.
            n = min(common + 1, len(gt), len(et))
            diffs = np.abs(np.subtract(gs["generated"]["scores"][:n], es["generated"]["scores"][:n]))
            compared_generated += n
            if n:
                worst["generated_abs"] = max(worst["generated_abs"], float(diffs.max()))
    return {"identical_token_sequences": same_tokens, "compared_generated_scores": compared_generated, **worst}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skeleton", type=Path, required=True, help="config.json + tokenizer files")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/probex-smoke"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.work / "model"
    if not (model / "config.json").exists():
        build_model(args.skeleton, model)
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    probes = build_probes(args.work / "probes", hidden)
    graphs, graphs_info = run_mode("graphs", model, probes, args.out, [])
    eager, eager_info = run_mode("eager", model, probes, args.out, ["--enforce-eager"])
    result = {
        "graphs": graphs_info,
        "eager": eager_info,
        "comparison": compare(graphs, eager),
        "responses": {"graphs": graphs, "eager": eager},
    }
    import torch
    import vllm

    result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    (args.out / "gpu_smoke.json").write_text(json.dumps(result, indent=1))
    c = result["comparison"]
    print(f"versions: {result['versions']}")
    print(f"graph log lines (graphs run): {len(graphs_info['graph_log_lines'])}; eager run: {len(eager_info['graph_log_lines'])}")
    for line in graphs_info["graph_log_lines"][:4]:
        print("   ", line[-160:])
    print(f"identical greedy sequences: {c['identical_token_sequences']}/{len(PROMPTS)}")
    print(f"worst prompt last_raw relative diff: {c['prompt_rel']:.2e}")
    print(f"worst calibrated score abs diff ({c['compared_generated_scores']} generated scores + prompt scores): {c['generated_abs']:.2e}")


if __name__ == "__main__":
    main()
