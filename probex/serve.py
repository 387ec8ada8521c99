"""`probex serve`: a worker and the gateway on one machine — the embedded default behind `make run`."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
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

    def command() -> list[str]:
        """The worker's command line, with the probe set of the policy as it is now (a restart after a
        live policy change must serve the new probes)."""
        if worker_command is not None:
            return worker_command
        try:
            probe_dirs = load_policy(policy_path).probe_dirs
        except PolicyError:
            probe_dirs = policy.probe_dirs  # the file is broken now; the gateway still serves the last good one
        return worker_command_line(model, worker_port, probe_dirs, worker_args)

    url = f"http://127.0.0.1:{worker_port}"
    worker = WorkerSupervisor(command, {**os.environ, "PROBEX_ADMIN_TOKEN": token}, url)
    try:
        try:
            worker.start_first()
        except WorkerExited as exc:
            raise SystemExit(f"probex serve: {exc}") from None
        print(f"probex serve: worker ready; gateway on http://{host}:{port}/v1 (OpenAI-compatible)", flush=True)
        worker.supervise()
        config = GatewayConfig(policy_path=policy_path, upstreams=[url], worker_admin_token=token, redis_url=redis_url,
                               listen_host=host, admin_keys=admin_keys)
        run_gateway(config, host, port)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the worker's stop short
        worker.stop()


class WorkerSupervisor:
    """Keeps the embedded worker running: one that dies is started again after a backoff (1 s, doubling up
    to 60 s while restarts keep failing, back to 1 s once a worker has run for 5 minutes), and each step is
    logged. The gateway answers 502 meanwhile and routes to the worker again once it is healthy."""

    def __init__(self, command, env: dict[str, str], url: str, backoff_s: float = 1.0, max_backoff_s: float = 60.0,
                 stable_s: float = 300.0) -> None:
        self.command, self.env, self.url = command, env, url
        self.backoff_s, self.max_backoff_s, self.stable_s = backoff_s, max_backoff_s, stable_s
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.restarts = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _spawn(self) -> subprocess.Popen:
        with self._lock:
            if self._stopping.is_set():
                raise WorkerExited(-signal.SIGTERM)
            # A session of its own: a terminal's Ctrl-C reaches this process, which stops the worker in order.
            self.proc = subprocess.Popen(self.command(), start_new_session=True, env=self.env)
            self.started_at = time.monotonic()
        print(f"probex serve: worker started (pid {self.proc.pid})", flush=True)
        return self.proc

    def start_first(self) -> None:
        wait_until_healthy(self._spawn(), self.url)

    def supervise(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="probex-worker-supervisor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        delay = self.backoff_s
        while not self._stopping.is_set():
            code = self.proc.wait()
            if self._stopping.is_set():
                return
            if time.monotonic() - self.started_at >= self.stable_s:
                delay = self.backoff_s  # it had been running fine: not a crash loop
            self.restarts += 1
            print(f"probex serve: worker exited with code {code}; restarting it in {delay:g} s "
                  f"(restart {self.restarts})", flush=True)
            if self._stopping.wait(delay):
                return
            delay = min(delay * 2, self.max_backoff_s)
            try:
                wait_until_healthy(self._spawn(), self.url)
            except WorkerExited as exc:
                print(f"probex serve: restarted worker failed: {exc}", flush=True)
                continue
            print("probex serve: worker ready again", flush=True)

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            worker = self.proc
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
