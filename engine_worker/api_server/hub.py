"""The hub in each API server process: the score formatter's messages in, "are request X's scores here yet?" out.

The score formatter (engine_worker/scores/formatter.py) keeps the books once for every API
server process and sends each its own requests' rows, calibrated and written as JSON; the
hub files them per request and wakes whoever waits to attach scores to a response or a
stream chunk. Requests are keyed by the id the middleware gave them (`X-Request-Id`). With
several API server processes each one's middleware starts its ids with its own tag
(`owner_tag`) and the formatter sends each process only the rows of those.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

import msgspec

from engine_worker.scores import render as responses
from engine_worker.scores.bookkeeping import CONTROL, SEQUENCE, pause_of
from engine_worker.scores.columns import RequestScores
from engine_worker.scores.wire import (BROADCAST, PUBLISHER, SILENT_AFTER_S, UNTAGGED, FormattedStep, ProbeSet)

log = logging.getLogger("probex.delivery")

class ScoreHub:
    """API-server side: receives score messages and answers "are request X's scores here yet?"."""

    def __init__(self, address: str, retention_s: float = 300.0, owner: str | None = None) -> None:
        """`address`: the score formatter's. `owner`: where several API server processes share
        the worker, this process's tag (`owner_tag`), the topic the formatter sends this
        process's rows on. None: the one API server process."""
        self.address = address
        self.retention_s = retention_s
        self.owner = owner
        # The formatter's topic for this process, its numbering of each topic heard (this
        # process's and BROADCAST), which formatter that was (`publisher`, new every start) and
        # when this hub last heard from it (`silent` once that is SILENT_AFTER_S ago).
        self._topic = owner.encode() if owner else UNTAGGED
        self._topic_name = self._topic.decode()
        self._formatter_sequences: dict[str, int] = {}
        self._formatter: int | None = None
        self.formatter_restarts = 0
        self.silent = False
        self._heard = time.monotonic()
        self._silence_task: asyncio.Task | None = None
        self._step_decoder = msgspec.msgpack.Decoder(FormattedStep)
        self._decoder = msgspec.msgpack.Decoder()
        # Bumped by each swap control message: the middleware's cached listings are older than it.
        self.swaps = 0
        self._requests: dict[str, RequestScores] = {}
        self._tables: dict[int, ProbeSet] = {}
        self._task: asyncio.Task | None = None
        self._socket = None
        self.messages_received = 0
        # How long responses were held back waiting for scores (the cost the tap adds to
        # latency, if any), split by first chunk (prompt summary) and later tokens.
        self.waits = {"prompt": WaitStats(), "tokens": WaitStats()}
        # The tap switched off at run time (`set_paused`): no scores come while it is, and a
        # stream that lived through a pause has tokens that never will; `pauses` counts the
        # pauses, so a response can tell whether one happened since it began.
        self.paused = False
        self.pauses = 0
        self._pause_sequence = 0
        # Scores lost on the way: messages missing from the worker's count (this process fell
        # so far behind that its queue filled) and steps the worker could not send (it says so).
        # Either way the tokens then in flight may never get theirs; `losses` counts the times,
        # so a response can tell whether one happened since it began, as with pauses.
        self.messages_lost = 0
        self.steps_lost = 0
        self.losses = 0
        self._last_sequence: int | None = None
        # Called with (version, dirs) for each probe set swapped in, from any process: the
        # middleware schedules the retention check for it.
        self.on_probes_swapped: Callable[[int, list[str]], None] | None = None
        # Called with the version of a probe set whose swap message never came (lost with
        # others: steps already carry the new version): the middleware asks the worker which
        # probes those are, for their retention check.
        self.on_probes_unannounced: Callable[[int], None] | None = None
        self._probe_version = 1  # the newest probe set heard of (the worker loads its startup set as 1)

    def start(self) -> None:
        if self._task is not None:
            return
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        self._socket = ctx.socket(zmq.SUB)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        loop = asyncio.get_running_loop()
        self._socket.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._socket.setsockopt(zmq.SUBSCRIBE, BROADCAST)
        self._heard = time.monotonic()
        self._silence_task = loop.create_task(self._watch_for_silence())
        # The formatter binds: one address for every API server process.
        self._socket.connect(self.address)
        self._task = loop.create_task(self._receive_forever())

    async def _receive_forever(self) -> None:
        """The formatter's messages ([topic, frame])."""
        receive, take = self._socket.recv_multipart, lambda frames: self.take_formatted(*frames)
        last_sweep = time.monotonic()
        while True:
            received = await receive()
            try:
                take(received)
            except Exception:  # a malformed message must not stop delivery for everyone
                log.exception("probex: could not take in a score message")
            now = time.monotonic()
            if now - last_sweep > 10:
                self.sweep(now)
                last_sweep = now

    async def _watch_for_silence(self) -> None:
        """The formatter sends something every second: long silence means it is gone (it
        exited, or its process hangs), and no scores will come until it is back."""
        while True:
            await asyncio.sleep(1.0)
            if not self.silent and time.monotonic() - self._heard > SILENT_AFTER_S:
                self.silent = True
                self._scores_lost(f"no word from the score formatter for {SILENT_AFTER_S:.0f} s: responses go out "
                                  "without the scores they are missing until it is back")

    def take_formatted(self, topic: bytes, frame: bytes) -> None:
        """One message from the score formatter: this process's rows of a step, or, on
        BROADCAST, a control message for every process."""
        if topic == self._topic:
            self._heard_now()
            self.ingest_formatted(self._step_decoder.decode(frame))
            return
        if topic != BROADCAST:  # a topic that only begins like ours or like BROADCAST
            return
        self._heard_now()
        message = self._decoder.decode(frame)
        self._count_formatted(message[PUBLISHER], BROADCAST.decode(), message[SEQUENCE])
        self._apply_pause(pause_of(message))  # the worker's pause state, on heartbeats and losses too
        kind = message.get(CONTROL)
        if kind == "heartbeat":
            # The formatter's count of this process's topic: messages lost at the end of a burst
            # show here, not only when the next one comes.
            announced = (message.get("last") or {}).get(self._topic_name)
            last = self._formatter_sequences.get(self._topic_name)
            if announced is not None and last is not None and announced > last:
                self._formatter_sequences[self._topic_name] = announced
                self._messages_missing(announced - last)
            return
        self.messages_received += 1
        if kind == "lost":
            mine = (message.get("by_owner") or {}).get(self._topic_name) or {}
            for key in mine.get("requests", ()):
                self._state(key).lost = True
            self._finished_keys(mine.get("finished", ()))
            why = str(message.get("why") or "scores lost")
            if message.get("messages"):
                self._messages_missing(int(message["messages"]), why)
            else:
                self.steps_lost += 1
                self._scores_lost(why)
            return
        self._control(message)

    def _heard_now(self) -> None:
        self._heard = time.monotonic()
        if self.silent:
            self.silent = False
            log.warning("probex: the score formatter is heard from again")

    def ingest_formatted(self, step: FormattedStep) -> None:
        """This process's rows of one step as the score formatter sent them: filed, nothing
        more (the books, calibration and JSON were the formatter's)."""
        self.messages_received += 1
        self._count_formatted(step.publisher, self._topic_name, step.sequence)
        self._apply_pause(step.pause)
        table = self._probe_set(step.version, step.probes)
        probes = table.probes
        prompted = []
        for prompt in step.prompts:
            state = self._state(prompt.request)
            prompted.append(state)
            state.prompt, state.prompt_fields, state.prompt_probes = prompt.summary, prompt.fields, probes
            state.prompt_json_parts = prompt.json_parts
            state.changed.set()
        if step.token_requests:
            now = time.monotonic()
            requests = self._requests
            for key, index, values, text in zip(step.token_requests, step.token_indexes, step.token_scores,
                                                step.token_json):
                state = requests.get(key) or self._state(key, now)
                state.touched = now
                state.add_token(index, values, probes)
                if state.token_json is not None and index >= state.token_json_from:
                    state.token_json[index] = text
                state.changed.set()
        self._finished_keys(step.finished)
        self._intake_done(prompted)

    def _count_formatted(self, publisher: int, stream: str, sequence: int) -> None:
        if publisher != self._formatter:
            if self._formatter is not None:
                # Started again: its books and whatever was on the way are gone.
                self.formatter_restarts += 1
                self._formatter_sequences.clear()
                self.swaps += 1
                self._scores_lost("the score formatter started again: scores then in flight are lost")
            self._formatter = publisher
        last = self._formatter_sequences.get(stream)
        self._formatter_sequences[stream] = sequence
        if last is not None and sequence > last + 1:
            self._messages_missing(sequence - last - 1)

    def _messages_missing(self, count: int, why: str | None = None) -> None:
        self.messages_lost += count
        # A swap may have been among them: listings are read again. A pause is set right by
        # the next message that carries the worker's pause state.
        self.swaps += 1
        self._scores_lost(why or f"{count} score messages lost (this API server process fell behind)")

    def _apply_pause(self, pause: tuple[int, bool] | None) -> None:
        """The worker's pause state (pause changes, paused) as a message carried it (`pause_of`):
        a process that missed a pause message is set right by the next step or heartbeat."""
        if pause is not None:
            self.set_paused(bool(pause[1]), int(pause[0]))

    def _probe_set(self, version: int, described: list | msgspec.Raw) -> ProbeSet:
        """The probe set a step was scored by (`described` as ProbeTable.describe wrote it)."""
        if version > self._probe_version:
            self._probe_version = version
            self.swaps += 1  # listings cached before it are older than it
            if self.on_probes_unannounced is not None:
                self.on_probes_unannounced(version)
        table = self._tables.get(version)
        if table is None:
            if isinstance(described, msgspec.Raw):
                described = msgspec.msgpack.decode(described)
            table = self._tables[version] = ProbeSet.from_described(described)
        return table

    def _intake_done(self, prompted: list[RequestScores]) -> None:
        for state in prompted:  # the step's tokens are in too: token 0 is among them
            responses.write_first_chunk_ahead(state)

    def _finished_keys(self, keys) -> None:
        for key in keys:
            state = self._requests.get(key)
            if state is not None:
                state.finished = True
                state.changed.set()

    def _scores_lost(self, what: str) -> None:
        """Some scores will never come: every waiting response looks again (`RequestScores.has`
        no longer waits for a token once a later one is in); what did come still goes out."""
        self.losses += 1
        for state in self._requests.values():
            state.changed.set()
        if self.losses in (1, 10, 100) or self.losses % 1000 == 0:
            log.warning("probex: %s (%d times so far)", what, self.losses)

    def _control(self, message: dict) -> None:
        """The tap paused or running again, or a swap, announced to every API server process:
        the process that took the request knew already, the others learn it here."""
        kind = message[CONTROL]
        if kind == "paused":
            self.set_paused(bool(message["paused"]), message.get("sequence"))
        elif kind == "swapped":
            self.swaps += 1
            if message.get("what") == "probes":
                self._probe_version = max(self._probe_version, int(message["version"]))
                if self.on_probes_swapped is not None:
                    self.on_probes_swapped(int(message["version"]), list(message.get("dirs") or []))
        else:
            log.warning("probex: unknown control message %r", kind)

    def _state(self, key: str, now: float | None = None) -> RequestScores:
        state = self._requests.get(key)
        if state is None:
            state = self._requests[key] = RequestScores()
        state.touched = time.monotonic() if now is None else now
        return state

    def get(self, key: str) -> RequestScores:
        return self._state(key)

    def release(self, key: str) -> None:
        self._requests.pop(key, None)

    def sweep(self, now: float | None = None) -> None:
        """Forget requests nobody asked about (e.g. sent straight to the engine)."""
        now = time.monotonic() if now is None else now
        stale = [k for k, s in self._requests.items() if now - s.touched > self.retention_s]
        for key in stale:
            del self._requests[key]

    def __len__(self) -> int:
        return len(self._requests)

    def set_paused(self, paused: bool, sequence: int | None = None) -> None:
        """The worker's tap was paused (or runs again): waits for scores end now, as none come.

        `sequence`: the worker's count of pause changes (the control message's, or the reply
        to this process's own request): one older than the last applied is ignored, so two
        processes switching the tap at once leave every process with the worker's state."""
        if sequence is not None:
            if sequence <= self._pause_sequence:
                return
            self._pause_sequence = sequence
        if paused and not self.paused:
            self.pauses += 1
            for state in self._requests.values():
                state.changed.set()  # waiters look again, and see the pause
        self.paused = paused

    def scores_in(self, state: RequestScores, *, prompt: bool, tokens: int) -> bool:
        """Are the prompt summary (if asked) and tokens [0, tokens) in already? Each check is
        one of `waits`' calls; `wait_more` waits for what is not in yet."""
        self.waits["prompt" if prompt else "tokens"].calls += 1
        return state.has(prompt=prompt, tokens=tokens)

    async def wait_for(self, key: str, *, prompt: bool, tokens: int, timeout: float) -> bool:
        """Wait until the prompt summary (if asked) and tokens [0, tokens) are in; False on timeout."""
        if self.scores_in(self._state(key), prompt=prompt, tokens=tokens):
            return True
        return await self.wait_more(key, prompt=prompt, tokens=tokens, timeout=timeout)

    async def wait_more(self, key: str, *, prompt: bool, tokens: int, timeout: float) -> bool:
        """`wait_for` after a `scores_in` check that said no (the stream relay's hot path
        makes that check without a coroutine)."""
        state = self._state(key)
        stats = self.waits["prompt" if prompt else "tokens"]
        start = time.monotonic()
        deadline = start + timeout
        losses = self.losses
        try:
            while not state.has(prompt=prompt, tokens=tokens):
                remaining = deadline - time.monotonic()
                # Paused, the formatter silent, or messages found lost since the wait began:
                # what is still missing after the message that showed the loss (booked before
                # this looks again) was in a lost one, or may be; waiting longer would only
                # hold the response.
                if remaining <= 0 or self.paused or self.silent or self.losses != losses:
                    return False
                state.changed.clear()
                try:
                    await asyncio.wait_for(state.changed.wait(), remaining)
                except asyncio.TimeoutError:
                    return False
            return True
        finally:
            stats.add(time.monotonic() - start)

    def wait_stats(self) -> dict[str, dict[str, float | int]]:
        return {kind: stats.as_dict() for kind, stats in self.waits.items()}


@dataclass
class TimeStats:
    """Count, total and maximum of one recurring piece of work's time, in seconds."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        if seconds > self.max_s:
            self.max_s = seconds

    def as_dict(self) -> dict[str, float | int]:
        return {"count": self.count, "total_s": self.total_s, "max_s": self.max_s}


class WaitStats(TimeStats):
    """The waits for scores (`count` of them had to wait, `total_s` in all), out of `calls`:
    every check (`ScoreHub.scores_in`), including those whose scores were already in."""

    calls: int = 0

    def as_dict(self) -> dict[str, float | int]:
        return {"calls": self.calls, "waited": self.count, "waited_s": self.total_s, "max_s": self.max_s}
