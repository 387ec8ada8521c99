"""GPU smoke test of the tap: CUDA graphs on vs off, on both vLLM model runners.

Runs on the GPU machine (see docs/gpu.md): builds a randomly initialised model with
SmolLM2-135M's architecture (weights cannot travel; the tokenizer skeleton does) and, for
each model runner (V1, V2), starts `probex worker` three times with the same probes and
capture mode on — `graphs` (vLLM's default cudagraph_mode, FULL_AND_PIECEWISE: FULL
graphs for decode batches, piecewise graphs for prefill), `piecewise` (PIECEWISE only)
and `eager` (`--enforce-eager`). It sends the same 8 prompts concurrently, with different
`max_tokens` so decode batches shrink one request at a time and get padded up to the
next captured graph size, and compares every score and the captured residuals.

A teacher-forced check runs in each graphs-mode engine: generated token j's score
(read at the row that sampled it, position P-1+j) must equal the last-prompt-token score
of a new request whose prompt is the original prompt plus the first j generated tokens.
That catches any off-by-one in the row -> request/token mapping, which same-code
comparisons between modes cannot see.

Writes `gpu_smoke.json` and the worker logs to --out and prints a short table.

    python3 -m bench.gpu_smoke --skeleton .gpukit/model --out "$OUT"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from probex.processes import logged_worker

# This run's workers' admin token (on 127.0.0.1 only): capture and recompute are engine
# controls, which a worker takes only with it. Handed over in the environment.
ADMIN_TOKEN = secrets.token_urlsafe(24)
CONTROLS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

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


def max_tokens_for(index: int) -> int:
    return 12 + 2 * index  # requests finish one by one: decode batches of 8, 7, ..., 1


async def query(url: str, model: str) -> list[dict]:
    import httpx

    async with httpx.AsyncClient(timeout=300, headers=CONTROLS) as client:
        async def one(index, prompt):
            body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens_for(index), "temperature": 0, "return_token_ids": True,
                    "vllm_xargs": {"probex_capture": True, "probex_recompute": True}}
            r = await client.post(url + "/v1/chat/completions", json=body)
            r.raise_for_status()
            return r.json()

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))


TEACHER_FORCED_TOKENS = (0, 1, 5, 11)


async def teacher_forced(url: str, model: str) -> dict:
    """Generated token j's served score vs the last-prompt score of prompt + generated[:j].

    Sampled (temperature 1, seeded) rather than greedy: a random-weight model repeats one
    token greedily, and neighbouring tokens then have the same scores, which would hide an
    off-by-one. Scores are compared calibrated (the response carries generated scores
    calibrated; both sides use the same slope and intercept).
    """
    import httpx

    async with httpx.AsyncClient(timeout=300, headers=CONTROLS) as client:
        async def sample(index, prompt):
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
                    "temperature": 1.0, "seed": 100 + index, "return_token_ids": True,
                    "vllm_xargs": {"probex_recompute": True}}
            r = await client.post(url + "/v1/chat/completions", json=body)
            r.raise_for_status()
            return r.json()

        async def forced(response, j):
            prompt = response["prompt_token_ids"] + response["choices"][0]["token_ids"][:j]
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "vllm_xargs": {"probex_recompute": True}}
            r = await client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            return forced_pairs(response["probex"]["scores"], r.json()["probex"]["scores"], j)

        sampled = await asyncio.gather(*(sample(i, p) for i, p in enumerate(PROMPTS[:4])))
        jobs = [forced(r, j) for r in sampled for j in TEACHER_FORCED_TOKENS if j < len(r["choices"][0]["token_ids"])]
        results = [pair for pairs in await asyncio.gather(*jobs) for pair in pairs]
    return teacher_forced_summary(results)


def forced_pairs(sampled: dict, forced: dict, j: int) -> list[tuple[float, list[float]]]:
    """Per probe: (|forced last-prompt score - generated score j|, the same against tokens j-1
    and j+1), from the `probex.scores` of the sampled response and of the forced request."""
    out = []
    for name, entry in sampled.items():
        scores = entry["generated"]["scores"]
        want = forced[name]["prompt"]["last"]
        others = [abs(want - scores[k]) for k in (j - 1, j + 1) if 0 <= k < len(scores)]
        out.append((abs(want - scores[j]), others))
    return out


def teacher_forced_summary(results: list[tuple[float, list[float]]]) -> dict:
    same = [d for d, _ in results]
    shifted = [o for _, others in results for o in others]
    return {"compared": len(same), "max_abs_diff": max(same),
            "median_abs_diff_one_token_off": float(np.median(shifted)) if shifted else None,
            # an off-by-one would make the neighbour the better match
            "closest_to_own_token": sum(d < min(others) for d, others in results if others),
            "with_neighbours": sum(1 for _, others in results if others)}


MODES = {
    "graphs": [],  # vLLM's default: FULL_AND_PIECEWISE
    "piecewise": ["--compilation-config", '{"cudagraph_mode": "PIECEWISE"}'],
    "eager": ["--enforce-eager"],
}
PAIRS = ("graphs_vs_eager", "piecewise_vs_eager", "graphs_vs_piecewise")
RUNNERS = {"v1": "0", "v2": "1"}  # VLLM_USE_V2_MODEL_RUNNER


def side_by_side(env: dict[str, str]) -> list[str]:
    """What engines starting on one GPU at the same time need: sets `env`, returns worker options."""
    env["VLLM_DISABLE_COMPILE_CACHE"] = "1"  # engines compiling at once must not share cache files
    # A fixed KV cache skips vLLM's memory profiling, which assumes no other process changes
    # its GPU memory meanwhile (it asserts so) - untrue for engines starting together.
    return ["--kv-cache-memory-bytes", str(2 << 30)]


def run_jobs(run: Callable[[Any], Any], jobs: Sequence[Any], parallel: bool) -> list[Any]:
    """`run(job)` for every job, all at once in threads (`parallel`) or one after another."""
    if not parallel:
        return [run(job) for job in jobs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, jobs))


def run_mode(runner: str, name: str, model: Path, probes: list[Path], out: Path, extra: list[str],
             attention_backend: str = "FLASH_ATTN", parallel: bool = False) -> tuple[list[dict], dict]:
    label = f"{runner}-{name}"
    port = 8100 + list(MODES).index(name) + 10 * list(RUNNERS).index(runner)
    capture = out / f"capture-{label}"
    log_path = out / f"worker-{label}.log"
    # Run one after the other, the compile cache stays on: the machine starts empty and every
    # run has the same tap configuration (part of the cache key), so later starts reuse graphs.
    env = dict(os.environ, VLLM_USE_V2_MODEL_RUNNER=RUNNERS[runner], PROBEX_ADMIN_TOKEN=ADMIN_TOKEN)
    cmd = [sys.executable, "-m", "probex.cli", "worker", "--model", str(model), "--port", str(port),
           *[f"--probe={p}" for p in probes], "--max-model-len", "1024",
           "--gpu-memory-utilization", os.environ.get("PROBEX_SMOKE_MEMORY", "0.3"),
           "--capture-dir", str(capture), *extra]
    if attention_backend:
        cmd += ["--attention-backend", attention_backend]
    if parallel:
        cmd += side_by_side(env)
    forced = None
    url = f"http://127.0.0.1:{port}"
    with logged_worker(cmd, env, log_path, url, label) as ready_s:
        score_consumer = worker_transfer(url).get("consumer")
        responses = asyncio.run(query(url, str(model)))
        if name == "graphs":
            try:
                forced = asyncio.run(teacher_forced(url, str(model)))
            except Exception as exc:  # keep the mode comparison even if this check breaks
                forced = {"error": repr(exc)[:500]}
        transfer = worker_transfer(url)
    text = log_path.read_text(errors="replace")
    graph_lines = [l[-200:] for l in text.splitlines() if any(re.search(p, l) for p in GRAPH_LOG_PATTERNS)]
    runner_lines = [l[-200:] for l in text.splitlines() if "Using V2 Model Runner" in l or "tap attached to vLLM model runner V2" in l]
    from safetensors.numpy import load_file

    for response in responses:
        (path,) = capture.glob(f"{response['id']}-*.safetensors")
        response["_captured"] = load_file(str(path))
    info = {"ready_s": round(ready_s, 1), "graph_log_lines": graph_lines[:8], "runner_log_lines": runner_lines[:4],
            "score_consumer": score_consumer,
            # prompt steps whose scores were copied out during their forward, of all steps
            "mid_forward_steps": transfer.get("mid_forward_steps"), "steps": transfer.get("submitted_steps", transfer.get("steps"))}
    if forced is not None:
        info["teacher_forced"] = forced
    return responses, info


def worker_transfer(url: str) -> dict:
    """The `transfer` section of the worker's /probex/probes listing (which thread consumed the
    scores, how many prompt steps were copied mid-forward), so a saved smoke says which path it
    checked; empty if the worker did not say."""
    import httpx

    try:
        return httpx.get(url + "/probex/probes", timeout=30).json().get("transfer") or {}
    except (httpx.HTTPError, ValueError):
        return {}


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


def reanalyzed_comparisons(saved: dict) -> dict:
    """A saved run's comparisons recomputed from its responses. The residual cosines need the
    captured activations, which are not stored: those are taken from the run's own comparisons."""
    comparisons = all_comparisons(saved["responses"])
    for pair, comparison in comparisons.items():
        recorded = saved.get("comparisons", {}).get(pair, {})
        for key in ("residual_cos_last_token_min", "residual_cos_any_token_min"):
            if key not in comparison and key in recorded:
                comparison[key] = recorded[key]
    return comparisons


FIRST_RUN_PAIRS = ("graphs_vs_compiled_no_graphs", "graphs_vs_eager", "compiled_no_graphs_vs_eager")


def all_comparisons(responses: dict[str, list[dict]]) -> dict:
    if "graphs" in responses:  # the first saved run: V1 only, modes without a runner prefix
        return {pair: compare(*(responses[m] for m in pair.split("_vs_"))) for pair in FIRST_RUN_PAIRS}
    out = {}
    for runner in RUNNERS:
        for pair in PAIRS:
            a, b = pair.split("_vs_")
            if f"{runner}-{a}" in responses and f"{runner}-{b}" in responses:
                out[f"{runner}: {pair}"] = compare(responses[f"{runner}-{a}"], responses[f"{runner}-{b}"])
    if "v1-graphs" in responses and "v2-graphs" in responses:
        out["graphs: v1_vs_v2"] = compare(responses["v1-graphs"], responses["v2-graphs"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skeleton", type=Path, help="config.json + tokenizer files")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--reanalyze", type=Path, metavar="JSON",
                        help="recompute the comparison table from a saved gpu_smoke.json (no engine needed)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/probex-smoke"))
    parser.add_argument("--runners", default="v1,v2", help="comma-separated subset of v1,v2")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--attention-backend", default="FLASH_ATTN", help="'' to let vLLM choose (CPU dry runs)")
    parser.add_argument("--parallel", action="store_true",
                        help="start every engine at once (correctness only; set PROBEX_SMOKE_MEMORY to fit them)")
    args = parser.parse_args()
    if args.reanalyze:
        saved = json.loads(args.reanalyze.read_text())
        report(saved, reanalyzed_comparisons(saved))
        return
    if not (args.skeleton and args.out):
        parser.error("--skeleton and --out are required unless --reanalyze is given")
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.work / "model"
    if not (model / "config.json").exists():
        build_model(args.skeleton, model)
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    probes = build_probes(args.work / "probes", hidden)
    jobs = {f"{runner}-{name}": (runner, name) for runner in args.runners.split(",") for name in args.modes.split(",")}

    def run(label: str):
        runner, name = jobs[label]
        return run_mode(runner, name, model, probes, args.out, MODES[name], args.attention_backend, args.parallel)

    runs = dict(zip(jobs, run_jobs(run, list(jobs), args.parallel)))
    result = {"modes": {label: info for label, (_, info) in runs.items()}}
    comparisons = all_comparisons({label: responses for label, (responses, _) in runs.items()})
    result["comparisons"] = comparisons
    for responses, _ in runs.values():
        for response in responses:
            response.pop("_captured")
    result["responses"] = {label: responses for label, (responses, _) in runs.items()}
    import torch
    import vllm

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU dry run)"
    result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__, "gpu": gpu}
    (args.out / "gpu_smoke.json").write_text(json.dumps(result, indent=1))
    report(result, comparisons)


def report(result: dict, comparisons: dict) -> None:
    print(f"versions: {result['versions']}")
    for label, info in result["modes"].items():
        captured = [l for l in info["graph_log_lines"] if "Capturing CUDA graphs" in l or "Graph capturing" in l]
        line = f"{label}: ready in {info['ready_s']} s; CUDA-graph capture log lines: {len(captured)}"
        if info.get("score_consumer"):
            line += f"; scores' consumer: {info['score_consumer']}"
        if info.get("mid_forward_steps") is not None:
            line += f"; {info['mid_forward_steps']} of {info['steps']} steps' scores copied mid-forward"
        if info.get("runner_log_lines"):
            line += "; V2 runner confirmed in log"
        if "error" in info.get("teacher_forced", {}):
            line += f"; teacher-forced check failed: {info['teacher_forced']['error']}"
        elif "teacher_forced" in info:
            tf = info["teacher_forced"]
            line += (f"; teacher-forced: {tf['compared']} scores, max diff {tf['max_abs_diff']:.2e}, closest to their"
                     f" own token {tf['closest_to_own_token']}/{tf['compared']}"
                     f" (one token off would give median {tf['median_abs_diff_one_token_off']:.2e})")
        print(line)
    print(f"{'pair':28} {'same seqs':>9} {'last raw':>9} {'mean/max':>9} {'generated':>9} {'cos last':>9} {'cos any':>9}")
    for pair, c in comparisons.items():
        print(f"{pair:28} {c['identical_token_sequences']:>6}/{len(PROMPTS)} {c['prompt_last_raw_abs']:9.2e} "
              f"{c['prompt_aggregate_abs']:9.2e} {c['generated_abs']:9.2e} {c.get('residual_cos_last_token_min', float('nan')):9.6f}"
              f" {c.get('residual_cos_any_token_min', float('nan')):9.6f}"
              f"  (aggregates skipped for different cache coverage: {c['aggregates_skipped_for_coverage']})")


if __name__ == "__main__":
    main()
