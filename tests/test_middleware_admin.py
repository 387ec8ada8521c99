"""The worker's admin routes (pausing the tap, live swaps) and what follows a swap: the
retention check once per probe set, listings read again."""

import asyncio
import json

import numpy as np
import pytest

from engine_worker.scores.bookkeeping import ProbeTable, StepView, step_message
from engine_worker.tap.config import TapConfig
from engine_worker.tap.layer import ProbeSlot
from engine_worker.vllm.api_server import VllmMiddleware as ProbexMiddleware
from tests.middleware_fixtures import (call_route, FakeEngineClient, idle_hub, ingest, post_through, RecordingApp,
                                       response_body)


def test_the_tap_is_paused_and_resumed_by_an_admin_and_paused_requests_pass_unmonitored(monkeypatch):
    monkeypatch.setenv("PROBEX_ADMIN_TOKEN", "secret")
    admin = [(b"authorization", b"Bearer secret")]

    async def go():
        app, engine = RecordingApp(), FakeEngineClient()
        capturing = TapConfig(layers=(3,), capture_rows=16, capture_dir="/tmp/probex-test-captures")
        middleware = ProbexMiddleware(app, hub=idle_hub(), tap_config=capturing)
        put = lambda body, headers=admin: call_route(middleware, "PUT", "/probex/tap", body, headers, engine)  # noqa: E731
        assert (await put(b'{"paused": true}', []))[0] == 401 and engine.calls == []
        status, answer = await put(b'{"paused": "yes"}')
        assert status == 400 and answer["error"]["param"] == "paused"
        assert await put(b'{"paused": true}') == (200, {"ok": True, "paused": True})
        assert engine.calls == [("probex_set_paused", (True,))] and middleware.hub.paused
        assert await call_route(middleware, "GET", "/probex/tap") == (200, {"paused": True})
        # paused: a request reaches vLLM as the client sent it (no token ids asked for, no id of ours)
        body = json.dumps({"prompt": "x", "max_tokens": 2, "vllm_xargs": {"probex_recompute": "true"}}).encode()
        sent = await post_through(middleware, "/v1/completions", body, headers=admin)
        forwarded = json.loads(app.bodies[-1])
        assert sent[0]["status"] == 200 and "return_token_ids" not in forwarded and app.request_ids[-1] is None
        assert forwarded["vllm_xargs"] == {"probex_recompute": 1}  # still checked and normalised
        capture = json.dumps({"prompt": "x", "vllm_xargs": {"probex_capture": True}}).encode()
        refused = await post_through(middleware, "/v1/completions", capture, headers=admin)
        assert refused[0]["status"] == 409 and b"tap_paused" in response_body(refused) and len(app.bodies) == 1
        assert await put(b'{"paused": false}') == (200, {"ok": True, "paused": False})
        await post_through(middleware, "/v1/completions", body, headers=admin)
        assert json.loads(app.bodies[-1])["return_token_ids"] is True and app.request_ids[-1] is not None
        # a worker that refuses (it steers) leaves the API server's state as it was
        engine.answer = {"ok": False, "error": "steering gates read its scores", "paused": False}
        status, answer = await put(b'{"paused": true}')
        assert status == 400 and answer["error"]["code"] == "pause_refused" and not middleware.hub.paused

    asyncio.run(go())
    monkeypatch.delenv("PROBEX_ADMIN_TOKEN")

    async def without_token():
        middleware = ProbexMiddleware(RecordingApp(), hub=idle_hub(), tap_config=TapConfig(layers=(3,)))
        return await call_route(middleware, "PUT", "/probex/tap", b'{"paused": true}', engine=FakeEngineClient())

    assert asyncio.run(without_token())[0] == 403


def test_a_swap_refused_by_any_rank_is_reported_as_refused():
    from engine_worker.api_server.middleware import _every_rank

    ok = {"ok": True, "version": 2}
    assert _every_rank([ok, ok]) is ok
    refused = {"ok": False, "error": "bad file", "version": 1}
    assert _every_rank([refused, refused])["error"] == "bad file"
    split = _every_rank([ok, refused])
    assert split["ok"] is False and "1 of 2 workers" in split["error"]


def test_several_api_server_processes_compute_a_probe_sets_retention_once(tmp_path):
    """Retention needs HF forward passes over every retention set: one process of the worker
    computes it, the others wait and read its result; a probe rewritten in place is computed
    again, and a result only counts for the model and probe files it was computed on."""
    import threading
    import time as clock

    from engine_worker.api_server.retention import computed_once

    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "probe.yaml").write_text("name: p\n")
    calls = []

    def compute(model_dir, probe_dirs):
        calls.append(threading.current_thread().name)
        clock.sleep(0.2)  # long enough for the other processes to be waiting on the lock
        return {"p": {"retention": 0.9, "calls": len(calls)}}

    shared = tmp_path / "shared"
    results = []
    threads = [threading.Thread(target=lambda: results.append(computed_once(shared, "/m", [str(probe)], compute)),
                                name=f"api-server-{i}") for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and results == [{"p": {"retention": 0.9, "calls": 1}}] * 3
    (probe / "probe.yaml").write_text("name: p\nchanged: true\n")
    assert computed_once(shared, "/m", [str(probe)], compute)["p"]["calls"] == 2
    assert computed_once(shared, "/other-model", [str(probe)], compute)["p"]["calls"] == 3
    assert computed_once(shared, "/m", [str(probe)], compute)["p"]["calls"] == 2  # still on file
    # a computation that fails fails once: the others read the failure instead of repeating it
    failures = []

    def failing(model_dir, probe_dirs):
        failures.append(1)
        raise ValueError("no retention set offline")

    for _ in range(2):
        with pytest.raises(RuntimeError, match="ValueError: no retention set offline"):
            computed_once(shared, "/third-model", [str(probe)], failing)
    assert len(failures) == 1


def test_the_shared_retention_directory_goes_when_its_process_exits(tmp_path):
    """It lives beside the score socket in the temporary directory, one per worker start."""
    import subprocess
    import sys
    from pathlib import Path

    shared = tmp_path / "probex-scores-x.sock.shared"
    code = (f"from pathlib import Path; from engine_worker.api_server.retention import RetentionTracker, computed_once\n"
            f"tracker = RetentionTracker(None, Path({str(shared)!r}))\n"
            f"computed_once(tracker.shared_dir, '/m', [], lambda model, dirs: {{'p': {{'retention': 1.0}}}})\n"
            f"assert any(Path({str(shared)!r}).iterdir())\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
    assert not shared.exists()


def test_a_probe_set_whose_swap_message_was_lost_still_gets_its_retention_check():
    """The swap message can be lost with others (a process far behind); the next step carries
    the new set's version: the process then reads the set from the worker's listing and
    schedules its retention check, once, and drops its cached listings."""
    from engine_worker.scores.bookkeeping import swapped_message

    table = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last_prompt_token", 1.0, 0.0),))
    swapped = ProbeTable(version=3, slots=table.slots)

    class ListingEngine:
        def __init__(self):
            self.calls = []

        async def collective_rpc(self, method, args=()):
            self.calls.append(method)
            return [{"version": 3, "probes": [{"name": "p", "source": "/probes/new"}, {"name": "q", "source": None}]}]

    def step(table, req):
        layout = StepView([req], np.array([1]), np.array([5]), np.array([4]))
        return step_message(table, layout, np.array([[0.5]], np.float32), [])

    async def go():
        hub = idle_hub()
        middleware = ProbexMiddleware(RecordingApp(), hub=hub)
        scheduled = []
        middleware.retention.schedule = scheduled.append
        engine = ListingEngine()
        await post_through(middleware, "/v1/models", b"", "GET", engine=engine)  # the server's app is known
        ingest(hub, step(table, "cmpl-probex-a-0-0123abcd"))
        await asyncio.sleep(0.01)
        assert engine.calls == [] and hub.swaps == 0  # the startup set: nothing missed
        ingest(hub, step(swapped, "cmpl-probex-a-0-0123abcd"))  # version 3; its swap message never came
        ingest(hub, step(swapped, "cmpl-probex-a-0-0123abcd"))
        for _ in range(100):
            if scheduled:
                break
            await asyncio.sleep(0.01)
        swaps_after_gap = hub.swaps
        ingest(hub, swapped_message("probes", 3, ["/probes/new"]))  # arriving after all: no second check
        middleware._schedule_retention(3, ["/probes/new"])
        return engine.calls, scheduled, swaps_after_gap

    calls, scheduled, swaps = asyncio.run(go())
    assert calls == ["probex_list_probes"] and scheduled == [["/probes/new"]] and swaps == 1


def test_listings_are_read_again_after_a_swap_another_api_server_process_took():
    """The steering and probe listings a steered request is checked against are cached until a
    swap: this process's own, or another's, which reaches this one as the worker's control
    message (ScoreHub.swaps)."""
    from engine_worker.scores.bookkeeping import swapped_message

    class ListingEngine:
        def __init__(self):
            self.calls = 0

        async def collective_rpc(self, method, args=()):
            self.calls += 1
            return [{"method": method, "version": self.calls}]

    hub = idle_hub()
    middleware = ProbexMiddleware(RecordingApp(), hub=hub)
    engine = ListingEngine()
    scope = {"app": type("App", (), {"state": type("State", (), {"engine_client": engine})()})()}

    async def listings():
        return await middleware._current_listings(scope)

    first = asyncio.run(listings())
    assert asyncio.run(listings()) is first and engine.calls == 2  # cached: steering + probes, read once
    middleware._retention_enabled = False  # a swap also schedules the retention check; not this test's
    ingest(hub, swapped_message("probes", 2, ["/probes/new"]))
    second = asyncio.run(listings())
    assert second is not first and engine.calls == 4
    assert asyncio.run(listings()) is second and engine.calls == 4


def test_each_probe_set_swapped_in_gets_its_retention_check_once_in_every_process():
    """A swap reaches a process as its own request's reply or as the worker's broadcast,
    whichever comes first: the retention check is scheduled once per probe-set version."""
    from engine_worker.scores.bookkeeping import swapped_message

    hub = idle_hub()
    middleware = ProbexMiddleware(RecordingApp(), hub=hub)
    scheduled = []
    middleware.retention.schedule = scheduled.append
    ingest(hub, swapped_message("probes", 2, ["/probes/a"]))  # another process's swap
    middleware._schedule_retention(2, ["/probes/a"])         # or this one's reply, after it
    ingest(hub, swapped_message("steering", 4))                # steering has no retention check
    middleware._schedule_retention(3, ["/probes/b"])          # this process's next swap
    ingest(hub, swapped_message("probes", 3, ["/probes/b"]))  # and its broadcast, after it
    assert scheduled == [["/probes/a"], ["/probes/b"]] and hub.swaps == 3
