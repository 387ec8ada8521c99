"""The score formatter (engine_worker/score_formatter.py): what each API server process files
from it equals what it books itself from the worker's steps, and nothing it loses goes unseen.

The engine path through it is covered by tests/test_engine_api_servers.py (real vLLM, two API
server processes, the worker started with --score-formatter)."""

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
from engine_worker.scores.bookkeeping import (SEQUENCE, ProbeSlot, ProbeTable, StepLayout, heartbeat_message, lost_message,
                                       paused_message, step_message, swapped_message)
from engine_worker.api_server.hub import BROADCAST, ScoreHub, ScorePublisher, owner_tag
from engine_worker.api_server.middleware import MonitoredCall, StreamRelay, inspect_request
from engine_worker.scores.formatter import FormatterProcess, ScoreFormatter
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
        layout = StepLayout(req, np.array(scheduled), np.array(computed), np.array(prompt))
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


def formatted_hubs(owners: dict[str, str | None]) -> tuple[dict[str, ScoreHub], dict[str, ScoreHub]]:
    direct = {name: ScoreHub("inproc://unused", owner=owner) for name, owner in owners.items()}
    formatted = {name: ScoreHub("inproc://unused", owner=owner, formatted=True) for name, owner in owners.items()}
    return direct, formatted


def deliver(formatter: ScoreFormatter, hubs: dict[str, ScoreHub], message: dict) -> None:
    """The formatter's frames to every hub subscribed to their topic, as ZMQ's PUB would."""
    for topic, frame in formatter.take(message):
        for hub in hubs.values():
            if topic in (hub._topic, BROADCAST):
                hub.take_formatted(topic, frame)


def request_view(state) -> dict:
    return {"prompt": state.prompt, "prompt_fields": state.prompt_fields, "prompt_json_parts": state.prompt_json_parts,
            "prompt_probes": [p.name for p in state.prompt_probes] if state.prompt_probes else None,
            "tokens": state.tokens, "token_json": state.token_json, "contiguous": state.contiguous,
            "latest": state.latest, "finished": state.finished, "lost": state.lost,
            "probes": {index: [p.name for p in state.probes_of(index)] for index in state.tokens}}


@pytest.mark.parametrize("processes", [1, 2])
def test_what_a_process_files_from_the_formatter_equals_what_it_books_from_the_worker(processes):
    tags = [owner_tag() for _ in range(processes)] if processes > 1 else [""]
    owners = {f"process{i}": tag or None for i, tag in enumerate(tags)}
    ids = {"a": engine_id(tags[0]), "b": engine_id(tags[-1]), "c": engine_id(tags[0])}
    direct, formatted = formatted_hubs(owners)
    formatter = ScoreFormatter(api_server_count=processes)
    for hubs in (direct, formatted):  # a and b are streams whose first chunk went out: token JSON is written ahead
        for key in ("a", "b"):
            for hub in hubs.values():
                if hub.owner is None or hub._owned(ids[key]):
                    hub.get(delivery.external_request_id(ids[key])).token_json = {}
    for message in worker_messages(ids):
        for hub in direct.values():
            hub.ingest(message)
        deliver(formatter, formatted, message)
    for name in owners:
        assert set(formatted[name]._requests) == set(direct[name]._requests)
        for key, state in direct[name]._requests.items():
            assert request_view(formatted[name]._requests[key]) == request_view(state), key
        for attribute in ("paused", "pauses", "steps_lost", "losses", "messages_lost", "_probe_version"):
            assert getattr(formatted[name], attribute) == getattr(direct[name], attribute), attribute
    # what the scenario covered, read from the direct books
    every = {key: state for hub in direct.values() for key, state in hub._requests.items()}
    a, b, c = (every[delivery.external_request_id(ids[k])] for k in "abc")
    assert a.finished and a.token_json and b.finished and c.lost and formatted["process0"].paused
    assert b.prompt["tokens_scored"] == 4 and c.prompt["tokens_scored"] == 2  # two chunks; half from the cache
    assert b.probes_of(2) is not b.token_probes and len(b.tokens[2]) == 2  # token 2 scored by the swapped-in set
    assert b.tokens[0] == (pytest.approx(calibrate(float(b.prompt["last_raw"][0]), 2.0, -0.5)),)


def test_a_process_files_only_its_own_rows_and_every_process_hears_controls():
    ours, theirs = owner_tag(), owner_tag()
    ids = {"a": engine_id(ours), "b": engine_id(theirs), "c": engine_id(ours)}
    _, hubs = formatted_hubs({"ours": ours, "theirs": theirs})
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
    assert {delivery.external_request_id(ids[k]) for k in "ac"} == set(hubs["ours"]._requests)
    assert {delivery.external_request_id(ids["b"])} == set(hubs["theirs"]._requests)
    assert hubs["ours"].swaps == hubs["theirs"].swaps == 1
    assert hubs["ours"].messages_received == 4 and hubs["theirs"].messages_received == 3


def test_losses_between_worker_formatter_and_process_are_all_seen():
    formatter = ScoreFormatter(api_server_count=1)
    hub = ScoreHub("inproc://unused", formatted=True)
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
    assert hub.steps_lost == 1 and hub._requests[delivery.external_request_id(ids["b"])].lost


def test_a_silent_formatter_ends_the_waits_for_scores(monkeypatch):
    """Nothing heard for SILENT_AFTER_S (a formatter gone, or never started): a chunk waiting
    for its scores goes out without them at once, and so do later ones, until it is back."""
    monkeypatch.setattr(delivery, "SILENT_AFTER_S", 0.3)
    call = MonitoredCall(key_prefix="cmpl-probex-a", stream=True, wants_token_ids=False)
    chunk = b'data: {"id":"x","choices":[{"index":0,"text":"a","token_ids":[5]}]}'

    async def scenario():
        hub = ScoreHub(f"ipc://{tempfile.mkdtemp()}/nobody", formatted=True)
        hub.start()
        try:
            started = time.monotonic()
            decorated = await StreamRelay(hub, call, None, 30.0)._decorate_event(chunk)
            return json.loads(decorated[6:]), time.monotonic() - started, hub.silent, hub.losses
        finally:
            hub._task.cancel()
            hub._silence_task.cancel()
            hub._socket.close()
            hub.collections.detach()

    body, elapsed, silent, losses = asyncio.run(scenario())
    assert silent and losses == 1 and elapsed < 5  # the score wait was 30 s
    assert "scores" not in body.get("probex", {}) or body["probex"]["scores"] == {}


def test_the_worker_runs_the_formatter_and_starts_it_again_when_it_dies():
    """The real processes and sockets: the worker's steps reach each API server process's hub
    through a formatter process; killed, it is started again, every hub says scores were lost,
    and scores flow again."""
    ours, theirs = owner_tag(), owner_tag()
    ids = {"a": engine_id(ours), "b": engine_id(theirs)}
    root = tempfile.mkdtemp()
    steps_at, scores_at = f"ipc://{root}/steps", f"ipc://{root}/scores"

    def step(computed):
        layout = StepLayout([ids["a"], ids["b"]], np.array([1, 1]), np.array([computed, computed]), np.array([2, 2]))
        return step_message(ONE_PROBE, layout, np.array([[0.5], [-1.0]], np.float32), [])

    async def scenario():
        publisher = ScorePublisher(steps_at, heartbeat_s=0.2)
        formatter = FormatterProcess(steps_at, scores_at, api_server_count=2).start()
        hubs = {"ours": ScoreHub(scores_at, owner=ours, formatted=True),
                "theirs": ScoreHub(scores_at, owner=theirs, formatted=True)}
        for hub in hubs.values():
            hub.start()
        try:
            await until(lambda: all(hub._formatter is not None for hub in hubs.values()))  # heartbeats heard
            publisher.publish(step(2))
            await until(lambda: all(len(hub) == 1 for hub in hubs.values()))
            first_pid = formatter.process.pid
            os.kill(first_pid, signal.SIGKILL)
            await until(lambda: all(hub.formatter_restarts == 1 for hub in hubs.values()))
            assert formatter.starts == 2 and formatter.process.pid != first_pid
            await asyncio.sleep(0.5)  # the new formatter's subscription reaches the worker
            publisher.publish(step(3))
            await until(lambda: all(2 in hub.get(hub_key(name)).tokens for name, hub in hubs.items()))
            return {name: (hub.get(hub_key(name)).tokens, hub.losses) for name, hub in hubs.items()}
        finally:
            formatter.close()
            publisher.close()
            for hub in hubs.values():
                hub._task.cancel()
                hub._silence_task.cancel()
                hub._socket.close()
                hub.collections.detach()

    def hub_key(name):
        return delivery.external_request_id(ids["a" if name == "ours" else "b"])

    seen = asyncio.run(scenario())
    assert seen["ours"][0] == {1: (pytest.approx(calibrate(0.5, 2.0, -0.5)),), 2: (pytest.approx(calibrate(0.5, 2.0, -0.5)),)}
    assert seen["theirs"][0][2] == (pytest.approx(calibrate(-1.0, 2.0, -0.5)),)
    assert seen["ours"][1] >= 1 and seen["theirs"][1] >= 1


def test_the_formatter_leaves_the_cores_a_cpu_engine_bound_its_worker_to():
    """vLLM's CPU backend binds every thread of its worker to the forward's cores, and a child
    keeps the binding of the thread that started it: the formatter takes the CPUs of the
    process that started the worker instead (the test plays the worker: one of its threads
    bound to one CPU starts the formatter)."""
    allowed = sorted(os.sched_getaffinity(os.getppid()))  # two CPUs on the dev machine and in CI
    root = tempfile.mkdtemp()
    result = {}

    def bound_worker_thread():
        os.sched_setaffinity(0, allowed[-1:])  # this thread only, as vLLM binds its worker's
        formatter = FormatterProcess(f"ipc://{root}/steps", f"ipc://{root}/scores", api_server_count=1).start()
        try:
            result["formatter"] = sorted(os.sched_getaffinity(formatter.process.pid))
        finally:
            formatter.close()

    thread = threading.Thread(target=bound_worker_thread)
    thread.start()
    thread.join(60)
    assert result["formatter"] == allowed


def test_a_process_that_missed_a_pause_is_set_right_by_the_next_heartbeat():
    """The worker's pause state rides on every heartbeat (the worker's, then the formatter's):
    a process that lost the pause message, or a formatter started after it, still learns it."""
    formatter = ScoreFormatter(api_server_count=1)
    hub = ScoreHub("inproc://unused", formatted=True)
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
    # without the formatter, the worker's heartbeat itself sets a process right
    direct = ScoreHub("inproc://unused")
    direct.ingest({**heartbeat_message(), "pause": [1, True], SEQUENCE: 1})
    assert direct.paused
    # and an older state than the hub has is ignored
    hub.take_formatted(*ScoreFormatter(api_server_count=1, publisher=restarted.publisher).take(
        {**paused_message(True, 1), SEQUENCE: 10})[0])
    assert not hub.paused


def test_the_worker_publishers_heartbeats_repeat_its_pause_state():
    import msgspec
    import zmq

    address = f"ipc://{tempfile.mkdtemp()}/steps"
    publisher = ScorePublisher(address, heartbeat_s=0.2)
    listener = zmq.Context.instance().socket(zmq.SUB)
    listener.setsockopt(zmq.SUBSCRIBE, b"")
    listener.connect(address)
    try:
        time.sleep(0.3)  # the subscription reaches the publisher
        publisher.publish(paused_message(True, 3))
        heard = []  # from the pause message on (heartbeats may come before it)
        while (len(heard) < 2) and listener.poll(5000):
            message = msgspec.msgpack.decode(listener.recv())
            if heard or message["control"] == "paused":
                heard.append(message)
    finally:
        publisher.close()
        listener.close(linger=0)
    assert heard[1]["control"] == "heartbeat" and heard[1]["pause"] == [3, True]


def test_ids_a_client_chose_reach_no_process_and_a_look_alike_topic_is_ignored():
    """Several processes: an id whose text after "-probex-" is not an owner tag (a client's own
    X-Request-Id, passed through unmonitored) goes to nobody, and a frame on a topic that only
    begins like a process's subscription is not filed."""
    ours = owner_tag()
    ids = {"a": engine_id(ours), "b": "x-probex-*zzzzzzz-0123abcd", "c": "plain-id-4567ef01"}
    formatter = ScoreFormatter(api_server_count=2)
    frames = formatter.take({**worker_messages(ids)[0], SEQUENCE: 1})
    assert [topic for topic, _ in frames] == [ours.encode()]
    hub = ScoreHub("inproc://unused", owner=ours, formatted=True)
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
        hub.collections.detach()


def test_a_process_with_no_rows_of_its_own_still_hears_the_formatter(monkeypatch):
    """One process busy, the other idle: the idle one gets the formatter's heartbeat every
    second all the same, and does not take the formatter for gone."""
    monkeypatch.setattr(delivery, "SILENT_AFTER_S", 1.5)
    ours, theirs = owner_tag(), owner_tag()
    busy = engine_id(ours)
    root = tempfile.mkdtemp()
    steps_at, scores_at = f"ipc://{root}/steps", f"ipc://{root}/scores"

    async def scenario():
        publisher = ScorePublisher(steps_at, heartbeat_s=0.2)
        formatter = FormatterProcess(steps_at, scores_at, api_server_count=2).start()
        hubs = [ScoreHub(scores_at, owner=ours, formatted=True), ScoreHub(scores_at, owner=theirs, formatted=True)]
        for hub in hubs:
            hub.start()
        try:
            await until(lambda: all(hub._formatter is not None for hub in hubs))
            for computed in range(2, 42):  # 4 s of steps for one process only
                layout = StepLayout([busy], np.array([1]), np.array([computed]), np.array([2]))
                publisher.publish(step_message(ONE_PROBE, layout, np.array([[0.5]], np.float32), []))
                await asyncio.sleep(0.1)
            return [(hub.silent, hub.losses, len(hub)) for hub in hubs]
        finally:
            _stop(hubs, formatter, publisher)

    (busy_state, idle_state) = asyncio.run(scenario())
    assert busy_state == (False, 0, 1) and idle_state == (False, 0, 0)


def test_a_formatter_that_hears_no_worker_lets_the_processes_stop_waiting(monkeypatch):
    monkeypatch.setattr(delivery, "SILENT_AFTER_S", 2.0)
    root = tempfile.mkdtemp()

    async def scenario():
        formatter = FormatterProcess(f"ipc://{root}/steps", f"ipc://{root}/scores", api_server_count=1).start()
        hub = ScoreHub(f"ipc://{root}/scores", formatted=True)
        hub.start()
        try:
            await until(lambda: hub._formatter is not None)  # heartbeats at first
            await until(lambda: hub.silent, timeout=15)  # held back once no worker was heard for 3 s
            return hub.losses
        finally:
            _stop([hub], formatter)

    assert asyncio.run(scenario()) == 1


def test_a_formatter_that_cannot_start_stops_the_worker_from_starting():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="score formatter did not start"):
        FormatterProcess("ipc:///nonexistent-probex-dir/steps", "ipc:///nonexistent-probex-dir/scores",
                         api_server_count=1).start()
    assert time.monotonic() - started < 20
