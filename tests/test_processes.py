"""probex.processes.logged_worker: waits for /health, logs, stops the whole process group, reports early exits."""

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def test_free_port_stays_out_of_the_kernels_ephemeral_range():
    # Ports the kernel hands to bind(0) and outgoing connections would race the server about to bind.
    from probex.processes import _ephemeral_port_range

    low, high = _ephemeral_port_range()
    ports = {free_port() for _ in range(50)}
    assert all(port < low or port > high for port in ports)
    assert len(ports) > 1  # picked at random, so two side-by-side starts rarely pick the same one


def test_free_port_skips_a_port_in_use(monkeypatch):
    import random
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        free = free_port()
        picks = iter([busy, busy, free])
        monkeypatch.setattr(random, "choice", lambda seq: next(picks))
        assert free_port() == free


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


EMBEDDED = """
import sys
import time
from pathlib import Path
from probex.serve import run_embedded
port, worker_port, policy = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
stand_in = [sys.executable, "-m", "tests.fixtures.mock_upstream", "--port", str(worker_port)]
run_embedded(policy, "mock-model", "127.0.0.1", port, worker_port, None, [], worker_command=stand_in)
"""


def test_a_killed_probex_serve_stops_its_worker_too(tmp_path):
    """`probex serve` (make run) started its worker in a session of its own: a SIGTERM to
    `probex serve` (kill, a supervisor) must stop the worker too, not leave it holding its port
    (and, served for real, the GPU). uvicorn raises the signal again after its shutdown, which
    Python's default handler would turn into an exit that skips the worker's stop."""
    import signal
    import subprocess
    import time

    import httpx

    from probex.cli import DEFAULT_POLICY

    port, worker_port = free_port(), free_port()
    serve = subprocess.Popen([sys.executable, "-c", EMBEDDED, str(port), str(worker_port), str(DEFAULT_POLICY)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert serve.poll() is None, serve.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway did not come up"
            time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{worker_port}/health", timeout=2).status_code == 200
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(40) == 128 + signal.SIGTERM
        with pytest.raises(httpx.ConnectError):  # the worker is gone with it
            httpx.get(f"http://127.0.0.1:{worker_port}/health", timeout=2)
    finally:
        if serve.poll() is None:
            serve.kill()


@pytest.mark.parametrize("role", ["gateway", "worker"])
def test_probex_serve_refuses_a_port_in_use_before_starting_its_worker(tmp_path, role):
    """A worker port already served (a worker left from an earlier start) would pass the health
    check for the new worker; a gateway port in use would fail only after the worker's start-up.
    Both are refused at once, naming the port and the option, with no worker started."""
    import socket

    from probex.cli import DEFAULT_POLICY
    from probex.processes import port_taken
    from probex.serve import run_embedded

    port, worker_port = free_port(), free_port()
    marker = tmp_path / "started"
    stand_in = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    taken = port if role == "gateway" else worker_port
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", taken))
        listener.listen()
        assert port_taken("127.0.0.1", taken)
        with pytest.raises(SystemExit, match=f"port {taken} \\({role}\\) is in use"):
            run_embedded(Path(DEFAULT_POLICY), "mock-model", "127.0.0.1", port, worker_port, None, [],
                         worker_command=stand_in)
    assert not marker.exists()
    assert not port_taken("127.0.0.1", port)


def test_probex_serve_hands_its_worker_the_admin_token_in_the_environment(tmp_path, monkeypatch):
    """The worker's admin token reaches it in its environment, where the worker's
    --admin-token reads its default, and never on its command line: there `ps` shows it to
    every local user, and a token starting with "-" (token_urlsafe gives one in 64 times)
    was read as an option, so `make run` failed to start its worker."""
    import json
    import secrets

    from engine_worker.vllm.launch import add_worker_arguments
    from probex.cli import DEFAULT_POLICY
    from probex.serve import run_embedded, worker_command_line

    monkeypatch.delenv("PROBEX_ADMIN_TOKEN", raising=False)
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: "-Xq3_a-dash-first")
    seen = tmp_path / "seen.json"
    stand_in = [sys.executable, "-c", "import json, os, sys; json.dump({'argv': sys.argv, 'token': "
                f"os.environ.get('PROBEX_ADMIN_TOKEN')}}, open({str(seen)!r}, 'w'))"]
    sigterm = signal.getsignal(signal.SIGTERM)  # run_embedded takes SIGTERM over, as a command does
    try:
        with pytest.raises(SystemExit, match="worker exited"):  # the stand-in exits once it has written
            run_embedded(Path(DEFAULT_POLICY), "mock-model", "127.0.0.1", free_port(), free_port(), None, [],
                         worker_command=stand_in)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    recorded = json.loads(seen.read_text())
    assert recorded["token"] == "-Xq3_a-dash-first"
    assert not any("-Xq3_a-dash-first" in arg for arg in recorded["argv"])
    # the real worker's command line as probex serve builds it (no token), read by the worker's own parser
    command = worker_command_line("mock-model", 8100, [tmp_path], ["--max-model-len", "512"])
    assert command[:4] == [sys.executable, "-m", "probex.cli", "worker"] and "--admin-token" not in command
    monkeypatch.setenv("PROBEX_ADMIN_TOKEN", recorded["token"])
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    args, passthrough = parser.parse_known_args(command[4:])
    assert args.admin_token == "-Xq3_a-dash-first" and args.probe == [str(tmp_path)] and args.port == 8100
    assert passthrough == ["--max-model-len", "512"]


def test_a_probex_command_stopped_by_sigterm_exits_0(tmp_path):
    """Unwound on SIGTERM (so its workers are stopped and its streams drained), a probex command
    exits 0: a stop that was asked for is a clean one for any supervisor (an exit status of 143
    counts as a failure for systemd)."""
    import signal
    import subprocess
    import time

    import httpx

    from probex.cli import DEFAULT_POLICY

    port = free_port()
    gateway = subprocess.Popen([sys.executable, "-m", "probex.cli", "gateway", "--config", DEFAULT_POLICY,
                                "--upstream", f"http://127.0.0.1:{free_port()}", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert gateway.poll() is None and time.monotonic() < deadline, "the gateway did not come up"
            time.sleep(0.2)
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(30) == 0
    finally:
        if gateway.poll() is None:
            gateway.kill()


def test_port_taken_reads_ipv6_hosts_and_tells_other_failures_apart():
    import socket

    from probex.processes import port_taken

    port = free_port()
    assert not port_taken("127.0.0.1", port) and not port_taken("localhost", port)
    if socket.has_ipv6:
        try:
            with socket.socket(socket.AF_INET6) as probe:
                probe.bind(("::1", 0))
        except OSError:
            pass  # no IPv6 loopback on this machine
        else:
            assert not port_taken("::1", port)
            with socket.socket(socket.AF_INET6) as listener:
                listener.bind(("::1", port))
                listener.listen()
                assert port_taken("::1", port)
    with pytest.raises(OSError):  # not an address of this machine: not "in use"
        port_taken("192.0.2.1", port)


def test_probex_serve_restarts_a_worker_that_dies_and_says_so(tmp_path):
    """The embedded default supervises its worker: killed, it is started again (the real supervision
    code, with the mock worker as the stand-in), the log says so, and the gateway serves again."""
    import queue
    import signal
    import subprocess
    import threading
    import time

    import httpx

    from probex.cli import DEFAULT_POLICY

    port, worker_port = free_port(), free_port()
    serve = subprocess.Popen([sys.executable, "-c", EMBEDDED, str(port), str(worker_port), str(DEFAULT_POLICY)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in serve.stdout], daemon=True).start()

    def next_line(fragment: str, timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if fragment in line:
                return line

    def chat() -> int:
        try:
            return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=10,
                              json={"model": "mock-model", "max_tokens": 2,
                                    "messages": [{"role": "user", "content": "hi"}]}).status_code
        except httpx.HTTPError:
            return 0

    try:
        first_pid = int(next_line("worker started (pid").split("pid ")[1].rstrip(")\n"))
        next_line("gateway on http://")
        deadline = time.monotonic() + 60
        while chat() != 200:
            assert time.monotonic() < deadline, "the gateway did not serve"
            time.sleep(0.2)
        os.kill(first_pid, signal.SIGKILL)
        assert "worker exited with code -9; restarting it in 1 s" in next_line("worker exited", 10)
        second_pid = int(next_line("worker started (pid", 10).split("pid ")[1].rstrip(")\n"))
        assert second_pid != first_pid
        next_line("worker ready again", 30)
        deadline = time.monotonic() + 10
        while chat() != 200:  # the gateway routes to it again (its health check runs every 2 s)
            assert time.monotonic() < deadline, "the restarted worker was not served"
            time.sleep(0.2)
        os.kill(second_pid, signal.SIGKILL)  # a second death in a row waits longer
        assert "restarting it in 2 s" in next_line("worker exited", 10)
        next_line("worker ready again", 30)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(40) == 128 + signal.SIGTERM
        with pytest.raises(httpx.ConnectError):  # the supervisor did not start another one on the way out
            httpx.get(f"http://127.0.0.1:{worker_port}/health", timeout=2)
    finally:
        if serve.poll() is None:
            serve.kill()


STUBBORN = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print("child", child.pid, flush=True)
""" + SERVER


def test_logged_worker_kills_what_of_the_group_ignores_sigterm(tmp_path):
    port = free_port()
    log = tmp_path / "w.log"
    with logged_worker([sys.executable, "-c", STUBBORN, str(port)], dict(os.environ), log,
                       f"http://127.0.0.1:{port}", "toy", timeout_s=30, stop_grace_s=1):
        pass
    child = int(next(line for line in log.read_text().splitlines() if line.startswith("child")).split()[1])
    import time

    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the child that ignored SIGTERM is still running")


def test_a_group_counts_as_running_only_while_a_live_process_is_in_it():
    from probex.processes import _group_running, process_state

    assert _group_running(os.getpgrp())
    child = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    child.wait()
    assert not _group_running(child.pid)  # its own group, now empty
    zombie = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and process_state(Path(f"/proc/{zombie.pid}/stat"))[0] != "Z":
        time.sleep(0.05)
    assert not _group_running(zombie.pid)  # exited, not yet reaped: a zombie holds nothing
    zombie.wait()
