"""The step timer (PROBEX_STEP_TIMING), its route, and the benchmark's split of idle TTFT by it."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from engine_worker.step_timing import (DEFAULT_MIN_ROWS, StepTimer, step_timing_enabled,
                                       step_timing_min_rows)
from probex import bench_engine as be


class FakeEvent:
    """A timing event on a stand-in device whose clock the test sets."""

    device_ms = 0.0

    def __init__(self) -> None:
        self.at = None
        self.synchronized = False

    def record(self):
        self.at = FakeEvent.device_ms

    def synchronize(self):
        self.synchronized = True

    def elapsed_time(self, end):
        assert end.synchronized, "the end event is waited for before it is read"
        return end.at - self.at


def test_the_timer_keeps_the_device_span_of_prompt_sized_forwards_only():
    timer = StepTimer("cuda", min_rows=300, capacity=3, events=FakeEvent)
    assert not timer.wants(299) and timer.wants(300)
    for number, (span, paused) in enumerate([(30.0, False), (31.5, True), (29.0, False), (33.0, True)]):
        FakeEvent.device_ms = 100.0 * number
        forward = timer.begin(1024, [f"req-{number}"])
        FakeEvent.device_ms += span
        timer.end(forward, paused=paused)
    read = timer.records()
    assert read["recorded"] == read["next"] == 4 and read["min_rows"] == 300
    # the newest `capacity` are kept, numbered in the order they ended
    assert [(r["sequence"], r["requests"], r["span_ms"], r["paused"]) for r in read["records"]] == [
        (1, ["req-1"], 31.5, True), (2, ["req-2"], 29.0, False), (3, ["req-3"], 33.0, True)]
    assert all(r["rows"] == 1024 and 0 < r["began_at"] <= r["launched_at"] for r in read["records"])
    # a client that read up to `next` - 1 gets only what came later
    assert timer.records(after=read["next"] - 1)["records"] == []
    assert [r["sequence"] for r in timer.records(after=2)["records"]] == [3]


def test_on_the_cpu_the_host_clock_times_the_synchronous_forward():
    timer = StepTimer("cpu", min_rows=2)
    forward = timer.begin(8, ["a", "b"])
    time.sleep(0.02)
    timer.end(forward, paused=False)
    (record,) = timer.records()["records"]
    assert 15.0 < record["span_ms"] < 1000.0 and record["requests"] == ["a", "b"]


def test_step_timing_is_switched_on_by_the_environment_and_its_row_count_checked():
    assert not step_timing_enabled({}) and not step_timing_enabled({"PROBEX_STEP_TIMING": "0"})
    assert step_timing_enabled({"PROBEX_STEP_TIMING": "1"}) and step_timing_enabled({"PROBEX_STEP_TIMING": " On "})
    assert step_timing_min_rows({}) == DEFAULT_MIN_ROWS == 257
    assert step_timing_min_rows({"PROBEX_STEP_TIMING_MIN_ROWS": "32"}) == 32
    for bad in ("0", "-4", "many"):
        with pytest.raises(ValueError, match="PROBEX_STEP_TIMING_MIN_ROWS"):
            step_timing_min_rows({"PROBEX_STEP_TIMING_MIN_ROWS": bad})


def test_a_controller_reads_its_timed_forwards_only_where_timing_is_on(monkeypatch):
    from engine_worker.tap.controller import TapController
    from engine_worker.tap.layer import LayerTap
    from probes.artifact import ServedModel

    def controller():
        tap = LayerTap(1, 8, capacity=2, max_rows=16)
        return TapController({1: tap}, ServedModel(hidden_size=8, num_hidden_layers=4), threaded=False)

    monkeypatch.delenv("PROBEX_STEP_TIMING", raising=False)
    off = controller()
    assert off.step_timer is None and off.listing()["step_timing"] is None
    with pytest.raises(ValueError, match="PROBEX_STEP_TIMING=1"):
        off.step_timings()
    monkeypatch.setenv("PROBEX_STEP_TIMING", "1")
    monkeypatch.setenv("PROBEX_STEP_TIMING_MIN_ROWS", "4")
    on = controller()
    forward = on.step_timer.begin(6, ["x"])
    on.step_timer.end(forward, paused=on.paused)
    assert on.listing()["step_timing"] == {"min_rows": 4, "recorded": 1}
    assert [r["requests"] for r in on.step_timings()["records"]] == [["x"]]


# --- the benchmark's side ------------------------------------------------------------------------


def records_for(paused, lead_in=1, spans=None, requests_each=1):
    spans = spans or [30.0] * (len(paused) + lead_in)
    states = [False] * lead_in + list(paused)
    return [{"sequence": i, "rows": 1024, "requests": [f"r{i}-{k}" for k in range(requests_each)],
             "span_ms": span, "paused": state, "began_at": float(i), "launched_at": float(i)}
            for i, (span, state) in enumerate(zip(spans, states))]


def test_idle_requests_are_matched_to_their_forwards_only_where_the_match_cannot_be_wrong():
    paused = [False, True, True, False]
    forwards, why = be.idle_forward_records(records_for(paused, spans=[9.0, 30.0, 31.0, 32.0, 33.0]), paused, 1)
    assert why is None and [f["span_ms"] for f in forwards] == [30.0, 31.0, 32.0, 33.0]  # the lead-in's left out
    assert be.idle_forward_records(records_for(paused)[1:], paused, 1) == (None, "4 timed forwards for 5 requests")
    assert be.idle_forward_records(records_for(paused, requests_each=2), paused, 1)[1] \
        == "a timed forward held more than one request"
    flipped = records_for(paused)
    flipped[2]["paused"] = False
    assert be.idle_forward_records(flipped, paused, 1)[1] == "the worker's pause state at a forward differs from the request's"


def test_the_idle_split_finds_a_small_host_cost_under_a_noisy_device_span():
    """The device's span scatters by 7 ms, the rest by 0.2 ms; with the tap running the rest
    takes 0.3 ms longer and the span 0.03 ms: 400 pairs cannot place the total to 1% of TTFT,
    the split places the host's part within a few hundredths of a millisecond."""
    rng = np.random.default_rng(0)
    paused = [be.idle_toggle_paused(n) for n in range(800)]
    span = 28.0 + rng.uniform(0.0, 24.0, 800) + np.where(paused, 0.0, 0.03)
    rest = 6.0 + rng.normal(0.0, 0.2, 800) + np.where(paused, 0.0, 0.3)
    way_in = 2.0 + rng.normal(0.0, 0.05, 800)  # the tap's cost is all on the way out
    ttft = span + rest
    ttft[5] = math.nan  # a failed request: its pair is left out
    split = be.forward_span_split(list(ttft), list(span), paused, list(way_in))
    assert split["pairs"] == 399
    assert split["sd_ms"]["span"] > 5.0 and split["sd_ms"]["rest"] < 0.3 and split["correlation_ttft_span"] > 0.99
    low, high = split["rest"]["ci95_ms"]
    assert low < 0.3 < high and high - low < 0.06, split["rest"]
    assert abs(split["span"]["difference_mean_ms"] - 0.03) < 1.5 and split["span"]["difference_sd_ms"] > 5.0
    assert split["rest"]["pct_of_ttft"] == pytest.approx(split["rest"]["difference_mean_ms"]
                                                         / split["paused_ttft_mean_ms"] * 100)
    assert abs(split["way_in"]["difference_mean_ms"]) < 0.02 and split["way_in"]["paused_mean_ms"] == pytest.approx(2.0, abs=0.01)
    assert split["way_out"]["ci95_ms"][0] < 0.3 < split["way_out"]["ci95_ms"][1]
    line = be.forward_span_line(split)
    assert "the rest of TTFT +0.3" in line and "the forward's end to the first chunk +0.3" in line
    assert "way_in" not in be.forward_span_split(list(ttft), list(span), paused)
    # and in the report a re-render prints, for the start that timed its forwards
    table = be.markdown_tables({"setups": [{"label": "tap-toggle", "results": {},
                                            "idle_ttft_toggle": {"forward_split": split}}]}).splitlines()
    assert "| tap-toggle | 399 | TTFT |" in "\n".join(table)
    out_row = next(line for line in table if line.startswith("| | | the forward's end to the first chunk |"))
    assert f"{split['way_out']['difference_mean_ms']:+.3f}" in out_row
    assert be.forward_span_split([30.0, 31.0], [20.0, 20.0], [False, True]) == {"pairs": 1}


def test_the_idle_split_says_whether_the_device_waited_for_the_forwards_launch():
    """A host whose CPU runs behind its GPU: the engine thread's enqueueing of a prefill takes
    about as long as the device's span of it, and the tap's host work in that launch (0.1 ms
    here) shows as a part of its own; on a fast host the launch is a fraction of the span."""
    rng = np.random.default_rng(2)
    paused = [be.idle_toggle_paused(n) for n in range(600)]
    tap = np.where(paused, 0.0, 0.1)
    slow_launch = 27.0 + rng.normal(0.0, 0.3, 600) + tap
    span = slow_launch + 0.5 + rng.normal(0.0, 0.05, 600)  # the device ends just after the last launch
    way_in = 2.0 + rng.normal(0.0, 0.05, 600)
    ttft = way_in + span + 4.0 + rng.normal(0.0, 0.1, 600)
    split = be.forward_span_split(list(ttft), list(span), paused, list(way_in), list(slow_launch))
    assert split["launch_over_span"] == pytest.approx(0.98, abs=0.01)
    low, high = split["launch"]["ci95_ms"]
    assert low < 0.1 < high and high - low < 0.1 and split["launch"]["paused_mean_ms"] == pytest.approx(27.0, abs=0.1)
    assert "launch over span 0.98" in be.forward_span_line(split)
    fast = be.forward_span_split(list(ttft), list(span), paused, list(way_in), list(slow_launch / 4))
    assert fast["launch_over_span"] == pytest.approx(0.245, abs=0.01)
    assert "launch" not in be.forward_span_split(list(ttft), list(span), paused, list(way_in))
    # the report, and a saved run re-rendered from its per-request times
    entry = {"forward_split": split, "per_request_ttft_ms": list(ttft), "per_request_span_ms": list(span),
             "per_request_way_in_ms": list(way_in), "per_request_launch_ms": list(slow_launch), "paused": paused}
    text = be.markdown_tables({"setups": [{"label": "tap-toggle", "results": {}, "idle_ttft_toggle": entry}]})
    assert "| | | the forward's launch on the host (within the span) |" in text
    assert "waited for the engine thread's launches, so host work added to the launch lengthens the prefill): " \
           "tap-toggle 0.98." in text


def test_the_step_timings_route_is_for_admins_and_says_when_timing_is_off(monkeypatch):
    from engine_worker.api_server.middleware import ProbexMiddleware
    from engine_worker.tap.config import TapConfig
    from tests.test_delivery_middleware import RecordingApp, call_route, idle_hub

    monkeypatch.setenv("PROBEX_ADMIN_TOKEN", "secret")
    admin = [(b"authorization", b"Bearer secret")]

    class Engine:
        def __init__(self, answer):
            self.answer, self.calls = answer, []

        async def collective_rpc(self, method, args=()):
            self.calls.append((method, args))
            return [dict(self.answer)]

    async def go():
        middleware = ProbexMiddleware(RecordingApp(), hub=idle_hub(), tap_config=TapConfig(layers=(3,)))
        on = Engine({"ok": True, "next": 7, "records": [{"sequence": 6, "span_ms": 30.0}]})
        route = "/probex/step-timings"
        assert (await call_route(middleware, "GET", route, engine=on))[0] == 401 and on.calls == []
        status, answer = await call_route(middleware, "GET", route, headers=admin, engine=on, query=b"after=5")
        assert status == 200 and answer == {"next": 7, "records": [{"sequence": 6, "span_ms": 30.0}]}
        assert on.calls == [("probex_step_timings", (5,))]
        status, answer = await call_route(middleware, "GET", route, headers=admin, engine=on, query=b"after=x")
        assert status == 400 and answer["error"]["param"] == "after"
        assert (await call_route(middleware, "POST", route, headers=admin, engine=on))[0] == 405
        off = Engine({"ok": False, "error": "forwards are not timed on this worker"})
        status, answer = await call_route(middleware, "GET", route, headers=admin, engine=off)
        assert status == 409 and answer["error"]["code"] == "step_timing_off" and off.calls == [("probex_step_timings", (-1,))]

    asyncio.run(go())


def test_the_way_out_tells_a_host_state_that_lasts_from_noise_that_does_not():
    """Session 27's idle runs: the way out sits at two levels some 4 ms apart, in runs of
    several requests, moving with the prefill's span. `way_out_in_order` says so from the
    per-request times, and a re-render works it out again for a saved run."""
    rng = np.random.default_rng(1)
    slow = np.repeat(rng.integers(0, 2, 40), 10).astype(bool)  # a state lasting 10 requests at a time
    paused = [be.idle_toggle_paused(n) for n in range(400)]
    way_in = 6.0 + rng.normal(0.0, 0.3, 400)
    span = 23.0 + 3.0 * slow + rng.normal(0.0, 0.5, 400)
    way_out = 3.5 + 4.0 * slow + rng.normal(0.0, 0.5, 400)
    split = be.forward_span_split(list(way_in + span + way_out), list(span), paused, list(way_in))
    levels = split["way_out_in_order"]
    assert levels["lag1_correlation"] > 0.7 and levels["correlation_with_span"] > 0.7
    assert levels["quartiles_ms"][0] < 4.0 < 7.0 < levels["quartiles_ms"][2]
    shuffled = rng.permutation(400)  # the same values, the state no longer lasting
    noise = be.way_out_in_order(way_out[shuffled], span[shuffled])
    assert abs(noise["lag1_correlation"]) < 0.2 and noise["correlation_with_span"] > 0.7
    assert be.way_out_in_order(np.array([1.0, 2.0]), np.array([1.0, 2.0])) == {}
    assert "way_out_in_order" not in be.forward_span_split(list(span + 5.0), list(span), paused)
    # a run saved before the statistic existed: the re-render makes it from the per-request times
    saved = {k: v for k, v in split.items() if k != "way_out_in_order"}
    entry = {"forward_split": saved, "per_request_ttft_ms": list(way_in + span + way_out),
             "per_request_span_ms": list(span), "per_request_way_in_ms": list(way_in), "paused": paused}
    text = be.markdown_tables({"setups": [{"label": "tap-toggle", "results": {}, "idle_ttft_toggle": entry}]})
    line = next(line for line in text.splitlines() if line.startswith("- tap-toggle: "))
    assert f"lag 1 {levels['lag1_correlation']:.2f}; with the span {levels['correlation_with_span']:.2f}" in line
