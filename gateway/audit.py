"""Audit trail of flags and blocks: a bounded Redis stream, or a local JSONL file.

Redis down at runtime: events wait in a bounded in-memory backlog and are retried on the
next event and by a periodic flush; an event pushed out of a full backlog is counted
(`probex_audit_events_total{result="dropped"}`), never silently lost.

Each event lands in the stream once: a write whose reply never came (a timeout after Redis
had applied it, or the request's task cancelled mid-call) is sent again, so every event
carries an id of its own that Redis keeps for `SENT_TTL_S`, and a write of an id it has
seen adds nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from pathlib import Path
from random import getrandbits  # event ids need to be unique, not secret: no syscall

from gateway.metrics import GatewayMetrics

log = logging.getLogger("probex.audit")

AUDIT_STREAM = "probex:audit"
POLICY_VERSION_KEY = "probex:policy_version"
SENT_PREFIX = "probex:audit:sent:"  # + an event's id: set while its write may still be sent again
SENT_TTL_S = 3600

# KEYS: the stream, the event's sent key; ARGV: the sent key's TTL, the stream's approximate
# maximum length, then the event's fields and values. Atomic: the event is added only with the key.
ADD_ONCE = """
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[1]) then
  return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 3))
end
return false
"""


class AuditSink:
    name = "none"

    async def record(self, event: dict) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    async def publish_policy_version(self, version: str) -> None:
        return None

    async def flush(self) -> None:
        return None

    async def close(self) -> None:
        return None


class JsonlAudit(AuditSink):
    name = "jsonl"

    def __init__(self, path: Path, metrics: GatewayMetrics) -> None:
        self.path = path
        self.metrics = metrics
        path.parent.mkdir(parents=True, exist_ok=True)

    async def record(self, event: dict) -> None:
        line = json.dumps(event, separators=(",", ":")) + "\n"
        with self.path.open("a") as fh:
            fh.write(line)
        self.metrics.audit_events.labels(sink=self.name, result="written").inc()


class RedisAudit(AuditSink):
    name = "redis"

    def __init__(self, url: str, metrics: GatewayMetrics, maxlen: int = 100_000, backlog: int = 10_000) -> None:
        import redis.asyncio as aioredis

        self.client = aioredis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        self.metrics = metrics
        self.maxlen = maxlen
        self.add_once = self.client.register_script(ADD_ONCE)
        self.backlog: deque[tuple[str, list]] = deque()  # (event id, flattened fields and values)
        self.backlog_limit = backlog
        self._lock = asyncio.Lock()

    async def record(self, event: dict) -> None:
        if len(self.backlog) >= self.backlog_limit:
            self.backlog.popleft()
            self.metrics.audit_events.labels(sink=self.name, result="dropped").inc()
        fields: list = []
        for k, v in event.items():
            fields += (k, v if isinstance(v, (str, int, float)) else json.dumps(v))
        self.backlog.append((f"{getrandbits(128):032x}", fields))
        await self.flush()

    async def flush(self) -> None:
        async with self._lock:
            while self.backlog:
                event_id, fields = self.backlog[0]
                try:
                    # None when an earlier write of this event landed after all: it is in the stream.
                    await self.add_once(keys=[AUDIT_STREAM, SENT_PREFIX + event_id],
                                        args=[SENT_TTL_S, self.maxlen, *fields])
                except Exception as exc:  # redis down: keep the backlog, retry later
                    self.metrics.audit_events.labels(sink=self.name, result="retry").inc()
                    log.warning("probex audit: Redis unavailable (%s); %d events waiting", exc, len(self.backlog))
                    break
                self.backlog.popleft()
                self.metrics.audit_events.labels(sink=self.name, result="written").inc()
            self.metrics.audit_backlog.set(len(self.backlog))

    async def publish_policy_version(self, version: str) -> None:
        try:
            await self.client.set(POLICY_VERSION_KEY, json.dumps({"version": version, "time": time.time()}))
        except Exception as exc:
            log.warning("probex: could not publish policy version to Redis: %s", exc)

    async def close(self) -> None:
        await self.client.aclose()


def admin_event(*, action: str, actor: str | None, ok: bool, message: str, previous_version: str,
                policy_version: str) -> dict:
    """An admin action: who (the admin key's name, never the key), what, and what came of it."""
    return {"event": "admin", "action": action, "actor": actor or "", "result": "ok" if ok else "rejected",
            "message": message[:500], "previous_version": previous_version, "policy_version": policy_version,
            "time": time.time()}


def audit_event(*, request_id: str, tenant: str, decision: str, probe: str | None, phase: str | None,
                scores: dict, policy_version: str, prompt: str | None = None, thresholds: dict | None = None,
                cascade: list | None = None) -> dict:
    """A monitored request's decision. `thresholds`: those of the deciding rule and phase, each with the
    false-positive rate it was resolved from; `cascade`: per escalated rule, the probe's score and
    decision, the judge's answer and the decision taken."""
    event = {
        "request_id": request_id,
        "tenant": tenant,
        "decision": decision,
        "probe": probe or "",
        "phase": phase or "",
        "scores": scores,
        "policy_version": policy_version,
        "time": time.time(),
    }
    if thresholds:
        event["thresholds"] = thresholds
    if cascade:
        event["cascade"] = cascade
    if prompt is not None:
        event["prompt"] = prompt
    return event
