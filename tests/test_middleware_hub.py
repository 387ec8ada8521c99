"""The score hub as the worker's messages reach it: lost messages and heartbeats end waits
early, pause states are taken from whatever comes next, and several API server processes
each book only their own requests."""

import asyncio
import json
import tempfile

import msgspec
import numpy as np
import pytest

from engine_worker.api_server.hub import ScoreHub
from engine_worker.api_server.requests import inspect_request
from engine_worker.scores.bookkeeping import ProbeTable, StepView, step_message
from engine_worker.scores.formatter import ScoreFormatter
from engine_worker.tap.layer import ProbeSlot
from probes.scoring import calibrate
from tests.middleware_fixtures import deliver, formatter_of, idle_hub, ingest


def test_a_gap_in_the_workers_count_is_counted_and_no_chunk_waits_for_a_lost_token():
    """Messages the worker could not put in the score ring (the formatter far behind): the
    missing numbers tell the formatter, which tells every hub. A chunk whose token was in a
    lost step goes out once a later token is in (steps come in order, so the missing one never
    will), instead of each later chunk waiting the full score wait; tokens still to come are
    waited for as usual."""
    from engine_worker.scores.bookkeeping import SEQUENCE
    from engine_worker.api_server.relay import StreamRelay
    from engine_worker.api_server.requests import MonitoredCall

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    call = MonitoredCall(key_prefix="cmpl-probex-a", stream=True, wants_token_ids=False)

    def step(sequence, scheduled, computed, raw):
        layout = StepView([f"{call.key(0)}-0123abcd"], np.array([scheduled]), np.array([computed]), np.array([2]))
        return {**step_message(table, layout, np.array(raw, np.float32), []), SEQUENCE: sequence}

    def chunk(token):
        return b'data: {"id":"x","choices":[{"index":0,"text":"a","token_ids":[%d]}]}' % token

    async def go():
        hub = idle_hub()
        relay = StreamRelay(hub, call, None, 30.0)
        ingest(hub, step(7, 2, 0, [[0.5], [1.5]]))  # the first heard: prompt + token 0 (7: joined late, no loss)
        first = json.loads((await relay._decorate_event(chunk(5)))[6:])
        waiting = asyncio.get_running_loop().create_task(relay._decorate_event(chunk(6)))  # token 1
        await asyncio.sleep(0.05)
        assert not waiting.done() and hub.messages_lost == 0
        started = asyncio.get_running_loop().time()
        ingest(hub, step(10, 1, 3, [[2.5]]))  # token 2 arrives; 8 and 9 (token 1's step among them) never do
        second = json.loads((await waiting)[6:])
        third = json.loads((await relay._decorate_event(chunk(7)))[6:])  # token 2, in
        waiting = asyncio.get_running_loop().create_task(relay._decorate_event(chunk(8)))  # token 3, to come
        await asyncio.sleep(0.05)
        held = not waiting.done()
        ingest(hub, step(11, 1, 4, [[-1.0]]))
        fourth = json.loads((await waiting)[6:])
        elapsed = asyncio.get_running_loop().time() - started
        return first, second, third, fourth, held, elapsed, hub

    first, second, third, fourth, held, elapsed, hub = asyncio.run(go())
    assert elapsed < 5 and hub.messages_lost == 2 and hub.losses == 1 and hub.steps_lost == 0 and hub.swaps == 1
    assert first["probex"]["scores"]["p"]["generated"]["scores"] == [pytest.approx(calibrate(1.5, 1.0, 0.0))]
    assert second["probex"]["scores"] == {}  # token 1: never came
    assert third["probex"]["scores"]["p"]["generated"] == {"offset": 2, "scores": [pytest.approx(calibrate(2.5, 1.0, 0.0))]}
    assert held and fourth["probex"]["scores"]["p"]["generated"] == {"offset": 3, "scores": [pytest.approx(calibrate(-1.0, 1.0, 0.0))]}
    ingest(hub, step(3, 1, 4, [[0.0]]))  # a lower number is no gap: nothing more counted lost
    assert hub.messages_lost == 2 and hub.losses == 1


def test_an_idle_formatter_sends_heartbeats_so_a_lost_last_step_does_not_hold_its_chunk():
    """The last step of a burst lost on its way to this process (its queue was full) and
    nothing after it: the idle formatter's heartbeat carries its count of this process's
    messages, the hub finds the gap, and the chunk waiting for that step's scores goes out
    then, not after the whole wait."""
    from engine_worker.api_server.relay import StreamRelay
    from engine_worker.api_server.requests import MonitoredCall

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    call = MonitoredCall(key_prefix="cmpl-probex-a", stream=True, wants_token_ids=False)
    engine_id = f"{call.key(0)}-0123abcd"

    def chunk(token):
        return b'data: {"id":"x","choices":[{"index":0,"text":"a","token_ids":[%d]}]}' % token

    async def scenario():
        hub = idle_hub()
        formatter = formatter_of(hub)
        ingest(hub, step_message(table, StepView([engine_id], np.array([2]), np.array([0]), np.array([2])),
                                 np.array([[0.5], [1.5]], np.float32), []))
        relay = StreamRelay(hub, call, None, 30.0)
        first = json.loads((await relay._decorate_event(chunk(5)))[6:])
        # the request's last step (token 1, its end): formatted, lost on the way to this process
        lost = formatter.take(step_message(table, StepView([engine_id], np.array([1]), np.array([2]), np.array([2])),
                                           np.array([[2.5]], np.float32), [engine_id]))
        assert [topic for topic, _ in lost] == [hub._topic]
        started = asyncio.get_running_loop().time()
        waiting = asyncio.get_running_loop().create_task(relay._decorate_event(chunk(6)))
        await asyncio.sleep(0.05)
        held = not waiting.done()
        deliver(hub, [formatter.heartbeat()])
        last = json.loads((await waiting)[6:])
        return first, last, held, asyncio.get_running_loop().time() - started, hub.messages_lost

    first, last, held, elapsed, lost = asyncio.run(scenario())
    assert first["probex"]["scores"]["p"]["generated"]["scores"] == [pytest.approx(calibrate(1.5, 1.0, 0.0))]
    assert held and last["probex"]["scores"] == {} and lost == 1
    assert elapsed < 5  # the heartbeat told it; the score wait was 30 s


def test_a_wait_under_way_ends_when_messages_are_found_lost():
    """A chunk already waiting when a gap is found: the message that showed the gap is booked
    first (its tokens still count); what is missing after it is not waited for."""
    from engine_worker.scores.bookkeeping import SEQUENCE, heartbeat_message

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    a, b = "cmpl-probex-a-0-0123abcd", "cmpl-probex-b-0-0123abcd"

    def step(sequence, req, computed, raw):
        layout = StepView([req], np.array([1 if computed else 2]), np.array([computed]), np.array([2]))
        return {**step_message(table, layout, np.array(raw, np.float32), []), SEQUENCE: sequence}

    async def go():
        hub = idle_hub()
        ingest(hub, step(1, a, 0, [[0.5], [1.5]]))  # a: prompt + token 0
        ingest(hub, step(2, b, 0, [[0.5], [1.5]]))  # b: prompt + token 0
        waiting_a = asyncio.get_running_loop().create_task(
            hub.wait_for("cmpl-probex-a-0", prompt=False, tokens=2, timeout=30))
        waiting_b = asyncio.get_running_loop().create_task(
            hub.wait_for("cmpl-probex-b-0", prompt=False, tokens=2, timeout=30))
        await asyncio.sleep(0.05)
        assert not waiting_a.done() and not waiting_b.done()
        ingest(hub, step(4, b, 2, [[2.5]]))  # 3 lost (a's token 1); this one brings b's token 1
        results = await asyncio.wait_for(asyncio.gather(waiting_a, waiting_b), 5)
        received = hub.messages_received
        ingest(hub, {**heartbeat_message(), SEQUENCE: 5})  # the worker's heartbeat, in order: nothing lost
        deliver(hub, [formatter_of(hub).heartbeat()])  # the formatter's, with its count of this process's
        return results, hub.messages_lost, hub.losses, hub.messages_received - received

    (got_a, got_b), lost, losses, heartbeats_counted = asyncio.run(go())
    assert got_a is False and got_b is True and lost == 1 and losses == 1
    assert heartbeats_counted == 0  # score messages only (what tests of delivery count)


def test_a_lost_pause_message_is_made_good_by_the_next_step():
    """Each step carries the worker's pause state: a process that lost the pause (or the
    resume) message, on the formatter's way to it or the worker's way to the formatter, takes
    it from the next message it gets, instead of waiting for scores that will not come, or
    relaying unmonitored, until the tap is switched again."""
    from engine_worker.scores.bookkeeping import SEQUENCE, paused_message

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    hub = idle_hub()
    formatter = formatter_of(hub)
    req = "cmpl-probex-a-0-0123abcd"

    def step(sequence, computed, pause):
        layout = StepView([req], np.array([1 if computed else 2]), np.array([computed]), np.array([2]))
        rows = np.full((int(layout.num_rows), 1), 0.5, np.float32)
        return {**step_message(table, layout, rows, [], pause), SEQUENCE: sequence}

    ingest(hub, step(1, 0, (0, False)))
    formatter.take({**paused_message(True, 1), SEQUENCE: 2})  # its broadcast never reaches this process
    assert not hub.paused
    ingest(hub, step(3, 2, (1, True)))  # a step in flight as the tap paused carries the new state
    assert hub.paused and hub.pauses == 1 and hub.messages_lost == 0
    ingest(hub, step(4, 3, (1, True)))
    assert hub.pauses == 1  # the same state again changes nothing
    # the resume never reached the formatter (5 is missing): the loss it reports carries the state
    ingest(hub, {**step_message(table, StepView.empty(), np.zeros((0, 1), np.float32), [], (2, False)), SEQUENCE: 6})
    assert not hub.paused and hub.messages_lost == 1 and hub.pauses == 1


def test_every_api_server_process_hears_each_step_and_books_only_its_own_requests():
    """Several API server processes (vLLM's --api-server-count): the formatter takes each of
    the worker's messages once and sends on the real wire (ZMQ PUB, msgpack); each process's
    hub books the rows of the requests its middleware tagged, prefills and decodes alike, and
    every hub hears pauses and swaps."""
    import zmq

    from engine_worker.scores.bookkeeping import SEQUENCE, paused_message, swapped_message
    from engine_worker.scores.wire import FormattedStep, owner_tag

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    ours, theirs = owner_tag(), owner_tag()
    assert ours != theirs and len(ours) == 8
    mine = inspect_request("/v1/chat/completions", {"messages": []}, owner=ours).key_prefix
    other = inspect_request("/v1/chat/completions", {"messages": []}, owner=theirs).key_prefix
    assert mine.startswith(f"chatcmpl-probex-{ours}") and len(mine) == len(other) == len("chatcmpl-probex-") + 32
    untagged = inspect_request("/v1/chat/completions", {"messages": []}).key_prefix  # one API server process
    assert len(untagged) == len(mine)
    engine_ids = {"mine": f"{mine}-0123abcd", "other": f"{other}-4567ef01"}  # vLLM appends 8 hex

    async def scenario():
        address = f"ipc://{tempfile.mkdtemp()}/scores"
        hubs = {"mine": ScoreHub(address, owner=ours), "other": ScoreHub(address, owner=theirs)}
        swapped_in = {name: [] for name in hubs}
        for name, hub in hubs.items():
            hub.on_probes_swapped = lambda version, dirs, name=name: swapped_in[name].append((version, dirs))
        formatter = ScoreFormatter(api_server_count=2)
        wire = zmq.Context.instance().socket(zmq.PUB)
        wire.bind(address)
        for hub in hubs.values():
            hub.start()
        try:
            await asyncio.sleep(0.3)  # the subscriptions reach the formatter (messages before are not for them)
            messages = [
                # step 1: both prompts (2 and 3 rows) prefilled, each samples its first token
                step_message(table, StepView([engine_ids["mine"], engine_ids["other"]], np.array([2, 3]),
                                             np.array([0, 0]), np.array([2, 3])),
                             np.array([[0.5], [1.5], [-2.0], [-3.0], [-4.0]], np.float32), []),
                # step 2: both decode one token
                step_message(table, StepView([engine_ids["mine"], engine_ids["other"]], np.array([1, 1]),
                                             np.array([2, 3]), np.array([2, 3])),
                             np.array([[0.25], [-5.0]], np.float32), []),
                # step 3: "mine" decodes again; "other" ended after step 2 (its books are released)
                step_message(table, StepView([engine_ids["mine"]], np.array([1]), np.array([3]), np.array([2])),
                             np.array([[0.75]], np.float32), [engine_ids["other"]]),
                swapped_message("probes", 2, ["/probes/new"]),
                paused_message(True, 1),
            ]
            for sequence, message in enumerate(messages, start=1):
                for frames in formatter.take({**message, SEQUENCE: sequence}):
                    wire.send_multipart(frames)
            for _ in range(100):
                if all(hub.messages_received == 5 for hub in hubs.values()):
                    break
                await asyncio.sleep(0.02)
            assert swapped_in == {"mine": [(2, ["/probes/new"])], "other": [(2, ["/probes/new"])]}
            return {name: (hub.messages_received, dict(hub._requests), hub.paused, hub.swaps, hub.messages_lost)
                    for name, hub in hubs.items()}
        finally:
            wire.close(linger=0)
            for hub in hubs.values():
                hub._task.cancel()
                hub._silence_task.cancel()
                hub._socket.close()

    seen = asyncio.run(scenario())
    for name, key in (("mine", mine), ("other", other)):
        received, requests, paused, swaps, lost = seen[name]
        assert received == 5 and paused and swaps == 1 and lost == 0
        assert list(requests) == [key]  # nothing booked for the other process's request
    mine_scores, other_scores = seen["mine"][1][mine], seen["other"][1][other]
    assert mine_scores.prompt["req"] == engine_ids["mine"] and mine_scores.prompt_fields["p"]["prompt"]["last_raw"] == pytest.approx(1.5)
    assert other_scores.prompt_fields["p"]["prompt"]["last_raw"] == pytest.approx(-4.0)
    assert mine_scores.tokens == {0: (pytest.approx(calibrate(1.5, 1.0, 0.0)),), 1: (pytest.approx(calibrate(0.25, 1.0, 0.0)),),
                                  2: (pytest.approx(calibrate(0.75, 1.0, 0.0)),)}
    assert other_scores.tokens == {0: (pytest.approx(calibrate(-4.0, 1.0, 0.0)),), 1: (pytest.approx(calibrate(-5.0, 1.0, 0.0)),)}
    assert other_scores.finished and not mine_scores.finished
    # batched completions' ids ("cmpl-<id>-<prompt index>-<8 hex>") are told apart the same way
    completion = inspect_request("/v1/completions", {"prompt": ["a", "b"]}, owner=ours)
    batch = [f"{completion.key(1)}-89abcdef", f"{other}-1-89abcdef"]
    frames = ScoreFormatter(api_server_count=2).take(step_message(
        table, StepView(batch, np.array([1, 1]), np.array([5, 5]), np.array([2, 2])), np.zeros((2, 1), np.float32), []))
    assert sorted(topic for topic, _ in frames) == sorted([ours.encode(), theirs.encode()])
    routed = {topic: msgspec.msgpack.decode(payload, type=FormattedStep).token_requests for topic, payload in frames}
    assert routed == {ours.encode(): [completion.key(1)], theirs.encode(): [f"{other}-1"]}


def test_a_pause_older_than_what_a_process_applied_is_ignored():
    """Two processes switch the tap at once: each applies its own reply and the worker's
    broadcasts in whatever order they arrive, and ends with the worker's last state."""
    from engine_worker.scores.bookkeeping import paused_message

    hub = idle_hub()
    ingest(hub, paused_message(True, 1))   # process A's pause, broadcast
    ingest(hub, paused_message(False, 2))  # process B's resume, broadcast
    hub.set_paused(True, 1)               # A's own reply, arriving late
    assert hub.paused is False and hub.pauses == 1
    hub.set_paused(True, 3)
    assert hub.paused is True
    hub.set_paused(False)  # no sequence (a reply from a worker that does not count): applied
    assert hub.paused is False
