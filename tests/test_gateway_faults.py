"""Faults around the gateway, against real processes and sockets: a worker killed mid-stream, SIGTERM with
streams in flight, callers that stop reading or hang up, and policy files broken under load."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import yaml

from gateway.app import GatewayConfig, create_app
from gateway.serving import ServerThread
from probex.processes import free_port
from tests.fixtures.mock_upstream import MODEL
from tests.gateway_fixtures import base_policy, start_stack, wait_for_healthy_upstreams, write_probe


def start_mock(port: int, tokens_per_s: float = 20) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tests.fixtures.mock_upstream", "--port", str(port),
                             "--tokens-per-s", str(tokens_per_s)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, "the mock worker exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the mock worker did not come up"
        time.sleep(0.05)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def healthy(gateway_url: str, upstream_url: str) -> bool:
    return f'probex_upstream_healthy{{upstream="{upstream_url}"}} 1.0' in httpx.get(gateway_url + "/metrics").text


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def body(max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": stream}


def test_a_worker_killed_mid_stream(tmp_path):
    """Streams end with an error event and [DONE], a whole response is a 502, later requests go to the
    other worker, and a restarted worker is routed to again, all without restarting the gateway."""
    write_probe(tmp_path / "probes", "harmful-request")
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(base_policy()))
    port_a, port_b = free_port(), free_port()
    url_a, url_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    a = start_mock(port_a)
    b = None
    config = GatewayConfig(policy_path=tmp_path / "policy.yaml", upstreams=[url_a, url_b],
                           audit_path=tmp_path / "audit.jsonl", upstream_timeout_s=30, connect_timeout_s=1,
                           health_interval_s=0.3)
    gateway = ServerThread(create_app(config)).start()
    try:
        wait_for_healthy_upstreams(gateway.url)
        sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=30)
        # With only A up, everything in flight is on A.
        sdk_stream = iter(sdk.chat.completions.create(**body(400, True)))
        assert next(sdk_stream).choices
        raw_lines: list[str] = []
        whole: dict = {}

        def raw_stream() -> None:
            with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body(400, True), timeout=30) as r:
                for line in r.iter_lines():
                    if line:
                        raw_lines.append(line)

        def whole_request() -> None:
            r = httpx.post(gateway.url + "/v1/chat/completions", json=body(400, False), timeout=30)
            whole.update(status=r.status_code, body=r.json(), at=time.monotonic())

        threads = [threading.Thread(target=raw_stream), threading.Thread(target=whole_request)]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(raw_lines) >= 2, 10, "the raw stream did not start")
        b = start_mock(port_b)
        wait_until(lambda: healthy(gateway.url, url_b), 10, "the gateway never saw B healthy")

        a.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError) as raised:
            for _ in sdk_stream:
                pass
        assert time.monotonic() - killed < 5
        assert not isinstance(raised.value, openai.APIConnectionError)
        assert "mid-stream" in raised.value.message
        for thread in threads:
            thread.join(10)
        assert raw_lines[-1] == "data: [DONE]"
        error = json.loads(raw_lines[-2].removeprefix("data: "))["error"]
        assert error["type"] == "server_error" and url_a in error["message"]
        assert whole["status"] == 502 and whole["body"]["error"]["code"] == "upstream_unavailable"
        assert whole["at"] - killed < 5

        # Later requests reach B, whether or not the gateway has noticed A is gone.
        for _ in range(6):
            assert httpx.post(gateway.url + "/v1/chat/completions", json=body(2, False), timeout=10).status_code == 200

        # A comes back, B goes: A is routed to again; meanwhile failures are fast 502s.
        a = start_mock(port_a)
        wait_until(lambda: healthy(gateway.url, url_a), 10, "the restarted worker was never seen healthy")
        b.send_signal(signal.SIGKILL)
        b.wait(10)
        for _ in range(6):
            started = time.monotonic()
            r = httpx.post(gateway.url + "/v1/chat/completions", json=body(2, False), timeout=10)
            assert r.status_code == 200 or (r.status_code in (502, 503) and time.monotonic() - started < 2), r.text
        deadline = time.monotonic() + 10
        while httpx.post(gateway.url + "/v1/chat/completions", json=body(2, False), timeout=10).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        metrics = httpx.get(gateway.url + "/metrics").text
        assert f'probex_upstream_errors_total{{kind="connect",upstream="{url_a}"}}' in metrics
        assert "probex_requests_in_flight 0.0" in metrics
    finally:
        gateway.stop()
        stop(a)
        if b is not None:
            stop(b)


def test_sigterm_drains_streams_in_flight_and_stops_accepting(tmp_path):
    write_probe(tmp_path / "probes", "harmful-request")
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(base_policy()))
    mock_port, port = free_port(), free_port()
    mock = start_mock(mock_port, tokens_per_s=20)
    gateway = subprocess.Popen([sys.executable, "-m", "probex.cli", "gateway", "--config", str(tmp_path / "policy.yaml"),
                                "--upstream", f"http://127.0.0.1:{mock_port}", "--port", str(port),
                                "--drain-timeout", "20"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(url), 60, "the gateway did not come up")
        wait_for_healthy_upstreams(url)
        results: list[list[str]] = [[] for _ in range(3)]

        def one(lines: list[str]) -> None:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body(40, True), timeout=30) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)

        threads = [threading.Thread(target=one, args=(lines,)) for lines in results]
        for thread in threads:
            thread.start()
        wait_until(lambda: all(len(lines) >= 2 for lines in results), 10, "the streams did not start")
        gateway.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_until(lambda: not _accepts(port), 5, "the gateway kept accepting connections after SIGTERM")
        for thread in threads:
            thread.join(30)
        for lines in results:  # every stream ran to its end: all 40 tokens, then [DONE]
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line[6:]) for line in lines[:-1]]
            assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) == 40
        # Exits 0 once drained: a stop that was asked for is a clean one.
        assert gateway.wait(25) == 0
        assert time.monotonic() - signalled < 20
        assert "Traceback" not in gateway.stderr.read()
    finally:
        stop(gateway)
        stop(mock)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _raw_stream_request(port: int, rcvbuf: int | None = None, max_tokens: int = 4096) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body(max_tokens, True)).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k-admin\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
    return sock


def test_callers_that_stop_reading_or_hang_up_are_dropped_and_nothing_leaks(tmp_path):
    s = start_stack(tmp_path, base_policy(admin_keys=["k-admin"]), tokens_per_s=5000, client_stall_timeout_s=1.0,
                    upstream_timeout_s=30)
    port = int(s.url.rsplit(":", 1)[1])
    try:
        # Reads nothing at all: a stream far longer than the sockets' buffers hold, read by no one.
        stalled = _raw_stream_request(port, rcvbuf=4096, max_tokens=200_000)
        started = time.monotonic()
        wait_until(lambda: s.state.aborted >= 1, 15, "the stalled caller's upstream request was never aborted")
        assert time.monotonic() - started >= 1.0  # not before the stall timeout
        stalled.settimeout(5)
        received = b""
        try:
            while chunk := stalled.recv(1 << 16):  # what was buffered, then the end of the connection
                received += chunk
        except ConnectionResetError:
            pass
        assert received.startswith(b"HTTP/1.1 200") and not received.rstrip().endswith(b"data: [DONE]")
        stalled.close()

        # Hangs up mid-stream.
        gone = _raw_stream_request(port)
        assert gone.recv(4096).startswith(b"HTTP/1.1 200")
        gone.close()
        wait_until(lambda: s.state.aborted >= 2, 10, "the hung-up caller's upstream request was never aborted")

        wait_until(lambda: s.state.open_streams == 0, 5, "the worker still generates for a caller who left")
        wait_until(lambda: "probex_requests_in_flight 0.0" in httpx.get(s.url + "/metrics").text, 5,
                   "the gateway still counts the dropped streams as in flight")
        # ... and serves on.
        assert httpx.post(s.url + "/v1/chat/completions", json=body(2, False), timeout=10).status_code == 200
    finally:
        s.stop()


def test_broken_policy_files_under_load_fail_no_request(tmp_path):
    s = start_stack(tmp_path, tokens_per_s=200)
    failures: list[str] = []
    served = [0]
    running = threading.Event()
    running.set()

    def load() -> None:
        with httpx.Client(timeout=10) as http:
            while running.is_set():
                for stream in (False, True):
                    try:
                        if stream:
                            with http.stream("POST", s.url + "/v1/chat/completions", json=body(4, True)) as r:
                                lines = [line for line in r.iter_lines() if line]
                                ok = r.status_code == 200 and lines[-1] == "data: [DONE]"
                        else:
                            r = http.post(s.url + "/v1/chat/completions", json=body(4, False))
                            ok = r.status_code == 200
                        served[0] += 1
                        if not ok:
                            failures.append(f"{r.status_code}")
                    except httpx.HTTPError as exc:
                        failures.append(repr(exc))

    def reload_errors() -> float:
        for line in httpx.get(s.url + "/metrics").text.splitlines():
            if line.startswith('probex_policy_reloads_total{result="error"}'):
                return float(line.split()[-1])
        return 0.0

    def version() -> str:
        return httpx.get(s.url + "/admin/policy").json()["policy_version"]

    workers = [threading.Thread(target=load) for _ in range(3)]
    for worker in workers:
        worker.start()
    try:
        original = version()
        valid = yaml.safe_dump(base_policy(on_block="refusal"))
        cut = valid.index("block: 0.9") + 3  # inside a mapping: not YAML any more
        breakages = [
            lambda: s.policy_path.write_bytes(b"\x00\xff garbage {{{ ]]"),
            lambda: s.write_policy(base_policy(probes={"harmful-request": {"path": "probes/missing"}})),
            lambda: s.policy_path.write_text(valid[:cut]),  # a save cut short mid-write
        ]
        for breakage in breakages:
            errors = reload_errors()
            breakage()
            wait_until(lambda: reload_errors() > errors, 10, "the broken file was not seen and refused")
            assert version() == original and httpx.get(s.url + "/ready").json()["last_reload_error"]
            time.sleep(0.2)
        with s.policy_path.open("a") as fh:  # the rest of the interrupted save arrives
            fh.write(valid[cut:])
        wait_until(lambda: version() != original, 10, "the completed save never took effect")
    finally:
        running.clear()
        for worker in workers:
            worker.join(20)
        s.stop()
    assert served[0] > 20 and not failures, failures[:5]
