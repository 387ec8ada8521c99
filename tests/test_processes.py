"""probex.processes.logged_worker: waits for /health, logs, stops the whole process group, reports early exits."""

import os
import sys

import pytest

from probex.processes import free_port, logged_worker

SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_logged_worker_waits_logs_and_stops(tmp_path):
    port = free_port()
    log = tmp_path / "w.log"
    with logged_worker([sys.executable, "-c", SERVER, str(port)], dict(os.environ), log,
                       f"http://127.0.0.1:{port}", "toy", timeout_s=30) as ready_s:
        assert ready_s >= 0
        import httpx

        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    assert "serving" in log.read_text()
    with pytest.raises(Exception):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)


def test_logged_worker_names_a_worker_that_died(tmp_path):
    log = tmp_path / "w.log"
    with pytest.raises(RuntimeError, match=r"toy worker exited with code 3: .*boom"):
        with logged_worker([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], dict(os.environ), log,
                           "http://127.0.0.1:1", "toy", timeout_s=30):
            pass
