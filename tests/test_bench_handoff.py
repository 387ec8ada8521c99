"""`probex.bench_handoff` runs (so the tooling cannot rot) and measures what it says it does."""

from __future__ import annotations

import json
import sys

from probex import bench_handoff


def test_handoff_benchmark_runs_and_writes_json(tmp_path, monkeypatch):
    out = tmp_path / "handoff.json"
    monkeypatch.setattr(sys, "argv", ["bench_handoff", "--requests", "4", "--steps", "20", "--python-us", "50",
                                      "--wait-us", "200", "--out", str(out)])
    bench_handoff.main()
    (row,) = json.loads(out.read_text())["results"]
    # (the run itself checks that the reading process saw every token of every step)
    assert row["requests"] == 4 and row["hook_us"] > 0 and row["reader_ingest_us"] > 0
    # the stand-in loop really waited between steps
    assert row["step_us"] >= 250 and row["baseline_step_us"] >= 250
