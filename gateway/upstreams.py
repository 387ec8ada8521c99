"""The workers behind the gateway: least-outstanding choice among healthy upstreams."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from gateway.metrics import GatewayMetrics

log = logging.getLogger("probex.upstreams")


class NoHealthyUpstream(Exception):
    pass


class WorkerAuth(httpx.Auth):
    """`Authorization: Bearer <worker token>` on requests to the configured workers, and on no other URL."""

    def __init__(self, token: str | None, upstream_urls: list[str]) -> None:
        self.header = f"Bearer {token}" if token else None
        self.prefixes = [u.rstrip("/") + "/" for u in upstream_urls]

    def applies_to(self, url: str) -> bool:
        return self.header is not None and any(url.startswith(prefix) for prefix in self.prefixes)

    def auth_flow(self, request: httpx.Request):
        if self.applies_to(str(request.url)):
            request.headers["Authorization"] = self.header
        else:
            request.headers.pop("Authorization", None)
        yield request


@dataclass
class Upstream:
    url: str
    healthy: bool = True
    outstanding: int = 0
    models: set[str] = field(default_factory=set)
    last_error: str | None = None


class UpstreamPool:
    def __init__(self, urls: list[str], client: httpx.AsyncClient, metrics: GatewayMetrics) -> None:
        if not urls:
            raise ValueError("at least one --upstream URL is needed")
        self.upstreams = [Upstream(u.rstrip("/")) for u in urls]
        self.client = client
        self.metrics = metrics
        self._task: asyncio.Task | None = None

    def pick(self, avoid: list[Upstream] | tuple = ()) -> Upstream:
        best = None
        for u in self.upstreams:  # on every request: a loop, not a list and a key function
            if u.healthy and (best is None or u.outstanding < best.outstanding) and u not in avoid:
                best = u
        if best is None:
            raise NoHealthyUpstream("no healthy upstream worker")
        return best

    @property
    def models(self) -> set[str]:
        if len(self.upstreams) == 1:  # the common case, on every request: no new set
            only = self.upstreams[0]
            return only.models if only.healthy else set()
        return set().union(*(u.models for u in self.upstreams if u.healthy))

    async def check(self, upstream: Upstream) -> None:
        try:
            health = await self.client.get(upstream.url + "/health", timeout=2.0)
            health.raise_for_status()
            listing = await self.client.get(upstream.url + "/v1/models", timeout=2.0)
            upstream.models = {m["id"] for m in listing.json().get("data", [])}
            if not upstream.healthy:
                log.info("probex: upstream %s is healthy again", upstream.url)
            upstream.healthy, upstream.last_error = True, None
        except (httpx.HTTPError, ValueError) as exc:
            if upstream.healthy:
                log.warning("probex: upstream %s failed its health check: %s: %s", upstream.url, type(exc).__name__, exc)
            upstream.healthy, upstream.last_error = False, f"{type(exc).__name__}: {exc}"
        self.metrics.upstream_healthy.labels(upstream=upstream.url).set(1 if upstream.healthy else 0)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(u) for u in self.upstreams))

    def start(self, interval_s: float = 2.0) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                await self.check_all()

        self._task = asyncio.get_running_loop().create_task(loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
