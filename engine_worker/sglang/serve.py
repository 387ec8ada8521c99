"""SGLang's HTTP server with ProbeX's middleware, as `probex worker --engine sglang` starts it.

SGLang 0.5.14's OpenAI routes live on a module-level FastAPI `app` that `launch_server` serves
in this process; the middleware is added to it before the server starts. The scheduler
processes SGLang spawns load ProbeX's plugin through the `sglang.srt.plugins` entry point,
so this checkout must be installed (its entry points registered) where SGLang runs.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points

PLUGIN = "engine_worker.sglang.plugin:register"


def plugin_problem(environ=None) -> str | None:
    """Why SGLang's processes would not load ProbeX's plugin, or None."""
    environ = os.environ if environ is None else environ
    names = [ep.name for ep in entry_points(group="sglang.srt.plugins") if ep.value == PLUGIN]
    if not names:
        return ("ProbeX's SGLang plugin is not registered: install this checkout (pip install -e .) in the"
                " environment SGLang runs in")
    allowed = environ.get("SGLANG_PLUGINS")
    if allowed and not set(names) & {name.strip() for name in allowed.split(",")}:
        return f"SGLANG_PLUGINS={allowed!r} leaves out ProbeX's plugin ({names[0]!r}); add it or unset SGLANG_PLUGINS"
    return None


def server_args_problem(args) -> str | None:
    """What the parsed server arguments ask for that ProbeX does not serve (launch.py says why)."""
    checks = [
        (getattr(args, "tp_size", 1) != 1, "tensor parallelism (tp_size > 1) is not available on SGLang yet"),
        (getattr(args, "pp_size", 1) != 1, "pipeline parallelism is not available with ProbeX"),
        (getattr(args, "dp_size", 1) != 1, "one engine per worker (dp_size > 1)"),
        (bool(getattr(args, "enable_dp_attention", False)), "data-parallel attention"),
        (getattr(args, "speculative_algorithm", None) not in (None, "", "NONE", "none"), "speculative decoding"),
        (bool(getattr(args, "enable_two_batch_overlap", False)), "two-batch overlap"),
        (bool(getattr(args, "enable_pdmux", False)), "PD multiplexing"),
        (getattr(args, "disaggregation_mode", "null") not in (None, "null"), "prefill/decode disaggregation"),
        ((getattr(args, "tokenizer_worker_num", 1) or 1) != 1, "several tokenizer workers"),
        ((getattr(args, "chunked_prefill_size", None) or 0) <= 0, "prefill without chunks (chunked_prefill_size <= 0)"),
    ]
    refused = [what for bad, what in checks if bad]
    return ", ".join(refused) if refused else None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    problem = plugin_problem()
    if problem:
        raise SystemExit(f"probex worker: refusing to start: {problem}")
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(argv)
    problem = server_args_problem(server_args)
    if problem:
        raise SystemExit(f"probex worker: refusing to start: not served by ProbeX on SGLang: {problem}")
    from sglang.srt.entrypoints.http_server import app, launch_server

    from engine_worker.sglang.api_server import SglangMiddleware
    from engine_worker.sglang.plugin import register

    register()  # this process too (SGLang's load_plugins does it again, idempotently)
    app.add_middleware(SglangMiddleware)
    launch_server(server_args)


if __name__ == "__main__":
    main()
