"""A gateway in front of the mock upstream, both on real sockets, for gateway tests."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import yaml

from gateway.app import GatewayConfig, create_app
from gateway.metrics import GatewayMetrics
from tests.fixtures.mock_upstream import MockState, create_mock_app
from gateway.serving import ServerThread
from probes.artifact import ProbeArtifact, ReadPoint, save_probe


def write_probe(root: Path, name: str, read: ReadPoint = ReadPoint.LAST_PROMPT_TOKEN) -> Path:
    probe = ProbeArtifact(name=name, layer=3, read=read, weight=np.ones(8, np.float32), bias=0.0)
    return save_probe(probe, root / name)


def wait_for_healthy_upstreams(gateway_url: str, timeout_s: float = 60) -> None:
    """Return once the gateway counts an upstream healthy: on a machine loaded by the parallel suite, the
    start-up health check can time out, and the gateway then refuses requests until its next check passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = httpx.get(gateway_url + "/ready", timeout=10).json()
        if not any(reason.startswith("upstream ") for reason in ready["reasons"]):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway's upstreams stayed unhealthy: {ready['reasons']}")
        time.sleep(0.1)


def base_policy(**overrides) -> dict:
    policy = {
        "probes": {"harmful-request": {"path": "probes/harmful-request"}},
        "rules": [{"probe": "harmful-request", "prompt": {"flag": 0.5, "block": 0.9},
                   "generated": {"flag": 0.5, "block": 0.6}}],
        "on_block": "error",
    }
    policy.update(overrides)
    return policy


@dataclass
class Stack:
    gateway: ServerThread
    mock: ServerThread
    state: MockState
    policy_path: Path
    metrics: GatewayMetrics
    app: object

    @property
    def url(self) -> str:
        return self.gateway.url

    def write_policy(self, policy: dict) -> None:
        self.policy_path.write_text(yaml.safe_dump(policy))

    def stop(self) -> None:
        self.gateway.stop()
        self.mock.stop()


def start_stack(tmp_path: Path, policy: dict | None = None, tokens_per_s: float = 500, redis_url: str | None = None,
                extra_probes: tuple[tuple[str, ReadPoint], ...] = (), **settings) -> Stack:
    """`settings` override the GatewayConfig's."""
    write_probe(tmp_path / "probes", "harmful-request")
    for name, read in extra_probes:
        write_probe(tmp_path / "probes", name, read)
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text(yaml.safe_dump(policy or base_policy()))
    state = MockState(["harmful-request"], tokens_per_s, max_tokens=8, admin_token="worker-token")
    mock = ServerThread(create_mock_app(state)).start()
    metrics = GatewayMetrics()
    config = GatewayConfig(**{**dict(policy_path=policy_path, upstreams=[mock.url], worker_admin_token="worker-token",
                                     redis_url=redis_url, audit_path=tmp_path / "audit.jsonl", max_body_bytes=64 * 1024,
                                     upstream_timeout_s=5, connect_timeout_s=1, health_interval_s=0.5), **settings})
    app = create_app(config, metrics)
    gateway = ServerThread(app).start()
    wait_for_healthy_upstreams(gateway.url)
    return Stack(gateway, mock, state, policy_path, metrics, app)
