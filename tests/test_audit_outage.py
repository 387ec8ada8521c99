"""Redis stopped for a minute under load, then started again: decisions keep flowing, and
afterwards every flagged or blocked request has exactly one audit event in Redis (matched by
request id), and the audit backlog is back to 0. The worker is the mock (this is the gateway's
behaviour); Redis is a real server whose writes survive its outage (append-only, fsync always)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import httpx
import pytest

from tests.fixtures.mock_upstream import MODEL
from tests.gateway_fixtures import base_policy, start_stack
from tests.redis_server import RedisServer

OUTAGE_S = 60.0


@pytest.fixture()
def redis_with_outage():
    server = RedisServer(persistent=True)
    yield server
    server.stop()


def test_a_minute_without_redis_under_load_loses_and_duplicates_no_audit_event(tmp_path, redis_with_outage):
    import redis

    # Every prompt is flagged (0.05 > 0.04); a prompt with "bomb" (0.95) is blocked.
    policy = base_policy(rules=[{"probe": "harmful-request", "prompt": {"flag": 0.04, "block": 0.9}}])
    s = start_stack(tmp_path, policy=policy, redis_url=redis_with_outage.url())
    decided: list[tuple[str, str]] = []  # (decision, request id) as the client saw them
    statuses: Counter = Counter()
    try:
        async def load(stop_at: float) -> None:
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as http:
                async def client(n: int) -> None:
                    i = 0
                    while time.monotonic() < stop_at:
                        text = "how to build a bomb" if (n + i) % 3 == 0 else "hello there"
                        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
                        r = await http.post("/v1/chat/completions", json=body)
                        statuses[r.status_code] += 1
                        decided.append((r.headers.get("x-probex-decision", ""), r.headers.get("x-request-id", "")))
                        i += 1
                        await asyncio.sleep(0.1)

                await asyncio.gather(*(client(n) for n in range(4)))

        async def scenario() -> dict:
            began = time.monotonic()
            loading = asyncio.create_task(load(began + 3 + OUTAGE_S + 3))
            await asyncio.sleep(3)
            redis_with_outage.halt()
            await asyncio.sleep(OUTAGE_S / 2)
            during = httpx.get(s.url + "/metrics").text
            await asyncio.sleep(OUTAGE_S / 2)
            await asyncio.to_thread(redis_with_outage.start)
            await loading
            return {"during": during}

        seen = asyncio.run(scenario())
        assert set(statuses) <= {200, 400} and statuses[200] > 0 and statuses[400] > 0, statuses
        backlog_during = [line for line in seen["during"].splitlines() if line.startswith("probex_audit_backlog ")]
        assert backlog_during and float(backlog_during[0].split()[1]) > 0, backlog_during
        deadline = time.monotonic() + 20
        while True:  # the periodic flush empties the backlog once Redis is back
            metrics = httpx.get(s.url + "/metrics").text
            if "probex_audit_backlog 0.0" in metrics or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert "probex_audit_backlog 0.0" in metrics
        expected = Counter(request_id for decision, request_id in decided if decision in ("flag", "block"))
        assert len(expected) == len(decided) and all(request_id for _, request_id in decided)
        events = redis.Redis.from_url(redis_with_outage.url()).xrange("probex:audit")
        written = Counter()
        for _, fields in events:
            fields = {k.decode(): v.decode() for k, v in fields.items()}
            if fields.get("event") != "admin":
                written[fields["request_id"]] += 1
                assert fields["decision"] in ("flag", "block") and json.loads(fields["scores"])
        assert written == expected, (len(written), len(expected), sum(written.values()))
    finally:
        s.stop()
