"""The score formatter: a process beside the worker that turns each step's raw scores into what
every API server process needs of it, rendered, so their event loops only file it.

    engine thread --score ring (shared memory)--> formatter --scores (ZMQ PUB, one topic per
    API server process)--> the hub in each API server process

The formatter keeps the books (`bookkeeping.StepReader`), calibrates, lays out each prompt's
scores as the first chunk writes them, writes each token's one-token chunk JSON, and sends
each API server process (`owner_tag` in its requests' ids) a `FormattedStep` with its rows
alone, on its own topic. Control messages (pause, swap, a lost step) go to every process on
`BROADCAST`. The ids are the middleware's own once the engine's suffix is cut (`external_request_id`).

Failure is never silent: each topic's messages are numbered and every message names the
formatter that sent it (`publisher`, random per start), so a hub finds messages lost on the
way and a formatter started again as a loss; a gap in the worker's count, or a step the
formatter could not read, is sent to every hub as one. Every second the formatter sends every
hub a heartbeat with each topic's count (a loss at the end of a burst shows then) and the
worker's pause state (a process that missed a pause message is set right); it holds them back
while it hears nothing from the worker, and a hub that hears nothing for `SILENT_AFTER_S`
stops waiting for scores (`ScoreHub.silent`). The worker starts the formatter
(`FormatterProcess`), starts it again if it exits, and the formatter ends with the worker. A
formatter started again has lost its books: a prompt being prefilled across the restart gets
a summary of its later rows alone (`tokens_scored` says so), and ends of requests it never
saw are not reported (nothing waits for them).

Engine-agnostic: nothing here imports vLLM.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import random
import re
import select
import signal
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import zmq

from engine_worker.scores import render as responses
from engine_worker.scores.bookkeeping import CONTROL, SEQUENCE, ProbeSlot, ProbeTable, StepReader, gather_scores, pause_of
from engine_worker.scores.wire import (BROADCAST, OWNER_MARKER, PUBLISHER, UNTAGGED, FormattedPrompt, FormattedStep,
                                       ProbeSet, external_request_id, laid_out_prompt)
from engine_worker.scores.ring import RingReader, ScoreRing

log = logging.getLogger("probex.score_formatter")

HEARTBEAT_S = 1.0  # every process hears from the formatter at least this often
WORKER_SILENT_AFTER_S = 3.0  # the worker heartbeats every second when idle
_OWNER_TAG = re.compile(r"[0-9a-f]{8}")  # wire.owner_tag's


class ScoreFormatter:
    """The formatter's work without its sockets: a worker message in, (topic, frame) pairs out."""

    def __init__(self, api_server_count: int, publisher: int | None = None) -> None:
        self.publisher = publisher if publisher is not None else random.getrandbits(31)
        self._tagged = api_server_count > 1
        self._reader = StepReader()
        self._tables: dict[int, ProbeSet] = {}
        self._described: dict[int, msgspec.Raw] = {}
        self._routes: dict[str, tuple[bytes, str]] = {}  # engine request id -> (topic, our id)
        self.sequences: dict[bytes, int] = {}
        self._last_worker_sequence: int | None = None
        # The worker's pause state as last heard ((pause changes, paused), from its steps, its
        # pause messages and its heartbeats): sent with every heartbeat and loss, so a process
        # that missed a pause message, or has no rows to carry one, is set right within a second.
        self.pause: tuple[int, bool] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self.last_broadcast = 0.0  # a heartbeat at once
        self.last_heard = time.monotonic()  # from the worker

    def take(self, message: dict) -> list[tuple[bytes, bytes]]:
        """One message from the worker (a step or a control message) as the frames to send."""
        out: list[tuple[bytes, bytes]] = []
        self.last_heard = time.monotonic()
        self._note_pause(message)
        sequence = message.get(SEQUENCE)
        if sequence is not None:
            last, self._last_worker_sequence = self._last_worker_sequence, sequence
            if last is not None and sequence > last + 1:
                out.append(self._broadcast({CONTROL: "lost", "messages": sequence - last - 1, "by_owner": {},
                                            "why": f"{sequence - last - 1} score messages lost between the worker "
                                                   "and the score formatter"}))
        kind = message.get(CONTROL)
        if kind == "heartbeat":
            pass  # its number was the news; the formatter sends heartbeats of its own
        elif kind == "lost":
            out.append(self._lost(message))
        elif kind is not None:
            out.append(self._broadcast(message))  # pause, swap: every process, as the worker sent it
        else:
            out += self._step(message)
        return out

    def step_failed(self, message: dict) -> tuple[bytes, bytes]:
        """A message that could not be read or formatted: its requests' waits end."""
        step = message.get("step") if isinstance(message, dict) else None
        requests = (step.get("req") or []) if isinstance(step, dict) else []
        return self._broadcast({CONTROL: "lost", "by_owner": self._by_owner([str(req) for req in requests], []),
                                "why": "a step's scores could not be formatted"})

    def heartbeat(self) -> tuple[bytes, bytes]:
        """Each topic's count so far (a hub that missed the last messages of a burst learns it
        now) and the worker's pause state."""
        return self._broadcast({CONTROL: "heartbeat", "last": {t.decode(): n for t, n in self.sequences.items()
                                                               if t != BROADCAST}})

    def _note_pause(self, message: dict) -> None:
        state = pause_of(message)  # a step's, a worker heartbeat's, or a pause message's
        if state is not None and (self.pause is None or state[0] >= self.pause[0]):
            self.pause = state

    def forget_stale(self, idle_s: float) -> None:
        self._reader.book.forget_stale(idle_s)
        if len(self._routes) > 100_000:  # ids are never reused: forgetting them all is safe
            self._routes.clear()

    def _step(self, message: dict) -> list[tuple[bytes, bytes]]:
        events = self._reader.read(message)
        version = message["v"]
        table = self._tables.get(version)
        if table is None:
            table = self._tables[version] = ProbeSet.from_described(message["probes"])
        probes = table.probes
        by_topic: dict[bytes, FormattedStep] = {}
        pause = pause_of(message)
        described = self._described.get(version)
        if described is None:
            described = self._described[version] = msgspec.Raw(self._encoder.encode(message["probes"]))

        def of(topic: bytes) -> FormattedStep:
            step = by_topic.get(topic)
            if step is None:
                step = by_topic[topic] = FormattedStep(self.publisher, 0, version, described, pause, [], [], [], [],
                                                       [], [])
            return step

        nobodys = UNTAGGED if self._tagged else None  # with several processes, no process's ids are untagged
        for event in events.prompt:
            topic, key = self._route(event["req"])
            if topic == nobodys:
                continue
            of(topic).prompts.append(FormattedPrompt(key, event, *laid_out_prompt(event, probes)))
        if events.token_req_ids:
            calibrated = table.calibrate(events.token_raw).tolist()
            for req, index, values in zip(events.token_req_ids, events.token_indexes, calibrated):
                topic, key = self._route(req)
                if topic == nobodys:
                    continue
                step = of(topic)
                scores = tuple(values)
                step.token_requests.append(key)
                step.token_indexes.append(index)
                step.token_scores.append(scores)
                step.token_json.append(responses.token_scores_json(index, scores, probes))
        for req in events.finished:
            topic, key = self._route(req)
            if topic != nobodys:
                of(topic).finished.append(key)
        out = []
        for topic, step in by_topic.items():
            step.sequence = self._next(topic)
            out.append((topic, self._encoder.encode(step)))
        return out

    def _lost(self, message: dict) -> tuple[bytes, bytes]:
        """The worker's "lost" (a step it could not send), each process's requests apart."""
        finished = self._reader.book.finish(list(message.get("finished", ())))
        return self._broadcast({CONTROL: "lost", "by_owner": self._by_owner(message.get("requests", ()), finished),
                                "why": "the worker could not send a step's scores"})

    def _by_owner(self, requests, finished) -> dict[str, dict[str, list[str]]]:
        """A loss's requests and ends by the process they belong to (topic name -> our ids)."""
        by_owner: dict[str, dict[str, list[str]]] = {}
        for field, reqs in (("requests", requests), ("finished", finished)):
            for req in reqs:
                topic, key = self._route(req)
                by_owner.setdefault(topic.decode(), {"requests": [], "finished": []})[field].append(key)
        return by_owner

    def _route(self, engine_request_id: str) -> tuple[bytes, str]:
        """(topic, our id): the owner tag the middleware put in the id, where it is one (a
        client's own X-Request-Id, passed through unmonitored, may hold anything)."""
        route = self._routes.get(engine_request_id)
        if route is None:
            topic = UNTAGGED
            if self._tagged:
                at = engine_request_id.find(OWNER_MARKER)
                tag = engine_request_id[at + len(OWNER_MARKER):at + len(OWNER_MARKER) + 8] if at >= 0 else ""
                if _OWNER_TAG.fullmatch(tag):
                    topic = tag.encode()
            route = self._routes[engine_request_id] = (topic, external_request_id(engine_request_id))
        return route

    def _broadcast(self, message: dict) -> tuple[bytes, bytes]:
        message = {**message, SEQUENCE: self._next(BROADCAST), PUBLISHER: self.publisher}
        if self.pause is not None and message.get(CONTROL) in ("heartbeat", "lost"):
            message["pause"] = list(self.pause)
        self.last_broadcast = time.monotonic()
        return BROADCAST, self._encoder.encode(message)

    def _next(self, topic: bytes) -> int:
        number = self.sequences[topic] = self.sequences.get(topic, 0) + 1
        return number


def ring_message(meta: bytes, scores: dict[int, np.ndarray], decoder: msgspec.msgpack.Decoder,
                 tables: dict[int, ProbeTable]) -> dict:
    """A score ring entry as the message `ScoreFormatter.take` reads: a step's probe columns
    gathered from the slot's rows as the worker's consume gathers them (`gather_scores`), by the
    step's probe table rebuilt from its `probes` and `slots` (each probe's column in its layer's
    buffer) and kept in `tables` by version. A step without rows gathers none."""
    message = decoder.decode(meta)
    if "step" in message and "raw" not in message:
        version = message["v"]
        table = tables.get(version)
        if table is None:  # described: (name, read, slope, intercept, layer)
            table = tables[version] = ProbeTable(version, tuple(
                ProbeSlot(name, layer, slot, read, slope, intercept)
                for slot, (name, read, slope, intercept, layer) in zip(message["slots"], message["probes"])))
        message["raw"] = gather_scores(table, int(message["rows"]), scores).tobytes()
    return message


class _RingSource:
    """The worker's messages from the score ring, polled. A step committed but not landed is
    polled every `BUSY_POLL_S` (its rows are a forward away at most); with nothing committed,
    as often for `STAY_BUSY_S` after the last entry (the next step is that close under load),
    then every `IDLE_POLL_S`: an idle prefill's scores wait for that at most, while its
    forward runs for milliseconds after the entry is committed."""

    BUSY_POLL_S = 20e-6
    STAY_BUSY_S = 0.05
    IDLE_POLL_S = 200e-6

    def __init__(self, fd: int) -> None:
        self.ring = ScoreRing.attach(fd)
        self.reader = RingReader(self.ring)
        self._decoder = msgspec.msgpack.Decoder()
        self._tables: dict[int, ProbeTable] = {}
        self._last_entry = 0.0
        _fine_timer_slack()

    def next(self, timeout_s: float) -> dict | None:
        """The next message, waiting up to about `timeout_s` for it; an entry that cannot be
        read comes back as {} (the caller reports it), never stops the ring."""
        deadline = time.monotonic() + timeout_s
        while True:
            entry = self.reader.poll()
            if entry is not None:
                _, meta, scores = entry
                try:
                    return ring_message(meta, scores, self._decoder, self._tables)
                except Exception:
                    log.exception("probex: could not read a score ring entry")
                    return {}
                finally:
                    self.reader.done()
                    self._last_entry = time.monotonic()
            now = time.monotonic()
            if now >= deadline:
                return None
            busy = self.reader.waiting_for_device() or now - self._last_entry < self.STAY_BUSY_S
            time.sleep(self.BUSY_POLL_S if busy else self.IDLE_POLL_S)


def _fine_timer_slack() -> None:
    """Sleeps of tens of microseconds as asked (Linux's default slack adds 50 µs to each)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(29, 1000)  # PR_SET_TIMERSLACK, in nanoseconds
    except (OSError, AttributeError):
        pass


def serve(ring_fd: int, score_address: str, api_server_count: int, parent_pid: int | None = None,
          ready_fd: int | None = None, high_water_mark: int = 100_000) -> None:
    """The formatter's loop: until the worker (`parent_pid`) is gone. `ready_fd`: written to
    once the socket is bound (`FormatterProcess` waits for it). The worker's messages come
    from its score ring (`ring_fd`, inherited)."""
    ctx = zmq.Context()
    steps = _RingSource(ring_fd)
    scores = ctx.socket(zmq.PUB)
    # A process so far behind that its queue is full loses messages there alone, and finds the gap.
    scores.setsockopt(zmq.SNDHWM, high_water_mark)
    scores.setsockopt(zmq.LINGER, 0)
    scores.bind(score_address)
    if ready_fd is not None:
        os.write(ready_fd, b"1")
        os.close(ready_fd)
    formatter = ScoreFormatter(api_server_count)
    last_sweep = last_parent_check = time.monotonic()
    worker_silent = False
    log.info("probex: score formatter %d: the worker's score ring -> %s", formatter.publisher, score_address)
    while True:
        message = steps.next(HEARTBEAT_S / 4)
        if message is not None:
            try:
                out = formatter.take(message) if message else [formatter.step_failed(message)]
            except Exception:  # a bad message must not stop delivery for everyone
                log.exception("probex: could not format a score message")
                out = [formatter.step_failed(message)]
            for topic, payload in out:
                scores.send_multipart((topic, payload), flags=zmq.NOBLOCK)
        now = time.monotonic()
        if parent_pid is not None and now - last_parent_check > 0.1:
            if os.getppid() != parent_pid:
                return
            last_parent_check = now
        # The worker heartbeats every second when it has nothing to send: if it is not heard,
        # no scores come through here either, and the API server processes should stop
        # waiting for them (they do when these heartbeats stop: ScoreHub.silent).
        if worker_silent != (now - formatter.last_heard > WORKER_SILENT_AFTER_S):
            worker_silent = not worker_silent
            (log.error if worker_silent else log.warning)(
                "probex: %s", f"nothing from the worker for {WORKER_SILENT_AFTER_S:.0f} s: heartbeats held back"
                if worker_silent else "the worker is heard from again")
        if now - formatter.last_broadcast >= HEARTBEAT_S and not worker_silent:
            scores.send_multipart(formatter.heartbeat(), flags=zmq.NOBLOCK)
        if now - last_sweep > 10:
            formatter.forget_stale(300.0)
            last_sweep = now


class FormatterNotStarted(RuntimeError):
    pass


class FormatterProcess:
    """The worker's score formatter as a child process, started again whenever it exits.

    One thread of the worker's starts it, waits for it and starts it again, and lives as long as
    the worker: the kernel ends the child when that thread ends (PR_SET_PDEATHSIG is tied to the
    thread that forked), and the child also checks its parent itself. The first start must
    succeed (the sockets bound and connected within `STARTUP_S`), or `start` raises and the
    worker does not start; a later one that fails is tried again, with a growing pause, and
    logged each time."""

    STARTUP_S = 30.0

    def __init__(self, score_address: str, api_server_count: int, ring_fd: int) -> None:
        """The worker's messages come from the score ring `ring_fd` (inherited by the child)."""
        self._inherited = (ring_fd,)
        self.command = [sys.executable, "-m", "engine_worker.scores.formatter", "--ring-fd", str(ring_fd),
                        "--scores", score_address, "--api-server-count", str(api_server_count),
                        "--parent", str(os.getpid())]
        cpus = launcher_cpus()
        if cpus:
            self.command += ["--cpus", ",".join(map(str, cpus))]
        self.starts = 0
        self.process: subprocess.Popen | None = None
        self._lock = threading.Lock()  # a close never misses a process being started
        self._closed = threading.Event()
        self._first = threading.Event()
        self._first_error: str | None = None

    def start(self) -> "FormatterProcess":
        threading.Thread(target=self._supervise, name="probex-score-formatter", daemon=True).start()
        self._first.wait()
        if self._first_error is not None:
            self.close()
            raise FormatterNotStarted(f"probex: the score formatter did not start: {self._first_error}")
        # A worker started by fork may end without running atexit; PR_SET_PDEATHSIG covers that.
        atexit.register(self.close)
        return self

    def _launch(self) -> subprocess.Popen | None:
        """The formatter started and ready (None: closed meanwhile); raises if it is not."""
        read_fd, write_fd = os.pipe()
        try:
            with self._lock:
                if self._closed.is_set():
                    return None
                process = self.process = subprocess.Popen([*self.command, "--ready-fd", str(write_fd)],
                                                          pass_fds=(write_fd, *self._inherited))
        finally:
            os.close(write_fd)
        try:
            ready, _, _ = select.select([read_fd], [], [], self.STARTUP_S)
            if not ready or os.read(read_fd, 1) != b"1":  # nothing in time, or it exited first
                process.kill()
                raise FormatterNotStarted(f"not ready within {self.STARTUP_S:.0f} s (exit code {process.wait()}; "
                                          "its error is in the worker's log)")
        finally:
            os.close(read_fd)
        return process

    def _supervise(self) -> None:
        failures = 0
        while not self._closed.is_set():
            try:
                process = self._launch()
            except (OSError, subprocess.SubprocessError, FormatterNotStarted) as exc:
                if not self._first.is_set():
                    self._first_error = str(exc)
                    self._first.set()
                    return
                failures += 1
                log.error("probex: could not start the score formatter again (%s); trying again", exc)
                self._closed.wait(min(5.0, 0.5 * failures))
                continue
            if process is None:
                return
            self.starts += 1
            self._first.set()
            began = time.monotonic()
            code = process.wait()
            if self._closed.is_set():
                return
            failures = 0 if time.monotonic() - began > 60 else failures + 1  # the pause grows only for a crash loop
            # Loud: the API server processes lose the scores then in flight (they see the new
            # formatter's number and say so), and none are delivered until it is back.
            log.error("probex: the score formatter (pid %d) exited with %s; starting it again", process.pid, code)
            self._closed.wait(min(5.0, 0.5 * failures))

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            process = self.process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()


def _end_with_parent(parent_pid: int) -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the loop's parent check still ends it
        pass
    if os.getppid() != parent_pid:  # the parent was gone before the request took effect
        raise SystemExit(0)


def launcher_cpus() -> list[int] | None:
    """The CPUs the process that started the worker may run on, for the formatter. A CPU engine
    binds its worker, every thread of it, to the cores its forward runs on (vLLM's OpenMP
    binding; the cores it leaves out are for the API server processes and the like), and a
    child keeps the binding of the thread that started it: the formatter would share the
    forward's cores. On a GPU machine nothing is bound, and this is the worker's own set (or the
    one a benchmark pinned the server to). None where it cannot be read: the child keeps the
    worker's."""
    try:
        return sorted(os.sched_getaffinity(os.getppid()))
    except (AttributeError, OSError):  # not Linux, or the launcher is gone
        return None


def _run_on(cpus: str) -> None:
    try:
        os.sched_setaffinity(0, [int(cpu) for cpu in cpus.split(",")])
    except (AttributeError, OSError, ValueError) as exc:  # the worker's CPUs, then: slower, not wrong
        log.warning("probex score formatter: could not move to CPUs %s (%s); it stays on the worker's", cpus, exc)


def main() -> None:
    parser = argparse.ArgumentParser(description="ProbeX score formatter (started by the worker)")
    parser.add_argument("--ring-fd", type=int, required=True, help="the worker's score ring (an inherited memfd; ring.py)")
    parser.add_argument("--scores", required=True, help="the address the API server processes connect to")
    parser.add_argument("--api-server-count", type=int, default=1)
    parser.add_argument("--parent", type=int, default=None, help="end when this process is gone")
    parser.add_argument("--ready-fd", type=int, default=None, help="written to once the sockets are up")
    parser.add_argument("--cpus", default=None, help="run on these CPUs (comma-separated; launcher_cpus)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.cpus:
        _run_on(args.cpus)
    if args.parent is not None:
        _end_with_parent(args.parent)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Ctrl-C reaches the whole process group: the worker ends it (with SIGTERM, or by exiting).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(args.ring_fd, args.scores, args.api_server_count, args.parent, args.ready_fd)


if __name__ == "__main__":
    main()
