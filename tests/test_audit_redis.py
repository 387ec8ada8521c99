"""The Redis audit sink writes each event once, also when a write's reply is lost.

Between the sink and a real Redis sits a TCP relay that can swallow Redis's replies: the write
reaches Redis and is applied, its reply never comes back, and the sink (timing out, or its
task cancelled) keeps the event and sends it again.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import redis

from gateway.audit import AUDIT_STREAM, RedisAudit
from gateway.metrics import GatewayMetrics

REDIS_DB = 5  # each module its own database of the test process's Redis (tests/conftest.py)


class ReplySwallower:
    """Relays TCP connections to `port`; while `swallow` is set, what the server sends is dropped."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.swallow = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while data := source.recv(65536):
                if not (replies and self.swallow.is_set()):
                    sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            s.close()


@pytest.fixture
def relay(redis_server):
    redis.Redis.from_url(redis_server.url(REDIS_DB)).flushdb()
    relay = ReplySwallower(redis_server.port)
    yield relay
    relay.close()


def entries(redis_server) -> list[dict]:
    stream = redis.Redis.from_url(redis_server.url(REDIS_DB)).xrange(AUDIT_STREAM)
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in stream]


def counted(metrics: GatewayMetrics, result: str) -> float:
    return metrics.audit_events.labels(sink="redis", result=result)._value.get()


def test_a_write_whose_reply_times_out_is_sent_again_but_lands_once(relay, redis_server):
    async def scenario():
        metrics = GatewayMetrics()
        sink = RedisAudit(f"redis://127.0.0.1:{relay.port}/{REDIS_DB}", metrics)
        await sink.record({"request_id": "warm", "decision": "flag"})  # connects, loads the script
        relay.swallow.set()
        await sink.record({"request_id": "r1", "decision": "block", "scores": {"prompt": {"p": 0.9}}})
        assert len(sink.backlog) == 1 and counted(metrics, "retry") == 1  # timed out: kept
        relay.swallow.clear()
        await sink.flush()
        await sink.flush()
        assert not sink.backlog and counted(metrics, "written") == 2
        await sink.close()

    asyncio.run(scenario())
    events = entries(redis_server)
    assert [e["request_id"] for e in events] == ["warm", "r1"]  # applied once, though sent twice
    assert events[1]["decision"] == "block" and events[1]["scores"] == '{"prompt": {"p": 0.9}}'


def test_a_write_cancelled_mid_call_is_sent_again_but_lands_once(relay, redis_server):
    async def scenario():
        metrics = GatewayMetrics()
        sink = RedisAudit(f"redis://127.0.0.1:{relay.port}/{REDIS_DB}", metrics)
        await sink.record({"request_id": "warm", "decision": "flag"})
        relay.swallow.set()
        task = asyncio.create_task(sink.record({"request_id": "r2", "decision": "flag"}))
        await asyncio.sleep(0.2)  # sent and applied; the reply is swallowed
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(sink.backlog) == 1
        relay.swallow.clear()
        await sink.flush()
        assert not sink.backlog
        await sink.close()

    asyncio.run(scenario())
    assert [e["request_id"] for e in entries(redis_server)] == ["warm", "r2"]


def test_distinct_events_with_equal_fields_all_land(relay, redis_server):
    async def scenario():
        sink = RedisAudit(f"redis://127.0.0.1:{relay.port}/{REDIS_DB}", GatewayMetrics())
        for _ in range(3):
            await sink.record({"event": "admin", "action": "reload", "result": "ok"})
        await sink.close()

    asyncio.run(scenario())
    assert len(entries(redis_server)) == 3
