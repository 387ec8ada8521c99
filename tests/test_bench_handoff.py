"""`probex.bench_handoff` runs (so the tooling cannot rot) and measures what it says it does."""

from __future__ import annotations

import json
import sys

from probex import bench_handoff


def test_handoff_benchmark_runs_both_ways_and_writes_json(tmp_path, monkeypatch):
    out = tmp_path / "handoff.json"
    monkeypatch.setattr(sys, "argv", ["bench_handoff", "--requests", "4", "--steps", "20", "--python-us", "50",
                                      "--wait-us", "200", "--prompt-tokens", "64", "--repeats", "5", "--out", str(out)])
    bench_handoff.main()
    result = json.loads(out.read_text())
    (row,) = result["results"]
    # the first token's host steps, each timed (the benchmark itself raises if a chunk came out undecorated)
    first = result["first_token"]
    assert first["prompt_tokens"] == 64 and first["repeats"] == 5
    assert all(first[key] > 0 for key in ("request_us", "request_decoded_us", "prefill_step_us", "decode_us", "intake_us",
                                       "first_chunk_us", "token_chunk_us", "first_chunk_ids_us",
                                       "first_chunk_ids_decoded_us", "formatter_prefill_step_us",
                                       "formatted_received_us", "first_chunk_paused_us"))
    # the API server's share of a decode step (the benchmark raises if a chunk waited or was not spliced)
    # one process, then one of four (--api-server-count 4, the default): its own stream of the four;
    # each from the worker and from the score formatter
    assert [(r["requests"], r["processes"], r["formatted"], r["steps"]) for r in result["api_decode_step"]] == [
        (4, 1, False, 20), (4, 1, True, 20), (4, 4, False, 20), (4, 4, True, 20)]
    assert all(r[key] > 0 for r in result["api_decode_step"]
               for key in ("intake_us", "received_us", "chunks_us", "chunks_decoded_us"))
    assert all((r["formatter_us"] is not None) == r["formatted"] for r in result["api_decode_step"])
    assert len(result["api_decode_step"][0]["gc_collections"]) == 3 and result["api_decode_step"][0]["gc_us_per_step"] >= 0
    assert all(first[key] > 0 for key in ("first_chunk_decoded_us", "token_chunk_decoded_us"))
    # the consume's parts, in a tight loop and after each --wait-us sleep: a decode step of each
    # --requests, then a --prompt-tokens-row prefill; every step was consumed and published
    # (each beside the same hook handing the step to a score ring, whose parts are not split)
    cold = result["consume_parts_cold"]
    assert [(c["requests"], c["rows"], c["sleep_us"], c["handoff"]) for c in cold] == [
        (4, 4, 200, "consumed inline"), (4, 4, 200, "score ring"), (0, 64, 200, "consumed inline"),
        (0, 64, 200, "score ring")]
    inline = [c for c in cold if c["handoff"] == "consumed inline"]
    assert all(c[state][f"{part}_us"] > 0 for c in inline for state in ("tight", "after_sleep")
               for part in ("gather", "message", "publish")) and all(c[s]["hook_us"] > 0 for c in cold for s in ("tight", "after_sleep"))
    assert all("gather_us" not in c["tight"] for c in cold if c["handoff"] == "score ring")
    assert row["requests"] == 4 and row["inline_us"] > 0 and row["hook_us"] > 0
    # the transfer thread consumed every step, and the stand-in loop really waited between steps
    assert row["consume_us"] > 0
    assert row["step_us"] >= 250 and row["baseline_step_us"] >= 250


def test_one_of_four_api_server_processes_books_and_relays_only_its_own_streams():
    """Its hub takes in every step but books only the rows of its own requests (every fourth),
    and its relays splice its own streams' chunks: the benchmark raises otherwise."""
    for formatted in (False, True):
        row = bench_handoff.api_decode_step(8, 5, prompt_tokens=16, processes=4, formatted=formatted)
        assert row["processes"] == 4 and row["requests"] == 8 and row["chunks_us"] > 0
