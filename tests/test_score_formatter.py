"""The score formatter (engine_worker/scores/formatter.py): what each API server process files
from it equals what the worker's steps booked, each process gets its own requests' rows, and
nothing lost on the way goes unseen.

The engine path through it is covered by tests/test_engine_api_servers.py (real vLLM, two API
server processes, the formatter reading the worker's score ring)."""

import asyncio
import json
import os
import signal
import tempfile
import threading
import time
from collections import Counter

import numpy as np
import pytest

from engine_worker.api_server import hub as delivery
from engine_worker.api_server.hub import ScoreHub
from engine_worker.api_server.relay import StreamRelay
from engine_worker.api_server.requests import MonitoredCall, inspect_request
from engine_worker.scores.bookkeeping import (CONTROL, SEQUENCE, ProbeSlot, ProbeTable, StepReader, StepView,
                                              heartbeat_message, lost_message, paused_message, step_message,
                                              swapped_message)
from engine_worker.scores.formatter import FormatterNotStarted, FormatterProcess, ScoreFormatter
from engine_worker.scores.ring import STEP, RingPublisher, ScoreRing
from engine_worker.scores.wire import BROADCAST, external_request_id, owner_tag
from probes.scoring import calibrate

ONE_PROBE = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 2.0, -0.5),))
TWO_PROBES = ProbeTable(version=2, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 2.0, -0.5),
                                          ProbeSlot("q", 5, 0, "prompt_mean", 0.5, 1.0)))


def engine_id(owner: str) -> str:
    """A request id as vLLM's engine sees it: the middleware's, and vLLM's "-<8 hex>"."""
    return inspect_request("/v1/chat/completions", {"messages": []}, owner=owner).key(0) + "-0123abcd"


def worker_messages(ids: dict[str, str]) -> list[dict]:
    """Steps as the worker publishes them (numbered): a whole prompt, a prompt in two chunks, a
    prompt partly from the prefix cache, decodes, an end, a pause, a swap to a two-probe set
    mid-stream, and a step the worker could not send."""
    a, b, c = ids["a"], ids["b"], ids["c"]
    rng = np.random.default_rng(5)

    def step(table, req, scheduled, computed, prompt, finished=(), pause=None):
        layout = StepView(req, np.array(scheduled), np.array(computed), np.array(prompt))
        raw = rng.normal(size=(int(sum(scheduled)), len(table.slots))).astype(np.float32)
        return step_message(table, layout, raw, list(finished), pause)

    messages = [
        step(ONE_PROBE, [a, b, c], [3, 2, 2], [0, 0, 2], [3, 4, 4]),  # a whole, b's first chunk, c from the cache
        step(ONE_PROBE, [a, b, c], [1, 2, 1], [3, 2, 4], [3, 4, 4]),  # b's last chunk samples its first token
        step(ONE_PROBE, [a, b, c], [1, 1, 1], [4, 4, 5], [3, 4, 4], finished=[a], pause=(1, False)),
        swapped_message("probes", 2, ["/probes/two"]),
        step(TWO_PROBES, [b, c], [1, 1], [5, 6], [4, 4]),
        paused_message(True, 2),
        heartbeat_message(),
        lost_message([c], [b]),
    ]
    return [{**message, SEQUENCE: number} for number, message in enumerate(messages, start=1)]


async def until(condition, timeout: float = 20.0) -> None:
    """Wait (polling, in the event loop) until `condition()` holds; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def hubs_for(owners: dict[str, str | None]) -> dict[str, ScoreHub]:
    return {name: ScoreHub("inproc://unused", owner=owner) for name, owner in owners.items()}


def booked_by_the_worker(messages: list[dict]) -> dict[str, dict]:
    """What each request was scored, read from the worker's messages with the books' own reader
    (`StepReader`), by our id: its prompt summary, each token's calibrated scores and the names
    of the probes that scored it, whether it ended and whether a step of it was lost."""
    reader = StepReader()
    books: dict[str, dict] = {}

    def of(req: str) -> dict:
        return books.setdefault(external_request_id(req), {"prompt": None, "tokens": {}, "finished": False,
                                                           "lost": False})

    for message in messages:
        kind = message.get(CONTROL)
        if kind == "lost":
            for req in message["requests"]:
                of(req)["lost"] = True
            for req in reader.book.finish(message["finished"]):
                of(req)["finished"] = True
        elif kind is None:
            events = reader.read(message)
            for summary in events.prompt:
                of(summary["req"])["prompt"] = summary
            for token in events.tokens:
                of(token["req"])["tokens"][token["index"]] = (
                    [calibrate(raw, slot.slope, slot.intercept) for raw, slot in zip(token["raw"], events.table.slots)],
                    events.table.names)
            for req in events.finished:
                of(req)["finished"] = True
    return books


def deliver(formatter: ScoreFormatter, hubs: dict[str, ScoreHub], message: dict) -> None:
    """The formatter's frames to every hub subscribed to their topic, as ZMQ's PUB would."""
    for topic, frame in formatter.take(message):
        for hub in hubs.values():
            if topic in (hub._topic, BROADCAST):
                hub.take_formatted(topic, frame)


@pytest.mark.parametrize("processes", [1, 2])
def test_what_a_process_files_from_the_formatter_equals_what_the_workers_steps_booked(processes):
    tags = [owner_tag() for _ in range(processes)] if processes > 1 else [""]
    owners = {f"process{i}": tag or None for i, tag in enumerate(tags)}
    ids = {"a": engine_id(tags[0]), "b": engine_id(tags[-1]), "c": engine_id(tags[0])}
    hubs = hubs_for(owners)
    formatter = ScoreFormatter(api_server_count=processes)
    for key in ("a", "b"):  # streams whose first chunk went out: their tokens' JSON is written ahead
        for hub in hubs.values():
            if hub.owner is None or hub.owner in ids[key]:
                hub.get(external_request_id(ids[key])).token_json = {}
    messages = worker_messages(ids)
    for message in messages:
        deliver(formatter, hubs, message)
    books = booked_by_the_worker(messages)
    for name, hub in hubs.items():
        mine = {external_request_id(req) for req in ids.values() if hub.owner is None or hub.owner in req}
        assert set(hub._requests) == mine, name
        for key in mine:
            state, booked = hub._requests[key], books[key]
            assert state.prompt == booked["prompt"] and state.finished == booked["finished"], key
            assert state.lost == booked["lost"], key
            assert set(state.tokens) == set(booked["tokens"]) and state.contiguous == len(booked["tokens"]), key
            for index, (scores, names) in booked["tokens"].items():
                assert state.tokens[index] == pytest.approx(tuple(scores)), (key, index)
                assert [p.name for p in state.probes_of(index)] == names, (key, index)
                if state.token_json is not None:  # the one-token chunk's scores, as the relay splices them
                    written = json.loads(state.token_json[index])
                    assert written == {name: {"generated": {"offset": index, "scores": [pytest.approx(score)]}}
                                       for name, score in zip(names, scores)}, (key, index)
            if booked["prompt"] is not None:
                slots = ONE_PROBE.slots  # every prompt completed before the swap
                assert [p.name for p in state.prompt_probes] == [slot.name for slot in slots]
                for slot, last in zip(slots, booked["prompt"]["last_raw"]):
                    assert state.prompt_fields[slot.name]["prompt"]["last"] == pytest.approx(
                        calibrate(last, slot.slope, slot.intercept))
                assert state.prompt_json_parts is not None
        assert (hub.paused, hub.pauses, hub.steps_lost, hub.losses, hub.messages_lost, hub._probe_version) \
            == (True, 1, 1, 1, 0, 2), name
    # what the scenario covered
    every = {key: state for hub in hubs.values() for key, state in hub._requests.items()}
    a, b, c = (every[external_request_id(ids[k])] for k in "abc")
    assert a.finished and a.token_json and b.finished and c.lost and not c.finished
    assert b.prompt["tokens_scored"] == 4 and c.prompt["tokens_scored"] == 2  # two chunks; half from the cache
    assert b.probes_of(2) is not b.token_probes and len(b.tokens[2]) == 2  # token 2 scored by the swapped-in set
    assert b.tokens[0] == (pytest.approx(calibrate(float(b.prompt["last_raw"][0]), 2.0, -0.5)),)


def test_a_process_files_only_its_own_rows_and_every_process_hears_controls():
    ours, theirs = owner_tag(), owner_tag()
    ids = {"a": engine_id(ours), "b": engine_id(theirs), "c": engine_id(ours)}
    hubs = hubs_for({"ours": ours, "theirs": theirs})
    formatter = ScoreFormatter(api_server_count=2)
    sent: list[bytes] = []
    for message in worker_messages(ids)[:4]:
        frames = formatter.take(message)
        sent += [topic for topic, _ in frames]
        for topic, frame in frames:
            for hub in hubs.values():
                if topic in (hub._topic, BROADCAST):
                    hub.take_formatted(topic, frame)
    # "theirs" has nothing in the first step (its prompt's first chunk samples no token); the swap goes to everyone
    assert Counter(sent) == {ours.encode(): 3, theirs.encode(): 2, BROADCAST: 1}
    assert {external_request_id(ids[k]) for k in "ac"} == set(hubs["ours"]._requests)
    assert {external_request_id(ids["b"])} == set(hubs["theirs"]._requests)
    assert hubs["ours"].swaps == hubs["theirs"].swaps == 1
    assert hubs["ours"].messages_received == 4 and hubs["theirs"].messages_received == 3


def test_losses_between_worker_formatter_and_process_are_all_seen():
    formatter = ScoreFormatter(api_server_count=1)
    hub = ScoreHub("inproc://unused")
    ids = {k: engine_id("") for k in "abc"}
    messages = worker_messages(ids)

    def feed(frames):
        for topic, frame in frames:
            hub.take_formatted(topic, frame)

    feed(formatter.take(messages[0]))
    feed(formatter.take(messages[2]))  # the worker's message 2 never reached the formatter
    assert hub.messages_lost == 1 and hub.losses == 1
    # the formatter's next message for this process is lost on the way (numbered as if the
    # worker's next: no gap there)
    dropped = formatter.take({**messages[4], SEQUENCE: 4})
    assert len(dropped) == 1
    feed([formatter.heartbeat()])  # the idle formatter's heartbeat carries the count: the gap shows
    assert hub.messages_lost == 2 and hub.losses == 2
    restarted = ScoreFormatter(api_server_count=1)
    assert restarted.publisher != formatter.publisher
    feed([restarted.heartbeat()])  # a formatter started again: what it had in flight is gone
    assert hub.formatter_restarts == 1 and hub.losses == 3
    feed([restarted.step_failed(messages[4])])  # a step it could not read: its requests wait no more
    assert hub.steps_lost == 1 and hub._requests[external_request_id(ids["b"])].lost


def test_a_silent_formatter_ends_the_waits_for_scores(monkeypatch):
    """Nothing heard for SILENT_AFTER_S (a formatter gone, or never started): a chunk waiting
    for its scores goes out without them at once, and so do later ones, until it is back."""
    monkeypatch.setattr(delivery, "SILENT_AFTER_S", 0.3)
    call = MonitoredCall(key_prefix="cmpl-probex-a", stream=True, wants_token_ids=False)
    chunk = b'data: {"id":"x","choices":[{"index":0,"text":"a","token_ids":[5]}]}'

    async def scenario():
        hub = ScoreHub(f"ipc://{tempfile.mkdtemp()}/nobody")
        hub.start()
        try:
            started = time.monotonic()
            decorated = await StreamRelay(hub, call, None, 30.0)._decorate_event(chunk)
            return json.loads(decorated[6:]), time.monotonic() - started, hub.silent, hub.losses
        finally:
            hub._task.cancel()
            hub._silence_task.cancel()
            hub._socket.close()

    body, elapsed, silent, losses = asyncio.run(scenario())
    assert silent and losses == 1 and elapsed < 5  # the score wait was 30 s
    assert "scores" not in body.get("probex", {}) or body["probex"]["scores"] == {}


def score_ring() -> ScoreRing:
    """A worker's score ring for ONE_PROBE (layer 3, slot 0), eight rows a step."""
    return ScoreRing.create({3: (8, 1)}, slots=16)


def stage_step(ring: ScoreRing, publisher: RingPublisher, layout: StepView, values: list[float]) -> None:
    """A step as the engine thread stages it: its rows' scores in the entry's slot, landed, then
    the step's description committed (`RingPublisher`; the formatter gathers the columns)."""
    entry = publisher.reserve()
    ring.scores(entry.slot)[3][:len(values), 0] = values
    ring.mark_landed(entry.slot, entry.ticket)
    message = step_message(ONE_PROBE, layout, None, [])
    message.update(rows=len(values), slots=ONE_PROBE.buffer_slots())
    publisher.commit(entry, message, kind=STEP)


def test_the_worker_runs_the_formatter_and_starts_it_again_when_it_dies():
    """The real processes and sockets: the worker's steps reach each API server process's hub
    through the score ring and a formatter process; killed, it is started again, every hub says
    scores were lost, and scores flow again."""
    ours, theirs = owner_tag(), owner_tag()
    ids = {"a": engine_id(ours), "b": engine_id(theirs)}
    scores_at = f"ipc://{tempfile.mkdtemp()}/scores"
    ring = score_ring()

    def step(computed):
        return StepView([ids["a"], ids["b"]], np.array([1, 1]), np.array([computed, computed]), np.array([2, 2]))

    async def scenario():
        publisher = RingPublisher(ring, heartbeat_s=0.2)
        formatter = FormatterProcess(scores_at, api_server_count=2, ring_fd=ring.fd).start()
        hubs = {"ours": ScoreHub(scores_at, owner=ours), "theirs": ScoreHub(scores_at, owner=theirs)}
        for hub in hubs.values():
            hub.start()
        try:
            await until(lambda: all(hub._formatter is not None for hub in hubs.values()))  # heartbeats heard
            stage_step(ring, publisher, step(2), [0.5, -1.0])
            await until(lambda: all(len(hub) == 1 for hub in hubs.values()))
            first_pid = formatter.process.pid
            os.kill(first_pid, signal.SIGKILL)
            await until(lambda: all(hub.formatter_restarts == 1 for hub in hubs.values()))
            assert formatter.starts == 2 and formatter.process.pid != first_pid
            stage_step(ring, publisher, step(3), [0.5, -1.0])
            await until(lambda: all(2 in hub.get(hub_key(name)).tokens for name, hub in hubs.items()))
            return {name: (hub.get(hub_key(name)).tokens, hub.losses) for name, hub in hubs.items()}
        finally:
            _stop(hubs.values(), formatter, publisher)

    def hub_key(name):
        return external_request_id(ids["a" if name == "ours" else "b"])

    try:
        seen = asyncio.run(scenario())
    finally:
        ring.close()
    assert seen["ours"][0] == {1: (pytest.approx(calibrate(0.5, 2.0, -0.5)),), 2: (pytest.approx(calibrate(0.5, 2.0, -0.5)),)}
    assert seen["theirs"][0] == {1: (pytest.approx(calibrate(-1.0, 2.0, -0.5)),), 2: (pytest.approx(calibrate(-1.0, 2.0, -0.5)),)}
    assert seen["ours"][1] >= 1 and seen["theirs"][1] >= 1


def test_the_formatter_leaves_the_cores_a_cpu_engine_bound_its_worker_to():
    """vLLM's CPU backend binds every thread of its worker to the forward's cores, and a child
    keeps the binding of the thread that started it: the formatter takes the CPUs of the
    process that started the worker instead (the test plays the worker: one of its threads
    bound to one CPU starts the formatter)."""
    allowed = sorted(os.sched_getaffinity(os.getppid()))  # two CPUs on the dev machine and in CI
    root = tempfile.mkdtemp()
    ring = score_ring()
    result = {}

    def bound_worker_thread():
        os.sched_setaffinity(0, allowed[-1:])  # this thread only, as vLLM binds its worker's
        formatter = FormatterProcess(f"ipc://{root}/scores", api_server_count=1, ring_fd=ring.fd).start()
        try:
            result["formatter"] = sorted(os.sched_getaffinity(formatter.process.pid))
        finally:
            formatter.close()

    thread = threading.Thread(target=bound_worker_thread)
    thread.start()
    thread.join(60)
    ring.close()
    assert result["formatter"] == allowed


def test_a_process_that_missed_a_pause_is_set_right_by_the_next_heartbeat():
    """The worker's pause state rides on every heartbeat (the worker's, then the formatter's):
    a process that lost the pause message, or a formatter started after it, still learns it."""
    formatter = ScoreFormatter(api_server_count=1)
    hub = ScoreHub("inproc://unused")
    formatter.take({**paused_message(True, 1), SEQUENCE: 1})  # its broadcast never reaches the hub
    assert not hub.paused
    hub.take_formatted(*formatter.heartbeat())
    assert hub.paused and hub.pauses == 1
    # a formatter started after the change hears it from the worker's next heartbeat
    restarted = ScoreFormatter(api_server_count=1)
    publisher_heartbeat = {**heartbeat_message(), "pause": [2, False], SEQUENCE: 9}
    assert restarted.take(publisher_heartbeat) == []
    hub.take_formatted(*restarted.heartbeat())
    assert not hub.paused
    # and an older state than the hub has is ignored
    hub.take_formatted(*ScoreFormatter(api_server_count=1, publisher=restarted.publisher).take(
        {**paused_message(True, 1), SEQUENCE: 10})[0])
    assert not hub.paused


def test_ids_a_client_chose_reach_no_process_and_a_look_alike_topic_is_ignored():
    """Several processes: an id whose text after "-probex-" is not an owner tag (a client's own
    X-Request-Id, passed through unmonitored) goes to nobody, and a frame on a topic that only
    begins like a process's subscription is not filed."""
    ours = owner_tag()
    ids = {"a": engine_id(ours), "b": "x-probex-*zzzzzzz-0123abcd", "c": "plain-id-4567ef01"}
    formatter = ScoreFormatter(api_server_count=2)
    frames = formatter.take({**worker_messages(ids)[0], SEQUENCE: 1})
    assert [topic for topic, _ in frames] == [ours.encode()]
    hub = ScoreHub("inproc://unused", owner=ours)
    for topic, frame in frames:
        hub.take_formatted(topic, frame)
    foreign = ScoreFormatter(api_server_count=2, publisher=formatter.publisher)
    hub.take_formatted(b"*zzzzzzz", foreign.take({**worker_messages({"a": engine_id(ours), "b": ids["b"],
                                                                     "c": ids["c"]})[0], SEQUENCE: 1})[0][1])
    assert hub.messages_lost == 0 and hub.losses == 0 and hub.messages_received == 1


def _stop(hubs, *closers):
    for closer in closers:
        closer.close()
    for hub in hubs:
        hub._task.cancel()
        hub._silence_task.cancel()
        hub._socket.close()


def test_a_process_with_no_rows_of_its_own_still_hears_the_formatter(monkeypatch):
    """One process busy, the other idle: the idle one gets the formatter's heartbeat every
    second all the same, and does not take the formatter for gone."""
    monkeypatch.setattr(delivery, "SILENT_AFTER_S", 1.5)
    ours, theirs = owner_tag(), owner_tag()
    busy = engine_id(ours)
    scores_at = f"ipc://{tempfile.mkdtemp()}/scores"
    ring = score_ring()

    async def scenario():
        publisher = RingPublisher(ring, heartbeat_s=0.2)
        formatter = FormatterProcess(scores_at, api_server_count=2, ring_fd=ring.fd).start()
        hubs = [ScoreHub(scores_at, owner=ours), ScoreHub(scores_at, owner=theirs)]
        for hub in hubs:
            hub.start()
        try:
            await until(lambda: all(hub._formatter is not None for hub in hubs))
            for computed in range(2, 42):  # 4 s of steps for one process only
                stage_step(ring, publisher, StepView([busy], np.array([1]), np.array([computed]), np.array([2])), [0.5])
                await asyncio.sleep(0.1)
            await until(lambda: 40 in hubs[0].get(external_request_id(busy)).tokens)
            return [(hub.silent, hub.losses, len(hub)) for hub in hubs]
        finally:
            _stop(hubs, formatter, publisher)

    try:
        (busy_state, idle_state) = asyncio.run(scenario())
    finally:
        ring.close()
    assert busy_state == (False, 0, 1) and idle_state == (False, 0, 0)


def test_a_formatter_that_hears_no_worker_lets_the_processes_stop_waiting(monkeypatch):
    """A ring nothing is written to (the worker hung): the formatter holds its heartbeats back
    once it has heard nothing for WORKER_SILENT_AFTER_S, and the hub then takes it for gone."""
    monkeypatch.setattr(delivery, "SILENT_AFTER_S", 2.0)
    scores_at = f"ipc://{tempfile.mkdtemp()}/scores"
    ring = score_ring()

    async def scenario():
        formatter = FormatterProcess(scores_at, api_server_count=1, ring_fd=ring.fd).start()
        hub = ScoreHub(scores_at)
        hub.start()
        try:
            await until(lambda: hub._formatter is not None)  # heartbeats at first
            await until(lambda: hub.silent, timeout=15)  # held back once no worker was heard for 3 s
            return hub.losses
        finally:
            _stop([hub], formatter)

    try:
        assert asyncio.run(scenario()) == 1
    finally:
        ring.close()


def test_a_formatter_that_cannot_start_stops_the_worker_from_starting():
    ring = score_ring()
    started = time.monotonic()
    try:
        with pytest.raises(FormatterNotStarted, match="score formatter did not start"):
            FormatterProcess("ipc:///nonexistent-probex-dir/scores", api_server_count=1, ring_fd=ring.fd).start()
    finally:
        ring.close()
    assert time.monotonic() - started < 20
