"""A minute of bench.soak: the gateway (its own process) in front of the shared demo worker, audit in real Redis.

16 concurrent clients send allowed, flagged, blocked and cut-off requests. The criteria are
those of `make soak` except RSS growth, which a minute cannot judge: it is only required to
be reported.
"""

from __future__ import annotations

import json

import pytest

from bench import soak

pytestmark = pytest.mark.engine

REDIS_DB = 3  # each module its own database of the test process's Redis (tests/conftest.py)


def test_a_minute_of_mixed_load_loses_no_audit_event_and_answers_no_5xx(demo_worker, redis_server, tmp_path):
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    soak.main(["--duration-s", "60", "--streams", "16", "--warmup-s", "10", "--worker-url", demo_worker.url,
               "--worker-pid", str(demo_worker.proc.pid), "--admin-token", demo_worker.admin_token,
               "--redis-url", redis_server.url(REDIS_DB), "--out", str(out), "--png", str(png)])
    report = json.loads(out.read_text())
    requests, audit, criteria = report["requests"], report["audit"], report["criteria"]

    # Every kind of request was sent, and enough of them to mean something.
    assert set(requests["by_kind"]) == {"allowed", "flagged", "blocked", "cut"}, requests
    assert min(requests["by_kind"].values()) >= 5 and requests["total"] >= 60, requests
    assert requests["by_status"].get("400", 0) == requests["by_kind"]["blocked"]

    assert criteria["zero_5xx"], requests
    assert criteria["zero_transport_or_stream_errors"], requests["error_examples"]
    assert criteria["statuses_as_expected"] and criteria["decisions_as_expected"], requests["unexpected_examples"]
    assert criteria["audit_exact"], audit
    assert audit["audit_events"] == audit["decisions_answered"]["flag"] + audit["decisions_answered"]["block"] > 0
    assert audit["lost"] == audit["duplicated"] == audit["unexpected"] == 0
    assert criteria["gateway_fds_flat"] and criteria["worker_fds_flat"], report["memory"]
    assert criteria["worker_alive_at_end"] and criteria["gateway_log_clean"], report["gateway_log_errors"]

    # RSS is measured and its growth reported (judged only by the 10-minute `make soak`).
    for name in ("gateway_rss", "worker_rss"):
        entry = report["memory"][name]
        assert entry["base"] > 0 and isinstance(entry["growth"], float), entry
        assert isinstance(criteria[f"{name}_growth_below_limit"], bool)
    assert report["memory"]["worker_rss"]["base"] > report["memory"]["gateway_rss"]["base"]  # the whole engine tree
    assert report["latency"]["ttft_stream_s"]["n"] > 0 and len(report["samples"]) >= 10
    assert png.stat().st_size > 10_000
