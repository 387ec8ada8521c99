"""The API server loop's sampling profiler (engine_worker/loop_profile.py) and the bench's
per-phase reading of it."""

from __future__ import annotations

import sys
import time

import pytest

from engine_worker import loop_profile
from engine_worker.loop_profile import LoopProfiler, profiler_from_env
from probex import bench_engine as be


def _function_in(filename: str, name: str, body: str):
    """A function whose frames say they run in `filename`, as code from that package would."""
    namespace: dict = {"sys": sys}
    exec(compile(f"def {name}(callback):\n    {body}\n", filename, "exec"), namespace)
    return namespace[name]


VLLM = "/venv/lib/python3.12/site-packages/vllm/entrypoints/openai/serving_completion.py"
UVICORN = "/venv/lib/python3.12/site-packages/uvicorn/protocols/http/httptools_impl.py"
PROBEX = "/work/repo/engine_worker/middleware.py"
RUNNERS = "/usr/lib/python3.12/asyncio/runners.py"


def test_the_owner_is_the_first_known_package_walking_out_from_the_innermost_frame():
    profiler = LoopProfiler(0.001)
    in_vllm = _function_in(VLLM, "completion_stream_generator", "return callback()")
    in_probex = _function_in(PROBEX, "send", "return callback()")
    in_server = _function_in(UVICORN, "send", "return callback()")
    here = lambda: sys._getframe()  # noqa: E731 - an unknown package's frame, innermost

    # vLLM's app runs inside the middleware's call: its frames are vLLM's, not ProbeX's
    frame = in_probex(lambda: in_vllm(here))
    assert profiler._classify(frame) == ("vllm", "tests/test_loop_profile.py:<lambda>")
    # ProbeX's code called from vLLM's (the relay's send) and what it calls (asyncio, ZMQ) are ProbeX's
    assert profiler._classify(in_vllm(lambda: in_probex(here)))[0] == "probex"
    # the relay handing a chunk to the server: the server's
    assert profiler._classify(in_probex(lambda: in_server(here)))[0] == "server"
    assert profiler._classify(here())[0] == "other"
    # the loop's run call innermost: waiting for events (or uvloop's own C code)
    idle = _function_in(RUNNERS, "run", "return sys._getframe()")(None)
    assert profiler._classify(idle) == ("idle", "asyncio/runners.py:run")


def test_the_frame_after_a_collection_is_booked_to_the_collection():
    """A collection holds the GIL until it ends; the sample after it finds the loop thread in the
    collection timer's callback, whose time is the collection's."""
    from engine_worker.delivery import CollectionPauses

    pauses = CollectionPauses()
    seen = {}
    hook = lambda phase, info: seen.setdefault("frame", sys._getframe(1))  # noqa: E731
    wrapped = _function_in(PROBEX, "record", "return callback('stop', {})")
    profiler = LoopProfiler(0.001, collection_hooks=(pauses.record, wrapped))
    wrapped(hook)
    assert profiler._classify(seen["frame"]) == ("gc", "engine_worker/middleware.py:record")
    # the hub's own timer, a bound method, is recognised by its code
    assert pauses.record.__func__.__code__ in profiler._collection_codes


def test_package_names_come_from_site_packages_or_the_repository():
    assert loop_profile._package_and_file(VLLM) == ("vllm", "serving_completion.py")
    assert loop_profile._package_and_file(PROBEX) == ("engine_worker", "middleware.py")
    assert loop_profile._package_and_file("/repo/probes/scoring.py") == ("probes", "scoring.py")
    assert loop_profile._package_and_file(RUNNERS) == ("asyncio", "runners.py")
    assert loop_profile._package_and_file("/usr/lib/python3.12/selectors.py") == ("", "selectors.py")


def test_a_busy_thread_is_booked_by_time_to_the_code_it_runs():
    """The sampler runs beside a thread busy in ProbeX's code for 0.3 s: most of the sampled
    time is booked to ProbeX, and the books add up to the time sampled."""
    busy = _function_in(PROBEX, "ingest", "return callback()")

    def spin():
        deadline = time.perf_counter() + 0.3
        while time.perf_counter() < deadline:
            pass

    profiler = LoopProfiler(0.001)
    profiler.start()
    busy(spin)
    profiler.stop()
    books = profiler.as_dict()
    assert books["samples"] > 10
    assert sum(books["by_owner"].values()) == pytest.approx(books["seconds"])
    assert books["by_owner"].get("probex", 0.0) > 0.7 * books["seconds"]
    assert any(frame.startswith("engine_worker/middleware.py:ingest") or frame.endswith(":spin")
               for frame in books["by_frame"])


def test_the_profiler_is_off_unless_the_environment_asks(monkeypatch):
    monkeypatch.delenv(loop_profile.ENV_LOOP_PROFILE_MS, raising=False)
    assert profiler_from_env() is None
    monkeypatch.setenv(loop_profile.ENV_LOOP_PROFILE_MS, "2")
    assert profiler_from_env().interval_s == pytest.approx(0.002)
    monkeypatch.setenv(loop_profile.ENV_LOOP_PROFILE_MS, "often")
    with pytest.raises(ValueError, match="milliseconds"):
        profiler_from_env()


def test_a_phase_reads_the_loops_shares_summed_over_processes():
    def health(pid, probex_s, vllm_s, idle_s):
        total = probex_s + vllm_s + idle_s
        return {"api_server": {"pid": pid, "count": 2},
                "loop_profile": {"interval_s": 0.002, "samples": int(total * 500), "seconds": total,
                                 "by_owner": {"probex": probex_s, "vllm": vllm_s, "idle": idle_s},
                                 "by_frame": {"engine_worker/delivery.py:ingest": probex_s}}}

    before = be.merge_process_health([health(7, 1.0, 2.0, 7.0), health(8, 1.0, 2.0, 7.0)])
    assert before["loop_profile"]["seconds"] == pytest.approx(20.0) and before["loop_profile"]["processes"] == 2
    after = be.merge_process_health([health(7, 2.0, 6.0, 12.0), health(8, 2.0, 6.0, 12.0)])
    delta = be.delivery_delta(before, after)["loop_profile"]
    assert delta["seconds"] == pytest.approx(20.0)
    assert delta["owner_share"] == pytest.approx({"probex": 0.1, "vllm": 0.4, "idle": 0.5})
    assert list(delta["owner_share"]) == ["idle", "vllm", "probex"]  # largest first
    assert delta["top_frames_share"] == pytest.approx({"engine_worker/delivery.py:ingest": 0.1})
    assert "probex 10.0%" in be.delivery_line(be.delivery_delta(before, after))
    assert be.loop_profile_delta(None, after["loop_profile"]) is None
