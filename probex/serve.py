"""`probex serve`: a worker and the gateway on one machine — the embedded default behind `make run`."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

from gateway.app import GatewayConfig
from gateway.auth import AdminKeyError, Authenticator, load_admin_keys
from gateway.policy import PolicyError, load_policy
from gateway.serving import run_gateway
from probex.processes import WorkerExited, port_taken, unwind_on_sigterm, wait_until_healthy


def worker_command_line(model: str, worker_port: int, probe_dirs, worker_args: list[str]) -> list[str]:
    """`probex worker` as `probex serve` starts it (its admin token goes in its environment)."""
    return [sys.executable, "-m", "probex.cli", "worker", "--model", model, "--port", str(worker_port),
            *[f"--probe={d}" for d in probe_dirs], *worker_args]


def run_embedded(policy_path: Path, model: str, host: str, port: int, worker_port: int, redis_url: str | None,
                 worker_args: list[str], worker_command: list[str] | None = None,
                 admin_key_file: str | None = None) -> None:
    """`worker_command` replaces `probex worker` (tests start a stand-in)."""
    try:
        policy = load_policy(policy_path)
        admin_keys = load_admin_keys(admin_key_file)
        Authenticator(admin_keys, host).check_startup(policy, host)
    except (PolicyError, AdminKeyError) as exc:
        raise SystemExit(f"probex serve: {exc}") from None
    # The worker's live-swap endpoint needs a token; the gateway is the only one told it. It goes
    # to the worker in its environment, not its command line: there every local user's `ps`
    # would show it, and a token starting with "-" (one in 64 of token_urlsafe's) would read as
    # an option, so the worker refused to start.
    token = os.environ.get("PROBEX_ADMIN_TOKEN") or secrets.token_urlsafe(24)
    cmd = worker_command or worker_command_line(model, worker_port, policy.probe_dirs, worker_args)
    # Checked before the worker's minute of start-up; besides, a worker port already served (by a
    # worker left from an earlier start, say) would pass the health check below for ours.
    for role, where, number in (("gateway", host, port), ("worker", "127.0.0.1", worker_port)):
        try:
            taken = port_taken(where, number)
        except OSError as exc:
            raise SystemExit(f"probex serve: cannot listen on {where}:{number} ({role}): {exc}") from None
        if taken:
            flag = "--port" if role == "gateway" else "--worker-port"
            raise SystemExit(f"probex serve: port {number} ({role}) is in use; stop what listens there or pick "
                             f"another with {flag}")
    # The worker runs in a session of its own (a terminal's Ctrl-C reaches this process, which
    # stops it in order), so a `kill` of this process must also end in the `finally` below
    # (uvicorn, which catches SIGTERM while serving, raises it again once the gateway is down).
    unwind_on_sigterm()
    print(f"probex serve: starting worker on :{worker_port} ({len(policy.probes)} probes); first start compiles, "
          "allow a minute or two", flush=True)
    worker = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, "PROBEX_ADMIN_TOKEN": token})
    try:
        url = f"http://127.0.0.1:{worker_port}"
        try:
            wait_until_healthy(worker, url)
        except WorkerExited as exc:
            raise SystemExit(f"probex serve: {exc}") from None
        print(f"probex serve: worker ready; gateway on http://{host}:{port}/v1 (OpenAI-compatible)", flush=True)
        config = GatewayConfig(policy_path=policy_path, upstreams=[url], worker_admin_token=token, redis_url=redis_url,
                               listen_host=host, admin_keys=admin_keys)
        run_gateway(config, host, port)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the worker's stop short
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
