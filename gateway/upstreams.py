"""The workers behind the gateway: least-outstanding choice among healthy upstreams.

Health: every few seconds each worker's `/health` and `/v1/models` are asked for. A worker that
refuses the connection is gone and is taken out of the choice at once. A worker that answers
late or with an error status may only be busy (a CPU engine under load answers its health
check after the requests it is computing), so it is taken out after `UNHEALTHY_AFTER_CHECKS`
such checks in a row; one passing check brings any worker back. A request that cannot reach a
worker also takes it out at once (gateway/errors.py)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from gateway.metrics import GatewayMetrics

log = logging.getLogger("probex.upstreams")


UNHEALTHY_AFTER_CHECKS = 3  # late or failed health checks in a row that take an answering worker out


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
    failed_checks: int = 0  # health checks in a row that failed without a refused connection


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
            upstream.healthy, upstream.last_error, upstream.failed_checks = True, None, 0
        except (httpx.HTTPError, ValueError) as exc:
            upstream.failed_checks += 1
            upstream.last_error = f"{type(exc).__name__}: {exc}"
            gone = isinstance(exc, httpx.ConnectError)  # refused or unroutable: nothing listens there
            if upstream.healthy and (gone or upstream.failed_checks >= UNHEALTHY_AFTER_CHECKS):
                log.warning("probex: upstream %s failed its health check (%d in a row), taken out: %s",
                            upstream.url, upstream.failed_checks, upstream.last_error)
                upstream.healthy = False
            elif upstream.healthy:
                log.info("probex: upstream %s was late or failed its health check (%d in a row): %s",
                         upstream.url, upstream.failed_checks, upstream.last_error)
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
