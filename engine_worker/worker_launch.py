"""`probex worker`'s engine-agnostic half: its arguments, the model and the probes checked
against it, and the tap configuration every engine's launcher hands to its engine.

Each engine folder's launch.py builds its engine's command line from `validated_tap`; the
`--engine` choice is made in probex/cli.py.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import tempfile
import uuid
from pathlib import Path

from probes.artifact import ProbeFormatError, ProbeMismatchError, ServedModel, check_probe_set, load_probe
from probes.steering import check_vector_set, load_vector
from engine_worker.settings import ADMIN_TOKEN, refuse_removed_settings
from engine_worker.tap.config import TapConfig

ENGINES = ("vllm", "sglang")


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="vllm",
                        help="the serving engine (default: vllm); its own options pass through to it")
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
                        help="run an engine version ProbeX is not verified with (warns once)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (beyond loopback an admin token is required)")
    parser.add_argument("--port", type=int, default=8100)


def refuse_removed(args: argparse.Namespace) -> None:
    """Retired settings and flags stop the start, each naming what replaces it (settings.REMOVED);
    so does a worker listening beyond loopback without an admin token."""
    refuse_removed_settings()
    if getattr(args, "removed_score_formatter", False):
        raise SystemExit("probex worker: --score-formatter / --no-score-formatter are gone: the score formatter"
                         " always runs beside the worker; drop the flag")
    if not args.admin_token and not is_loopback(args.host):
        raise SystemExit(f"probex worker: --host {args.host} is beyond loopback: give the worker an admin token"
                         " (--admin-token TOKEN or PROBEX_ADMIN_TOKEN; the gateway sends it with --worker-admin-token),"
                         " or listen on 127.0.0.1")


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, or "localhost") is reachable from this machine only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve beyond this machine
        return False


def validated_tap(args: argparse.Namespace, api_servers: int = 1) -> tuple[Path, TapConfig]:
    """The model directory and the tap configuration, once the probes, layers and steering
    vectors are checked against the model; a startup refusal (SystemExit) naming the file
    or option and the problem otherwise."""
    model_dir = resolve_model(args.model)
    served = ServedModel.from_model_dir(model_dir)
    probes = load_or_refuse(lambda: [load_probe(d, served) for d in args.probe], check_probe_set)
    layers = sorted({p.layer for p in probes} | set(args.layer))
    refuse_layers_out_of_range(layers, "--layer", served, model_dir)
    if not layers:
        raise SystemExit("probex worker: give at least one --probe or --layer to tap")
    if args.steer_vectors < 1:
        raise SystemExit("probex worker: --steer-vectors must be at least 1")
    vectors = load_or_refuse(lambda: [load_vector(d, served) for d in args.steer_vector], check_vector_set)
    steer_layers = sorted({v.layer for v in vectors} | set(args.steer_layer))
    refuse_layers_out_of_range(steer_layers, "--steer-layer", served, model_dir)
    for layer in steer_layers:
        count = sum(v.layer == layer for v in vectors)
        if count > args.steer_vectors:
            raise SystemExit(f"probex worker: refusing to start: {count} steering vectors at layer {layer} exceed"
                             f" --steer-vectors {args.steer_vectors}")
    capture_rows = 0
    if args.capture_dir:
        Path(args.capture_dir).mkdir(parents=True, exist_ok=True)
        capture_rows = 1 << 30  # clipped to the engine's rows per step when the tap is built
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
    return model_dir, tap


def load_or_refuse(load, check_set):
    """Artifacts loaded and checked as a set, or the worker refuses to start naming the file and problem."""
    try:
        artifacts = load()
        check_set(artifacts)
    except (ProbeFormatError, ProbeMismatchError) as exc:
        raise SystemExit(f"probex worker: refusing to start: {exc}") from None
    return artifacts


def refuse_layers_out_of_range(layers: list[int], flag: str, served: ServedModel, model_dir: Path) -> None:
    for layer in layers:
        if not 0 <= layer < served.num_hidden_layers:
            raise SystemExit(
                f"probex worker: refusing to start: {flag} {layer} is out of range for {model_dir}"
                f" ({served.num_hidden_layers} decoder layers)"
            )


def flag_values(passthrough: list[str], flags: tuple[str, ...]) -> list[tuple[str, str]]:
    """(flag, value) for each of `flags` among the engine's arguments, as `--flag V` or `--flag=V`."""
    found = []
    for i, arg in enumerate(passthrough):
        flag, _, value = arg.partition("=")
        if flag in flags:
            found.append((flag, value or (passthrough[i + 1] if i + 1 < len(passthrough) else "")))
    return found


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
