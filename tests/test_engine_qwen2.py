"""The tap on vLLM's Qwen2 decoder layer: a small randomly initialised Qwen2 model, float32, HF as reference.

Architecture coverage, not model quality: the weights are random (seeded) and the
tokenizer is SmolLM2's (any tokenizer with a matching vocabulary size works).
"""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file

from probes.artifact import ProbeArtifact, ReadPoint, load_probe, save_probe
from tests.engine_harness import Worker, control_headers, model_dir

pytestmark = pytest.mark.engine

HIDDEN, LAYERS = 128, 4


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("qwen2")
    model_path = root / "model"
    config = Qwen2Config(vocab_size=49152, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(model_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_dir() / name, model_path / name)
    rng = np.random.default_rng(3)
    probe_dir = save_probe(ProbeArtifact(name="q2", layer=2, read=ReadPoint.LAST_PROMPT_TOKEN,
                                         weight=rng.standard_normal(HIDDEN).astype(np.float32), bias=0.5),
                           root / "q2")
    capture = root / "capture"
    with Worker([f"--probe={probe_dir}", "--capture-dir", str(capture), "--dtype", "float32",
                 "--max-model-len", "1024", "--gpu-memory-utilization", "0.1"], root / "worker.log",
                model=str(model_path)) as worker:
        yield worker, model, probe_dir, capture


def test_qwen2_tap_matches_hf(qwen):
    import torch

    worker, model, probe_dir, capture = qwen
    probe = load_probe(probe_dir)
    for text in ("Hello there, how are you?", "Tell me about the moon and the tides, in detail please."):
        body = {"model": worker.model, "prompt": text, "max_tokens": 2, "temperature": 0, "return_token_ids": True,
                "vllm_xargs": {"probex_capture": True}}
        r = httpx.post(worker.url + "/v1/completions", timeout=120, json=body, headers=control_headers(worker, body))
        assert r.status_code == 200, r.text
        body = r.json()
        ids = body["choices"][0]["prompt_token_ids"]
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[3][0].numpy()
        (path,) = capture.glob(f"{body['id']}-*.safetensors")
        ours = load_file(str(path))["layer_2"]
        cos = (ours * hidden).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(hidden, axis=1))
        assert cos.min() >= 0.9999, cos.min()
        served = body["probex"]["scores"]["q2"]["prompt"]["last_raw"]
        assert served == pytest.approx(float(probe.raw_score(hidden[-1])), rel=1e-3, abs=1e-3)
