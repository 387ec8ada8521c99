"""The gateway's settings (what `probex gateway` and `probex serve` configure)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


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
