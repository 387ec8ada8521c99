"""Running the gateway (`probex gateway`) and the embedded stack (`probex serve`)."""

from __future__ import annotations

import gc
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from gateway.app import GatewayConfig, create_app
from gateway.policy import PolicyError, load_policy

log = logging.getLogger("probex.serve")


class ServerThread:
    """uvicorn in a background thread (tests, benchmarks, `probex serve`)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout: float = 30) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    @property
    def url(self) -> str:
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def run_gateway(config: GatewayConfig, host: str, port: int) -> None:
    try:
        app = create_app(config)
    except PolicyError as exc:
        raise SystemExit(f"probex gateway: {exc}") from None
    # What start-up built (modules, schemas, the app) lives as long as the process: keep it out of the
    # cyclic collector's full passes, which otherwise take tens of milliseconds mid-stream.
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=host, port=port, log_level="info")


def run_embedded(policy_path: Path, model: str, host: str, port: int, worker_port: int, redis_url: str | None,
                 worker_args: list[str]) -> None:
    """Worker + gateway on one machine: the `make run` default."""
    try:
        policy = load_policy(policy_path)
    except PolicyError as exc:
        raise SystemExit(f"probex serve: {exc}") from None
    token = os.environ.get("PROBEX_ADMIN_TOKEN") or secrets.token_urlsafe(24)
    cmd = [sys.executable, "-m", "probex.cli", "worker", "--model", model, "--port", str(worker_port),
           "--admin-token", token, *[f"--probe={d}" for d in policy.probe_dirs], *worker_args]
    print(f"probex serve: starting worker on :{worker_port} ({len(policy.probes)} probes); first start compiles, "
          "allow a minute or two", flush=True)
    worker = subprocess.Popen(cmd, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{worker_port}"
        while True:
            if worker.poll() is not None:
                raise SystemExit(f"probex serve: worker exited with code {worker.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        print(f"probex serve: worker ready; gateway on http://{host}:{port}/v1 (OpenAI-compatible)", flush=True)
        config = GatewayConfig(policy_path=policy_path, upstreams=[url], worker_admin_token=token,
                               redis_url=redis_url)
        run_gateway(config, host, port)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
