"""The HTTP/1.1 client of the completion routes: keep-alive connections on asyncio protocols, httptools parsing.

A general client (aiohttp before this) spent about a quarter of a millisecond of the
gateway's time-to-first-token between being handed a request and its bytes leaving on the
2-core benchmark machine: request and response objects, header multidicts, timers and
stream readers built per request. The completion routes only ever POST JSON to a few known
workers and read the answer as it arrives, so this client does only that: one write per
request, a C parser (httptools, what uvicorn uses) feeding body bytes into a list, and one
future per wait.

Errors are `UpstreamError` (could not connect, connection dropped, malformed response) or
`UpstreamTimeout` (connect or read timed out; also a `TimeoutError`).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from typing import Callable
from urllib.parse import urlsplit

import httptools

# Reading stops while this much body is buffered and nobody reads it (a slow caller), so a
# fast worker cannot fill the gateway's memory.
_HIGH_WATER = 1 << 18
# The workers (uvicorn) close idle keep-alive connections after 5 s; reusing one just as the
# worker closes it fails the request, so connections idle longer than this are not reused.
_KEEPALIVE_S = 4.0


class UpstreamError(Exception):
    """The worker could not be reached, dropped the connection, or sent something that is not HTTP."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """Connecting, or waiting for the next bytes of a response, took longer than the configured limit."""


class UpstreamUnreachable(UpstreamError):
    """No connection to the worker could be made: the request reached nobody (safe to send elsewhere)."""


class UpstreamAbandoned(UpstreamError):
    """The gateway's caller went away: the connection was closed on purpose, not to be retried."""


class _Stale(Exception):
    """A reused keep-alive connection was closed before any byte of the response: safe to send again."""


class UpstreamResponse(asyncio.Protocol):
    """One keep-alive connection, and the response to the request it carries (one at a time).

    After the head (`status`) arrives, `readany()` hands over body bytes as they come and
    `read()` the whole body. `release()` returns the connection to the pool once the response
    has fully arrived (at once, or when the rest comes in, which is then discarded);
    `close()` drops it, which aborts the request in the worker.
    """

    __slots__ = ("origin", "transport", "parser", "status", "chunks", "buffered", "head_done", "complete",
                 "keep_alive", "delimited", "received", "error", "waiter", "deadline", "timer", "released", "paused",
                 "reused", "idle_since", "request")

    def __init__(self, origin: "_Origin") -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.error: Exception | None = None  # set once the connection is unusable
        self.waiter: asyncio.Future | None = None
        self.deadline = 0.0  # loop time by which the current wait must end
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False
        self.reused = False  # taken from the idle pool (not freshly connected) for the current request
        self.idle_since = 0.0
        self.request = b""  # kept until the response head is in, to send again if the connection was stale
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.head_done = self.complete = False
        self.keep_alive = True
        self.delimited = False  # content-length or chunked; otherwise the body ends when the connection does
        self.received = False
        self.released = False

    # -- asyncio.Protocol

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # One write per request and per relayed event: nothing to gain from Nagle, a delayed-ACK
            # round (40 ms on Linux) to lose.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed HTTP response from {self.origin.name}: {exc}"))
            return
        if self.buffered > _HIGH_WATER and not self.paused and not self.complete:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> None:
        self._ended()

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended()

    # -- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.delimited = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        if not self.released:  # released early: the caller wants none of the rest
            self.chunks.append(body)
            self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        if self.released:
            self._to_pool()

    # -- the caller's side

    async def head(self, timeout: float) -> None:
        while not self.head_done:
            if self.error is not None:
                stale = self.reused and not self.received and not isinstance(self.error, UpstreamAbandoned)
                raise _Stale() if stale else self.error
            await self._wait(timeout)

    async def readany(self) -> bytes:
        """The body bytes that have arrived since the last call, waiting for some; b"" at the end."""
        while True:
            chunks = self.chunks
            if chunks:
                self.chunks = []
                self.buffered = 0
                if self.paused:
                    self.paused = False
                    self.transport.resume_reading()
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            await self._wait(self.origin.read_timeout)

    async def read(self) -> bytes:
        parts = []
        while True:
            data = await self.readany()
            if not data:
                return b"".join(parts)
            parts.append(data)

    def release(self) -> None:
        """Back to the pool when the response is complete; until then the rest is read and dropped."""
        if self.released:
            return
        self.released = True
        self.chunks = []
        self.buffered = 0
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        if self.complete:
            self._to_pool()
        elif self.error is not None:
            self.close()

    def close(self) -> None:
        self.released = True
        self._fail(UpstreamError(f"connection to {self.origin.name} closed by the gateway"))

    def abandon(self) -> None:
        """Close it because the caller went away (which aborts the request in the worker); a
        wait for the head or the body raises UpstreamAbandoned, and the request is not sent again."""
        self.released = True
        self._fail(UpstreamAbandoned(f"the caller went away; connection to {self.origin.name} closed"))

    def send_request(self, request: bytes) -> None:
        """Write the whole request. A transport that died before its `connection_lost` arrived
        (a reset on an idle keep-alive connection, say) fails the connection instead of raising:
        `head()` then reports it, and a reused connection counts as stale and is replaced."""
        self.request = request
        try:
            self.transport.write(request)
        except (RuntimeError, OSError) as exc:
            self._fail(UpstreamError(f"{self.origin.name} closed the connection: {exc}"))

    # -- internals

    async def _wait(self, timeout: float) -> None:
        loop = self.origin.loop
        # One timer per connection that re-arms itself, rather than a timer made and cancelled per
        # wait: waits come every few milliseconds of a stream, timeouts after tens of seconds.
        self.deadline = loop.time() + timeout
        if self.timer is None:
            self.timer = loop.call_at(self.deadline, self._check_deadline)
        self.waiter = loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def _check_deadline(self) -> None:
        self.timer = None
        waiter = self.waiter
        if waiter is None or waiter.done() or self.error is not None:
            return
        loop = self.origin.loop
        if loop.time() >= self.deadline - 0.002:  # uvloop rounds timers to whole milliseconds
            self._timed_out()
        else:
            self.timer = loop.call_at(self.deadline, self._check_deadline)

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _timed_out(self) -> None:
        what = "response head" if not self.head_done else "next bytes of the response"
        self._fail(UpstreamTimeout(f"{self.origin.name} sent no {what} within {self.origin.read_timeout:g} s"))

    def _ended(self) -> None:
        if self.error is None:
            if self.head_done and not self.complete and not self.delimited:
                self.complete = True  # a body delimited by the end of the connection
            self.error = UpstreamError(f"{self.origin.name} closed the connection"
                                       + (" mid-response" if self.head_done and not self.complete else ""))
        self._wake()

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _to_pool(self) -> None:
        if self.error is None and self.keep_alive and not self.transport.is_closing() \
                and len(self.origin.idle) < self.origin.max_idle:
            self._reset()
            self.released = True  # idle: body bytes arriving now belong to nobody
            self.idle_since = time.monotonic()
            self.origin.idle.append(self)
        else:
            self.close()


class _Origin:
    """Connections to one worker: idle ones are reused most-recent first."""

    __slots__ = ("name", "host", "port", "ssl", "base", "host_header", "idle", "loop", "connect_timeout",
                 "read_timeout", "max_idle", "auth_header")

    def __init__(self, url: str, loop, connect_timeout: float, read_timeout: float, max_idle: int,
                 token: str | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream URL {url!r} is not http(s)://host[:port][/path]")
        self.name = url
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.base = parts.path.rstrip("/").encode()
        self.host_header = parts.netloc.rsplit("@", 1)[-1].encode("idna")
        self.idle: list[UpstreamResponse] = []
        self.loop = loop
        self.connect_timeout, self.read_timeout, self.max_idle = connect_timeout, read_timeout, max_idle
        self.auth_header = b"authorization: Bearer %s\r\n" % token.encode("latin-1") if token else b""

    def take_idle(self) -> UpstreamResponse | None:
        idle = self.idle
        oldest_usable = time.monotonic() - _KEEPALIVE_S
        while idle:
            conn = idle.pop()
            # Bytes arriving on an idle connection answer no request of ours: not reusable.
            if conn.error is None and not conn.received and not conn.head_done and conn.idle_since > oldest_usable \
                    and not conn.transport.is_closing():
                conn.released = False
                conn.reused = True
                return conn
            conn.close()
        return None

    async def connect(self) -> UpstreamResponse:
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: UpstreamResponse(self), self.host, self.port, ssl=self.ssl),
                self.connect_timeout)
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"connecting to {self.name} took longer than {self.connect_timeout:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamUnreachable(f"cannot connect to {self.name}: {exc}") from None
        return conn


class UpstreamClient:
    """POSTs JSON to workers and hands back the response as it arrives."""

    def __init__(self, connect_timeout: float, read_timeout: float, max_idle_per_upstream: int = 256,
                 token: str | None = None, upstream_urls: list[str] = ()) -> None:
        """`token` goes as `Authorization: Bearer <token>` to the URLs in `upstream_urls` (the
        configured workers) and to no other."""
        self.connect_timeout, self.read_timeout, self.max_idle = connect_timeout, read_timeout, max_idle_per_upstream
        self.origins: dict[str, _Origin] = {}
        self.tokens = {url.rstrip("/"): token for url in upstream_urls} if token else {}

    def _origin(self, url: str) -> _Origin:
        origin = self.origins.get(url)
        if origin is None:
            origin = self.origins[url] = _Origin(url, asyncio.get_running_loop(), self.connect_timeout,
                                                 self.read_timeout, self.max_idle, self.tokens.get(url.rstrip("/")))
        return origin

    async def send(self, url: str, path: str, body: bytes) -> UpstreamResponse:
        """Write a POST of `body` to `url` + `path`; waits only when a new connection is needed.

        The caller can do its own book-keeping while the worker works, then `await response(conn)`.
        """
        origin = self.origins.get(url) or self._origin(url)
        request = b"POST %s%s HTTP/1.1\r\nhost: %s\r\n%scontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
            origin.base, path.encode(), origin.host_header, origin.auth_header, len(body))
        conn = origin.take_idle() or await origin.connect()
        conn.send_request(request + body)
        return conn

    async def response(self, conn: UpstreamResponse,
                       follow: Callable[[UpstreamResponse], None] | None = None) -> UpstreamResponse:
        """The connection carrying the answer to what `send` wrote, once the response head is in.
        `follow` is told of the connection the request goes out on again, should `conn` be stale."""
        try:
            await conn.head(conn.origin.read_timeout)
        except _Stale:
            # A keep-alive connection the worker closed without answering: almost always one it was
            # closing for idleness as the request went out, so the request is sent once more on a new
            # connection (what browsers do, and a fresh connection that fails this way is an error).
            conn.close()
            fresh = await conn.origin.connect()
            fresh.send_request(conn.request)
            if follow is not None:
                follow(fresh)
            return await self.response(fresh, follow)
        except BaseException:
            conn.close()
            raise
        conn.request = b""
        return conn

    async def post(self, url: str, path: str, body: bytes) -> UpstreamResponse:
        return await self.response(await self.send(url, path, body))

    def close(self) -> None:
        for origin in self.origins.values():
            while origin.idle:
                origin.idle.pop().close()
