"""The trace summary behind `probex bench engine --profile-requests`, on made-up traces."""

import gzip
import json

import pytest

from bench.profile_trace import find_traces, merged_intervals, summarize_events, summarize_trace


def kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def made_up_trace():
    return [
        kernel("gemm_a", 0, 100), kernel("gemm_b", 50, 100),  # two streams at once: counted once
        kernel("Memcpy DtoH (Device -> Pinned)", 160, 10, cat="gpu_memcpy"),  # the device waited 10 µs for it
        kernel("_tap_rows_0d1d2d", 172, 10),  # 2 µs behind the copy: going from one to the next
        kernel("gemm_a", 5000, 100),  # the next request, a long gap away
        kernel("cudaGraphLaunch", 0, 5, cat="cuda_runtime"), kernel("cudaGraphLaunch", 4990, 5, cat="cuda_runtime"),
        kernel("aten::mm", 1, 3, cat="cpu_op"),
        {"ph": "i", "cat": "kernel", "name": "an instant, not a span", "ts": 3},
    ]


def test_busy_time_idle_gaps_and_probex_kernels_per_graph_launch():
    summary = summarize_events(made_up_trace())
    assert summary["device_events"] == 5 and summary["host_events"] == 3 and summary["graph_launches"] == 2
    assert summary["device_busy_us"] == pytest.approx(150 + 10 + 10 + 100)
    assert summary["span_us"] == pytest.approx(5100)
    gaps = summary["idle_gaps_us"]
    assert (gaps["kernel_to_kernel_count"], gaps["kernel_to_kernel_total"]) == (1, pytest.approx(2))
    assert (gaps["waiting_count"], gaps["waiting_total"], gaps["waiting_max"]) == (1, pytest.approx(10), pytest.approx(10))
    assert (gaps["between_requests_count"], gaps["between_requests_total"]) == (1, pytest.approx(4818))
    assert summary["probex_kernels"] == {"count": 1, "total_us": pytest.approx(10),
                                         "by_rows": {"0": {"count": 1, "mean_us": pytest.approx(10)}}}
    assert summary["copies"] == {"Memcpy DtoH (Device -> Pinned)": {
        "count": 1, "total_us": pytest.approx(10), "by_bytes": {"0": {"count": 1, "mean_us": pytest.approx(10)}}}}
    assert summary["kernels"]["count"] == 4 and summary["kernels"]["top"][0] == {
        "name": "gemm_a", "count": 2, "total_us": pytest.approx(200)}
    per = summary["per_graph_launch_us"]
    assert per == {"device_busy": pytest.approx(135), "waiting_idle": pytest.approx(5),
                   "kernel_to_kernel_idle": pytest.approx(1), "probex_kernels": pytest.approx(5),
                   "copies": pytest.approx(5)}


def test_probex_calls_split_by_the_rows_they_ran_and_copies_by_size():
    def call(ts, dur, rows):
        return dict(kernel("_tap_rows", ts, dur), args={"grid": [rows, 8, 1]})

    def copy(ts, dur, size):
        return dict(kernel("Memcpy DtoH (Device -> Pinned)", ts, dur, cat="gpu_memcpy"), args={"bytes": size})

    summary = summarize_events([call(0, 16, 1024), call(20, 16, 1024), call(40, 4, 1), copy(50, 2, 32768),
                                copy(60, 1, 32), copy(70, 1, 32)])
    assert summary["probex_kernels"]["by_rows"] == {"1": {"count": 1, "mean_us": pytest.approx(4)},
                                                    "1024": {"count": 2, "mean_us": pytest.approx(16)}}
    assert summary["copies"]["Memcpy DtoH (Device -> Pinned)"]["by_bytes"] == {
        "32": {"count": 2, "mean_us": pytest.approx(1)}, "32768": {"count": 1, "mean_us": pytest.approx(2)}}


def test_a_trace_without_device_events_says_so():
    summary = summarize_events([kernel("aten::mm", 1, 3, cat="cpu_op")])
    assert summary == {"device_events": 0, "host_events": 1, "graph_launches": 0}


def test_merged_intervals_join_overlapping_and_touching_ones_only():
    assert merged_intervals([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]


def test_the_worker_trace_is_found_and_read_gzipped(tmp_path):
    worker = tmp_path / "tap" / "rank0.1700000000.pt.trace.json.gz"
    worker.parent.mkdir()
    with gzip.open(worker, "wt") as f:
        json.dump({"traceEvents": made_up_trace()}, f)
    (tmp_path / "tap" / "notes.txt").write_text("not a trace")
    (tmp_path / "tap" / "api_server.1700000000.pt.trace.json").write_text(json.dumps({"traceEvents": []}))
    assert find_traces(tmp_path) == [worker]
    summary = summarize_trace(worker)
    assert summary["trace"] == worker.name and summary["device_busy_us"] == pytest.approx(270)


def test_kernels_whose_long_names_share_a_prefix_are_kept_apart():
    prefix = "void cutlass::device_kernel<flash::FlashAttnFwdSm90<" + "x" * 200
    summary = summarize_events([kernel(prefix + "decode>", 0, 5), kernel(prefix + "prefill>", 10, 50)])
    assert summary["kernels"]["by_name"] == {prefix + "prefill>": [1, 50], prefix + "decode>": [1, 5]}


def test_kernel_differences_rank_what_a_set_up_adds_or_slows_per_graph_launch():
    from bench.profile_trace import kernel_differences

    base = summarize_events(made_up_trace())
    slower = [dict(e, dur=e["dur"] + 40) if e.get("name") == "gemm_b" else e for e in made_up_trace()]
    other = summarize_events(slower + [kernel("_tap_rows_0d1d2d", 6000, 6), kernel("gemm_c", 6010, 2)])
    rows = kernel_differences(base, other, limit=3)
    assert [(r["name"], r["delta_us"]) for r in rows] == [
        ("gemm_b", pytest.approx(20.0)), ("_tap_rows_0d1d2d", pytest.approx(3.0)), ("gemm_c", pytest.approx(1.0))]
    assert (rows[1]["base_count"], rows[1]["other_count"]) == (1, 2) and rows[2]["base_count"] == 0
    assert kernel_differences(base, summarize_events([kernel("aten::mm", 1, 3, cat="cpu_op")])) == []
