"""The gateway's settings (what `probex gateway` and `probex serve` configure)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

_HEADER_SAFE = frozenset(chr(c) for c in range(0x21, 0x7F))  # visible ASCII: safe in an HTTP header value


@dataclass
class GatewayConfig:
    policy_path: Path
    upstreams: list[str]
    worker_admin_token: str | None = None
    redis_url: str | None = None
    audit_path: Path = field(default_factory=lambda: Path.home() / ".cache" / "probex" / "audit.jsonl")
    max_body_bytes: int = 1 << 20
    upstream_timeout_s: float = 120.0
    connect_timeout_s: float = 2.0
    watch_policy: bool = True
    health_interval_s: float = 2.0
    client_stall_timeout_s: float = 30.0  # a stream's caller that reads nothing this long is dropped
    drain_timeout_s: float = 30.0  # on SIGTERM: how long streams in flight may take to finish
    listen_host: str = "127.0.0.1"  # where the gateway listens: beyond loopback, admin keys are required
    admin_keys: dict[str, str] = field(default_factory=dict)  # name -> key, besides the policy's

    def __post_init__(self) -> None:
        token = self.worker_admin_token
        if token is not None and (not token or not set(token) <= _HEADER_SAFE):
            raise ValueError("the worker token must be non-empty visible ASCII (it goes in an HTTP header)")
