"""GPU smoke test of steering: the in-graph write and gate under CUDA graphs, vs piecewise and eager.

Runs on the GPU machine (docs/gpu.md for the set-up; same random-weight SmolLM2-architecture
model as `bench.gpu_smoke`). For each model runner and mode (`graphs` = vLLM's default
FULL_AND_PIECEWISE, `piecewise`, `eager`) it starts `probex worker` with probes at layers
10 and 20, steering at layer 10 (a fixed random unit vector), and sends 8 prompts in five
variants at once — one batch, so steered, gated and unsteered rows share every step:

- `plain`      no steering
- `zero`       alpha = 0                      (must equal plain bit for bit)
- `steered`    alpha = A at every token
- `gated`      alpha = A where probe a10 (layer 10, read before the write) > 0.5
- `generation` alpha = A on generated tokens only (prompt scores must equal plain's)

A is half the mean norm of the residual stream at layer 10 (first prompt) and a10's bias puts
its threshold in the widest gap between the middle half of its raw scores over every prompt's
rows (`gate_bias_with_margin`; both measured once, through capture mode, then swapped in
live with PUT /probex/probes in every engine), so the write changes what a random model
says and the gate opens at some tokens and not at others.
It then times 8 requests x 128 tokens with no steered row (idle op) vs all rows steered.

    python3 -m bench.gpu_steer_smoke --skeleton .gpukit/model --out "$OUT" [--runners v1,v2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.gpu_smoke import (GRAPH_LOG_PATTERNS, MODES, PROMPTS, RUNNERS, build_model, max_tokens_for, run_jobs,
                              side_by_side)
from engine_worker.steering import raw_threshold  # torch-free
from probex.processes import logged_worker

VARIANTS = ("plain", "zero", "steered", "gated", "generation")
GATE_THRESHOLD = 0.5
ADMIN = "smoke-admin"


def build_artifacts(root: Path, hidden: int) -> tuple[list[Path], Path]:
    from probes.artifact import ProbeArtifact, ReadPoint, save_probe
    from probes.steering import SteeringVector, save_vector

    rng = np.random.default_rng(11)
    probes = [
        save_probe(ProbeArtifact(name=n, layer=l, read=ReadPoint.LAST_PROMPT_TOKEN,
                                 weight=rng.standard_normal(hidden).astype(np.float32) / np.sqrt(hidden), bias=0.0),
                   root / n)
        for n, l in (("a10", 10), ("c20", 20))
    ]
    v = rng.standard_normal(hidden).astype(np.float32)
    vector = save_vector(SteeringVector("rand10", 10, v / np.linalg.norm(v)), root / "rand10")
    return probes, vector


def xargs_for(variant: str, alpha: float) -> dict:
    base = {"probex_steer": "rand10", "probex_steer_alpha": alpha}
    return {
        "plain": {},
        "zero": dict(base, probex_steer_alpha=0.0),
        "steered": base,
        "gated": dict(base, probex_steer_gate="a10", probex_steer_threshold=GATE_THRESHOLD),
        "generation": dict(base, probex_steer_window="generation"),
    }[variant]


async def post_all(url: str, bodies: list[dict]) -> list[dict]:
    import httpx

    # steering, capture and recompute are engine controls: the worker takes them with its admin token only
    async with httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {ADMIN}"}) as client:
        rs = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=b) for b in bodies))
    for r in rs:
        if r.status_code != 200:
            raise RuntimeError(f"worker answered {r.status_code}: {r.text[:500]}")
    return [r.json() for r in rs]


def body(model: str, prompt: str, max_tokens: int, xargs: dict, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True, "vllm_xargs": {"probex_recompute": True, **xargs},
            # the top-2 gap at each token: how close greedy decoding was to a tie where two runs part ways
            "logprobs": True, "top_logprobs": 2, **extra}


def gate_bias_with_margin(raw: np.ndarray, threshold_raw: float = 0.0) -> tuple[float, float]:
    """(bias, margin): the bias that moves the widest gap between the prompt rows' raw scores
    (bias excluded) within their middle half onto the gate's raw threshold, and the distance
    from there to the nearest row.

    The middle half keeps the gate open at some rows and shut at others; the widest gap keeps
    every prompt row's decision away from the threshold, so two runs whose scores differ by
    less than the margin (TP=2 vs TP=1: all-reduce order) decide every prompt row alike. At the
    median itself rows sit arbitrarily close to the threshold and flip on rounding.
    """
    values = np.sort(np.asarray(raw, dtype=np.float64).ravel())
    if values.size < 2:
        raise ValueError("the gate needs at least two prompt rows to place its threshold between")
    low, high = int(values.size * 0.25), max(int(np.ceil(values.size * 0.75)), int(values.size * 0.25) + 2)
    middle = values[low:min(high, values.size)]
    gaps = np.diff(middle)
    widest = int(np.argmax(gaps))
    if gaps[widest] <= 0:
        raise ValueError("the prompt rows' middle half has a single value: no gap to put the gate's threshold in")
    midpoint = float((middle[widest] + middle[widest + 1]) / 2)
    return threshold_raw - midpoint, float(gaps[widest] / 2)


def calibrate(url: str, model: str, capture: Path, gate_probe: Path) -> dict:
    """Alpha and the gate probe's bias from the residual stream at layer 10 (capture mode).

    A random model's stream can sit entirely on one side of a random probe; re-biasing the
    gate probe (`gate_bias_with_margin`, over every prompt's rows) puts the 0.5 threshold
    among them, so the gate opens at some tokens and not at others, with no prompt row
    within `gate_margin` of it.
    """
    from safetensors.numpy import load_file

    from probes.artifact import load_probe, save_probe

    responses = asyncio.run(post_all(url, [body(model, p, 1, {"probex_capture": True}) for p in PROMPTS]))
    rows = []
    for r in responses:
        (path,) = capture.glob(f"{r['id']}-*.safetensors")
        rows.append(load_file(str(path))["layer_10"])
    probe = load_probe(gate_probe)
    first = rows[0].astype(np.float64)
    raw = np.concatenate([r.astype(np.float64) @ probe.weight for r in rows])
    probe.bias, margin = gate_bias_with_margin(raw, raw_threshold(GATE_THRESHOLD, probe.slope, probe.intercept))
    save_probe(probe, gate_probe)
    return {"alpha": float(0.5 * np.linalg.norm(first, axis=1).mean()), "gate_bias": probe.bias,
            "gate_margin": margin, "gate_rows": int(raw.size)}


def load_probes(url: str, probes: list[Path]) -> None:
    import httpx

    r = httpx.put(url + "/probex/probes", json={"probes": [str(p) for p in probes]},
                  headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    if r.status_code != 200:
        raise RuntimeError(f"probe swap refused: {r.text[:300]}")


def timed(url: str, model: str, xargs: dict) -> float:
    bodies = [body(model, p, 128, xargs, ignore_eos=True) for p in PROMPTS]
    start = time.perf_counter()
    asyncio.run(post_all(url, bodies))
    return time.perf_counter() - start


class SharedSettings:
    """Steering strength and gate bias, measured by one engine and reused by every other.

    Runs only compare if every engine steers with the same numbers; with engines started
    together, the others wait here until the measuring one has them (or has failed).
    """

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._value: dict | None = None
        self._error: BaseException | None = None

    def measure(self, url: str, model: str, capture: Path, gate_probe: Path) -> dict:
        try:
            self._value = calibrate(url, model, capture, gate_probe)
            return self._value
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._ready.set()

    def wait(self, timeout_s: float = 1200) -> dict:
        if not self._ready.wait(timeout_s):
            raise TimeoutError("the engine measuring the steering settings did not finish")
        if self._value is None:
            raise RuntimeError(f"the engine measuring the steering settings failed: {self._error!r}")
        return self._value


def run_mode(runner: str, mode: str, model: Path, probes: list[Path], vector: Path, out: Path,
             settings: SharedSettings, measures: bool, attention_backend: str = "FLASH_ATTN",
             parallel: bool = False, dtype: str = "") -> dict:
    port = 8300 + list(MODES).index(mode) + 10 * list(RUNNERS).index(runner)
    env = dict(os.environ, VLLM_USE_V2_MODEL_RUNNER=RUNNERS[runner])
    extra = list(MODES[mode]) + (["--dtype", dtype] if dtype else [])
    # Timing engines that share the GPU with others would measure the others.
    return run_engine(f"{runner}-{mode}", port, env, extra, model, probes, vector, out, settings, measures,
                      attention_backend, parallel, timing=mode == "graphs" and not parallel)


def run_engine(label: str, port: int, env: dict[str, str], extra: list[str], model: Path, probes: list[Path],
               vector: Path, out: Path, settings: SharedSettings, measures: bool, attention_backend: str,
               parallel: bool, timing: bool = False, capture_variants: tuple[str, ...] = ()) -> dict:
    """One `probex worker` with probes a10/c20 and the steering vector: the five variants of every prompt in
    one batch (and, with `timing`, 8 x 128 tokens with the op idle vs every row steered).

    `capture_variants`: those variants' requests also capture their prompt rows, and the gate
    probe's raw score on every prompt row is recorded (`gate_prompt_rows`): the gate decides
    prompt rows too, and their scores are not otherwise delivered."""
    capture = out / f"capture-{label}"
    log_path = out / f"worker-{label}.log"
    cmd = [sys.executable, "-m", "probex.cli", "worker", "--model", str(model), "--port", str(port),
           *[f"--probe={p}" for p in probes], "--steer-vector", str(vector), "--max-model-len", "1024",
           "--admin-token", ADMIN,
           "--gpu-memory-utilization", os.environ.get("PROBEX_SMOKE_MEMORY", "0.3"), "--capture-dir", str(capture),
           *extra]
    if attention_backend:
        cmd += ["--attention-backend", attention_backend]
    if parallel:
        cmd += side_by_side(env)
    url = f"http://127.0.0.1:{port}"
    with logged_worker(cmd, env, log_path, url, label) as ready_s:
        if measures:
            values = settings.measure(url, str(model), capture, probes[0])
        else:
            values = settings.wait()
        load_probes(url, probes)  # the re-biased gate probe, swapped in live
        alpha = values["alpha"]
        bodies = [body(str(model), p, max_tokens_for(i),
                       dict(xargs_for(v, alpha), **({"probex_capture": True} if v in capture_variants else {})))
                  for v in VARIANTS for i, p in enumerate(PROMPTS)]
        responses = asyncio.run(post_all(url, bodies))
        timings = None
        if timing:
            timed(url, str(model), {})  # warm-up
            timings = {"idle_s": timed(url, str(model), {}),
                       "active_s": timed(url, str(model), xargs_for("steered", alpha))}
    text = log_path.read_text(errors="replace")
    graph_lines = [l[-200:] for l in text.splitlines() if any(re.search(p, l) for p in GRAPH_LOG_PATTERNS)]
    n = len(PROMPTS)
    by_variant = {v: responses[k * n:(k + 1) * n] for k, v in enumerate(VARIANTS)}
    result = {"settings": values, "ready_s": round(ready_s, 1), "graph_log_lines": graph_lines[:6], "timing": timings,
              "responses": {v: [strip(r) for r in rs] for v, rs in by_variant.items()}}
    if capture_variants:
        result["gate_prompt_rows"] = gate_prompt_rows(capture, probes[0], {v: by_variant[v] for v in capture_variants})
    return result


def gate_prompt_rows(capture: Path, gate_probe: Path, responses: dict[str, list[dict]]) -> dict:
    """The gate probe's raw score on every captured prompt row of each response, and the raw
    threshold the gate compares it with. Recomputed here in float32 from the captured rows:
    the device's own matmul may round differently, so a row within ~1e-4 of the threshold
    may have been decided the other way there."""
    from safetensors.numpy import load_file

    from probes.artifact import load_probe

    probe = load_probe(gate_probe)
    raw = {}
    for variant, rs in responses.items():
        raw[variant] = []
        for r in rs:
            (path,) = capture.glob(f"{r['id']}-*.safetensors")
            rows = load_file(str(path))[f"layer_{probe.layer}"].astype(np.float32)
            raw[variant].append((rows @ probe.weight.astype(np.float32) + np.float32(probe.bias)).tolist())
    return {"threshold_raw": raw_threshold(GATE_THRESHOLD, probe.slope, probe.intercept), "raw": raw}


def strip(response: dict) -> dict:
    scores = response["probex"]["scores"]
    content = (response["choices"][0].get("logprobs") or {}).get("content") or []
    return {"tokens": response["choices"][0]["token_ids"],
            "top2_gap": [t["top_logprobs"][0]["logprob"] - t["top_logprobs"][1]["logprob"]
                         if len(t.get("top_logprobs") or []) > 1 else None for t in content],
            "scores": {name: {"prompt": s["prompt"], "generated": s["generated"]["scores"]}
                       for name, s in scores.items()}}


def _max_generated_diff(a: dict, b: dict) -> float:
    diffs = [abs(p - q) for name in a["scores"]
             for p, q in zip(a["scores"][name]["generated"], b["scores"][name]["generated"])]
    return max(diffs, default=0.0)


def _prompt_diff(a: dict, b: dict, probe: str) -> float:
    pa, pb = a["scores"][probe]["prompt"], b["scores"][probe]["prompt"]
    return max(abs(pa[k] - pb[k]) for k in ("last_raw", "last", "mean", "max"))


def checks_within(run: dict) -> dict:
    """What must hold inside one engine run.

    Comparisons between variants compare *different rows of one batch*. On a GPU the fp32
    score GEMM may sum in a different order for different row positions, so "unchanged"
    means: same tokens, scores within ~1e-6 (what plain rows differ by between engines
    too); bit-identity of an alpha = 0 row is shown on the CPU (tests/test_engine_steering.py).
    """
    r = run["responses"]
    n = len(PROMPTS)
    gate_fired = []
    for i in range(n):
        gate_fired.append(sum(s > GATE_THRESHOLD for s in r["gated"][i]["scores"]["a10"]["generated"]))
    return {
        "zero_tokens_equal_plain": sum(r["zero"][i]["tokens"] == r["plain"][i]["tokens"] for i in range(n)),
        "zero_max_abs_score_diff_vs_plain": max(
            max(_max_generated_diff(r["zero"][i], r["plain"][i]),
                *(_prompt_diff(r["zero"][i], r["plain"][i], name) for name in r["plain"][i]["scores"]))
            for i in range(n)),
        "steered_tokens_differ": sum(r["steered"][i]["tokens"] != r["plain"][i]["tokens"] for i in range(n)),
        "steered_c20_prompt_differs": sum(r["steered"][i]["scores"]["c20"]["prompt"]["last_raw"]
                                          != r["plain"][i]["scores"]["c20"]["prompt"]["last_raw"] for i in range(n)),
        "steered_c20_prompt_max_abs_raw_diff": max(
            abs(r["steered"][i]["scores"]["c20"]["prompt"]["last_raw"] - r["plain"][i]["scores"]["c20"]["prompt"]["last_raw"])
            for i in range(n)),
        "gated_tokens_differ_from_plain": sum(r["gated"][i]["tokens"] != r["plain"][i]["tokens"] for i in range(n)),
        "gated_tokens_differ_from_steered": sum(r["gated"][i]["tokens"] != r["steered"][i]["tokens"] for i in range(n)),
        "gate_open_generated_tokens": gate_fired,
        # a10 is read at the steering layer, before the write: steering must not move it
        "gate_a10_prompt_max_abs_diff_vs_plain": max(_prompt_diff(r["gated"][i], r["plain"][i], "a10") for i in range(n)),
        # a generation-only window leaves the prompt alone, so even c20 (after the write) stays
        "generation_window_prompt_c20_max_abs_diff_vs_plain": max(
            _prompt_diff(r["generation"][i], r["plain"][i], "c20") for i in range(n)),
        "generation_window_tokens_differ_from_plain": sum(
            r["generation"][i]["tokens"] != r["plain"][i]["tokens"] for i in range(n)),
        "prompts": n,
    }


def compare_runs(a: dict, b: dict) -> dict:
    out = {}
    for v in VARIANTS:
        same = sum(x["tokens"] == y["tokens"] for x, y in zip(a["responses"][v], b["responses"][v]))
        diffs = [abs(p - q) for x, y in zip(a["responses"][v], b["responses"][v])
                 for name in x["scores"] for p, q in zip(x["scores"][name]["generated"], y["scores"][name]["generated"])]
        out[v] = {"identical_sequences": same, "max_abs_generated_score_diff": max(diffs) if diffs else None}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skeleton", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/probex-steer-smoke"))
    parser.add_argument("--runners", default="v1,v2")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--attention-backend", default="FLASH_ATTN", help="'' to let vLLM choose (CPU dry runs)")
    parser.add_argument("--dtype", default="", help="e.g. float32: compiled and eager kernels then agree token for "
                        "token (FlashAttention has no fp32: pair with --attention-backend TRITON_ATTN)")
    parser.add_argument("--parallel", action="store_true",
                        help="start every engine at once (correctness only: no timing; set PROBEX_SMOKE_MEMORY to fit)")
    parser.add_argument("--reanalyze", type=Path, metavar="JSON",
                        help="recompute the checks of a saved gpu_steer_smoke.json (no engines); writes it back")
    args = parser.parse_args()
    if args.reanalyze:
        saved = json.loads(args.reanalyze.read_text())
        analyse(saved, list(dict.fromkeys(l.split("-")[0] for l in saved["runs"])),
                list(dict.fromkeys(l.split("-", 1)[1] for l in saved["runs"])))
        args.reanalyze.write_text(json.dumps(saved, indent=1) + "\n")
        report(saved)
        return
    if not (args.skeleton and args.out):
        parser.error("--skeleton and --out are required unless --reanalyze is given")
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.work / "model"
    if not (model / "config.json").exists():
        model.mkdir(parents=True, exist_ok=True)
        build_model(args.skeleton, model)
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    probes, vector = build_artifacts(args.work / "artifacts", hidden)
    result: dict = {"runs": {}}
    settings = SharedSettings()
    jobs = [(runner, mode) for runner in args.runners.split(",") for mode in args.modes.split(",")]

    def run(job: tuple[str, str]) -> dict:
        runner, mode = job
        return run_mode(runner, mode, model, probes, vector, args.out, settings, measures=job == jobs[0],
                        attention_backend=args.attention_backend, parallel=args.parallel, dtype=args.dtype)

    runs = run_jobs(run, jobs, args.parallel)
    for (runner, mode), run_result in zip(jobs, runs):
        result["runs"][f"{runner}-{mode}"] = run_result
    analyse(result, args.runners.split(","), args.modes.split(","))
    import torch
    import vllm

    result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU dry run)"}
    (args.out / "gpu_steer_smoke.json").write_text(json.dumps(result, indent=1) + "\n")
    report(result)


def analyse(result: dict, runners: list[str], modes: list[str]) -> None:
    result["within"], result["pairs"] = {}, {}
    for label, run_result in result["runs"].items():
        result["within"][label] = checks_within(run_result)
    for runner in runners:
        labels = [f"{runner}-{m}" for m in modes]
        for i, first in enumerate(labels):
            for second in labels[i + 1:]:
                result["pairs"][f"{first} vs {second}"] = compare_runs(result["runs"][first], result["runs"][second])
    for mode in modes:  # the same mode across runners: the adapters must agree
        for i, first in enumerate(runners):
            for second in runners[i + 1:]:
                a, b = f"{first}-{mode}", f"{second}-{mode}"
                result["pairs"][f"{a} vs {b}"] = compare_runs(result["runs"][a], result["runs"][b])


def report(result: dict) -> None:
    for label, run_result in result["runs"].items():
        print(f"{label}: ready {run_result['ready_s']} s, {result['within'][label]}", flush=True)
    for pair, per_variant in result["pairs"].items():
        print(pair, {v: (c["identical_sequences"], c["max_abs_generated_score_diff"]) for v, c in per_variant.items()})
    for label, info in result["runs"].items():
        if info["timing"]:
            print(label, "8 x 128 tokens: idle op", round(info["timing"]["idle_s"], 3), "s, all rows steered",
                  round(info["timing"]["active_s"], 3), "s")
    if "versions" in result:
        print(result["versions"])


if __name__ == "__main__":
    main()
