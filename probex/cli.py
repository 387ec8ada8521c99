"""The `probex` command."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

DEFAULT_POLICY = "config/policy.yaml"


def main(argv: list[str] | None = None) -> int | None:
    parser = argparse.ArgumentParser(prog="probex", description="ProbeX: inline probe monitoring for LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="fetch and cache known models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    fetch = model_sub.add_parser("fetch", help="build the bf16 HF directory of a known model")
    fetch.add_argument("name")
    fetch.add_argument("--force", action="store_true")

    worker = sub.add_parser(
        "worker",
        help="serve an engine's OpenAI API with the ProbeX tap: vLLM, or SGLang with --engine sglang"
             " (unknown options pass through to the engine)",
    )
    from engine_worker.worker_launch import add_worker_arguments

    add_worker_arguments(worker)

    gateway = sub.add_parser("gateway", help="run the OpenAI-compatible monitoring proxy in front of workers")
    gateway.add_argument("--config", default=DEFAULT_POLICY, help="policy YAML (watched for live reload)")
    gateway.add_argument("--upstream", action="append", default=[], metavar="URL", help="worker URL (repeatable)")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8000)
    gateway.add_argument("--redis", default=None, metavar="URL", help="audit + shared state in Redis (default: JSONL)")
    gateway.add_argument("--worker-admin-token", default=None, help="the workers' token, sent as a bearer token on "
                         "every call to them (default: $PROBEX_ADMIN_TOKEN)")
    gateway.add_argument("--client-stall-timeout", type=float, default=30.0, metavar="S",
                         help="drop a stream whose caller reads nothing for S seconds (aborting its upstream request)")
    gateway.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                         help="on SIGTERM, how long requests in flight may take to finish")
    gateway.add_argument("--admin-key-file", default=None, metavar="FILE", help="admin keys, one name:key a line "
                         "(default: $PROBEX_ADMIN_KEYS_FILE; also $PROBEX_ADMIN_KEYS=name:key,...); required "
                         "unless --host is loopback")

    serve = sub.add_parser("serve", help="worker + gateway together (the embedded default behind `make run`)")
    serve.add_argument("--config", default=DEFAULT_POLICY)
    serve.add_argument("--model", default="smollm2-135m-instruct")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--worker-port", type=int, default=8100)
    serve.add_argument("--redis", default=None, metavar="URL")
    serve.add_argument("--admin-key-file", default=None, metavar="FILE",
                       help="admin keys, one name:key a line (as for `probex gateway`)")

    extract = sub.add_parser("extract", help="residual activations through the serving tap (capture mode)")
    from probex.extract import add_extract_arguments

    add_extract_arguments(extract)

    steer_vector = sub.add_parser("steer-vector", help="a steering vector: difference of means of two prompt sets"
                                  " at a layer, through the tap's capture mode")
    from probex.steer_vector import add_steer_vector_arguments

    add_steer_vector_arguments(steer_vector)

    evaluate = sub.add_parser("eval", help="a probe's AUROC from served scores vs offline activations")
    from probex.eval_served import add_eval_arguments

    add_eval_arguments(evaluate)

    train = sub.add_parser("train", help="fit a probe on labelled prompts and write a probe artifact")
    from probex.train_cli import add_train_arguments

    add_train_arguments(train)

    quantize = sub.add_parser("quantize", help="write a fake-quantized (RTN) copy of a model")
    from probex.quantize import add_quantize_arguments

    add_quantize_arguments(quantize)

    calibrate = sub.add_parser("calibrate", help="relative calibration retention of probes on a model")
    from probex.calibrate import add_calibrate_arguments

    add_calibrate_arguments(calibrate)

    thresholds = sub.add_parser("thresholds", help="score thresholds at chosen false-positive rates, measured on"
                                " benign prompts through a worker; written into probe.yaml and a policy")
    from probex.thresholds_cli import add_thresholds_arguments

    add_thresholds_arguments(thresholds)

    schema = sub.add_parser("policy-schema", help="write the policy JSON Schema")
    schema.add_argument("--out", default="config/policy.schema.json")

    args, extra = parser.parse_known_args(argv)
    if args.command == "worker":  # it passes its signals on to vLLM (engine_worker/vllm/child.py)
        return _run(parser, args, extra)
    from probex.processes import Terminated, unwind_on_sigterm

    previous = unwind_on_sigterm()
    try:
        return _run(parser, args, extra)
    except Terminated:
        raise SystemExit(0) from None  # a stop that was asked for, and done in order (drained, workers stopped)
    except ValueError as exc:
        if not isinstance(exc, _user_errors()):
            raise  # anything else is a bug: its traceback is what finds it
        # A bad dataset or probe a command did not refuse itself: the message already names the
        # file and the fault, so it reads as the commands' own refusals do.
        raise SystemExit(f"probex {args.command}: {exc}") from None
    finally:
        if previous is not None:  # main() may be called in a process that goes on (tests)
            signal.signal(signal.SIGTERM, previous)


def _user_errors() -> tuple[type[ValueError], ...]:
    """Errors whose message says which file is wrong and why: the user's to fix, not a bug in ProbeX."""
    from probes.artifact import ProbeFormatError, ProbeMismatchError
    from probes.datasets import DatasetError

    return DatasetError, ProbeFormatError, ProbeMismatchError


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> int | None:
    if args.command not in ("worker", "serve") and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")

    if args.command == "model":
        from probes.models import fetch_model

        print(fetch_model(args.name, force=args.force))
    elif args.command == "worker":
        if args.engine == "sglang":
            from engine_worker.sglang.launch import run_worker
        else:
            from engine_worker.vllm.launch import run_worker

        run_worker(args, extra)
    elif args.command == "gateway":
        import os

        from gateway.app import GatewayConfig
        from gateway.auth import AdminKeyError, load_admin_keys
        from gateway.serving import run_gateway

        if not args.upstream:
            parser.error("gateway: give at least one --upstream URL")
        try:
            config = GatewayConfig(policy_path=Path(args.config), upstreams=args.upstream, redis_url=args.redis,
                                   worker_admin_token=args.worker_admin_token or os.environ.get("PROBEX_ADMIN_TOKEN"),
                                   listen_host=args.host, admin_keys=load_admin_keys(args.admin_key_file),
                                   client_stall_timeout_s=args.client_stall_timeout, drain_timeout_s=args.drain_timeout)
        except (AdminKeyError, ValueError) as exc:
            raise SystemExit(f"probex gateway: {exc}") from None
        run_gateway(config, args.host, args.port)
    elif args.command == "serve":
        from engine_worker.vllm.launch import resolve_model
        from probex.serve import run_embedded

        worker_args = extra or ["--max-model-len", "4096", "--gpu-memory-utilization", "0.25"]
        resolve_model(args.model)  # refuse now, not after the gateway's banner, if it is not fetched
        # The name, not the resolved path, goes to the worker: it then serves the model under that name.
        run_embedded(Path(args.config), args.model, args.host, args.port, args.worker_port, args.redis, worker_args,
                     admin_key_file=args.admin_key_file)
    elif args.command == "extract":
        from probex.extract import run_extract

        run_extract(args)
    elif args.command == "steer-vector":
        from probex.steer_vector import run_steer_vector

        run_steer_vector(args)
    elif args.command == "eval":
        from probex.eval_served import run_eval

        run_eval(args)
    elif args.command == "train":
        from probex.train_cli import run_train

        run_train(args)
    elif args.command == "quantize":
        from probex.quantize import run_quantize

        run_quantize(args)
    elif args.command == "calibrate":
        from probex.calibrate import run_calibrate

        run_calibrate(args)
    elif args.command == "thresholds":
        from probex.thresholds_cli import run_thresholds

        run_thresholds(args)
    elif args.command == "policy-schema":
        from gateway.policy import policy_json_schema

        try:
            Path(args.out).write_text(json.dumps(policy_json_schema(), indent=2) + "\n")
        except OSError as exc:
            raise SystemExit(f"probex policy-schema: cannot write {args.out}: {exc.strerror or exc}") from None
        print(args.out)


if __name__ == "__main__":
    sys.exit(main())
