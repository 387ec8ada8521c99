"""The `probex` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="probex", description="ProbeX: inline probe monitoring for LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="fetch and cache known models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    fetch = model_sub.add_parser("fetch", help="build the bf16 HF directory of a known model")
    fetch.add_argument("name")
    fetch.add_argument("--force", action="store_true")

    worker = sub.add_parser(
        "worker",
        help="serve vLLM's OpenAI API with the ProbeX tap (unknown options pass through to `vllm serve`)",
    )
    from engine_worker.launch import add_worker_arguments

    add_worker_arguments(worker)

    args, extra = parser.parse_known_args(argv)
    if args.command != "worker" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")

    if args.command == "model":
        from probex.models import fetch_model

        print(fetch_model(args.name, force=args.force))
    elif args.command == "worker":
        from engine_worker.launch import run_worker

        run_worker(args, extra)


if __name__ == "__main__":
    sys.exit(main())
