"""Running the gateway (`probex gateway`), and uvicorn in a thread for tests and benchmarks."""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time

import uvicorn

from gateway.app import GatewayConfig, create_app
from gateway.auth import AdminKeyError
from gateway.policy import PolicyError

log = logging.getLogger("probex.serve")


class ServerThread:
    """uvicorn in a background thread (tests, benchmarks, `probex serve`)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, drain_timeout_s: float | None = None) -> None:
        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                     timeout_graceful_shutdown=drain_timeout_s)
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
        app = create_app(dataclasses.replace(config, listen_host=host))
    except (PolicyError, AdminKeyError) as exc:
        raise SystemExit(f"probex gateway: {exc}") from None
    # What start-up built (modules, schemas, the app) lives as long as the process: keep it out of the
    # cyclic collector's full passes, which otherwise take tens of milliseconds mid-stream.
    gc.collect()
    gc.freeze()
    # On SIGTERM uvicorn stops accepting, lets the requests in flight (streams too) finish for up
    # to the drain timeout, then cancels what is left.
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=config.drain_timeout_s)
