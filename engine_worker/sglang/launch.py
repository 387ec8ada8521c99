"""`probex worker --engine sglang`: SGLang's OpenAI server with the ProbeX tap and middleware.

The probes are checked against the model as for vLLM (engine_worker/worker_launch.py); then
SGLang starts through serve.py, which adds the middleware to SGLang's app. The tap
configuration travels in PROBEX_TAP_CONFIG, which every SGLang process inherits; the plugin
(`sglang.srt.plugins` entry point, plugin.py) patches each of them.

Refused before anything starts, naming the option: what ProbeX does not serve on SGLang
(steering; tensor, pipeline and data parallelism, data-parallel attention; speculative
decoding, whose draft model would be tapped too; two-batch overlap, PD multiplexing and
disaggregation, whose batches are split or prebuilt; several tokenizer workers, each of which
would need the score hub; prefill without chunks, which leaves a step's rows unbounded).
serve.py checks the parsed server arguments again (a `--config` file, an abbreviated flag).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from engine_worker.settings import ADMIN_TOKEN, TAP_CONFIG
from engine_worker.worker_launch import flag_values, refuse_removed, validated_tap

SERVE_MODULE = "engine_worker.sglang.serve"

# flag -> what is refused, for flags whose value must be 1 (SGLang's names, aliases and the
# short forms its parser accepts as abbreviations)
_MUST_BE_ONE = {
    ("--tp", "--tp-size", "--tensor-parallel-size"): "tensor parallelism is not available on SGLang yet; run one GPU"
                                                    " per worker behind the gateway",
    ("--pp", "--pp-size", "--pipeline-parallel-size"): "pipeline parallelism is not available with ProbeX",
    ("--dp", "--dp-size", "--data-parallel-size"): "ProbeX delivers the scores of one engine per worker; run a"
                                                  " worker per engine behind the gateway",
    ("--tokenizer-worker-num",): "one tokenizer worker only: it is the API server that relays the scores",
}
# flags refused whatever their value
_REFUSED = {
    "--enable-dp-attention": "data-parallel attention splits a step's rows across engines",
    "--speculative-algorithm": "speculative decoding is not available with ProbeX (its draft model would be"
                               " tapped too, and verified rows are no tokens yet)",
    "--speculative-draft-model-path": "speculative decoding is not available with ProbeX",
    "--speculative-draft-model": "speculative decoding is not available with ProbeX",
    "--enable-two-batch-overlap": "two-batch overlap splits a step into micro-batches the tap does not place",
    "--enable-pdmux": "PD multiplexing splits prefills the tap does not place",
    "--disaggregation-mode": "prefill/decode disaggregation is not available with ProbeX",
}
_STEERING = "steering is not available on SGLang yet: start without --steer-layer / --steer-vector"


def refuse_sglang_options(args: argparse.Namespace, passthrough: list[str]) -> None:
    if args.steer_layer or args.steer_vector:
        raise SystemExit(f"probex worker: refusing to start: {_STEERING}")
    for flags, why in _MUST_BE_ONE.items():
        for flag, value in flag_values(passthrough, flags):
            if value.strip() != "1":
                raise SystemExit(f"probex worker: refusing to start: {flag} {value or '(missing)'}: {why}")
    for flag, value in flag_values(passthrough, tuple(_REFUSED)):
        if flag == "--disaggregation-mode" and value.strip() == "null":
            continue
        raise SystemExit(f"probex worker: refusing to start: {flag}: {_REFUSED[flag]}")
    for flag, value in flag_values(passthrough, ("--chunked-prefill-size",)):
        try:
            chunk = int(value)
        except ValueError:
            chunk = 0
        if chunk <= 0:
            raise SystemExit(f"probex worker: refusing to start: {flag} {value or '(missing)'}: the tap needs"
                             " chunked prefill (a bound on a step's tokens); give a positive size")
    if any(arg == "--model-path" or arg.startswith("--model-path=") for arg in passthrough):
        raise SystemExit("probex worker: refusing to start: give the model with --model, not --model-path")


def build_worker_command(args: argparse.Namespace, passthrough: list[str]) -> tuple[list[str], dict[str, str]]:
    """Validate the probes against the model and the SGLang options, then return (argv, env)
    that start SGLang's server through serve.py."""
    refuse_removed(args)
    refuse_sglang_options(args, passthrough)
    model_dir, tap = validated_tap(args, api_servers=1)
    argv = [
        sys.executable, "-W", "ignore::DeprecationWarning", "-m", SERVE_MODULE,
        "--model-path", str(model_dir), "--host", args.host, "--port", str(args.port),
        *_served_name(args.model, passthrough),
        *passthrough,
    ]
    env = dict(os.environ)
    env[TAP_CONFIG] = tap.to_json()  # read by every SGLang process (models.py, runner.py) and the middleware
    if args.admin_token:
        env[ADMIN_TOKEN] = args.admin_token
    else:
        env.pop(ADMIN_TOKEN, None)
    return argv, env


def _served_name(requested: str, passthrough: list[str]) -> list[str]:
    """A model asked for by its short name is served under that name (SGLang takes one)."""
    if Path(requested).expanduser().is_dir() or any(a.startswith("--served-model-name") for a in passthrough):
        return []
    return ["--served-model-name", requested]


def run_worker(args: argparse.Namespace, passthrough: list[str]) -> None:
    argv, env = build_worker_command(args, passthrough)
    os.execvpe(argv[0], argv, env)
