"""GPU smoke of `probex worker --engine sglang` (SGLang 0.5.14), in one process.

Runs on the GPU machine once the SGLang kit is installed (docs/gpu-sglang.md, commands in
docs/sglang.md). From the tokenizer skeleton of the vLLM smoke (docs/gpu.md) it builds
random-init Llama and Qwen2 models, each saved in float32 and bfloat16, and gpu_smoke's three
probes (layers 10 and 20), then starts the worker one mode at a time and checks:

- parity-*: served prompt and generated scores equal w·HF hidden_states[L + 1] + b from
  transformers on the same saved weights (fp32: relative 1e-3 and captured residual rows at
  cosine >= 0.9999; bf16: within a few times HF's own bf16 rounding);
- teacher-forced: each sampled token's score sits on its own row;
- radix: a repeated prompt is scored from its uncached tail with the same last score, and
  `probex_recompute` scores every row;
- isolation, isolation-no-overlap: 16 concurrent mixed-length requests (half streamed) score as
  each does alone; stream chunks carry as many scores as tokens; no score step lost;
- swap-pause: probes swapped and the tap paused and resumed under 8 streams, none failing;
- graphs: default (decode and piecewise prefill graphs) vs prefill graphs off vs no graphs.

Each check is independent: a failure is recorded with its traceback and the next one runs.
Every number goes to `sglang_smoke.json` in --out (rewritten after each check), the worker
logs beside it; a short table is printed at the end.

    python3 -m bench.sglang_smoke --skeleton /root/skeleton --out /root/runs/sglang-smoke
    python3 -m bench.sglang_smoke --report sglang_smoke.json     # the table again, anywhere
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.gpu_smoke import (ADMIN_TOKEN, CONTROLS, PROMPTS, TEACHER_FORCED_TOKENS, build_probes, forced_pairs,
                             max_tokens_for, teacher_forced_summary)
from bench.sglang_smoke_analysis import (MODE_TOL, Check, Reference, build_models, chat_prompt_ids, compare_records,
                                         cosines, graph_lines, output_ids, own_row_closest, parity_rows, parity_summary, parse_args,
                                         record_of, reference_scores, run_checks, served_scores, stream_record)
from probex.processes import free_port, logged_worker, unwind_on_sigterm

# Every worker: the kit's kernels (docs/gpu-sglang.md), a decode graph for every batch the
# checks make (up to 17 requests at once), a fixed sampling seed.
SGLANG_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch",
               "--cuda-graph-max-bs-decode", "32", "--random-seed", "0"]
# SGLang 0.5.14's per-phase graph switch (ServerArgs.cuda_graph_backend_prefill); the default
# prefill backend is tc_piecewise. --disable-cuda-graph is its deprecated alias for both phases.
PREFILL_GRAPHS_OFF = ["--cuda-graph-backend-prefill", "disabled"]
MODES = {"graphs": [], "prefill-graphs-off": PREFILL_GRAPHS_OFF, "no-graphs": ["--disable-cuda-graph"],
         "no-overlap": ["--disable-overlap-schedule"]}
# What SGLang 0.5.14 logs once a phase's graphs are captured (model_runner.py), and which a mode expects.
GRAPH_LOG = {"decode": "Capture target decode CUDA graph end", "prefill": "Capture target prefill CUDA graph end",
             "mid_forward": "leave mid-forward", "server_args": "disable_overlap_schedule="}
EXPECTED_GRAPHS = {"graphs": (True, True), "prefill-graphs-off": (True, False), "no-graphs": (False, False),
                   "no-overlap": (True, True)}
START_S, CHECK_S = 150.0, 45.0  # time estimates until a start has been seen
# fp32 workers: Triton's fp32 dots (SGLang's Triton attention) in full precision, not TF32
FP32_ENV = {"TRITON_F32_DEFAULT": "ieee"}


@dataclass(frozen=True)
class EngineKey:
    arch: str
    dtype: str
    mode: str = "graphs"
    capture: bool = False

    @property
    def label(self) -> str:
        return f"{self.arch}-{self.dtype}-{self.mode}" + ("-capture" if self.capture else "")


LLAMA_BF16 = EngineKey("llama", "bfloat16")


class Engines:
    """One worker at a time: `url(key)` stops the running one if it is another and starts `key`'s."""

    def __init__(self, smoke: "Smoke") -> None:
        self.smoke = smoke
        self.current: tuple[EngineKey, str, contextlib.ExitStack] | None = None
        self.info: dict[str, dict] = {}
        self.failed: dict[EngineKey, str] = {}

    def log_path(self, key: EngineKey) -> Path:
        return self.smoke.args.out / f"worker-{key.label}.log"

    def capture_dir(self, key: EngineKey) -> Path:
        return self.smoke.args.out / f"capture-{key.label}"

    def url(self, key: EngineKey) -> str:
        if self.current is not None and self.current[0] == key:
            return self.current[1]
        self.stop()
        if key in self.failed:
            raise RuntimeError(f"{key.label} did not start earlier: {self.failed[key][-600:]}")
        smoke, port = self.smoke, free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "probex.cli", "worker", "--engine", "sglang", "--model",
               str(smoke.models[(key.arch, key.dtype)]), "--port", str(port), *[f"--probe={p}" for p in smoke.probe_dirs],
               "--dtype", key.dtype, "--chunked-prefill-size", str(smoke.args.chunked_prefill_size),
               *SGLANG_ARGS, *MODES[key.mode], *smoke.args.extra_arg]
        if key.capture:
            cmd += ["--capture-dir", str(self.capture_dir(key))]
        env = dict(os.environ, PROBEX_ADMIN_TOKEN=ADMIN_TOKEN, **(FP32_ENV if key.dtype == "float32" else {}))
        stack = contextlib.ExitStack()
        self.info[key.label] = {"command": cmd[3:]}
        try:
            ready_s = stack.enter_context(logged_worker(cmd, env, self.log_path(key), url, key.label,
                                                        timeout_s=smoke.args.start_timeout_s))
        except BaseException as exc:
            stack.close()
            self.failed[key] = f"{type(exc).__name__}: {exc}"
            self.info[key.label].update(start_error=self.failed[key][-3000:], **self.log_facts(key))
            raise
        self.info[key.label]["ready_s"] = round(ready_s, 1)
        self.current = (key, url, stack)
        return url

    def stop(self) -> None:
        if self.current is None:
            return
        key, url, stack = self.current
        self.current = None
        try:
            self.info[key.label].update(worker_state(url))
        finally:
            stack.close()
            self.info[key.label].update(self.log_facts(key))

    def log_facts(self, key: EngineKey) -> dict:
        path = self.log_path(key)
        text = path.read_text(errors="replace") if path.exists() else ""
        lines = graph_lines(text, GRAPH_LOG)
        return {"log_lines": lines, "graphs_captured": {"decode": bool(lines["decode"]), "prefill": bool(lines["prefill"])},
                "log_errors": [l[-300:] for l in text.splitlines() if "Traceback" in l or "Error" in l][:6]}

    def start_estimate(self) -> float:
        seen = [i["ready_s"] for i in self.info.values() if "ready_s" in i]
        return max(seen) if seen else START_S


def worker_state(url: str) -> dict:
    """The worker's health (steps lost, paused) and its tap's transfer counters, as it says."""
    import httpx

    out = {}
    for path, key in (("/probex/health", "health"), ("/probex/probes", "listing")):
        try:
            body = httpx.get(url + path, timeout=60).json()
        except (httpx.HTTPError, ValueError) as exc:
            out[key] = {"error": repr(exc)[:300]}
            continue
        out[key] = {k: body.get(k) for k in ("score_steps_lost", "score_messages_lost", "paused", "transfer")
                    if k in body}
    return out


class Smoke:
    def __init__(self, args) -> None:
        self.args = args
        self.engines = Engines(self)
        self.batches: dict[EngineKey, list[dict]] = {}  # the standard batch's responses per engine
        self._refs: dict[tuple, Reference] = {}
        self._tokenizers: dict[str, object] = {}
        self.models: dict[tuple[str, str], Path] = {}
        self.probe_dirs: list[Path] = []
        self.probes: list = []

    def prepare(self) -> None:
        from probes.artifact import load_probe

        self.models = build_models(self.args.skeleton, self.args.work)
        hidden = json.loads((self.models[("llama", "float32")] / "config.json").read_text())["hidden_size"]
        self.probe_dirs = build_probes(self.args.work / "probes", hidden)
        self.probes = [load_probe(d) for d in self.probe_dirs]

    def reference(self, arch: str, dtype: str, compute: str) -> Reference:
        key = (arch, dtype, compute)
        if key not in self._refs:
            self._refs[key] = Reference(self.models[(arch, dtype)], compute)
        return self._refs[key]

    def prompt_ids(self, arch: str, prompt: str) -> list[int]:
        if arch not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[arch] = AutoTokenizer.from_pretrained(self.models[(arch, "float32")])
        return chat_prompt_ids(self._tokenizers[arch], prompt)

    def model(self, key: EngineKey) -> str:
        return str(self.models[(key.arch, key.dtype)])

    def prompt_scale(self, key: EngineKey, ids: list[int]) -> dict[str, float]:
        """Each probe's spread (std) over a prompt's rows in HF fp32: the unit of MODE_TOL."""
        rows = self.reference(key.arch, key.dtype, "float32").rows(ids, sorted({p.layer for p in self.probes}))
        return {p.name: float(np.std(p.raw_score(rows[p.layer]))) for p in self.probes}

    def estimate(self, check: Check) -> float:
        running = self.engines.current[0] if self.engines.current else None
        starts = [k for k in check.engines if k != running and k not in self.batches]
        return len(starts) * self.engines.start_estimate() + CHECK_S


# -- client --------------------------------------------------------------------------------------

def chat_body(model: str, prompt: str, max_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
              stream: bool = False, xargs: dict | None = None, **extra) -> dict:
    """A chat request that gets its generated ids back (logprobs in SGLang's meta_info, or token
    texts per stream chunk); streams ask for usage on every chunk and at the end."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "logprobs": True, **extra}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    else:
        body["return_meta_info"] = True
    if seed is not None:
        body["seed"] = seed
    if xargs:
        body["vllm_xargs"] = xargs
    return body


def client():
    import httpx

    return httpx.AsyncClient(timeout=300, headers=CONTROLS)


async def post(c, url: str, path: str, body: dict) -> dict:
    r = await c.post(url + path, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"POST {path}: {r.status_code} {r.text[:600]}")
    return r.json()


async def stream(c, url: str, body: dict, abort_after_chunks: int | None = None) -> dict:
    """A streamed chat: its status, parsed chunks and whether it ended with [DONE]; closed by the
    client after `abort_after_chunks` chunks with text, if given."""
    chunks, done = [], False
    async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "chunks": [], "done": False, "body": (await r.aread()).decode()[:600]}
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
                texts = [(ch.get("delta") or {}).get("content") for ch in chunks[-1].get("choices") or []]
                if abort_after_chunks is not None and any(texts):
                    abort_after_chunks -= 1
                    if abort_after_chunks <= 0:
                        return {"status": 200, "chunks": chunks, "done": False, "aborted": True}
    return {"status": r.status_code, "chunks": chunks, "done": done}


def finished_cleanly(result: dict) -> bool:
    finals = [ch for ch in result["chunks"] if ch.get("choices")]
    return (result["status"] == 200 and result["done"] and not any("error" in ch for ch in result["chunks"])
            and bool(finals) and finals[-1]["choices"][0].get("finish_reason") in ("stop", "length"))


async def query_batch(url: str, model: str, capture: bool) -> list[dict]:
    """gpu_smoke's 8 prompts at once, greedy, with different max_tokens, every prompt row scored."""
    xargs = {"probex_recompute": True, **({"probex_capture": True} if capture else {})}
    async with client() as c:
        return await asyncio.gather(*(post(c, url, "/v1/chat/completions",
                                           chat_body(model, p, max_tokens_for(i), xargs=xargs))
                                      for i, p in enumerate(PROMPTS)))


def standard_batch(smoke: Smoke, key: EngineKey) -> list[dict]:
    if key not in smoke.batches:
        url = smoke.engines.url(key)
        smoke.batches[key] = asyncio.run(query_batch(url, smoke.model(key), key.capture))
    return smoke.batches[key]


# -- checks --------------------------------------------------------------------------------------

def captured_rows(smoke: Smoke, key: EngineKey, response_id: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    folder = smoke.engines.capture_dir(key)
    for _ in range(50):  # written by the scheduler process as the prompt's scores come in
        found = sorted(folder.glob(f"{response_id}*.safetensors"))
        if found:
            return load_file(str(found[0]))
        time.sleep(0.2)
    present = sorted(p.name for p in folder.glob("*"))[:5] if folder.exists() else []
    raise FileNotFoundError(f"no capture for {response_id} in {folder} (there: {present})")


def check_parity(smoke: Smoke, arch: str, dtype: str) -> dict:
    key = EngineKey(arch, dtype, capture=dtype == "float32")
    responses = standard_batch(smoke, key)
    ref = smoke.reference(arch, dtype, "float32")
    ref16 = smoke.reference(arch, dtype, "bfloat16") if dtype == "bfloat16" else None
    layers = sorted({p.layer for p in smoke.probes})
    rows, problems, row_cos, own = [], [], [], [0, 0]
    for prompt, response in zip(PROMPTS, responses):
        ids, generated = smoke.prompt_ids(arch, prompt), output_ids(response)
        if response["usage"]["prompt_tokens"] != len(ids):
            problems.append(f"{prompt[:30]!r}: served {response['usage']['prompt_tokens']} prompt tokens, the"
                            f" chat template here gives {len(ids)}")
            continue
        served = served_scores(response, smoke.probes)
        problems += [f"{prompt[:30]!r} {n}: {s['tokens_scored']} of {len(ids)} prompt rows scored"
                     for n, s in served.items() if s["tokens_scored"] != len(ids)]
        hidden = ref.rows(ids + generated, layers)
        want = reference_scores(hidden, smoke.probes, len(ids), len(generated))
        want16 = (reference_scores(ref16.rows(ids + generated, layers), smoke.probes, len(ids), len(generated))
                  if ref16 else None)
        got, trouble = parity_rows(served, want, want16)
        rows += got
        problems += trouble
        for name, s in served.items():
            closest, compared = own_row_closest(s["generated"], want[name]["generated"])
            own[0], own[1] = own[0] + closest, own[1] + compared
        if key.capture:
            captured = captured_rows(smoke, key, response["id"])
            for layer in layers:
                mine, theirs = captured[f"layer_{layer}"], hidden[layer][:len(ids)]
                if mine.shape != theirs.shape:
                    problems.append(f"capture layer {layer}: {mine.shape} rows, HF {theirs.shape}")
                    continue
                row_cos += cosines(mine, theirs).tolist()
    summary = parity_summary(rows, dtype, problems, row_cos)
    summary["generated_closest_to_own_row"] = f"{own[0]}/{own[1]} (greedy tokens repeat: informative only)"
    summary["generated_tokens"] = sum(len(output_ids(r)) for r in responses)
    return summary


def check_teacher_forced(smoke: Smoke) -> dict:
    """gpu_smoke's teacher-forced check: token j sampled (so neighbours differ) vs the last
    prompt score of prompt + generated[:j] sent as token ids."""
    url, model = smoke.engines.url(LLAMA_BF16), smoke.model(LLAMA_BF16)
    recompute = {"probex_recompute": True}

    async def run():
        async with client() as c:
            sampled = await asyncio.gather(*(post(c, url, "/v1/chat/completions", chat_body(
                model, p, 12, temperature=1.0, seed=100 + i, xargs=recompute)) for i, p in enumerate(PROMPTS[:4])))
            jobs, keys = [], []
            for prompt, response in zip(PROMPTS, sampled):
                ids, generated = smoke.prompt_ids("llama", prompt), output_ids(response)
                for j in TEACHER_FORCED_TOKENS:
                    if j < len(generated):
                        body = {"model": model, "prompt": ids + generated[:j], "max_tokens": 1, "temperature": 0,
                                "vllm_xargs": recompute}
                        jobs.append(post(c, url, "/v1/completions", body))
                        keys.append((response, j))
            forced = await asyncio.gather(*jobs)
        return [pair for (response, j), f in zip(keys, forced)
                for pair in forced_pairs(response["probex"]["scores"], f["probex"]["scores"], j)]

    summary = teacher_forced_summary(asyncio.run(run()))
    summary["pass"] = summary["compared"] > 0 and summary["closest_to_own_token"] == summary["with_neighbours"]
    return summary


def check_radix(smoke: Smoke) -> dict:
    """A: a new prompt; B: the same again (its prefix from the radix cache); C: the same with
    probex_recompute (every row run and scored)."""
    url, model = smoke.engines.url(LLAMA_BF16), smoke.model(LLAMA_BF16)
    words = " ".join(f"entry {i} of the shipping manifest" for i in range(20))
    prompt = f"[{uuid.uuid4().hex[:8]}] Read this manifest: {words}. Which entry is last?"
    ids = smoke.prompt_ids("llama", prompt)

    async def run():
        async with client() as c:
            out = [await post(c, url, "/v1/chat/completions", chat_body(model, prompt, 4)) for _ in range(2)]
            return out + [await post(c, url, "/v1/chat/completions",
                                     chat_body(model, prompt, 4, xargs={"probex_recompute": True}))]

    a, b, c = (served_scores(r, smoke.probes) for r in asyncio.run(run()))
    scale = smoke.prompt_scale(LLAMA_BF16, ids)
    out = {"prompt_tokens": len(ids), "probes": {}}
    ok = True
    for name in b:
        allowed = MODE_TOL["bfloat16"] * scale[name]
        entry = {"tokens_scored": [a[name]["tokens_scored"], b[name]["tokens_scored"], c[name]["tokens_scored"]],
                 "last_raw_abs_diff_repeat": abs(a[name]["last"] - b[name]["last"]),
                 "last_raw_abs_diff_recompute": abs(b[name]["last"] - c[name]["last"]), "allowed": allowed}
        ok = ok and (b[name]["tokens_scored"] < b[name]["prompt_tokens"] == len(ids)
                     and c[name]["tokens_scored"] == c[name]["prompt_tokens"] == len(ids)
                     and max(entry["last_raw_abs_diff_repeat"], entry["last_raw_abs_diff_recompute"]) <= allowed)
        out["probes"][name] = entry
    out["pass"] = bool(ok)
    return out


def isolation_specs(model: str) -> list[dict]:
    """16 requests of mixed prompt lengths (about 40 to 330 tokens) and output lengths, every
    second one streamed, all scoring every prompt row."""
    specs = []
    for i in range(16):
        filler = " ".join(f"note {k} about the topic" for k in range(4 * i))
        prompt = f"[request {i}] {filler} {PROMPTS[i % len(PROMPTS)]}"
        specs.append(chat_body(model, prompt, 3 + (i * 7) % 29, stream=i % 2 == 1, xargs={"probex_recompute": True}))
    return specs


def check_isolation(smoke: Smoke, mode: str) -> dict:
    key = EngineKey("llama", "bfloat16", mode)
    url = smoke.engines.url(key)
    before = worker_state(url).get("health", {})
    specs = isolation_specs(smoke.model(key))
    abort = chat_body(smoke.model(key), f"[aborted] {PROMPTS[0]}", 200, stream=True, ignore_eos=True)

    async def one(c, body, abort_after=None):
        if body.get("stream"):
            return await stream(c, url, body, abort_after)
        return await post(c, url, "/v1/chat/completions", body)

    async def run():
        async with client() as c:
            together = await asyncio.gather(*(one(c, b) for b in specs), one(c, abort, abort_after=3))
            alone = [await one(c, b) for b in specs]
            after_abort = await one(c, specs[0])
        return together[:-1], together[-1], alone, after_abort

    together, aborted, alone, after_abort = asyncio.run(run())
    after = worker_state(url).get("health", {})

    def records(results):
        out, counts = [], []
        for body, result in zip(specs, results):
            if body.get("stream"):
                record, count = stream_record(result["chunks"], smoke.probes)
                count["ok"] = count["ok"] and finished_cleanly(result)
                out.append(record)
                counts.append(count)
            else:
                out.append(record_of(result, smoke.probes))
        return out, counts

    first, counts_together = records(together)
    second, counts_alone = records(alone)
    comparison = compare_records(first, second, "bfloat16")
    lost = {k: (after.get(k) or 0) - (before.get(k) or 0) for k in ("score_steps_lost", "score_messages_lost")}
    streams_ok = all(c["ok"] for c in counts_together + counts_alone)
    return {"together_vs_alone": comparison, "streams_checked": len(counts_together) + len(counts_alone),
            "stream_problems": [c["problems"] for c in counts_together + counts_alone if not c["ok"]][:4],
            "aborted_stream": {"chunks": len(aborted["chunks"]), "aborted": aborted.get("aborted", False)},
            "after_abort_served": bool(after_abort.get("probex")), "lost": lost,
            "pass": bool(comparison["pass"] and streams_ok and not any(lost.values()) and after_abort.get("probex"))}


def check_swap_pause(smoke: Smoke) -> dict:
    """Under 8 streams: swap in a set with probe a10 negated (b10 dropped), pause the tap, ask
    while paused, resume; then a10's score is 2 * bias - its score before."""
    import httpx

    from probes.artifact import ProbeArtifact, save_probe

    url, model = smoke.engines.url(LLAMA_BF16), smoke.model(LLAMA_BF16)
    a10 = next(p for p in smoke.probes if p.name == "a10")
    flipped = save_probe(ProbeArtifact(name="a10", layer=a10.layer, read=a10.read, weight=-a10.weight, bias=a10.bias),
                         smoke.args.work / "probes-swapped" / "a10")
    new_set = [str(flipped), *(str(d) for d, p in zip(smoke.probe_dirs, smoke.probes) if p.name == "c20")]
    probe_body = chat_body(model, PROMPTS[2], 1, xargs={"probex_recompute": True})
    out: dict = {}

    async def run():
        async with client() as c:
            before = await post(c, url, "/v1/chat/completions", probe_body)
            streams = [asyncio.create_task(stream(c, url, chat_body(model, p, 64, stream=True, ignore_eos=True)))
                       for p in PROMPTS]
            await asyncio.sleep(1.0)
            swap = await c.put(url + "/probex/probes", json={"probes": new_set})
            await asyncio.sleep(0.5)
            pause = await c.put(url + "/probex/tap", json={"paused": True})
            health = (await c.get(url + "/probex/health")).json()
            unmonitored = await post(c, url, "/v1/chat/completions", chat_body(model, PROMPTS[3], 2))
            resume = await c.put(url + "/probex/tap", json={"paused": False})
            results = await asyncio.gather(*streams)
            after = await post(c, url, "/v1/chat/completions", probe_body)
            return before, swap, pause, health, unmonitored, resume, results, after

    try:
        before, swap, pause, health, unmonitored, resume, results, after = asyncio.run(run())
    finally:
        restored = httpx.put(url + "/probex/probes", json={"probes": [str(d) for d in smoke.probe_dirs]},
                             headers=CONTROLS, timeout=120)
        out["restored"] = restored.status_code
    was = before["probex"]["scores"]["a10"]["prompt"]["last_raw"]
    now = after["probex"]["scores"]["a10"]["prompt"]["last_raw"]
    allowed = MODE_TOL["bfloat16"] * smoke.prompt_scale(LLAMA_BF16, smoke.prompt_ids("llama", PROMPTS[2]))["a10"]
    clean = [finished_cleanly(r) for r in results]
    out.update({
        "swap": [swap.status_code, [p["name"] for p in swap.json().get("probes", [])] if swap.status_code == 200
                 else swap.text[:300]],
        "pause": [pause.status_code, pause.json() if pause.status_code == 200 else pause.text[:300]],
        "paused_in_health": health.get("paused"), "unmonitored_has_probex": "probex" in unmonitored,
        "resume": [resume.status_code, resume.text[:200]], "streams_finished_cleanly": f"{sum(clean)}/{len(clean)}",
        "stream_tokens_scored_a10": [sum(len(((ch.get("probex") or {}).get("scores") or {}).get("a10", {})
                                             .get("generated", {}).get("scores", [])) for ch in r["chunks"])
                                     for r in results],
        "after_swap_names": sorted(after["probex"]["scores"]),
        "a10_after_minus_expected": now - (2 * a10.bias - was), "allowed": allowed})
    out["pass"] = bool(swap.status_code == 200 and out["swap"][1] == ["a10", "c20"] and pause.status_code == 200
                       and health.get("paused") is True and not out["unmonitored_has_probex"]
                       and resume.status_code == 200 and all(clean) and out["after_swap_names"] == ["a10", "c20"]
                       and abs(out["a10_after_minus_expected"]) <= allowed and restored.status_code == 200)
    return out


def check_graphs(smoke: Smoke) -> dict:
    runs, logs = {}, {}
    for mode in ("graphs", "prefill-graphs-off", "no-graphs"):
        key = EngineKey("llama", "bfloat16", mode)
        runs[mode] = [record_of(r, smoke.probes) for r in standard_batch(smoke, key)]
        logs[mode] = smoke.engines.log_facts(key)["graphs_captured"]
    out = {"captured": logs, "comparisons": {}}
    ok = True
    for a, b in (("graphs", "prefill-graphs-off"), ("graphs", "no-graphs"), ("prefill-graphs-off", "no-graphs")):
        comparison = compare_records(runs[a], runs[b], "bfloat16")
        out["comparisons"][f"{a} vs {b}"] = comparison
        ok = ok and comparison["pass"]
    expected = {m: dict(zip(("decode", "prefill"), EXPECTED_GRAPHS[m])) for m in logs}
    out["log_as_expected"] = logs == expected
    out["pass"] = bool(ok and out["log_as_expected"])
    return out


def _parity(arch, dtype):
    return Check(f"parity-{arch}-{ {'bfloat16': 'bf16', 'float32': 'fp32'}[dtype]}",
                 lambda smoke: check_parity(smoke, arch, dtype), (EngineKey(arch, dtype, capture=dtype == "float32"),))


CHECKS = {c.name: c for c in [
    _parity("llama", "bfloat16"),
    Check("teacher-forced", check_teacher_forced, (LLAMA_BF16,)),
    Check("radix", check_radix, (LLAMA_BF16,)),
    Check("isolation", lambda smoke: check_isolation(smoke, "graphs"), (LLAMA_BF16,)),
    Check("swap-pause", check_swap_pause, (LLAMA_BF16,)),
    _parity("llama", "float32"),
    Check("graphs", check_graphs, tuple(EngineKey("llama", "bfloat16", m)
                                        for m in ("graphs", "prefill-graphs-off", "no-graphs"))),
    Check("isolation-no-overlap", lambda smoke: check_isolation(smoke, "no-overlap"),
          (EngineKey("llama", "bfloat16", "no-overlap"),)),
    _parity("qwen2", "bfloat16"),
    _parity("qwen2", "float32"),
]}


# -- main ----------------------------------------------------------------------------------------

def versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("sglang", "sglang-kernel", "transformers", "torch"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    try:  # not through torch: this process leaves the GPU to the workers
        out["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                    text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["gpu"] = None
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, list(CHECKS))
    if args.report:
        return report(json.loads(args.report.read_text()))
    args.out.mkdir(parents=True, exist_ok=True)
    unwind_on_sigterm()  # a stopped smoke still stops its worker
    started = time.monotonic()
    smoke = Smoke(args)
    result = {"versions": versions(), "checks_asked": args.checks, "budget_s": args.budget_s,
              "chunked_prefill_size": args.chunked_prefill_size, "checks": {}, "engines": smoke.engines.info}

    def record(results: dict) -> None:
        result["checks"] = results
        result["elapsed_s"] = round(time.monotonic() - started, 1)
        (args.out / "sglang_smoke.json").write_text(json.dumps(result, indent=1, default=str))

    try:
        smoke.prepare()
        run_checks([CHECKS[name] for name in args.checks], smoke, args.budget_s, smoke.estimate, record,
                   started=started)
    except Exception as exc:  # the models or probes could not be built
        result["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        smoke.engines.stop()
        record(result["checks"])
        report(result)


def report(result: dict) -> None:
    print(f"versions: {result['versions']}  elapsed {result.get('elapsed_s')} s")
    for label, info in result["engines"].items():
        listing = (info.get("listing") or {}).get("transfer") or {}
        lost = (info.get("health") or {}).get("score_steps_lost")
        print(f"  {label:34} ready {info.get('ready_s', '-'):>6} s  graphs {info.get('graphs_captured')}"
              f"  mid-forward steps {listing.get('mid_forward_steps')}/{listing.get('submitted_steps')}"
              f"  steps lost {lost}" + (f"  START FAILED: {info['start_error'][:160]}" if "start_error" in info else ""))
    print(f"{'check':22} {'status':8} {'s':>6}  numbers")
    for name, r in result["checks"].items():
        keys = ("max_rel_diff", "max_abs_diff", "allowed_abs", "residual_cos_min", "problems",
                "closest_to_own_token", "with_neighbours", "log_as_expected", "streams_finished_cleanly", "lost")
        numbers = {k: r[k] for k in keys if k in r}
        for sub in ("together_vs_alone",):
            if sub in r:
                numbers["diff/std"] = round(r[sub]["max_diff_over_std"], 4)
        for pair, c in (r.get("comparisons") or {}).items():
            numbers[pair] = f"{c['identical_token_sequences']}/{c['requests']} same, diff/std {c['max_diff_over_std']:.4f}"
        if r.get("status") == "error":
            numbers = {"error": r["error"].strip().splitlines()[-1][:160]}
        if r.get("status") == "skipped":
            numbers = {"reason": r["reason"]}
        print(f"{name:22} {r.get('status', '?'):8} {r.get('seconds', '-'):>6}  {json.dumps(numbers, default=str)[:400]}")


if __name__ == "__main__":
    main()
