"""The active policy: live reload (file watch, admin request, other replicas), probe pushes, retention polling."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import httpx

from gateway.audit import POLICY_VERSION_KEY, AuditSink
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.policy import LoadedPolicy, PolicyError, load_policy
from gateway.upstreams import UpstreamPool

log = logging.getLogger("probex.gateway")


class PolicyManager:
    """Holds the active policy; a reload validates, pushes probes to every worker, then swaps."""

    def __init__(self, config: GatewayConfig, pool: UpstreamPool, metrics: GatewayMetrics, audit: AuditSink) -> None:
        self.config, self.pool, self.metrics, self.audit = config, pool, metrics, audit
        self.current: LoadedPolicy = load_policy(config.policy_path)
        self._lock = asyncio.Lock()
        self.last_error: str | None = None
        self.retention: dict[str, float] = {}

    async def push_probes(self, probe_dirs: list[str]) -> None:
        for upstream in self.pool.upstreams:
            try:
                r = await self.pool.client.put(upstream.url + "/probex/probes", json={"probes": probe_dirs},
                                               timeout=30)
            except httpx.HTTPError as exc:
                raise PolicyError(f"worker {upstream.url} unreachable while swapping probes: {exc}") from None
            if r.status_code != 200:
                try:
                    message = r.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = r.text[:300]
                raise PolicyError(f"worker {upstream.url} refused the probe set: {message}")

    async def reload(self, reason: str) -> tuple[bool, str]:
        async with self._lock:
            try:
                return await self._reload(reason)
            except Exception as exc:
                # A reload is reached from the watcher and the replica follower too: an exception
                # escaping here would end those tasks and with them every later live reload.
                log.exception("probex: policy reload (%s) failed unexpectedly", reason)
                return self._failed(f"reload failed unexpectedly ({type(exc).__name__}: {exc})", reason)

    async def _reload(self, reason: str) -> tuple[bool, str]:
        try:
            candidate = load_policy(self.config.policy_path)
        except PolicyError as exc:
            return self._failed(str(exc), reason)
        except Exception as exc:  # the file is what is new, so a crash on it refuses the file
            log.exception("probex: policy reload (%s): loading %s crashed", reason, self.config.policy_path)
            return self._failed(f"{self.config.policy_path}: cannot load policy ({type(exc).__name__}: {exc})",
                                reason)
        if candidate.version == self.current.version:
            self.last_error = None  # the file again matches what is served: an earlier refusal is history
            return True, f"policy {candidate.version} unchanged"
        if candidate.probe_dirs != self.current.probe_dirs or candidate.probe_digests != self.current.probe_digests:
            try:
                await self.push_probes(candidate.probe_dirs)
            except PolicyError as exc:
                try:  # put back what the old policy serves on workers that did take the new set
                    await self.push_probes(self.current.probe_dirs)
                except PolicyError:
                    log.exception("probex: rollback of the probe set failed")
                return self._failed(str(exc), reason)
        previous, self.current = self.current, candidate
        self.metrics.reloads.labels(result="ok").inc()
        self.metrics.set_policy(candidate)
        await self.audit.publish_policy_version(candidate.version)
        self.last_error = None
        log.info("probex: policy %s -> %s (%s)", previous.version, candidate.version, reason)
        return True, f"policy {candidate.version} active"

    def _failed(self, message: str, reason: str) -> tuple[bool, str]:
        self.metrics.reloads.labels(result="error").inc()
        self.last_error = message
        log.error("probex: policy reload (%s) rejected, keeping %s: %s", reason, self.current.version, message)
        return False, message

    async def watch(self) -> None:
        from watchfiles import awatch

        path = self.config.policy_path.resolve()
        retry_s = 1.0
        while True:
            try:
                async for changes in awatch(path.parent, debounce=50, step=20):
                    retry_s = 1.0
                    if any(Path(p).resolve() == path for _, p in changes):
                        await self.reload("file changed")
            except Exception:
                # Live reload must outlive a failing watch (its directory replaced, say): watch again,
                # and reload once in case the file changed while nobody watched.
                log.exception("probex: watching %s failed; watching again in %.0f s", path, retry_s)
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, 30.0)
                await self.reload("file watch restarted")
            else:
                return

    async def follow_replicas(self, redis_client, interval_s: float = 1.0) -> None:
        """Replicas sharing a policy file converge on the version one of them published."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                raw = await redis_client.get(POLICY_VERSION_KEY)
                published = json.loads(raw).get("version") if raw else None
            except Exception:  # Redis away, or a value this follower cannot read: not this replica's policy
                continue
            if published and published != self.current.version:
                await self.reload("another replica published a new version")

    async def poll_retention(self) -> None:
        """Read each worker's calibration retention (when it reports one) and raise alarms."""
        threshold = self.current.policy.calibration_alarm_below
        self.metrics.alarm_below.set(threshold)
        for upstream in self.pool.upstreams:
            try:
                health = (await self.pool.client.get(upstream.url + "/probex/health", timeout=2)).json()
            except (httpx.HTTPError, ValueError):
                continue
            for probe, value in (health.get("retention") or {}).items():
                if value is None:
                    continue
                self.retention[probe] = float(value)
                self.metrics.retention.labels(probe=probe).set(value)
                alarm = float(value) < threshold
                self.metrics.alarm.labels(probe=probe).set(1 if alarm else 0)
                if alarm:
                    log.warning("probex: calibration retention alarm: probe %s retention %.3f < %.3f",
                                probe, value, threshold)


async def periodic(fn, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await fn()
        except Exception:
            log.exception("probex: periodic task %s failed", getattr(fn, "__name__", fn))
