"""`probex bench engine`: the metric math, the model directory and probes it writes, the SSE client,
the analysis, and (engine) its CPU smoke mode end to end, so the GPU tooling cannot rot."""

from __future__ import annotations

import asyncio
import gzip
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from probex import bench_engine as be
from probes.artifact import ServedModel, load_probe

# --- metric math ------------------------------------------------------------------------------


def test_percentile_is_numpy_linear_and_nan_when_empty():
    assert be.percentile([1, 2, 3, 4], 50) == 2.5
    assert be.percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert be.percentile([7.0], 99) == 7.0
    assert math.isnan(be.percentile([], 50))


def test_tpot_from_timestamps():
    # first token at 0.1 s, last of 11 at 1.1 s: ten intervals of 100 ms
    assert be.tpot_s(0.1, 1.1, 11) == pytest.approx(0.1)
    assert be.tpot_s(0.1, 0.1, 1) is None


def test_overhead_pct():
    assert be.overhead_pct(105.0, 100.0) == pytest.approx(5.0)
    assert be.overhead_pct(90.0, 100.0) == pytest.approx(-10.0)
    assert math.isnan(be.overhead_pct(1.0, 0.0))
    assert math.isnan(be.overhead_pct(math.nan, 1.0))


def _result(times, tokens=None, **kw) -> be.RequestResult:
    r = be.RequestResult(ok=True, ttft_s=times[0], e2e_s=times[-1] + 0.001, token_times_s=list(times),
                         chunk_tokens=tokens or [1] * len(times), **kw)
    return r


def test_request_result_itl_and_tpot_count_tokens_not_chunks():
    r = _result([0.05, 0.06, 0.08], tokens=[1, 1, 2])  # the last chunk carries two tokens
    assert r.output_tokens == 4
    assert r.itl_s == pytest.approx([0.01, 0.02])
    assert r.tpot_s == pytest.approx((0.08 - 0.05) / 3)


def test_summarize():
    ok = [_result([0.1 + 0.01 * i for i in range(5)]) for _ in range(3)]
    failed = be.RequestResult(error="HTTP 500: boom")
    s = be.summarize([*ok, failed], wall_s=2.0, client_cpu_s=0.5, expected_tokens=5)
    assert s["requests"] == 4 and s["failed"] == 1 and s["errors"] == ["HTTP 500: boom"]
    assert s["output_tokens"] == 15 and s["output_tokens_per_s"] == pytest.approx(7.5)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(10.0) and s["itl_ms"]["p99"] == pytest.approx(10.0)
    assert s["client_busy_cores"] == pytest.approx(0.25)
    assert s["requests_with_wrong_token_count"] == 0
    assert be.summarize(ok, 1.0, 0.0, expected_tokens=6)["requests_with_wrong_token_count"] == 3


def test_score_check_counts_only_complete_aligned_scores():
    names = ["a", "b"]
    check = be._ScoreCheck(names)
    check.chunk({"scores": {"a": {"prompt": {}, "generated": {"offset": 0, "scores": [0.1]}},
                            "b": {"prompt": {}, "generated": {"offset": 0, "scores": [0.2]}}}}, 0, 1)
    check.chunk({"scores": {"a": {"generated": {"offset": 1, "scores": [0.1, None]}},
                            "b": {"generated": {"offset": 1, "scores": [0.2, 0.3]}}}}, 1, 2)
    r = be.RequestResult(ok=True, chunk_tokens=[1, 2])
    check.finish(r)
    assert r.scored_tokens == 2 and r.prompt_scored_probes == 2 and not r.score_problems
    cov = be.score_coverage([r], expected_probes=2)
    assert cov["coverage"] == pytest.approx(2 / 3) and cov["requests_with_all_prompt_scores"] == 1

    assert r.prompt_last_raw == {}  # the test chunks carry no last_raw
    raw = be._ScoreCheck(["a"])
    raw.chunk({"scores": {"a": {"prompt": {"last": 0.6, "last_raw": 0.4},
                                "generated": {"offset": 0, "scores": [0.1]}}}}, 0, 1)
    r = be.RequestResult(ok=True, chunk_tokens=[1])
    raw.finish(r)
    assert r.prompt_last_raw == {"a": 0.4}

    misaligned = be._ScoreCheck(names)
    misaligned.chunk({"scores": {"a": {"generated": {"offset": 5, "scores": [0.1]}}}}, 0, 1)
    assert misaligned.problems


# --- model directory, probes, plans --------------------------------------------------------------


def _fake_tokenizer(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_text(json.dumps({
        "added_tokens": [{"id": 0, "content": "<|endoftext|>"}, {"id": 1, "content": "<|im_start|>"},
                         {"id": 2, "content": "<|im_end|>"}],
        "model": {"type": "BPE", "vocab": {"a": 3}}}))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    (root / "chat_template.jinja").write_text("{{ messages }}")
    (root / "model.safetensors").write_bytes(b"not copied")
    return root


def test_llama_3_1_8b_config_and_tokenizer_files(tmp_path):
    model = be.write_model_dir(be.LLAMA_3_1_8B, _fake_tokenizer(tmp_path / "tok"), tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    expected = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "intermediate_size": 14336, "vocab_size": 128256, "rope_theta": 500000.0,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
                "tie_word_embeddings": False, "architectures": ["LlamaForCausalLM"], "bos_token_id": 1,
                "eos_token_id": 2}
    assert {k: config[k] for k in expected} == expected
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert sorted(p.name for p in model.iterdir()) == ["chat_template.jinja", "config.json", "tokenizer.json",
                                                       "tokenizer_config.json"]
    assert ServedModel.from_model_dir(model) == ServedModel(4096, 32, name="model")
    # transformers reads the legacy rope keys as Llama-3.1's scaled RoPE
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.from_pretrained(model)
    rope = getattr(hf, "rope_parameters", None) or hf.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    assert (hf.hidden_size, hf.num_key_value_heads, hf.vocab_size) == (4096, 8, 128256)


def test_tokenizer_dir_without_tokenizer_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no tokenizer files"):
        be.write_model_dir(be.TINY_LLAMA, tmp_path / "empty", tmp_path / "model")


def test_probes_two_layers_four_each_unit_and_mixed_reads(tmp_path):
    assert be.default_probe_layers(32) == (10, 20)
    assert be.default_probe_layers(4) == (1, 2)
    specs = be.write_probes(tmp_path, 4096, (10, 20))
    assert len(specs) == 8 and [s.layer for s in specs].count(10) == 4
    assert {s.read for s in specs} == {"last_prompt_token", "prompt_mean", "prompt_max"}
    served = ServedModel(4096, 32)
    for spec in specs:
        probe = load_probe(spec.path, served)
        assert probe.name == spec.name and probe.layer == spec.layer
        assert np.linalg.norm(probe.weight) == pytest.approx(1.0, rel=1e-5)


def test_plans_same_launcher_and_plugin_switch(tmp_path):
    plans = be.plan_setups(be.parse_setups("plain,tap,eager,plain"), tmp_path, [tmp_path / "p1"],
                           ["--load-format", "dummy"], "v1")
    assert [p.label for p in plans] == ["plain#1", "tap", "eager", "plain#2"]
    assert len({p.port for p in plans}) == 4
    plain, tap, eager, _ = plans
    assert plain.env_changes["VLLM_PLUGINS"] == be.NO_PLUGINS and eager.env_changes["VLLM_PLUGINS"] == be.NO_PLUGINS
    assert tap.env_changes["VLLM_PLUGINS"] is None  # removed: the ProbeX plugin must load
    assert all(p.env_changes["VLLM_USE_V2_MODEL_RUNNER"] == "0" for p in plans)
    assert all(p.env_changes["VLLM_DISABLE_COMPILE_CACHE"] == "1" for p in plans)
    assert "vllm.entrypoints.openai.api_server" in plain.argv and "--enforce-eager" not in plain.argv
    without_port = lambda plan: [a for a in plan.argv if a != str(plan.port)]  # noqa: E731
    assert without_port(eager) == without_port(plain) + ["--enforce-eager"]  # the same launcher, one flag more
    assert tap.argv[2:4] == ["probex.cli", "worker"] and f"--probe={tmp_path / 'p1'}" in tap.argv
    assert all(p.argv[-2:] == ["--load-format", "dummy"] for p in (plain, tap))
    assert be.plan_setups(["plain"], tmp_path, [], [], "default")[0].env_changes["VLLM_USE_V2_MODEL_RUNNER"] is None
    # several API server processes for every set-up (--extra-arg="--api-server-count 2"): plain
    # and eager start them as the worker does, through vLLM's `serve`
    scaled = be.plan_setups(["plain", "tap"], tmp_path, [tmp_path / "p1"], ["--api-server-count", "2"], "v2")
    assert scaled[0].argv[3:6] == ["-m", "engine_worker.vllm.serve", str(tmp_path)]
    assert scaled[0].argv[-2:] == ["--api-server-count", "2"] and scaled[1].argv[-2:] == ["--api-server-count", "2"]
    with pytest.raises(SystemExit):
        be.parse_setups("plain,hooks")


def test_profiled_set_ups_each_get_the_torch_profiler_writing_to_their_own_folder(tmp_path):
    plain, tap = be.plan_setups(["plain", "tap"], tmp_path, [tmp_path / "p1"], [], "v2",
                                profile_dir=tmp_path / "profile")
    for plan in (plain, tap):
        config = json.loads(plan.argv[plan.argv.index("--profiler-config") + 1])
        assert config["profiler"] == "torch" and config["ignore_frontend"] is True
        assert config["torch_profiler_dir"] == str((tmp_path / "profile" / plan.label).resolve())
        assert plan.trace_dir == tmp_path / "profile" / plan.label  # where the profile phase looks
    assert "--profiler-config" not in be.plan_setups(["plain"], tmp_path, [], [], "v2")[0].argv


def test_planned_set_ups_never_share_a_port(tmp_path, monkeypatch):
    """Side by side, set-ups start together: a port the OS hands out twice must not reach two."""
    handed_out = iter([5000, 5000, 5001, 5000, 5001, 5002])
    monkeypatch.setattr(be, "free_port", lambda: next(handed_out))
    plans = be.plan_setups(["plain", "tap", "plain"], tmp_path, [tmp_path / "p1"], [], "v2")
    assert [p.port for p in plans] == [5000, 5001, 5002]


def test_log_checks():
    text = ("... enforce_eager=True, kv_cache_dtype=auto ...\nINFO Using V2 Model Runner\n"
            "Capturing CUDA graphs (decode, FULL): 100%\nGraph capturing finished in 5 secs\n")
    checks = be.log_checks(text)
    assert checks == {"enforce_eager": True, "cuda_graph_capture_lines": 2, "model_runner_v2": True,
                      "probex_tap_on_runner_v2": False, "probex_runs_unsteered_lines": 0,
                      "probex_buffers_among_weights_lines": 0}
    among = "probex: tapping decoder layer 10 (LlamaDecoderLayer), 8 probe slots, buffers among the weights\n"
    assert be.log_checks(among * 2)["probex_buffers_among_weights_lines"] == 2
    assert be.log_checks("nothing")["enforce_eager"] is None
    warned = "WARNING probex: request cmpl-1 runs unsteered: steering vector 'x' is not loaded\n"
    assert be.log_checks(warned)["probex_runs_unsteered_lines"] == 1


# --- the steer set-ups: vector artifact, request xargs, plans ------------------------------------


def test_steer_vector_artifact_unit_random_at_the_middle_layer(tmp_path):
    from probes.steering import load_vector

    assert be.default_steer_layer((10, 20)) == 15 and be.default_steer_layer((2, 1)) == 1
    probes = be.write_probes(tmp_path / "probes", 4096, (10, 20))
    steer = be.write_steer_vector(tmp_path / "steering", 4096, be.default_steer_layer((10, 20)), probes, alpha=1.0)
    vector = load_vector(steer.path, ServedModel(4096, 32))  # what `probex worker --steer-vector` loads
    assert (vector.name, vector.layer, steer.layer) == (be.STEER_VECTOR_NAME, 15, 15)
    assert np.linalg.norm(vector.vector) == pytest.approx(1.0, rel=1e-5)
    assert steer.gate == "bench-l10-0"  # the earlier layer can gate a write at 15; layer 20 cannot
    again = be.write_steer_vector(tmp_path / "again", 4096, 15, probes)
    assert load_vector(again.path).digest == vector.digest  # fixed seed
    assert load_vector(be.write_steer_vector(tmp_path / "s1", 4096, 15, probes, seed=1).path).digest != vector.digest
    for probe in probes:  # not a probe direction
        assert abs(float(load_probe(probe.path).weight @ vector.vector)) < 0.2
    tiny = be.write_steer_vector(tmp_path / "tiny", 256, be.default_steer_layer((1, 2)),
                                 be.write_probes(tmp_path / "tiny-probes", 256, (1, 2)))
    assert tiny.layer == 1 and tiny.gate == "bench-l1-0"
    assert be.write_steer_vector(tmp_path / "early", 4096, 5, probes).gate is None


def test_steer_xargs_per_set_up_are_what_the_worker_accepts(tmp_path):
    from engine_worker.steering import steering_from_xargs

    steer = be.SteerBench("v", 15, tmp_path, alpha=1.0, gate="bench-l10-0")
    assert steer.xargs("steer-idle") is None and steer.xargs("tap") is None
    active, gated = steer.xargs("steer-active"), steer.xargs("steer-gated")
    assert active == {"probex_steer": "v", "probex_steer_alpha": 1.0, "probex_steer_window": "all"}
    assert gated == dict(active, probex_steer_gate="bench-l10-0", probex_steer_threshold=0.5)
    request = steering_from_xargs(dict(gated))  # the worker's own parser of these keys
    assert (request.vector, request.alpha, request.gate, request.threshold, request.window) == (
        "v", 1.0, "bench-l10-0", 0.5, "all")
    assert steering_from_xargs(dict(active)).gate is None
    body = be.completion_body("m", [1, 2], 4, active)
    assert body["vllm_xargs"] == active and body["vllm_xargs"] is not active
    assert "vllm_xargs" not in be.completion_body("m", [1, 2], 4, None)
    with pytest.raises(ValueError):
        be.SteerBench("v", 5, tmp_path, 1.0, gate=None).xargs("steer-gated")


def test_steer_plans_are_the_tap_worker_plus_the_vector(tmp_path):
    vector = tmp_path / "steering" / "bench-steer"
    plans = be.plan_setups(be.parse_setups("tap,steer-idle,steer-active,steer-gated"), tmp_path,
                           [tmp_path / "p1"], ["--load-format", "dummy"], "v2", vector)
    tap, idle, active, gated = plans
    def without_port(plan):
        return [a for a in plan.argv if a not in (str(plan.port), f"--steer-vector={vector}")]

    for plan in (idle, active, gated):
        assert f"--steer-vector={vector}" in plan.argv and plan.argv[2:4] == ["probex.cli", "worker"]
        assert without_port(plan) == without_port(tap)  # the same worker otherwise
        assert plan.env_changes == dict(tap.env_changes)
        assert plan.env_changes["VLLM_PLUGINS"] is None
    assert not any(a.startswith("--steer-vector") for a in tap.argv)
    with pytest.raises(ValueError, match="steering vector"):
        be.plan_setups(["steer-idle"], tmp_path, [tmp_path / "p1"], [], "default")


# --- the SSE client against a scripted server -------------------------------------------------------


def _sse(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def _serve_script(writes: list[tuple[float, bytes]],
                        arrivals: list[float] | None = None) -> tuple[asyncio.AbstractServer, int]:
    """An HTTP/1.0-style server that answers any POST with `writes` (delay, bytes), then closes;
    appends each request's arrival time (time.perf_counter()) to `arrivals` if given."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if arrivals is not None:
            arrivals.append(time.perf_counter())
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        for delay, data in writes:
            await asyncio.sleep(delay)
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _token_chunk(ids, offset, probes=()):
    chunk = {"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": None}]}
    if probes:
        chunk["probex"] = {"scores": {p: {"generated": {"offset": offset, "scores": [0.5] * len(ids)},
                                          **({"prompt": {"last": 0.5}} if offset == 0 else {})} for p in probes}}
    return chunk


def test_client_parses_split_and_merged_events_and_checks_scores():
    probes = ("p1", "p2")
    first, second, third = (_sse(_token_chunk([5], 0, probes)), _sse(_token_chunk([6], 1, probes)),
                            _sse(_token_chunk([127999, 8], 2, probes)))
    usage = _sse({"choices": [], "usage": {"completion_tokens": 4}})
    writes = [(0.02, first[:17]), (0.0, first[17:]), (0.02, second + third), (0.0, usage + b"data: [DONE]\n\n")]

    async def go():
        server, port = await _serve_script(writes)
        async with server:
            async with be._Transport(1) as transport:
                return await be.one_request(transport, f"http://127.0.0.1:{port}/v1/completions",
                                            be.completion_body("m", [1, 2], 4), probes)

    r = asyncio.run(go())
    assert r.ok, r.error
    assert r.chunk_tokens == [1, 1, 2] and r.output_tokens == 4 and r.usage_tokens == 4
    assert r.same_read_chunks == 1  # second and third arrived in one read
    assert r.ttft_s >= 0.015 and r.token_times_s[1] - r.token_times_s[0] >= 0.015
    assert r.scored_tokens == 4 and r.prompt_scored_probes == 2 and r.max_token_id == 127999


def test_client_reports_a_stream_without_done_as_failed():
    async def go():
        server, port = await _serve_script([(0.0, _sse(_token_chunk([5], 0)))])
        async with server:
            async with be._Transport(1) as transport:
                return await be.one_request(transport, f"http://127.0.0.1:{port}/v1/completions",
                                            be.completion_body("m", [1], 2), None)

    r = asyncio.run(go())
    assert not r.ok and "[DONE]" in r.error


def test_a_malformed_chunk_fails_its_request_not_the_phase():
    script = [(0.0, _sse(_token_chunk([5], 0))), (0.0, b'data: {"choices":[{"index":0\n\n'), (0.0, b"data: [DONE]\n\n")]

    async def go():
        server, port = await _serve_script(script)
        async with server:
            return await be.run_phase(f"http://127.0.0.1:{port}", "m", [[1], [2]], 2, 2, None)

    results, _, _ = asyncio.run(go())
    assert len(results) == 2 and all(not r.ok and r.error.startswith(("JSONDecodeError", "ValueError", "DecodeError"))
                                      for r in results), [r.error for r in results]


def test_a_phase_reads_its_streams_only_after_every_stream_ended(monkeypatch):
    # The client's one event loop carries every stream: a chunk parsed while others stream
    # would delay their reads, and by more for chunks that carry scores.
    probes = ("p1",)
    script = [(0.0, _sse(_token_chunk([5], 0, probes))), (0.05, _sse(_token_chunk([6], 1, probes))),
              (0.0, b"data: [DONE]\n\n")]
    parsed_at: list[float] = []
    loads = be._loads
    monkeypatch.setattr(be, "_loads", lambda raw: parsed_at.append(time.perf_counter()) or loads(raw))

    async def go():
        server, port = await _serve_script(script)
        async with server:
            return await be.run_phase(f"http://127.0.0.1:{port}", "m", [[1], [2], [3]], 2, 2, probes)

    results, _, _ = asyncio.run(go())
    assert all(r.ok and r.scored_tokens == 2 for r in results) and len(results) == 3
    assert all(r.token_times_s[1] - r.token_times_s[0] >= 0.04 for r in results)  # stamped at the reads
    last_read = max(r.sent_at + r.e2e_s for r in results)
    assert len(parsed_at) == 6 and min(parsed_at) >= last_read


def _run_phase_arrivals(concurrency: int, spread_s: float) -> list[float]:
    """Each request's arrival at the server, in seconds after the phase was started, sorted."""
    arrivals: list[float] = []
    # each request lasts longer than the spread, as on a server: no client finishes and takes a
    # second prompt before the last one has started
    script = [(3.0, _sse(_token_chunk([5], 0)) + b"data: [DONE]\n\n")]
    started = []

    async def go():
        server, port = await _serve_script(script, arrivals)
        async with server:
            started.append(time.perf_counter())
            results, _, _ = await be.run_phase(f"http://127.0.0.1:{port}", "m", [[1]] * concurrency, concurrency,
                                               1, None, spread_s=spread_s)
        assert all(r.ok for r in results)

    asyncio.run(go())
    return sorted(a - started[0] for a in arrivals)


def test_clients_start_spread_over_the_given_window_or_together():
    # Bounds a loaded machine cannot break (this suite shares two cores with engine processes;
    # a client was seen 0.37 s late): a client's sleep never ends early, so client k of a
    # spread phase arrives no sooner than k x 0.6 s; unspread, all four arrive within 1.2 s,
    # where a spread phase has sent only two.
    spread = _run_phase_arrivals(4, spread_s=2.4)  # clients start at 0, 0.6, 1.2, 1.8 s
    assert len(spread) == 4 and all(arrival >= 0.6 * k - 0.005 for k, arrival in enumerate(spread)), spread
    together = _run_phase_arrivals(4, spread_s=0.0)
    assert len(together) == 4 and together[-1] < 1.2, together


def test_paced_requests_are_sent_on_a_schedule_whatever_is_in_flight():
    # Two streams, requests every 0.4 s, each lasting 2 s: clients that wait for their last
    # request would send the third only after 2 s; paced, it goes at 0.8 s. Bounds a loaded
    # machine cannot break: a sleep never ends early, and the third comes long before 2 s.
    arrivals: list[float] = []
    script = [(2.0, _sse(_token_chunk([5], 0)) + b"data: [DONE]\n\n")]
    started = []

    async def go():
        server, port = await _serve_script(script, arrivals)
        async with server:
            started.append(time.perf_counter())
            return await be.run_phase(f"http://127.0.0.1:{port}", "m", [[1]] * 5, 2, 1, None, spread_s=0.8,
                                      paced=True)

    results, _, _ = asyncio.run(go())
    sent = sorted(a - started[0] for a in arrivals)
    assert len(sent) == 5 and all(r.ok for r in results)
    assert all(arrival >= 0.4 * k - 0.005 for k, arrival in enumerate(sent)), sent
    assert sent[2] < 1.8, sent  # before any request ended
    flight = be.in_flight(results)
    assert flight["max"] >= 3 and flight["mean"] > 2, flight  # more than the two streams at once
    with pytest.raises(ValueError, match="duration"):
        asyncio.run(be.run_phase("http://127.0.0.1:9", "m", [[1]], 2, 1, None, paced=True))


def test_paced_interval_keeps_the_concurrency_in_flight_on_average():
    def done(e2e, ok=True):
        return be.RequestResult(ok=ok, e2e_s=e2e)

    # Little's law: 8 in flight at a mean duration of 2 s is 4 requests a second
    assert be.paced_interval_s([done(1.0), done(3.0), done(2.0), done(50.0, ok=False)], 8) == pytest.approx(0.25)
    assert be.paced_interval_s([done(math.nan, ok=False)], 8) == 0.0
    # in flight: two overlapping requests, then a third alone (ends meet starts: not counted together)
    spans = [be.RequestResult(ok=True, sent_at=0.0, e2e_s=2.0), be.RequestResult(ok=True, sent_at=1.0, e2e_s=1.0),
             be.RequestResult(ok=True, sent_at=2.0, e2e_s=2.0), be.RequestResult(ok=False)]
    assert be.in_flight(spans) == {"mean": pytest.approx(5.0 / 4.0), "max": 2}
    assert be.in_flight([])["max"] == 0


def test_one_stream_phases_interleave_request_by_request_abba():
    # one of each state per pair of requests, the pairs' order alternating; each state count times
    assert be.interleaved_states(4, first_paused=False) == [False, True, True, False, False, True, True, False]
    assert be.interleaved_states(3, first_paused=True) == [True, False, False, True, True, False]
    with pytest.raises(ValueError, match="one running phase and one paused"):
        be.interleaved_phase_pair("http://127.0.0.1:9", "m", [(False, 1, True), (False, 2, False)], 2, 4, [2, 2],
                                  None, None, True, 8)


def test_output_lengths_are_seeded_and_spread_around_the_output_len():
    lengths = be.output_lengths(400, 256, 0.5, seed=3)
    assert lengths == be.output_lengths(400, 256, 0.5, seed=3)  # the same for every set-up
    assert min(lengths) >= 128 and max(lengths) <= 384 and len(set(lengths)) > 50
    assert abs(np.mean(lengths) - 256) < 15
    assert be.output_lengths(3, 256, 0.0, seed=3) == [256, 256, 256]
    assert min(be.output_lengths(50, 2, 0.9, seed=1)) >= 1
    with pytest.raises(ValueError):
        be.output_lengths(3, 256, 1.0, seed=3)


def test_wrong_token_counts_are_judged_against_each_requests_own_length():
    def done(tokens, asked):
        return be.RequestResult(ok=True, ttft_s=0.01, e2e_s=0.1, token_times_s=[0.01], chunk_tokens=[tokens],
                                expected_tokens=asked)

    entry = be.summarize([done(5, 5), done(7, 7), done(6, 8)], wall_s=1.0, client_cpu_s=0.0, expected_tokens=256)
    assert entry["expected_output_tokens"] == 20 and entry["requests_with_wrong_token_count"] == 1


def test_a_phase_whose_clients_could_not_be_spread_is_warned_about():
    setup = {"label": "tap", "kind": "tap", "checks": {},
             "results": {"8": {"arrivals_not_spread": True}, "64": {"arrival_spread_s": 3.6}}}
    warnings = be.find_warnings([setup])
    assert len(warnings) == 1 and warnings[0].startswith("tap c=8: no warm-up request succeeded")


def test_a_saved_engine_consumer_whose_output_queue_took_no_work_is_warned_about():
    """A saved run of sessions 39-40 (PROBEX_PROMPT_SCORES_AFTER_OUTPUT, since removed) with it
    on, the engine thread consuming, and the engine core's queue not set up (a vLLM whose
    engine core changed): the run says its prompt scores went ahead of their tokens; with the
    queue set up, or the transfer thread consuming, it does not."""
    def setup(can_consume, consumer):
        return {"label": "tap-toggle", "kind": "tap-toggle",
                "checks": {"probex_transfer_settings": {"prompt_scores_after_output": True,
                                                        "output_thread_can_consume": can_consume}},
                "results": {"1": {"delivery": {"transfer": {"consumer": consumer}}}}}

    warnings = be.find_warnings([setup(False, "engine")])
    assert len(warnings) == 1 and "output queue did not take ProbeX's work" in warnings[0]
    assert be.find_warnings([setup(True, "engine")]) == []
    assert be.find_warnings([setup(False, "thread")]) == []  # the CPU backend: nothing to hand on there


def test_process_cpu_without_a_baseline_is_left_out_and_ended_threads_still_count():
    tick = os.sysconf("SC_CLK_TCK")
    before = {10: {"name": "api", "total": 0, "threads": {10: 0, 11: 0}}}
    # thread 11 ended during the phase: its time is in the process total, not in any thread
    after = {10: {"name": "api", "total": 2 * tick, "threads": {10: tick // 2}},
             12: {"name": "new", "total": 5 * tick, "threads": {12: 5 * tick}}}
    (row,) = be.group_cpu_cores(before, after, wall_s=2.0)
    assert row["pid"] == 10 and row["cores"] == pytest.approx(1.0) and row["main_thread"] == pytest.approx(0.25, abs=0.01)


def test_arrival_spread_is_the_median_duration_of_the_warm_up_that_succeeded():
    def done(e2e, ok=True):
        return be.RequestResult(ok=ok, e2e_s=e2e)

    assert be.arrival_spread_s([done(1.0), done(3.0), done(2.0), done(50.0, ok=False)]) == 2.0
    assert be.arrival_spread_s([done(math.nan, ok=False)]) == 0.0


def test_prompts_are_seeded_and_inside_every_tokenizer():
    a, b = be.random_prompts(3, 50, seed=1), be.random_prompts(3, 50, seed=1)
    assert a == b and a != be.random_prompts(3, 50, seed=2)
    flat = np.asarray(a)
    assert flat.min() >= be.PROMPT_ID_RANGE[0] and flat.max() < be.PROMPT_ID_RANGE[1] <= 49152


# --- analysis, tables, chart, reanalysis -----------------------------------------------------------


def _entry(tpot: float, **extra) -> dict:
    stats = lambda v: {"p50": v, "p99": v * 1.5, "mean": v}  # noqa: E731
    return {"ttft_ms": stats(20.0), "tpot_ms": stats(tpot), "itl_ms": stats(tpot), "e2e_ms": stats(100.0),
            "output_tokens_per_s": 1000.0 / tpot, "failed": 0, "client_busy_cores": 0.1, **extra}


def _setup(kind: str, label: str, tpot: dict[str, float], **extra) -> dict:
    return {"label": label, "kind": kind, "checks": {"enforce_eager": kind == "eager"},
            "results": {c: _entry(v, **extra) for c, v in tpot.items()}}


def _saved_run() -> dict:
    tap_scores = {"scores": {"expected_probes": 8, "generated_tokens": 10, "scored_tokens": 10, "coverage": 1.0,
                             "requests_with_all_prompt_scores": 2, "requests": 2, "problems": []}}
    setups = [_setup("plain", "plain#1", {"1": 5.0, "8": 6.0}), _setup("tap", "tap#1", {"1": 5.05, "8": 6.06},
                                                                        **tap_scores),
              _setup("plain", "plain#2", {"1": 5.2, "8": 6.0}), _setup("tap", "tap#2", {"1": 5.15, "8": 6.06},
                                                                        **tap_scores),
              _setup("eager", "eager", {"1": 20.4, "8": 24.0})]
    for s in setups:
        if s["kind"] == "tap":
            s["checks"].update(probex_probes_listed=8, probex_probes_expected=8)
    return {"setups": setups, "model": {"name": "llama-3.1-8b"}, "versions": {"gpu": "NVIDIA H200", "vllm": "0.25.0"},
            "workload": {"input_len": 1024, "output_len": 256}, "probes": [{}] * 8, "runner": "v1"}


def test_idle_ttft_compares_set_ups_prompt_by_prompt_and_flags_failures():
    def with_idle(setup, ttfts, failed=0, scores=None):
        setup["idle_ttft"] = {"requests": len(ttfts), "failed": failed, "errors": ["boom"] if failed else [],
                              "per_request_ttft_ms": ttfts, "ttft_ms": {"p50": float(np.nanmedian(ttfts))},
                              **({"scores": scores} if scores else {})}
        return setup

    plain = [with_idle(_setup("plain", "plain#1", {"1": 5.0}), [30.0, 40.0, 50.0]),
             with_idle(_setup("plain", "plain#2", {"1": 5.0}), [30.0, 40.0, 50.0])]
    # every prompt 2% slower, but one repeat lost a request: its prompt counts from the other repeat
    tap = [with_idle(_setup("tap", "tap#1", {"1": 5.0}), [30.6, 40.8, 51.0]),
           with_idle(_setup("tap", "tap#2", {"1": 5.0}), [30.6, math.nan, 51.0], failed=1)]
    summary = be.idle_ttft_summary(plain + tap)
    assert summary["ttft_p50_ms"]["plain"] == pytest.approx(40.0)
    assert summary["overhead_pct_vs_plain"]["tap"]["per_prompt_median"] == pytest.approx(2.0)
    problems = be.find_problems(plain + tap)
    assert [p for p in problems if "idle TTFT" in p] == ["tap#2 idle TTFT: 1 failed requests (boom)"]
    partial = {"coverage": 0.5, "scored_tokens": 1, "generated_tokens": 2, "requests_with_all_prompt_scores": 1,
               "requests": 1}
    undelivered = with_idle(_setup("tap", "tap#3", {"1": 5.0}), [30.0, 40.0, 50.0], scores=partial)
    assert any("tap#3 idle TTFT: SCORES NOT FULLY DELIVERED" in p for p in be.find_problems([undelivered]))
    table = be.markdown_tables({"setups": plain + tap, "workload": {"idle_ttft_requests": 3, "idle_ttft_pause_s": 0.1},
                                **be.analyze(plain + tap)})
    assert "| tap | 40.80 | +2.0% | +2.0% | n/a |" in table  # no vLLM metrics in these records
    # a repeat with a different request count (runs merged from different --idle-ttft-requests):
    # the p50s still compare, prompt by prompt no longer does
    longer = with_idle(_setup("tap", "tap#4", {"1": 5.0}), [30.6, 40.8, 51.0, 61.2])
    merged = be.idle_ttft_summary(plain + tap + [longer])
    assert merged["ttft_p50_ms"]["tap"] == pytest.approx((40.8 + 40.8 + 45.9) / 3)
    assert math.isnan(merged["overhead_pct_vs_plain"]["tap"]["per_prompt_median"])


def test_a_diagnostic_set_up_that_ran_the_default_is_reported():
    ran_default = _setup("tap-scores-after-tokens", "tap-scores-after-tokens#1", {"1": 5.0})
    ran_default["checks"]["probex_transfer_settings"] = {"scores_ahead_of_tokens": True, "copy_stream": "same"}
    side = _setup("tap-side-copies", "tap-side-copies#1", {"1": 5.0})
    side["checks"]["probex_transfer_settings"] = {"scores_ahead_of_tokens": True, "copy_stream": "side"}
    problems = be.find_problems([ran_default, side])
    assert [p for p in problems if "reports" in p] == [
        "tap-scores-after-tokens#1: the worker reports scores_ahead_of_tokens=True, not False: it ran the default"
        " instead of the set-up's {'PROBEX_SCORE_RING': '0', 'PROBEX_SCORES_AHEAD_OF_TOKENS': '0'}"]


def test_vllms_ttft_is_split_by_its_stage_histograms_per_phase():
    def server(ttft, queue, prefill):
        return {"server": {"ttft_mean_ms": ttft, "queue_mean_ms": queue, "prefill_mean_ms": prefill}}

    plain = _setup("plain", "plain#1", {"1": 5.0})
    plain["results"]["1"].update(server(28.0, 0.2, 25.0))
    plain["idle_ttft"] = {"per_request_ttft_ms": [32.0], "ttft_ms": {"p50": 32.0}, **server(29.0, 0.3, 25.5)}
    taps = [_setup("tap", f"tap#{i}", {"1": 5.0}) for i in (1, 2)]
    taps[0]["results"]["1"].update(server(30.0, 0.2, 26.0))
    taps[1]["results"]["1"].update(server(31.0, 0.4, 26.5))
    taps[0]["idle_ttft"] = {"per_request_ttft_ms": [30.0], "ttft_ms": {"p50": 30.0},  # no stage histograms: skipped
                            "server": {"ttft_mean_ms": 28.0}}
    split = be.ttft_split_summary([plain, *taps])
    assert split["plain"]["idle"] == pytest.approx({"ttft": 29.0, "queue": 0.3, "prefill": 25.5, "api": 3.2})
    assert split["tap"]["1"] == pytest.approx({"ttft": 30.5, "queue": 0.3, "prefill": 26.25, "api": 3.95})
    assert "idle" not in split["tap"]
    table = be.markdown_tables({"setups": [plain, *taps], "workload": {}, **be.analyze([plain, *taps])})
    assert "| tap | c=1 | 30.50 | 0.30 | 26.25 | 3.95 |" in table


def test_analyze_means_over_repeats_and_overheads():
    result = be.merge_runs([_saved_run()])
    per_kind = result["summary"]["per_kind"]
    assert per_kind["plain"]["1"]["tpot_p50"] == pytest.approx(5.1) and per_kind["plain"]["1"]["runs"] == 2
    assert result["overhead_pct"]["tap_vs_plain"]["1"]["tpot_p50"] == pytest.approx(0.0, abs=1e-9)
    assert result["overhead_pct"]["tap_vs_plain"]["8"]["tpot_p50"] == pytest.approx(1.0)
    assert result["overhead_pct"]["eager_vs_plain"]["1"]["tpot_p50"] == pytest.approx(300.0)
    assert result["overhead_pct"]["tap_vs_plain"]["8"]["output_tokens_per_s"] == pytest.approx(1 / 1.01 * 100 - 100)
    assert result["summary"]["tpot_p50_spread_over_repeats_pct"]["plain"]["1"] == pytest.approx(0.2 / 5.1 * 100)
    assert result["problems"] == []
    tables = be.markdown_tables(result)
    assert "| tap | 8 | +1.0% |" in tables and "| eager | 1 | +300.0% |" in tables


def test_delivery_delta_reads_the_worker_and_hub_counters_per_phase():
    """Per-step means between two /probex/health snapshots: the worker's hook and its parts,
    the transfer thread, and the chunks the API server held for scores."""
    before = {"engine_thread": {"steps": 10, "hook_s": 0.001, "layout_s": 0.0002},
              "transfer": {"steps": 10, "landed_s": 0.05, "landed_max_s": 0.01, "consume_s": 0.001,
                           "consume_max_s": 0.0002, "waits_for_staging": 0, "stage_s": 0.0004, "handoff_s": 0.0001},
              "score_waits": {"tokens": {"calls": 5, "waited": 1, "waited_s": 0.002, "max_s": 0.002}}}
    after = {"engine_thread": {"steps": 30, "hook_s": 0.003, "layout_s": 0.0006},
             "transfer": {"steps": 30, "landed_s": 0.25, "landed_max_s": 0.02, "consume_s": 0.003,
                          "consume_max_s": 0.0003, "waits_for_staging": 1, "stage_s": 0.0012, "handoff_s": 0.0003,
                          "copy_stream": "side"},
             "score_waits": {"tokens": {"calls": 15, "waited": 3, "waited_s": 0.006, "max_s": 0.002}}}
    delta = be.delivery_delta(before, after)
    assert delta["transfer"].pop("copy_stream") == "side"  # which copy path the phase ran
    assert delta["transfer"].pop("consumer") == "thread" and delta["transfer"].pop("stale_steps") == 0
    assert delta["transfer"].pop("mid_forward_steps") == 0  # a worker from before session 35 says nothing of them
    assert delta["engine_thread"] == pytest.approx({"steps": 20, "hook_mean_ms": 0.1, "layout_mean_ms": 0.02,
                                                    "stage_mean_ms": 0.04, "handoff_mean_ms": 0.01,
                                                    "other_mean_ms": 0.03})
    assert delta["transfer"] == pytest.approx({"steps": 20, "landed_mean_ms": 10.0, "consume_mean_ms": 0.1,
                                               "landed_max_ms_so_far": 20.0, "consume_max_ms_so_far": 0.3,
                                               "waits_for_staging": 1})
    assert delta["tokens_waits"]["waited"] == 2 and delta["tokens_waits"]["mean_ms_when_waiting"] == pytest.approx(2.0)
    line = be.delivery_line(delta)
    assert "0.100 ms of ProbeX hooks per step (layout 0.020, stage 0.040, handoff 0.010, other 0.030)" in line
    assert be.delivery_delta(None, after) == {}
    # prefill-sized steps' consume, and the API server's loop time (intake, first chunks)
    before["transfer"].update(large_steps=1, large_consume_s=0.0005)
    after["transfer"].update(large_steps=3, large_consume_s=0.0015)
    before["score_loop_time"] = {"intake_prompt_steps": {"count": 1, "total_s": 0.0001, "max_s": 0.0001}}
    after["score_loop_time"] = {"intake_prompt_steps": {"count": 3, "total_s": 0.0005, "max_s": 0.0002},
                                "first_chunks": {"count": 0, "total_s": 0.0, "max_s": 0.0}}
    delta = be.delivery_delta(before, after)
    assert delta["transfer"]["large_steps"] == 2 and delta["transfer"]["large_consume_mean_ms"] == pytest.approx(0.5)
    assert delta["api_loop"] == {"intake_prompt_steps": pytest.approx({"count": 2, "mean_ms": 0.2,
                                                                       "max_ms_so_far": 0.2})}
    line = be.delivery_line(delta)
    assert "(0.500 ms for the 2 prefill-sized)" in line and "API server loop: intake_prompt_steps 0.200 ms x2" in line
    assert "scores_lost" not in delta and "LOST" not in line  # a worker that does not count losses
    # scores lost during the phase: messages missing from the worker's count, steps it could not send
    before.update(score_messages_lost=2, score_steps_lost=0)
    after.update(score_messages_lost=2, score_steps_lost=0)
    assert be.delivery_delta(before, after)["scores_lost"] == {"messages": 0, "steps": 0}
    assert "LOST" not in be.delivery_line(be.delivery_delta(before, after))
    after.update(score_messages_lost=5, score_steps_lost=1)
    assert "SCORES LOST: 3 messages, 1 steps" in be.delivery_line(be.delivery_delta(before, after))
    # a worker from before the split reports the hook only
    old = {"engine_thread": {"steps": 10, "hook_s": 0.001}}
    assert be.delivery_delta(old, {"engine_thread": {"steps": 20, "hook_s": 0.002}})["engine_thread"] == \
        pytest.approx({"steps": 10, "hook_mean_ms": 0.1})


def test_problems_are_flagged():
    run = _saved_run()
    tap = run["setups"][1]["results"]["1"]
    tap["scores"] = dict(tap["scores"], scored_tokens=9, coverage=0.9)
    run["setups"][4]["checks"]["enforce_eager"] = False
    run["setups"][0]["results"]["1"].update(failed=2, errors=["HTTP 500"], responses_with_probex_field=3)
    problems = "\n".join(be.merge_runs([run])["problems"])
    assert "SCORES NOT FULLY DELIVERED: 9/10" in problems
    assert "eager: the engine did not run with enforce_eager=True" in problems
    assert "plain#1 c=1: 2 failed requests" in problems and "not stock vLLM" in problems


def _steer_run() -> dict:
    run = _saved_run()
    scores = run["setups"][1]["results"]["1"]["scores"]
    steering = {"probex_probes_listed": 8, "probex_probes_expected": 8,
                "probex_steering_vectors": [{"name": "bench-steer", "layer": 15, "norm": 1.0, "digest": "d"}],
                "probex_steering_expected": {"name": "bench-steer", "layer": 15}, "probex_runs_unsteered_lines": 0}
    idle = _setup("steer-idle", "steer-idle", {"1": 5.1, "8": 6.12}, scores=scores)
    active = _setup("steer-active", "steer-active", {"1": 5.2, "8": 6.3}, scores=scores)
    idle["checks"].update(steering)
    active["checks"].update(steering, steering_effect={
        "prompts": 2, "layer": 15, "probes_after_write": ["bench-l20-0"], "max_abs_raw_diff_after_write": 0.03,
        "max_abs_raw_diff_at_or_before_write": 0.0, "errors": []})
    run["setups"] = [s for s in run["setups"] if s["label"] in ("plain#1", "tap#1")] + [idle, active]
    run["steering"] = {"vector": "bench-steer", "layer": 15, "alpha": 1.0}
    return run


def test_steer_set_ups_overheads_over_plain_and_over_tap(tmp_path):
    result = be.merge_runs([_steer_run()])
    assert result["problems"] == [] and result["warnings"] == []
    overhead = result["overhead_pct"]
    assert set(overhead) == {"tap_vs_plain", "steer-idle_vs_plain", "steer-active_vs_plain", "steer-idle_vs_tap",
                             "steer-active_vs_tap"}
    assert overhead["steer-idle_vs_plain"]["1"]["tpot_p50"] == pytest.approx(2.0)
    assert overhead["steer-active_vs_tap"]["8"]["tpot_p50"] == pytest.approx((6.3 / 6.06 - 1) * 100)
    tables = be.markdown_tables(result)
    head, over_tap = tables.split("Overhead over tap")
    assert "| steer-idle | 1 | +2.0% |" in head and "| steer-active | 1 | +4.0% |" in head
    assert "| steer-idle | 1 | +1.0% |" in over_tap and "| tap |" not in over_tap
    if importlib.util.find_spec("matplotlib"):
        assert be.write_png(result, tmp_path / "c.png") and (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_steer_problems_are_flagged():
    run = _steer_run()
    idle, active = run["setups"][2], run["setups"][3]
    idle["checks"]["probex_steering_vectors"] = []
    active["checks"]["steering_effect"]["max_abs_raw_diff_after_write"] = 0.0
    active["checks"]["probex_runs_unsteered_lines"] = 2
    problems = "\n".join(be.merge_runs([run])["problems"])
    assert "steer-idle: /probex/steering lists [], not bench-steer at layer 15" in problems
    assert "steer-active: STEERING HAD NO EFFECT" in problems and "ran 2 request(s) unsteered" in problems
    del active["checks"]["steering_effect"]
    assert "steer-active: the steering check did not run" in "\n".join(be.merge_runs([run])["problems"])
    active["checks"]["steering_effect"] = {"prompts": 2, "layer": 3, "probes_after_write": [], "errors": [],
                                           "max_abs_raw_diff_after_write": math.nan}
    assert any("not observable" in w for w in be.merge_runs([run])["warnings"])


def test_merge_relabels_and_reanalyze_cli(tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(_saved_run()))
    run_b = _saved_run()
    run_b["setups"] = [s for s in run_b["setups"] if s["kind"] == "eager"]
    second = tmp_path / "b.json.gz"  # saved runs may be gzipped
    second.write_bytes(gzip.compress(json.dumps(run_b).encode()))
    merged = be.merge_runs([be.load_saved_run(first), be.load_saved_run(second)])
    assert [s["label"] for s in merged["setups"]] == ["plain#1", "tap#1", "plain#2", "tap#2", "eager#1", "eager#2"]
    from probex.cli import main

    png = tmp_path / "chart.png"
    assert main(["bench", "engine", "--reanalyze", str(first), str(second), "--png", str(png),
                 "--merged-json", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    assert "| set-up | concurrency | TPOT p50 |" in out and "eager#2" in out
    assert json.loads((tmp_path / "m.json").read_text())["overhead_pct"]["eager_vs_plain"]
    if importlib.util.find_spec("matplotlib"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the CPU smoke mode, end to end -----------------------------------------------------------------


@pytest.mark.engine
def test_smoke_mode_runs_plain_tap_and_eager(tmp_path):
    """One run, three servers: plain, the tap (switched off and on between phases: tap-toggle,
    here beginning paused at each concurrency) and eager. The steering set-ups are
    left out here to keep the suite's time (a server start is minutes on a 2-core machine):
    their plans and analysis are tested above, the steering op on the engine in
    test_engine_steering."""
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "bench.bench_engine", "--smoke", "--setups",
                           "plain,tap-toggle,eager", "--profile-requests", "1", "--idle-ttft-pairs", "3",
                           "--toggle-first", "paused", "--toggle-pairs", "1,2:2",
                           "--arrivals", "paced", "--interleave-one-stream",
                           "--worker-env", "PROBEX_STEP_TIMING=1",
                           "--worker-env", "PROBEX_STEP_TIMING_MIN_ROWS=32",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=1500)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    result = json.loads((out / "bench_engine.json").read_text())

    assert result["versions"]["gpu"] == "cpu" and result["versions"]["vllm"] and result["versions"]["torch"]
    assert result["command"] and result["runner"] == "default" and result["problems"] == []
    assert result["model"]["config"]["vocab_size"] == 128256 and result["model"]["load_format"] == "dummy"
    assert len(result["probes"]) == 8 and {p["layer"] for p in result["probes"]} == {1, 2}
    assert [s["label"] for s in result["setups"]] == ["plain", "tap-toggle", "eager"]
    workload = result["workload"]
    assert workload["arrivals"] == "paced" and workload["interleave_one_stream"] is True
    for setup in result["setups"]:
        assert "error" not in setup, setup.get("error")
        assert (out / setup["log"]).stat().st_size > 0
        assert setup["checks"]["enforce_eager"] is (setup["kind"] == "eager"), setup["label"]
        assert set(setup["results"]) == {"1", "2"}
        for c, e in setup["results"].items():
            where = f"{setup['label']} c={c}"
            assert e["failed"] == 0 and e["requests_with_wrong_token_count"] == 0, where
            # lengths spread around --output-len, each request got exactly what it asked for
            lengths = [r["expected_tokens"] for r in e["per_request"]]
            assert e["output_tokens"] == e["expected_output_tokens"] == sum(lengths), where
            assert len(set(lengths)) > 1 and all(4 <= n <= 12 for n in lengths), (where, lengths)
            for key in ("ttft_ms", "e2e_ms"):
                assert all(math.isfinite(v) and v > 0 for v in e[key].values()), (where, key, e[key])
            assert e["output_tokens_per_s"] > 0, where
            # two streams: a request every half of a warm-up request's mean duration; one has nothing to pace
            assert (e["arrival_spread_s"] > 0) is (c == "2"), (where, e["arrival_spread_s"])
            assert ("arrival_interval_s" in e) is (c == "2"), where
            if c == "2":
                assert e["arrival_interval_s"] == pytest.approx(e["arrival_spread_s"] / 2, abs=1e-4), where
            assert e["in_flight"]["max"] >= 1, (where, e["in_flight"])
            # tap-toggle's one-stream phases ran request by request in turn with their paused
            # neighbours: vLLM's own means covered both, so neither phase has them
            interleaved = setup["kind"] == "tap-toggle" and c == "1"
            assert e.get("interleaved", False) is interleaved, where
            # a loaded 2-core machine may deliver a whole short stream in one read (client gaps of 0);
            # vLLM's own per-token time below is the positive one
            assert all(math.isfinite(v) and v >= 0 for v in [*e["tpot_ms"].values(), *e["itl_ms"].values()]), where
            if not interleaved:
                assert e["server"].get("tpot_mean_ms", 0) > 0, where  # vLLM's own /metrics were read
            if setup["kind"] == "tap-toggle":
                scores = e["scores"]
                assert scores["coverage"] == 1.0 and scores["scored_tokens"] == e["output_tokens"], (where, scores)
                assert scores["requests_with_all_prompt_scores"] == scores["requests"], (where, scores)
                # the worker's own account of delivery during the phase (from /probex/health)
                delivery = e["delivery"]
                assert delivery["engine_thread"]["steps"] > 0 and delivery["engine_thread"]["hook_mean_ms"] > 0, where
                # staged through the score ring: the formatter's process consumed them, none was lost
                transfer = delivery["transfer"]
                assert transfer["consumer"] == "formatter" and transfer["submitted_steps"] > 0, (where, transfer)
                assert transfer["dropped_steps"] == 0 and transfer["message_errors"] == 0, (where, transfer)
                # every request's first content chunk asked for its prompt scores once
                assert delivery["prompt_waits"]["chunks"] == scores["requests"], (where, delivery)
            else:
                assert e["responses_with_probex_field"] == 0, where
        idle = setup["idle_ttft"]  # two requests, one at a time, after the concurrency phases
        assert idle["requests"] == 2 and idle["failed"] == 0 and idle["max_tokens"] == 2, (setup["label"], idle)
        assert all(math.isfinite(v) and v > 0 for v in idle["per_request_ttft_ms"]), (setup["label"], idle)
        assert idle["server"]["ttft_mean_ms"] > 0, (setup["label"], idle)  # vLLM's own /metrics
        # one request under vLLM's torch profiler, its trace found and read (a CPU build records no device events)
        profile = setup["profile"]
        assert profile["failed"] == 0 and "error" not in profile, (setup["label"], profile)
        assert (out / "profile" / profile["trace_path"]).is_file(), profile
        assert profile["device_events"] == 0 and profile["host_events"] > 0, profile
        if setup["kind"] == "tap-toggle":
            assert idle["scores"]["coverage"] == 1.0, (setup["label"], idle["scores"])
            # the worker's and the API server's accounts of the first tokens' path
            loop = idle["delivery"]["api_loop"]
            assert loop["intake_prompt_steps"]["count"] == 2 and loop["first_chunks"]["count"] == 2, loop
    assert set(result["idle_ttft"]["overhead_pct_vs_plain"]) == {"tap-toggle", "eager"}
    assert "TTFT at an idle engine (2 requests one at a time" in proc.stdout
    assert workload["profile_requests"] == 1 and "Device time from each set-up's profiled requests" in proc.stdout
    # dummy weights sample ids the SmolLM2 tokenizer (49152 tokens) lacks: served as empty text, counted all the same
    assert max(e["max_generated_token_id"] for s in result["setups"] for e in s["results"].values()) >= 49152
    tap = result["setups"][1]
    assert tap["checks"]["probex_probes_listed"] == 8 and tap["checks"]["probex_tapped_layers"] == [1, 2]
    assert "enforce_eager=True" in (out / "eager.log").read_text()
    for kind in ("tap-toggle_vs_plain", "eager_vs_plain"):
        assert set(result["overhead_pct"][kind]) == {"1", "2"}
    # tap-toggle: at two streams the tap was paused, ran, ran and was paused again on one
    # server (--toggle-first paused, two pairs there), at one stream paused and running once
    # (the default pairs); paused, its responses were stock vLLM's; running again, every token
    # was scored again; its first running phase is the set-up's own (results)
    assert result["workload"]["toggle_first"] == "paused"
    assert result["workload"]["toggle_pairs"] == {"default": 1, "2": 2}
    assert tap["toggle_first_paused"] is True and "tap-toggle (began paused)" in proc.stdout
    for c, phases in tap["toggle"].items():
        assert [p["paused"] for p in phases] == {"1": [True, False], "2": [True, False, False, True]}[c], c
        assert phases[1] == {"paused": False, **tap["results"][c]}, c
        for phase in phases:
            assert phase["failed"] == 0 and phase["output_tokens"] == phase["expected_output_tokens"], (c, phase)
            if phase["paused"]:
                assert phase["responses_with_probex_field"] == 0 and "scores" not in phase, c
            else:
                assert phase["scores"]["coverage"] == 1.0, (c, phase["scores"])
            # every streamed request's way through the API server, timed running and paused alike;
            # interleaved (one stream), the running phase's account holds its paused neighbour's too
            assert phase.get("interleaved", False) is (c == "1"), c
            if phase.get("interleaved") and phase["paused"]:
                assert "delivery" not in phase and "server" not in phase, c
                continue
            loop = phase["delivery"]["api_loop"]
            requests = phase["requests"] * (2 if phase.get("interleaved") else 1)
            assert all(loop[part]["count"] == requests for part in
                       ("request_way_in", "vllm_to_first_chunk", "first_chunk_out")), (c, phase["paused"], loop)
    assert set(result["toggle_overhead_pct"]) == {"1", "2"} and "The tap within one start" in proc.stdout
    assert "| 2 | the middleware's way in (first look to vLLM) | 2 |" in proc.stdout
    # and at an idle engine, request by request: three pairs (--idle-ttft-pairs; two idle
    # requests before them), each one running and one paused, ABBA
    toggled = tap["idle_ttft_toggle"]
    assert toggled["paused"] == [False, True, True, False, False, True] and toggled["failed"] == 0, toggled
    # one lead-in request ahead of them (a new connection, right after the counters' scrape), left out
    assert toggled["lead_in_requests"] == 1 and toggled["requests"] == 6 and toggled["wall_s"] > 0, toggled
    assert toggled["running_without_scores"] == 0 and toggled["paused_with_scores"] == 0, toggled
    assert toggled["scores"]["coverage"] == 1.0 and toggled["scores"]["requests"] == 3, toggled["scores"]
    assert all(math.isfinite(v) and v > 0 for v in toggled["per_request_ttft_ms"]), toggled
    # the worker timed each request's prefill forward (PROBEX_STEP_TIMING=1, prompts of 32 rows),
    # matched to the requests in order, its pause state the request's: TTFT split into the
    # forward's span and the rest
    assert "forward_spans_unmatched" not in toggled, toggled.get("forward_spans_unmatched")
    spans = toggled["per_request_span_ms"]
    assert len(spans) == 6 and all(0 < span < ttft for span, ttft in zip(spans, toggled["per_request_ttft_ms"]))
    # the way in (the client's send to the forward's launch, on the clock both processes read)
    # is a part of TTFT, as the span is
    way_in = toggled["per_request_way_in_ms"]
    assert all(0 < w < ttft - span for w, ttft, span in zip(way_in, toggled["per_request_ttft_ms"], spans)), way_in
    split = toggled["forward_split"]
    assert split["pairs"] == 3 and split["sd_ms"]["ttft"] > 0 and set(split) >= {"span", "rest", "way_in", "way_out"}
    assert "idle TTFT split, running over paused" in proc.stdout
    assert result["idle_ttft_toggle"]["all_starts"]["pairs"] == 3
    assert result["workload"]["idle_ttft_pairs"] == 3 and result["workload"]["idle_ttft_requests"] == 2
    assert "TTFT at an idle engine with the tap running over paused, request by request" in proc.stdout
    assert "| set-up | concurrency |" in proc.stdout
    if importlib.util.find_spec("matplotlib"):
        assert (out / "bench_engine_tpot.png").read_bytes()[:4] == b"\x89PNG"


def test_server_cpu_is_read_per_thread_from_proc_for_the_whole_process_group():
    """A child in its own group that burns CPU on a second thread and idles on its main one."""
    code = ("import threading, time\n"
            "def burn():\n    end = time.time() + 30\n    while time.time() < end: pass\n"
            "threading.Thread(target=burn, daemon=True).start()\ntime.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        time.sleep(0.3)
        before, began = be.group_cpu_ticks(proc.pid), time.monotonic()
        time.sleep(1.0)
        rows = be.group_cpu_cores(before, be.group_cpu_ticks(proc.pid), time.monotonic() - began)
    finally:
        proc.kill()
        proc.wait()
    (row,) = rows
    assert row["pid"] == proc.pid and row["name"].startswith("python")
    assert row["busiest_other_thread"] > 0.2 and row["main_thread"] < 0.1, row  # > 0.2: a loaded 2-core CI
    assert row["cores"] >= row["busiest_other_thread"]
    assert "main thread 0.0" in be.cpu_line(rows)


def test_worker_env_takes_probex_settings_only_and_reaches_worker_set_ups_only(tmp_path):
    env = be.parse_worker_env(["PROBEX_SCORE_WAIT_S=0", "PROBEX_SWITCH_INTERVAL_S=0.0005"])
    assert env == {"PROBEX_SCORE_WAIT_S": "0", "PROBEX_SWITCH_INTERVAL_S": "0.0005"}
    with pytest.raises(SystemExit):
        be.parse_worker_env(["VLLM_X=1"])
    plans = be.plan_setups(["plain", "tap"], tmp_path, [tmp_path / "p"], [], "default", worker_env=env)
    assert "PROBEX_SCORE_WAIT_S" not in plans[0].env_changes
    assert plans[1].env_changes["PROBEX_SCORE_WAIT_S"] == "0"


def test_the_op_only_set_up_turns_delivery_off_and_its_missing_scores_are_no_problem(tmp_path):
    plans = be.plan_setups(be.parse_setups("plain,tap,tap-op-only,tap-engine-consumer,tap-thread-consumer"), tmp_path,
                           [tmp_path / "p"], [], "default")
    assert [p.env_changes.get("PROBEX_DELIVERY") for p in plans] == [None, None, "off", None, None]
    assert [p.env_changes.get("PROBEX_SCORE_CONSUMER") for p in plans] == [None, None, None, "engine", "thread"]
    # The tap's default, the score ring, consumes in the formatter's process whatever the runner;
    # the consumer set-ups measure the ZMQ path (PROBEX_SCORE_RING=0), which takes the runner's
    # consumer: with vLLM choosing the runner, the bench cannot know it.
    assert [p.score_consumer for p in plans] == [None, "formatter", None, "engine", "thread"]
    assert [p.env_changes.get("PROBEX_SCORE_RING") for p in plans] == [None, None, None, "0", "0"]
    zmq = {"PROBEX_SCORE_RING": "0"}
    assert be.plan_setups(["tap"], tmp_path, [tmp_path / "p"], [], "default", worker_env=zmq)[0].score_consumer is None
    on_v2 = be.plan_setups(["plain", "tap", "tap-thread-consumer"], tmp_path, [tmp_path / "p"], [], "v2", worker_env=zmq)
    on_v1 = be.plan_setups(["tap"], tmp_path, [tmp_path / "p"], [], "v1", worker_env=zmq)
    assert [p.score_consumer for p in on_v2] == [None, "engine", "thread"] and on_v1[0].score_consumer == "engine"
    # Runner V1 reads the tokens through an async output only when it schedules asynchronously.
    synchronous_v1 = be.plan_setups(["tap"], tmp_path, [tmp_path / "p"], ["--no-async-scheduling"], "v1",
                                    worker_env=zmq)
    assert synchronous_v1[0].score_consumer == "thread"
    on_two_gpus = be.plan_setups(["tap"], tmp_path, [tmp_path / "p"], ["--tensor-parallel-size", "2"], "v2",
                                 worker_env=zmq)
    assert on_two_gpus[0].score_consumer == "thread"  # V2 reads tokens on another thread at TP > 1
    # What the worker decides from what the bench cannot see is not predicted (nor checked)
    for args in (["--pipeline-parallel-size", "2"], ["--distributed-executor-backend=mp"],
                 ["--speculative-config", "{}"], ["-dp", "2"]):
        assert be.plan_setups(["tap"], tmp_path, [tmp_path / "p"], args, "v1", worker_env=zmq)[0].score_consumer \
            is None, args
    # Without the score formatter there is no ring either: the runner's consumer again.
    direct = be.plan_setups(["tap-toggle-direct", "tap-toggle-zmq", "tap-toggle"], tmp_path, [tmp_path / "p"], [], "v2")
    assert [p.score_consumer for p in direct] == ["engine", "engine", "formatter"]
    consumer = be.analyze([_setup("plain", "plain", {"1": 5.0}), _setup("tap", "tap", {"1": 5.1}),
                           _setup("tap-thread-consumer", "tap-thread-consumer", {"1": 5.151})])["overhead_pct"]
    assert consumer["tap-thread-consumer_vs_tap"]["1"]["tpot_p50"] == pytest.approx(1.0)
    # The worker reports its consumer; a set-up that did not get the one planned for it is
    # flagged (e.g. a worker ignoring the setting, or another runner than the one asked for).
    tap_ok, tap_switched, experiment, unknown = (
        _setup("tap", "tap#1", {"1": 5.0}), _setup("tap", "tap#2", {"1": 5.0}),
        _setup("tap-thread-consumer", "tap-thread-consumer", {"1": 5.0}), _setup("tap", "tap#3", {"1": 5.0}))
    for setup, reported, expected in ((tap_ok, "engine", "engine"), (tap_switched, "thread", "engine"),
                                      (experiment, "thread", "thread"), (unknown, "thread", None)):
        setup["checks"]["probex_score_consumer"] = reported
        if expected:
            setup["checks"]["probex_score_consumer_expected"] = expected
    problems = be.find_problems([tap_ok, tap_switched, experiment, unknown])
    assert [p.split(":")[0] for p in problems if "consumed scores" in p] == ["tap#2"]
    assert "probex.cli" in plans[2].argv and "worker" in plans[2].argv
    run = _saved_run()
    unscored = dict(run["setups"][1]["results"]["1"]["scores"], scored_tokens=0, coverage=0.0,
                    requests_with_all_prompt_scores=0)
    op_only = _setup("tap-op-only", "tap-op-only", {"1": 5.0, "8": 6.0}, scores=unscored)
    op_only["checks"].update(probex_probes_listed=8, probex_probes_expected=8)
    tap = _setup("tap", "tap#9", {"1": 5.0, "8": 6.0}, scores=unscored)
    tap["checks"].update(probex_probes_listed=8, probex_probes_expected=8)
    problems = be.find_problems([op_only, tap])
    assert not [p for p in problems if p.startswith("tap-op-only")]
    assert any(p.startswith("tap#9") and "SCORES NOT FULLY DELIVERED" in p for p in problems)
    # ... but scores showing up there mean the setting never reached the worker.
    op_only["results"]["1"]["scores"] = dict(unscored, scored_tokens=5)
    assert any(p.startswith("tap-op-only c=1: scores were delivered") for p in be.find_problems([op_only]))


def test_side_by_side_set_ups_swap_gpus_every_round(tmp_path):
    # plain,tap,plain,tap on two GPUs: each set-up once on each GPU, and each round uses both.
    gpus = be.parse_gpus("0,1")
    plans = be.plan_setups(be.parse_setups("plain,tap,plain,tap"), tmp_path, [tmp_path / "p"], [], "default",
                           gpus=gpus)
    placed = [(p.label, p.env_changes["CUDA_VISIBLE_DEVICES"]) for p in plans]
    assert placed == [("plain#1", "0"), ("tap#1", "1"), ("plain#2", "1"), ("tap#2", "0")]
    rounds = be.rounds_of(plans, len(gpus))
    assert [[p.label for p in r] for r in rounds] == [["plain#1", "tap#1"], ["plain#2", "tap#2"]]
    # Three kinds twice on two GPUs: rounds cut across the kinds' cycles, and still every
    # kind meets both GPUs.
    kinds = be.parse_setups("plain,tap,tap-op-only,plain,tap,tap-op-only")
    placed = be.assign_gpus(kinds, gpus)
    assert placed == ["0", "1", "0", "1", "0", "1"] and be.unbalanced_kinds(kinds, placed, gpus) == []
    assert all(len(set(placed[i:i + 2])) == 2 for i in range(0, 6, 2))  # a round never shares a GPU
    assert be.assign_gpus(["plain", "tap", "eager"] * 3, ["0", "1", "2"]) == ["0", "1", "2", "1", "2", "0",
                                                                               "2", "0", "1"]
    # An order that cannot be balanced is named: plain always leads a round of one.
    assert be.unbalanced_kinds(["plain", "plain"], ["0", "0"], gpus) == ["plain"]
    # Without --gpus nothing is pinned and set-ups run one at a time.
    assert "CUDA_VISIBLE_DEVICES" not in be.plan_setups(["plain"], tmp_path, [], [], "default")[0].env_changes
    assert be.parse_gpus(None) == [] and be.rounds_of(plans, 1) == [[p] for p in plans]
    assert be.rounds_of(plans, len(be.parse_gpus(None))) == [[p] for p in plans]
    for bad in ("0,0", "a,1"):
        with pytest.raises(SystemExit):
            be.parse_gpus(bad)


def test_side_by_side_runs_plans_at_once_and_reports_a_lane_failure(tmp_path):
    import threading

    plans = be.plan_setups(["plain", "tap"], tmp_path, [tmp_path / "p"], [], "default", gpus=["0", "1"])
    both_started = threading.Barrier(2, timeout=10)  # breaks (and fails the lane) unless the two overlap
    ran = []

    def run_one(plan):
        both_started.wait()
        ran.append(plan.label)

    be.run_side_by_side(plans, run_one, stop_all=lambda: None)
    assert sorted(ran) == ["plain", "tap"]

    def broken(plan):
        if plan.kind == "tap":
            raise RuntimeError("lane bug")

    with pytest.raises(RuntimeError, match="lane bug"):
        be.run_side_by_side(plans, broken, stop_all=lambda: None)


def test_overhead_by_gpu_compares_each_set_up_with_plain_on_its_own_gpu():
    # GPU 1 is 4% faster than GPU 0; the tap costs 1% on each. Pooled over GPUs the design
    # still balances, but only the per-GPU figures show the two estimates.
    runs = [("plain", "plain#1", "0", 5.0), ("tap", "tap#1", "1", 4.848), ("plain", "plain#2", "1", 4.8),
            ("tap", "tap#2", "0", 5.05)]
    setups = []
    for kind, label, gpu, tpot in runs:
        setup = _setup(kind, label, {"1": tpot})
        setup["gpu"] = gpu
        setups.append(setup)
    by_gpu = be.analyze(setups)["tpot_p50_overhead_pct_by_gpu"]
    assert by_gpu["tap"]["0"]["1"] == pytest.approx(1.0) and by_gpu["tap"]["1"]["1"] == pytest.approx(1.0)
    assert "plain" not in by_gpu
    assert be.analyze([_setup("plain", "plain", {"1": 5.0}), _setup("tap", "tap", {"1": 5.1})])[
        "tpot_p50_overhead_pct_by_gpu"] == {}
    text = be.markdown_tables(dict(be.merge_runs([{"setups": setups, "versions": {}}])))
    assert "tap on GPU 0 c=1: +1.0%" in text


def test_overheads_over_starts_come_with_their_95_percent_interval():
    """Each start one sample: plain 10.0/10.2/9.8, tap 1% above start by start. The interval
    is Welch's (df = 4 here: two equal relative spreads), computed by hand; "steady" drops the
    run's first start (plain#1), leaving plain two."""
    plain = [_setup("plain", f"plain#{i}", {"1": v}) for i, v in enumerate((10.0, 10.2, 9.8), 1)]
    tap = [_setup("tap", f"tap#{i}", {"1": v * 1.01}) for i, v in enumerate((10.0, 10.2, 9.8), 1)]
    setups = [s for pair in zip(plain, tap) for s in pair]  # plain#1 ran first
    starts = be.overhead_over_starts(setups)
    row = starts["all"]["tap"]["1"]
    assert (row["starts"], row["plain_starts"]) == (3, 3)
    tpot = row["tpot_p50"]
    rel_se = math.sqrt(2 * (0.04 / 3) / 100.0)  # sample variance 0.04 of means 10 (and 10.1, relatively the same)
    assert tpot["pct"] == pytest.approx(1.0) and tpot["df"] == pytest.approx(4.0)
    assert tpot["se_pct"] == pytest.approx(1.01 * rel_se * 100)
    assert tpot["ci95_pct"] == pytest.approx([1.0 - 2.78 * tpot["se_pct"], 1.0 + 2.78 * tpot["se_pct"]])
    assert row["ttft_p50"]["pct"] == pytest.approx(0.0)  # every start's TTFT is 20 ms here
    steady = starts["steady"]["tap"]["1"]
    assert (steady["starts"], steady["plain_starts"]) == (3, 2)
    # one start per kind: no interval; side by side (--gpus): no single first start
    assert be.overhead_over_starts(setups[:2]) == {}
    assert "steady" not in be.overhead_over_starts([dict(s, gpu="0") for s in setups])
    # runs merged by --reanalyze: each run's first start is left out of "steady"
    merged = be.merge_runs([{"setups": setups[:4]}, {"setups": setups[4:] + [_setup("plain", "p", {"1": 10.0})]}])
    steady = merged["overhead_over_starts"]["steady"]["tap"]["1"]
    assert (steady["starts"], steady["plain_starts"]) == (3, 2)  # plain#1 and plain#3 (each run's first) left out
    # a start that lost its metric is left out rather than turning the row into NaN; no spread: no df
    lost = _setup("tap", "tap#4", {"1": 10.1})
    lost["results"]["1"]["tpot_ms"]["p50"] = math.nan
    flat = [_setup("plain", "a", {"1": 10.0}), _setup("plain", "b", {"1": 10.0}), _setup("tap", "c", {"1": 10.1}),
            _setup("tap", "d", {"1": 10.1}), lost]
    row = be.overhead_over_starts(flat)["all"]["tap"]["1"]
    assert row["tpot_p50"]["pct"] == pytest.approx(1.0) and row["tpot_p50"]["df"] is None
    json.dumps(row, allow_nan=False)
    table = be.markdown_tables({"setups": setups, "workload": {}, **be.analyze(setups)})
    lo, hi = tpot["ci95_pct"]
    assert f"| tap | all | 1 | 3 (3) | +1.0% | {lo:+.1f}% … {hi:+.1f}% |" in table


def test_the_tap_toggled_within_one_start_is_compared_phase_against_phase(tmp_path):
    """tap-toggle: the running phases' mean over the paused phases' mean, per start and
    concurrency, then over starts; a paused phase that carried scores is a problem, as is a
    running phase that did not deliver them. Its worker gets the run's admin token."""
    def toggled(label, running, paused):
        setup = _setup("tap-toggle", label, {"1": running[0]})
        phases = [{"paused": False, **setup["results"]["1"]}]
        for r, p in zip(running[1:] + [None], paused):
            phases.append({"paused": True, **_entry(p)})
            if r is not None:
                phases.append({"paused": False, **_entry(r)})
        setup["toggle"] = {"1": phases}
        return setup

    starts = [toggled("tap-toggle#1", [5.05, 5.06], [5.0, 5.01]), toggled("tap-toggle#2", [4.02, 4.02], [4.0, 4.0])]
    # the order the bench runs them in: running and paused, ABBA, so neither sits earlier on average
    assert be.toggle_order(2) == [False, True, True, False] and be.toggle_order(1) == [False, True]
    assert be.toggle_order(3) == [False, True, True, False, False, True]
    assert be.toggle_order(2, first_paused=True) == [True, False, False, True]
    # which starts begin paused: by default every second tap-toggle start, so the position after
    # the warm-up falls on both states
    def first_paused(kinds, **kw):
        return [(p.label, p.toggle_first_paused) for p in be.plan_setups(kinds, tmp_path, [tmp_path / "p"], [], "v2", **kw)]
    kinds = ["tap-toggle", "plain", "tap-toggle", "tap-toggle"]
    assert first_paused(kinds) == [("tap-toggle#1", False), ("plain", False), ("tap-toggle#2", True),
                                   ("tap-toggle#3", False)]
    assert [f for _, f in first_paused(kinds, toggle_first="paused")] == [True, False, True, True]
    assert [f for _, f in first_paused(kinds, toggle_first="running")] == [False, False, False, False]
    with pytest.raises(ValueError, match="toggle_first must be one of"):
        be.plan_setups(kinds, tmp_path, [], [], "v2", toggle_first="first")
    # each phase's prompts: the first running phase is the set-up's own, on the prompts every
    # set-up gets (own seed); every other phase fresh ones, in both orders and at any pairs
    for pairs in (1, 2, 3):
        for first in (False, True):
            plan = be.toggle_phase_plan(be.toggle_order(pairs, first), own_seed=17, seed=0, concurrency=8)
            assert [paused for paused, _, _ in plan] == be.toggle_order(pairs, first)
            assert [own for _, _, own in plan] == [number == int(first) for number in range(2 * pairs)]
            assert plan[int(first)][1] == 17
            seeds = [phase_seed for _, phase_seed, _ in plan]
            assert len(set(seeds)) == len(seeds), (pairs, first, seeds)
    # and apart from other concurrencies' and the bench's fixed seed offsets
    other = {s for c in (1, 8, 64, 500) for _, s, own in be.toggle_phase_plan(be.toggle_order(3), 17, 0, c) if not own}
    assert len(other) == 4 * 5 and not other & {be.IDLE_TTFT_SEED, be.PROFILE_SEED, be.TOGGLE_IDLE_SEED}
    with pytest.raises(ValueError, match="at least 1"):
        be.toggle_order(0)
    # --toggle-pairs: one number for every concurrency, or that number and some concurrencies' own
    assert be.parse_toggle_pairs("3") == {None: 3} and be.toggle_pairs_record({None: 3}) == 3
    assert be.parse_toggle_pairs("3, 8:6,64:8") == {None: 3, 8: 6, 64: 8}
    assert be.toggle_pairs_record({None: 3, 64: 8}) == {"default": 3, "64": 8}
    assert be.parse_toggle_pairs("3,64:8", concurrencies=[1, 8, 64]) == {None: 3, 64: 8}
    with pytest.raises(ValueError, match=r"names concurrency 46, which the run does not have \(--concurrency 1,8,64\)"):
        be.parse_toggle_pairs("3,46:8", concurrencies=[1, 8, 64])
    for bad, message in (("64:8", "needs a number for the concurrencies it does not name"),
                         ("3,64:0", "at least 1"), ("3,64:8,64:4", "names 64 twice"), ("3,4", "names the default twice"),
                         ("3,x:2", "neither N nor CONCURRENCY:N"), ("", "neither N nor CONCURRENCY:N")):
        with pytest.raises(ValueError, match=message):
            be.parse_toggle_pairs(bad)
    from probex.cli import main

    with pytest.raises(SystemExit, match="--idle-ttft-pairs must be 0 or more"):  # before any server starts
        main(["bench", "engine", "--idle-ttft-pairs", "-1", "--tokenizer-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="names 8 twice"):
        main(["bench", "engine", "--toggle-pairs", "2,8:3,8:4", "--tokenizer-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="names concurrency 16, which the run does not have"):
        main(["bench", "engine", "--toggle-pairs", "2,16:3", "--tokenizer-dir", str(tmp_path)])
    result = be.toggle_overhead(starts)["1"]
    first = (5.055 / 5.005 - 1) * 100
    assert result["starts"] == 2 and result["tpot_p50_per_start"] == pytest.approx([first, 0.5])
    assert result["tpot_p50"] == pytest.approx((first + 0.5) / 2)
    assert len(result["ttft_p50_per_start"]) == 2
    assert result["ttft_p50"] == pytest.approx(np.mean(result["ttft_p50_per_start"]))
    # each running phase against its paused neighbour, over both starts: the goals' interval
    pairs = [(5.05 / 5.0 - 1) * 100, (5.06 / 5.01 - 1) * 100, 0.5, 0.5]
    assert result["phase_pairs"]["tpot_p50"] == pytest.approx(pairs)
    half = be._t_975(3) * np.std(pairs, ddof=1) / 2
    assert result["ci95_pct"]["tpot_p50"] == pytest.approx([result["tpot_p50"] - half, result["tpot_p50"] + half])
    assert result["ci95_pct"]["ttft_p50"] == pytest.approx([0.0, 0.0])  # every phase's TTFT the same
    # one pair has no scatter to read; a NaN pair is not a sample
    assert be.toggle_overhead([toggled("one", [5.05], [5.0])])["1"]["ci95_pct"]["tpot_p50"] is None
    assert be.phase_pair_interval(1.0, [1.0, math.nan]) is None and be.phase_pair_interval(math.nan, [1, 2]) is None
    table = be.markdown_tables({"setups": starts, "workload": {}, **be.analyze(starts)})
    assert f"| 1 | 2 | {be._pct((first + 0.5) / 2)} |" in table and "The tap within one start" in table
    # no phase carried vLLM's own ITL: no engine-side column value
    assert "vllm_itl_mean" not in result and "| — |" in table
    # with it in every phase: the engine's ITL running over paused, per start then over starts
    # (start 1 running 5.0 / 5.2 against paused 5.0 / 5.0: +2%; start 2 equal: 0%)
    for start, (running_itl, paused_itl) in zip(starts, (([5.0, 5.2], [5.0, 5.0]), ([4.0, 4.0], [4.0, 4.0]))):
        phases = start["toggle"]["1"]
        for phase, value in zip([p for p in phases if not p["paused"]], running_itl):
            phase["server"] = {"itl_mean_ms": value}
        for phase, value in zip([p for p in phases if p["paused"]], paused_itl):
            phase["server"] = {"itl_mean_ms": value}
    assert be.toggle_overhead(starts)["1"]["vllm_itl_mean"] == pytest.approx((2.0 + 0.0) / 2)
    del starts[1]["toggle"]["1"][2]["server"]  # one start without it: no mean over starts
    assert "vllm_itl_mean" not in be.toggle_overhead(starts)["1"]
    # the API server's load, every phase's reading by state and start: tokens per chunk, and
    # its event loop's thread (the server's own process, by pid; vLLM's engine core and a
    # helper left out)
    for number, phase in enumerate(starts[0]["toggle"]["1"]):
        phase["tokens_per_chunk"] = 2.0 if not phase["paused"] else 1.25
        phase["server_pid"] = 10
        phase["server_cpu"] = [{"pid": 9, "name": "python3", "main_thread": 0.7},
                               {"pid": 10, "name": "python3", "main_thread": 0.6 + number / 100},
                               {"pid": 11, "name": "VLLM::EngineCore", "main_thread": 0.9}]
    load = be.toggle_overhead(starts)["1"]["api_server"]
    assert load["tokens_per_chunk"]["running"][0] == [2.0, 2.0] and load["tokens_per_chunk"]["paused"][0] == [1.25, 1.25]
    assert load["main_thread_cores"]["running"][0] == pytest.approx([0.60, 0.62])  # phases R, P, R, P here
    assert load["main_thread_cores"]["paused"][0] == pytest.approx([0.61, 0.63])
    assert all(math.isnan(v) for v in load["main_thread_cores"]["running"][1])  # start 2 recorded none
    table = be.markdown_tables({"setups": starts, "workload": {}, **be.analyze(starts)})
    assert "| 1 | 2.00, 2.00; n/a, n/a | 1.25, 1.25; n/a, n/a | 0.60, 0.62; n/a, n/a | 0.61, 0.63; n/a, n/a |" in table
    # TTFT in the same phases: each phase's p50 by state and start, and vLLM's split, means over
    # every phase of a state, all starts together (start 1's phases run R, P, R, P)
    for phase, (ttft, queue, prefill) in zip(starts[0]["toggle"]["1"], ((300, 20, 130), (150, 5, 90),
                                                                       (160, 5, 100), (200, 10, 90))):
        phase["server"] = {"ttft_mean_ms": ttft, "queue_mean_ms": queue, "prefill_mean_ms": prefill}
    assert be.phase_ttft_split(starts[0]["toggle"]["1"][0]) == {"ttft": 300, "queue": 20, "prefill": 130, "api": 150}
    assert "vllm_ttft_split" not in be.toggle_overhead(starts)["1"]  # start 2's phases have no queue or prefill
    for phase in starts[1]["toggle"]["1"]:
        phase["server"] = {"ttft_mean_ms": 100.0, "queue_mean_ms": 0.0, "prefill_mean_ms": 60.0}
    ttft = be.toggle_overhead(starts)["1"]
    split = ttft["vllm_ttft_split"]
    assert split["running"] == pytest.approx({"ttft": 165.0, "queue": 6.25, "prefill": 87.5, "api": 71.25})
    assert split["paused"] == pytest.approx({"ttft": 137.5, "queue": 3.75, "prefill": 75.0, "api": 58.75})
    assert ttft["ttft_p50_ms"]["running"][0] == [p["ttft_ms"]["p50"] for p in starts[0]["toggle"]["1"] if not p["paused"]]
    table = be.markdown_tables({"setups": starts, "workload": {}, **be.analyze(starts)})
    assert "| 165.0 / 137.5 | 6.2 / 3.8 | 87.5 / 75.0 | 71.2 / 58.8 |" in table
    # several API server processes (vLLM's --api-server-count): the busiest of them
    phase = starts[0]["toggle"]["1"][0]
    phase["server_cpu"] += [{"pid": 12, "name": "VLLM::APIServer", "main_thread": 0.3},  # /proc cuts names to 15
                            {"pid": 13, "name": "VLLM::APIServer", "main_thread": 0.65}]
    assert be.api_server_main_thread_cores(phase) == pytest.approx(0.65)
    # a phase saved before the pid was: the busiest process that is not vLLM's engine core
    del phase["server_pid"]
    assert be.api_server_main_thread_cores(phase) == pytest.approx(0.7)
    starts[0]["toggle"]["1"][1]["responses_with_probex_field"] = 3
    starts[0]["toggle"]["1"][2]["scores"] = {"coverage": 0.5, "scored_tokens": 1, "generated_tokens": 2,
                                             "requests_with_all_prompt_scores": 1, "requests": 1}
    problems = be.find_problems(starts)
    assert any("tap-toggle#1 c=1 phase 2 (paused): responses carry a probex field" in p for p in problems)
    assert any("tap-toggle#1 c=1 phase 3 (running): SCORES NOT FULLY DELIVERED" in p for p in problems)
    # a start that began paused: its first phase is checked as stock vLLM's, its second (the
    # set-up's own, results) once, as results
    began_paused = toggled("tap-toggle#3", [4.02, 4.02], [4.0, 4.0])
    running, paused = ([p for p in began_paused["toggle"]["1"] if p["paused"] is state] for state in (False, True))
    began_paused["toggle"]["1"] = [paused[0], running[0], running[1], paused[1]]
    began_paused["toggle"]["1"][0]["responses_with_probex_field"] = 5
    began_paused["results"]["1"]["failed"] = running[0]["failed"] = 2
    assert be.toggle_began_paused(began_paused) and not be.toggle_began_paused(starts[1])
    problems = be.find_problems([began_paused])
    assert any("tap-toggle#3 c=1 phase 1 (paused): responses carry a probex field" in p for p in problems), problems
    assert sum("2 failed requests" in p for p in problems) == 1 and "tap-toggle#3 c=1: 2 failed" in " ".join(problems)
    table = be.markdown_tables({"setups": [starts[0], began_paused], "workload": {}, **be.analyze([starts[0], began_paused])})
    assert "tap-toggle#1 (began running), tap-toggle#3 (began paused)." in table
    assert "has its second phase as the set-up's own" in table and "Unequal numbers" not in table
    (plan,) = be.plan_setups(["tap-toggle"], tmp_path, [tmp_path / "p"], [], "default")
    assert plan.env_changes["PROBEX_ADMIN_TOKEN"] == be.TOGGLE_ADMIN_TOKEN and len(be.TOGGLE_ADMIN_TOKEN) == 32
    # a save from another lane (--gpus) copies the growing parts: what its lane adds later is not in it
    snapshot = be.record_snapshot(began_paused)
    began_paused["toggle"]["8"] = []
    began_paused["toggle"]["1"].append({"paused": True})
    assert set(snapshot["toggle"]) == {"1"} and len(snapshot["toggle"]["1"]) == 4


def test_the_chart_has_a_colour_and_a_name_for_every_set_up_kind(tmp_path):
    setups = [_setup(kind, kind, {"1": 5.0, "8": 6.0}) for kind in be.KINDS]
    result = {"setups": setups, "versions": {"gpu": "NVIDIA H200"}, "probes": [{}] * 8, **be.analyze(setups)}
    assert be.write_png(result, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"
    # a run of idle requests alone (--concurrency "") has no TPOT to chart: no chart, no failure
    idle_only = [_setup("tap-toggle", "tap-toggle", {})]
    result = {"setups": idle_only, "versions": {"gpu": "NVIDIA H200"}, "probes": [{}] * 8, **be.analyze(idle_only)}
    assert not be.write_png(result, tmp_path / "idle.png") and not (tmp_path / "idle.png").exists()


def test_idle_requests_alternate_the_tap_abba_and_pair_neighbours():
    assert [be.idle_toggle_paused(n) for n in range(8)] == [False, True, True, False, False, True, True, False]
    # running 11 ms against paused 10 ms in every pair, give or take 0.5 ms: +10% with a tight interval
    pairs = [(11.0 + d, 10.0 + d) for d in (-0.5, 0.0, 0.5, 0.25, -0.25, 0.1)]
    result = be.paired_ttft_overhead(pairs + [(math.nan, 10.0)])
    assert result["pairs"] == 6 and result["pct"] == pytest.approx(100 * 1.0 / result["paused_mean_ms"])
    assert result["ci95_pct"][0] == pytest.approx(result["pct"]) == pytest.approx(result["ci95_pct"][1])
    noisy = be.paired_ttft_overhead([(10.0, 11.0), (12.0, 10.0), (10.5, 10.0), (10.0, 10.5)])
    assert noisy["ci95_pct"][0] < 0 < noisy["ci95_pct"][1]
    # differences -1, +2, +0.5, -0.5 ms: SD 1.323 ms, 12.75% of the paused mean 10.375 ms (the
    # running mean is 10.625); a ±0.5% interval needs (1.96 x 12.75 / 0.5)^2 pairs, a tight
    # series far fewer
    assert noisy["difference_sd_pct"] == pytest.approx(1.3229 / 10.375 * 100, rel=1e-3)
    assert noisy["pairs_for_half_width"] == math.ceil((1.96 * noisy["difference_sd_pct"] / 0.5) ** 2)
    assert noisy["pairs_for_half_width"] > 1000 > result["pairs_for_half_width"]
    assert be.paired_ttft_overhead([(1.0, 1.0)]) == {"pairs": 1}
    # each pair is read by its own states, whichever came first; two requests of one state are refused
    assert be.toggled_pairs([11.0, 10.0, 20.0, 22.0], [False, True, True, False]) == [(11.0, 10.0), (22.0, 20.0)]
    with pytest.raises(ValueError, match="same state"):
        be.toggled_pairs([1.0, 2.0], [True, True])
    with pytest.raises(ValueError, match="pairs"):
        be.toggled_pairs([1.0, 2.0, 3.0], [False, True, False])
    # a run's summary pools every start's pairs, each request put in its pair by its own state
    setups = [{"label": f"tap-toggle#{i}", "kind": "tap-toggle", "results": {}, "checks": {},
               "idle_ttft_toggle": {"paused": [False, True, True, False], "per_request_ttft_ms": [11.0, 10.0, 10.0, 11.0],
                                    "running_over_paused": be.paired_ttft_overhead([(11.0, 10.0), (11.0, 10.0)])}}
              for i in (1, 2)]
    summary = be.toggled_idle_ttft_summary(setups)
    assert summary["all_starts"]["pairs"] == 4 and summary["all_starts"]["pct"] == pytest.approx(10.0)
    assert summary["over_starts"]["starts"] == 2 and summary["over_starts"]["ci95_pct"] == pytest.approx([10.0, 10.0])
    assert "over_starts_by_rank" not in summary  # two pairs a start: too few for a rank reading
    assert [s["label"] for s in summary["per_start"]] == ["tap-toggle#1", "tap-toggle#2"]
    table = be.markdown_tables({"setups": setups, "workload": {}, **be.analyze(setups)})
    assert "| 2 | 4 | 11.00 | 10.00 | +10.00% |" in table


def test_idle_pairs_are_also_read_by_rank():
    """The Hodges–Lehmann shift and its Wilcoxon interval, found by bisection, equal the
    textbook computation over all pairwise means; a few pairs that carry a jump of the host's
    state pull the mean and widen its interval, not the rank reading."""
    rng = np.random.default_rng(7)
    assert math.isnan(be.hodges_lehmann_shift(rng.standard_normal(5))[1][0])  # too few for a 95% interval
    for n in (6, 40, 301):
        differences = rng.standard_t(2, n) + 0.3
        i, j = np.triu_indices(n)
        walsh = np.sort((differences[i] + differences[j]) / 2)
        k = math.floor(n * (n + 1) / 4 - 1.96 * math.sqrt(n * (n + 1) * (2 * n + 1) / 24))
        shift, (low, high) = be.hodges_lehmann_shift(differences)
        assert shift == pytest.approx(np.median(walsh), abs=1e-9)
        assert (low, high) == pytest.approx((walsh[k], walsh[len(walsh) - 1 - k]), abs=1e-9)
    # ties (equal magnitudes) share a rank and still give the median of the pairwise means
    tied = np.array([1.0, 1.0, -1.0, 2.0, 2.0, 0.5])
    i, j = np.triu_indices(len(tied))
    assert be.hodges_lehmann_shift(tied)[0] == pytest.approx(np.median((tied[i] + tied[j]) / 2), abs=1e-9)
    assert math.isnan(be.hodges_lehmann_shift([1.0])[0])
    # 200 pairs 0.3 ms apart give or take 0.2 ms, and 20 that straddled a 4 ms change of state
    steady = [(30.3 + e, 30.0) for e in rng.normal(0, 0.2, 200)]
    jumps = [(34.3, 30.0) if n % 2 else (30.3, 34.0) for n in range(20)]
    clean, noisy = be.paired_ttft_overhead(steady), be.paired_ttft_overhead(steady + jumps)
    assert clean["hodges_lehmann"]["pct"] == pytest.approx(1.0, abs=0.1)
    assert noisy["hodges_lehmann"]["pct"] == pytest.approx(1.0, abs=0.15)
    ranked_width = noisy["hodges_lehmann"]["ci95_pct"][1] - noisy["hodges_lehmann"]["ci95_pct"][0]
    assert ranked_width < (noisy["ci95_pct"][1] - noisy["ci95_pct"][0]) / 3
    setups = [{"label": "tap-toggle#1", "kind": "tap-toggle", "results": {}, "checks": {},
               "idle_ttft_toggle": {"paused": [False, True] * len(steady),
                                    "per_request_ttft_ms": [x for pair in steady for x in pair],
                                    "running_over_paused": clean}}]
    table = be.markdown_tables({"setups": setups, "workload": {}, **be.analyze(setups)})
    assert "The same pairs by rank (Hodges–Lehmann shift" in table
    over = be.toggled_idle_ttft_summary([dict(setups[0], label=f"tap-toggle#{i}") for i in (1, 2)])
    assert over["over_starts_by_rank"]["pct"] == pytest.approx(clean["hodges_lehmann"]["pct"])
    assert f"by start {be._pct2(clean['hodges_lehmann']['pct'])}." in table


def test_a_phase_reads_the_engine_consumers_waits_for_tokens():
    def health(count, wait_s, ready, large_count, large_wait_s, large_ready, steps):
        return {"engine_thread": {"steps": steps, "hook_s": steps * 0.0002, "layout_s": 0.0,
                                  "token_reads": {"count": count, "wait_s": wait_s, "ready": ready,
                                                  "large_count": large_count, "large_wait_s": large_wait_s,
                                                  "large_ready": large_ready}}}

    delta = be.delivery_delta(health(10, 0.01, 2, 1, 0.0, 1, 10), health(110, 0.11, 42, 11, 0.0005, 9, 110))
    reads = delta["engine_thread"]
    assert reads["token_reads"] == {"count": 100, "wait_mean_ms": pytest.approx(1.0), "ready_share": pytest.approx(0.4)}
    assert reads["prefill_token_reads"] == {"count": 10, "wait_mean_ms": pytest.approx(0.05),
                                            "ready_share": pytest.approx(0.8)}
    line = be.delivery_line(delta)
    assert "ready by then in 40% of 100 steps" in line and "ready by then in 80% of 10 prefill steps" in line


def test_the_relay_counters_of_several_api_server_processes_are_summed():
    """With --api-server-count N each process counts the requests it relayed: a phase's
    delivery figures are those of all of them together; the worker's own parts come once."""
    def health(pid, loop_count, loop_total, loop_max, calls, waited_s, messages):
        return {"transfer": {"steps": 10}, "api_server": {"pid": pid, "count": 2},
                "score_loop_time": {"chunks_spliced": {"count": loop_count, "total_s": loop_total, "max_s": loop_max}},
                "score_waits": {"tokens": {"calls": calls, "waited": 1, "waited_s": waited_s, "max_s": waited_s}},
                "score_messages_received": messages, "score_messages_lost": pid - 7, "score_steps_lost": 1}

    merged = be.merge_process_health([health(7, 100, 0.002, 0.0001, 50, 0.01, 30), health(8, 300, 0.004, 0.0003, 70, 0.02, 30)])
    assert merged["score_messages_lost"] == 1 and merged["score_steps_lost"] == 2  # each process's own
    assert merged["score_loop_time"]["chunks_spliced"] == {"count": 400, "total_s": pytest.approx(0.006), "max_s": 0.0003}
    assert merged["score_waits"]["tokens"] == {"calls": 120, "waited": 2, "waited_s": pytest.approx(0.03), "max_s": 0.02}
    assert merged["score_messages_received"] == 30 and merged["transfer"] == {"steps": 10}  # each got every one
    assert merged["api_server"]["processes"] == 2 and merged["api_server"]["pids"] == [7, 8]
    single = health(7, 1, 0.1, 0.1, 1, 0.0, 1)
    assert be.merge_process_health([single]) == single
    # a phase whose two snapshots heard from different processes: no relay figures from them
    later = be.merge_process_health([health(7, 200, 0.004, 0.0001, 90, 0.02, 60), health(8, 500, 0.006, 0.0003, 99, 0.03, 60)])
    delta = be.delivery_delta(merged, later)
    assert delta["api_loop"]["chunks_spliced"]["count"] == 300 and delta["tokens_waits"]["chunks"] == 69
    partial = be.delivery_delta(merged, be.merge_process_health([health(7, 200, 0.004, 0.0001, 90, 0.02, 60)]))
    assert partial.get("relay_processes_differ") and "api_loop" not in partial and "tokens_waits" not in partial


def test_the_run_is_held_against_the_taps_goals_within_one_start_where_it_can():
    """The goals table: TPOT p50 ≤ +0.5% at 1 stream and ≤ +1% elsewhere, TTFT ≤ +1%, read
    within one start where tap-toggle ran, else tap over plain across starts; a missing
    reading fails its goal; the idle pairs pass on the point estimate with the interval said."""
    toggled = {"1": {"starts": 1, "tpot_p50": 0.42, "ttft_p50": -1.1},
               "8": {"starts": 1, "tpot_p50": 0.9, "ttft_p50": 0.2},
               "64": {"starts": 1, "tpot_p50": -0.1, "ttft_p50": -1.7}}
    idle = {"per_start": [{"label": "tap-toggle"}], "all_starts": {"pairs": 600, "pct": 0.05, "ci95_pct": [-0.44, 0.54]}}
    eager = {"eager_vs_plain": {"64": {"tpot_p50": 99.9}, "8": {"tpot_p50": 261.8}, "1": {"tpot_p50": 232.3}}}
    across = {"tap_vs_plain": {"1": {"tpot_p50": 3.0, "ttft_p50": 0.0}}}
    goals = be.goal_readings({"toggle_overhead_pct": toggled, "idle_ttft_toggle": idle,
                              "overhead_pct": {**eager, **across}})
    assert goals["all_met"] is True
    assert [(r["measure"], r["concurrency"], r["goal_pct"]) for r in goals["rows"]] == [
        ("TPOT p50", "1", 0.5), ("TTFT p50 under load", "1", 1.0), ("TPOT p50", "8", 1.0),
        ("TTFT p50 under load", "8", 1.0), ("TPOT p50", "64", 1.0), ("TTFT p50 under load", "64", 1.0),
        ("TTFT at an idle engine", "idle", 1.0)]
    assert {r["source"] for r in goals["rows"][:6]} == {"within the start"}  # not tap_vs_plain's +3%
    assert goals["rows"][-1]["interval_under_goal"] is True
    assert list(goals["eager_tpot_p50_pct"]) == ["1", "8", "64"]
    table = "\n".join(be.goal_lines(goals))
    assert "| TPOT p50 | 1 | +0.42% | ≤ +0.5% | yes | within the start |" in table
    assert "+0.05% (95% -0.44% … +0.54%, 600 pairs)" in table
    assert "+232.3% at 1, +261.8% at 8, +99.9% at 64" in table and table.endswith("Every goal met.")

    # 0.6% at one stream is over that concurrency's own goal, not over 8's
    toggled["1"]["tpot_p50"] = 0.6
    goals = be.goal_readings({"toggle_overhead_pct": toggled, "idle_ttft_toggle": idle})
    assert goals["all_met"] is False and [r["met"] for r in goals["rows"]].count(False) == 1
    assert "| TPOT p50 | 1 | +0.60% | ≤ +0.5% | **no** |" in "\n".join(be.goal_lines(goals))
    # a missing reading fails; an idle interval past the goal is said, though the estimate meets it
    toggled["1"]["tpot_p50"], toggled["64"]["ttft_p50"] = 0.4, math.nan
    idle["all_starts"]["ci95_pct"] = [-0.2, 1.3]
    idle["per_start"].append({"label": "tap-toggle#2"})
    goals = be.goal_readings({"toggle_overhead_pct": toggled, "idle_ttft_toggle": idle})
    assert goals["all_met"] is False and [r["concurrency"] for r in goals["rows"] if not r["met"]] == ["64"]
    assert goals["rows"][-1]["source"] == "pairs within each of 2 starts, pooled"
    del toggled["64"]
    lines = be.goal_lines(be.goal_readings({"toggle_overhead_pct": toggled, "idle_ttft_toggle": idle}))
    assert lines[-1] == ("Every goal met; the 95% interval of the idle TTFT reaches across the goal: more pairs or "
                         "starts would show which side it is.")
    assert any("4 of the rows read within starts rest on one phase pair each" in line for line in lines)
    # phase pairs (two or more): their interval beside the within-start rows, and how many
    # pairs would clear the goal where it straddles it
    toggled["8"].update(starts=2, phase_pairs={"tpot_p50": [0.5, 1.3], "ttft_p50": [-3.0, -2.0]},
                        tpot_p50=0.9, ttft_p50=-2.5,
                        ci95_pct={"tpot_p50": be.phase_pair_interval(0.9, [0.5, 1.3]),
                                  "ttft_p50": be.phase_pair_interval(-2.5, [-3.0, -2.0])})
    idle["all_starts"].update(pct=1.3, ci95_pct=[1.1, 1.6])  # wholly over its goal: not in the verdict's list
    goals = be.goal_readings({"toggle_overhead_pct": toggled, "idle_ttft_toggle": idle})
    tpot8, ttft8 = [r for r in goals["rows"] if r["concurrency"] == "8"]
    assert tpot8["met"] and not (tpot8["interval_under_goal"] or tpot8["interval_over_goal"])
    def half_width(n, pairs):  # phase_pair_interval's half-width at n pairs of the same scatter
        return be._t_975(n - 1) * np.std(pairs, ddof=1) / math.sqrt(n)
    n = tpot8["pairs_to_clear"]
    assert tpot8["pairs"] == 2 and half_width(n, [0.5, 1.3]) <= 0.1 < half_width(n - 1, [0.5, 1.3])
    # past the t table's last row the count is closed-form (a hair's margin must not spin)
    far = be.pairs_to_clear(1.0, 1.5, [0.0, 200.0])
    assert far > 100_000 and half_width(far, [0.0, 200.0]) <= 0.5 < half_width(far - 1, [0.0, 200.0])
    # -2.5 ± 6.4 crosses +1% at two pairs; three, at t = 4.3, would clear it
    assert ttft8["met"] and ttft8["ci95_pct"][1] > 1.0 and ttft8["pairs_to_clear"] == 3
    assert goals["rows"][-1]["interval_over_goal"] is True and goals["all_met"] is False
    lines = be.goal_lines(goals)
    table = "\n".join(lines)
    assert "| TPOT p50 | 8 | +0.90% (95% -4.18% … +5.98%, 2 phase pairs) | ≤ +1% | yes | within each start, mean of 2 |" in table
    assert f"TPOT p50 at 8 about {n}, TTFT p50 under load at 8 about 3." in table
    assert lines[-1] == ("Not every goal met; the 95% interval of TPOT p50 at 8, TTFT p50 under load at 8 reach across "
                         "the goal: more pairs or starts would show which side they are.")
    # a pair without a reading (NaN) is not one of the samples the row says it rests on
    toggled["8"]["phase_pairs"]["tpot_p50"].append(math.nan)
    goals = be.goal_readings({"toggle_overhead_pct": toggled, "idle_ttft_toggle": idle})
    assert [r["pairs"] for r in goals["rows"] if r["concurrency"] == "8"] == [2, 2]
    # without tap-toggle: tap over plain across starts; nothing to read: no verdict
    goals = be.goal_readings({"overhead_pct": across})
    assert [(r["source"], r["met"]) for r in goals["rows"]] == [("tap over plain, across starts", False),
                                                                ("tap over plain, across starts", True)]
    assert be.goal_readings({}) == {"rows": [], "all_met": None, "eager_tpot_p50_pct": {}}
    assert be.goal_lines(be.goal_readings({})) == []
    # the table says how the phases' requests arrived (runs saved before the choice: staggered)
    assert "clients that each send their next request when the last ends, their first" in be.arrivals_line({})
    line = be.arrivals_line({"arrivals": "paced", "interleave_one_stream": True})
    assert "(paced)" in line and "request by request in turn" in line and "on average" not in line


def test_paced_goals_table_says_how_many_requests_were_in_flight():
    """Paced arrivals hold waiting clients' request rate, not their count: the arrivals line
    says how many were in flight per concurrency, over the measured phases (tap-toggle's
    phases once each; interleaved one-stream phases and one stream left out)."""
    def phase(mean, most, interleaved=False):
        return {"in_flight": {"mean": mean, "max": most}, "interleaved": interleaved}
    toggled = {"label": "tap-toggle", "results": {"64": phase(99.0, 99)},
               "toggle": {"1": [phase(1.0, 1, True)] * 2, "64": [phase(44.0, 58), phase(46.0, 60)]}}
    plain = {"label": "plain", "results": {"1": phase(0.5, 1), "8": phase(6.0, 10), "64": phase(48.0, 61)}}
    assert be.in_flight_by_concurrency([toggled, plain]) == {"1": (0.5, 1), "8": (6.0, 10), "64": (46.0, 61)}
    line = be.arrivals_line({"arrivals": "paced"}, [toggled, plain])
    assert "in flight on average (most at once): 6.0 (10) at 8, 46.0 (61) at 64;" in line
    # waiting clients hold the count itself: nothing to add
    assert "on average" not in be.arrivals_line({"arrivals": "staggered"}, [toggled, plain])


def test_ttft_under_load_is_split_where_vllms_own_ttft_ends_phase_pair_by_phase_pair():
    """Each running phase against its paused neighbour: the client's TTFT mean, vLLM's own
    (its /metrics, `server.ttft_mean_ms`) and the difference beyond vLLM's, in ms with a 95%
    interval over the pairs; a phase without vLLM's figure leaves its pair out of those two."""
    def phase(paused, client, vllm):
        entry = _entry(10.0)
        entry["ttft_ms"] = {"p50": client, "p99": client, "mean": client}
        if vllm is not None:
            entry["server"] = {"ttft_mean_ms": vllm}
        return {"paused": paused, **entry}

    # (client, vLLM) running then paused, per pair: vLLM's own moves a lot, the rest by ~1.5 ms
    readings = [((66.0, 58.0), (63.5, 57.0)), ((70.0, 61.0), (64.0, 56.5)), ((60.0, 52.5), (61.0, 55.0)),
                ((65.0, 57.0), (62.0, 55.5))]
    phases = []
    for (running, paused) in readings:
        phases += [phase(False, *running), phase(True, *paused)]
    start = {"label": "tap-toggle", "kind": "tap-toggle", "checks": {}, "results": {"64": phases[0]},
             "toggle": {"64": phases}}
    where = be.toggle_overhead([start])["64"]["ttft_where_ms"]
    beyond = [(r[0] - r[1]) - (p[0] - p[1]) for r, p in readings]
    assert where["client"]["difference_mean_ms"] == pytest.approx(np.mean([r[0] - p[0] for r, p in readings]))
    assert where["vllm"]["difference_mean_ms"] == pytest.approx(np.mean([r[1] - p[1] for r, p in readings]))
    assert where["beyond_vllm"]["difference_mean_ms"] == pytest.approx(np.mean(beyond)) and where["beyond_vllm"]["pairs"] == 4
    half = be._t_975(3) * np.std(beyond, ddof=1) / 2
    assert where["beyond_vllm"]["ci95_ms"] == pytest.approx([np.mean(beyond) - half, np.mean(beyond) + half])
    report = be.markdown_tables({"setups": [start], "toggle_overhead_pct": be.toggle_overhead([start])}).splitlines()
    assert any(line.startswith("| 64 | the client's beyond vLLM's own | 4 | +1.50 (") for line in report), report
    # phases without the API server's own timing: those parts have no pairs and no rows
    assert where["request_way_in"] == {"pairs": 0} and not any("middleware's way in" in line for line in report)
    # ... nor without vLLM's stage histograms; with them, vLLM's own TTFT splits into the
    # engine's stage (scheduled to the first token) and the rest
    assert where["vllm_prefill"] == {"pairs": 0} and not any("of it, the engine's" in line for line in report)
    for number, p in enumerate(phases):
        p["server"].update(queue_mean_ms=0.5, prefill_mean_ms=40.0 + 0.8 * (not p["paused"]) + number)
    where = be.toggle_overhead([start])["64"]["ttft_where_ms"]
    assert where["vllm_prefill"]["difference_mean_ms"] == pytest.approx(0.8 - 1.0)
    assert where["vllm_api"]["difference_mean_ms"] == pytest.approx(
        where["vllm"]["difference_mean_ms"] - where["vllm_prefill"]["difference_mean_ms"])
    # with it, the client's TTFT splits again around the middleware
    for number, p in enumerate(phases):
        p["delivery"] = {"api_loop": {"request_way_in": {"mean_ms": 0.1 + 0.05 * (not p["paused"])},
                                      "vllm_to_first_chunk": {"mean_ms": 50.0 + number},
                                      "first_chunk_out": {"mean_ms": 0.2 + 0.3 * (not p["paused"])}}}
    where = be.toggle_overhead([start])["64"]["ttft_where_ms"]
    assert where["request_way_in"]["difference_mean_ms"] == pytest.approx(0.05)
    assert where["first_chunk_out"]["difference_mean_ms"] == pytest.approx(0.3)
    assert where["vllm_to_first_chunk"]["difference_mean_ms"] == pytest.approx(-1.0)
    assert where["outside_middleware"]["difference_mean_ms"] == pytest.approx(
        where["client"]["difference_mean_ms"] - 0.05 - 0.3 + 1.0)
    # a phase without vLLM's own figure: its pair counts for the client's difference only
    phases[2] = phase(False, 70.0, None)
    where = be.toggle_overhead([start])["64"]["ttft_where_ms"]
    assert where["client"]["pairs"] == 4 and where["vllm"]["pairs"] == where["beyond_vllm"]["pairs"] == 3
    assert be.ms_difference([1.0]) == {"pairs": 1, "difference_mean_ms": 1.0} and be.ms_difference([]) == {"pairs": 0}


def test_a_poll_on_a_machine_without_the_run_says_so_at_once(tmp_path):
    """On the GPU machine a poll that lands on a fresh machine (the one running the job was
    given back) must not wait out its seconds for a run that is gone."""
    import uuid

    name = f"never-started-{uuid.uuid4().hex}"
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "poll.sh"
    done = subprocess.run(["bash", str(script), "600", name], env={**os.environ, "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert f"poll: no run {name} on this machine" in done.stdout


def test_cpu_lists_read_and_write_as_taskset_does_and_refuse_cpus_this_host_lacks():
    assert be.format_cpu_list([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11" and be.format_cpu_list([5]) == "5"
    assert be.parse_cpu_list(None) is None and be.parse_cpu_list("  ") is None
    allowed = sorted(os.sched_getaffinity(0))
    text = be.format_cpu_list(allowed)
    assert be.parse_cpu_list(text) == allowed and be.parse_cpu_list(f" {allowed[-1]} ") == [allowed[-1]]
    missing = max(allowed) + 1
    with pytest.raises(SystemExit, match=rf"CPUs {missing} are not available here"):
        be.parse_cpu_list(f"{allowed[0]},{missing}")
    for huge in ("0-30000000", "99999999"):  # refused at once, never expanded
        with pytest.raises(SystemExit, match=rf"CPUs {missing} and above are not available here"):
            be.parse_cpu_list(huge)
    for bad in ("a-b", "3-1", "-1", "0-", "0,,1"):
        with pytest.raises(SystemExit, match="CPU list"):
            be.parse_cpu_list(bad)
    # a pinned client would hand its CPUs down to the servers it starts: they keep this process's
    assert be.cpu_sets(None, text) == (allowed, allowed)
    assert be.cpu_sets(str(allowed[0]), text) == ([allowed[0]], allowed)
    assert be.cpu_sets(None, None) == (None, None)


def test_the_host_layout_groups_logical_cpus_by_the_core_they_share(tmp_path):
    """A run records which logical CPUs are SMT siblings (two busy threads on one core slow
    each other): read from sysfs, so a run on another host can be compared by its layout."""
    for cpu, siblings in enumerate(["0,2", "1,3", "0,2", "1,3", "4-5", "4-5"]):  # sysfs writes both forms
        topology = tmp_path / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(siblings + "\n")
    (tmp_path / "cpu" / "cpu0" / "cpufreq").mkdir()
    (tmp_path / "cpu" / "cpu0" / "cpufreq" / "scaling_governor").write_text("performance\n")
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nmodel name\t: Some CPU @ 2.0GHz\n")
    assert be.host_cpu_layout(tmp_path / "cpu", tmp_path / "cpuinfo") == {
        "model": "Some CPU @ 2.0GHz", "logical_cpus": 6, "physical_cores": 3, "cores": ["0,2", "1,3", "4-5"],
        "governor": "performance"}
    assert be.host_cpu_layout(tmp_path / "nothing", tmp_path / "none") == {}  # a VM that hides it all


def test_a_server_runs_where_it_was_pinned_and_a_server_that_did_not_is_reported(tmp_path):
    """--server-cpus: the server's first process is pinned as it starts, so what it forks later
    (vLLM's engine core, its API server processes) runs there too; the run checks it."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    forks = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    plan = be.SetupPlan(label="pinned", kind="plain", argv=[sys.executable, "-c", forks], env_changes={}, port=1)
    server = be.Server(plan, tmp_path / "server.log", cpus=[cpu])
    try:
        deadline = time.monotonic() + 30
        while len(be._group_members(server.proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(be._group_members(server.proc.pid)) == 2  # the server and the process it forked
        assert be.group_affinity(server.proc.pid) == [str(cpu)]
    finally:
        server.stop()
    setup = _setup("plain", "plain#1", {"1": 5.0})
    setup["checks"].update(server_cpus_asked=str(cpu), server_cpus_seen=[str(cpu)])
    assert not [p for p in be.find_problems([setup]) if "--server-cpus" in p]
    setup["checks"]["server_cpus_seen"] = [str(cpu), "0-15"]
    assert [p for p in be.find_problems([setup]) if "--server-cpus" in p] == [
        f"plain#1: the server's threads may run on CPUs {cpu}, 0-15, not only the {cpu} --server-cpus asked for"]
    # CPUs the kernel refuses fail the server's start; nothing is left running
    refused = be.Server(plan, tmp_path / "refused.log", cpus=[max(os.sched_getaffinity(0)) + 1])
    try:
        assert refused.proc.wait(timeout=30) != 0
    finally:
        refused.stop()
    assert "Invalid argument" in (tmp_path / "refused.log").read_text() and not be._group_members(refused.proc.pid)


def test_the_direct_set_up_toggles_like_tap_toggle_and_the_formatter_is_checked_where_it_was_to_run(tmp_path,
                                                                                                     monkeypatch):
    """tap-toggle runs the score formatter (the worker's default) and tap-toggle-direct leaves it
    out (`PROBEX_SCORE_FORMATTER=0`), its starts alternating which state comes first as
    tap-toggle's do. A phase in which the API server processes saw the formatter start again, or
    hear nothing, is a problem; so is a phase of a worker that was to run it whose processes never
    reported one, or one that was to leave it out whose processes did. Set-ups saved without the
    expectation (before session 29) are not checked."""
    monkeypatch.delenv("PROBEX_SCORE_FORMATTER", raising=False)
    plans = be.plan_setups(["tap-toggle", "tap-toggle-direct", "tap-toggle-direct", "tap-op-only", "plain"], tmp_path,
                           [tmp_path / "p"], [], "v2")
    assert [p.toggle_first_paused for p in plans[:3]] == [False, False, True]
    assert plans[1].env_changes["PROBEX_SCORE_FORMATTER"] == "0" and "PROBEX_SCORE_FORMATTER" not in plans[0].env_changes
    assert plans[1].env_changes["PROBEX_ADMIN_TOKEN"] == plans[0].env_changes["PROBEX_ADMIN_TOKEN"] == be.TOGGLE_ADMIN_TOKEN
    # the worker's default, the variant, a worker that delivers nothing (no formatter to expect), stock vLLM
    assert [p.score_formatter for p in plans] == [True, False, False, None, None]
    monkeypatch.setenv("PROBEX_SCORE_FORMATTER", "off")  # the bench's own environment reaches its servers
    assert be.plan_setups(["tap-toggle"], tmp_path, [tmp_path / "p"], [], "v2")[0].score_formatter is False
    assert be.plan_setups(["tap-toggle"], tmp_path, [tmp_path / "p"], [], "v2",
                          worker_env={"PROBEX_SCORE_FORMATTER": "1"})[0].score_formatter is True

    def health(pid, restarts, silent):
        return {"api_server": {"pid": pid, "count": 2}, "score_formatter": {"restarts_seen": restarts, "silent": silent}}

    before = be.merge_process_health([health(7, 0, False), health(8, 0, False)])
    after = be.merge_process_health([health(7, 1, False), health(8, 1, True)])
    assert after["score_formatter"] == {"restarts_seen": 2, "silent": True, "processes": 2}
    setup = _setup("tap-toggle", "tap-toggle", {"1": 5.0})
    setup["checks"]["probex_score_formatter_expected"] = True
    setup["results"]["1"]["delivery"] = be.delivery_delta(before, after)
    assert setup["results"]["1"]["delivery"]["score_formatter"] == {"restarts": 2, "silent": True}
    problems = be.find_problems([setup])
    assert any("started again 2 time(s)" in p for p in problems) and any("heard nothing" in p for p in problems)
    setup["results"]["1"]["delivery"] = be.delivery_delta(before, before)
    assert not any("formatter" in p for p in be.find_problems([setup]))
    without = {"transfer": {"steps": 3}}  # what processes that read the worker's steps themselves report
    setup["results"]["1"]["delivery"] = without
    assert any("no API server process reported the score formatter" in p for p in be.find_problems([setup]))
    # a toggled phase other than the set-up's own is checked too
    setup["results"]["1"]["delivery"] = be.delivery_delta(before, before)
    setup["toggle"] = {"1": [{"paused": False, **setup["results"]["1"]}, {"paused": True, **_entry(5.0),
                                                                          "delivery": without}]}
    assert any("phase 2 (paused): no API server process reported the score formatter" in p
               for p in be.find_problems([setup]))
    del setup["toggle"]
    direct = _setup("tap-toggle-direct", "tap-toggle-direct", {"1": 5.0})
    direct["checks"]["probex_score_formatter_expected"] = False
    direct["results"]["1"]["delivery"] = without
    assert not be.find_problems([direct])
    direct["results"]["1"]["delivery"] = be.delivery_delta(before, before)
    assert any("heard from a score formatter that PROBEX_SCORE_FORMATTER=0 was to leave out" in p
               for p in be.find_problems([direct]))
    del setup["checks"]["probex_score_formatter_expected"]  # saved before session 29
    setup["results"]["1"]["delivery"] = without
    assert not be.find_problems([setup])


def test_idle_pairs_are_checked_for_the_formatter_and_pooled_score_paths_are_warned_about():
    """The idle pairs of a start are held to what its worker was to run like its phases are, a
    formatter that went silent in them included; a toggled kind whose starts ran different score
    paths (a run saved before session 29 on the direct path, re-rendered with a new one) pools
    the two, which the warnings say."""
    formatted = {"score_formatter": {"restarts": 0, "silent": False}}
    setup = {"label": "tap-toggle", "kind": "tap-toggle", "checks": {"probex_score_formatter_expected": True},
             "results": {}, "idle_ttft_toggle": {"failed": 0, "errors": [], "delivery": formatted}}
    assert not be.find_problems([setup])
    setup["idle_ttft_toggle"]["delivery"] = {"transfer": {"steps": 3}}
    assert any("idle TTFT, paused and running in turn: no API server process reported the score formatter" in p
               for p in be.find_problems([setup]))
    setup["idle_ttft_toggle"]["delivery"] = {"score_formatter": {"restarts": 0, "silent": True}}
    assert any("idle TTFT, paused and running in turn: an API server process heard nothing" in p
               for p in be.find_problems([setup]))
    setup["idle_ttft_toggle"]["delivery"] = formatted
    setup["idle_ttft"] = {"failed": 0, "delivery": {"transfer": {"steps": 3}}}
    assert any(p.startswith("tap-toggle idle TTFT: no API server process") for p in be.find_problems([setup]))
    del setup["idle_ttft"]

    saved = {"label": "tap-toggle#old", "kind": "tap-toggle", "checks": {}, "env": {}, "results": {},
             "idle_ttft_toggle": {"failed": 0, "errors": []}}
    assert be.score_path(saved) == "direct" and be.score_path(setup) == "formatter"
    assert be.score_path({**saved, "env": {"PROBEX_SCORE_FORMATTER": "1"}}) == "formatter"
    warnings = be.find_warnings([saved, setup])
    assert any("tap-toggle's starts ran different score paths (direct: tap-toggle#old; formatter: tap-toggle)" in w
               for w in warnings), warnings
    assert not any("score paths" in w for w in be.find_warnings([setup]))


def test_a_toggled_variant_is_read_on_its_own_starts_apart_from_tap_toggles():
    """tap-toggle and tap-toggle-direct in one run: each kind's running-over-paused figures
    and goals come from its own starts, never pooled, and the report shows both."""
    def toggled(kind, label, running, paused):
        setup = _setup(kind, label, {"1": running})
        setup["toggle"] = {"1": [{"paused": False, **setup["results"]["1"]}, {"paused": True, **_entry(paused)}]}
        return setup

    setups = [toggled("tap-toggle", "tap-toggle", 5.5, 5.0), toggled("tap-toggle-direct", "tap-toggle-direct", 5.05, 5.0)]
    analysis = be.analyze(setups)
    assert analysis["toggle_overhead_pct"]["1"]["tpot_p50"] == pytest.approx(10.0)
    variant = analysis["toggle_variants"]["tap-toggle-direct"]
    assert variant["toggle_overhead_pct"]["1"]["tpot_p50"] == pytest.approx(1.0)
    assert [r["met"] for r in variant["goals"]["rows"] if r["measure"] == "TPOT p50"] == [False]  # 1% over a 0.5% goal
    tables = be.markdown_tables({**analysis, "setups": setups})
    assert "**tap-toggle-direct**, its own starts:" in tables
    assert "tap-toggle's starts, in the order of the lists above: tap-toggle (began running)." in tables
    assert "tap-toggle-direct's starts, in the order of the lists above: tap-toggle-direct (began running)." in tables
    assert "toggle_variants" not in be.analyze(setups[:1])


def test_a_retired_set_up_is_no_longer_run_but_its_saved_runs_read_as_a_toggled_variant():
    """tap-toggle-early-consume and tap-toggle-scores-after-output ran worker experiments since
    removed: --setups refuses them, and a saved run of one reads on its own starts as before,
    with the steps its experiment counted still in its delivery line."""
    for retired in be.RETIRED_KINDS:
        with pytest.raises(SystemExit, match="removed"):
            be.parse_setups(f"tap-toggle,{retired}")
        assert retired in be.TOGGLE_KINDS and retired not in be.KIND_WORKER_ENV
    assert not set(be.RETIRED_KINDS) & set(be.RUNNABLE_KINDS)

    def toggled(kind, running, paused):
        setup = _setup(kind, kind, {"1": running})
        setup["toggle"] = {"1": [{"paused": False, **setup["results"]["1"]}, {"paused": True, **_entry(paused)}]}
        return setup

    setups = [toggled("tap-toggle", 5.5, 5.0), toggled("tap-toggle-early-consume", 5.05, 5.0)]
    analysis = be.analyze(setups)
    variant = analysis["toggle_variants"]["tap-toggle-early-consume"]
    assert variant["toggle_overhead_pct"]["1"]["tpot_p50"] == pytest.approx(1.0)
    assert "tap-toggle-early-consume" in analysis["summary"]["per_kind"]  # its rows in the tables
    tables = be.markdown_tables({**analysis, "setups": setups})
    assert "**tap-toggle-early-consume**, its own starts:" in tables
    saved = {"transfer": {"landed_mean_ms": 0.5, "consume_mean_ms": 0.1, "early_steps": 3, "after_output_steps": 2}}
    assert ", 3 consumed early by the watchdog, 2 consumed after their tokens' output" in be.delivery_line(saved)


def test_a_toggled_bar_on_the_chart_also_carries_its_reading_within_its_start():
    """The chart's tap-toggle bar is its first running phase against plain's start, which
    includes the two starts' difference; its label also gives the running-over-paused figure
    of its own start(s), the one the goals read, and a toggled variant's its own."""
    def toggled(kind, label, running, paused):
        setup = _setup(kind, label, {"1": running})
        setup["toggle"] = {"1": [{"paused": False, **setup["results"]["1"]}, {"paused": True, **_entry(paused)}]}
        return setup

    setups = [_setup("plain", "plain", {"1": 5.0}), toggled("tap-toggle", "tap-toggle", 5.25, 5.2),
              toggled("tap-toggle-direct", "tap-toggle-direct", 5.5, 5.0), _setup("eager", "eager", {"1": 15.0})]
    result = {**be.analyze(setups), "setups": setups}
    assert be.chart_bar_label(result, "plain", "1", 5.0) == "5.00"
    assert be.chart_bar_label(result, "eager", "1", 15.0) == "15.00\n+200.0%"
    assert be.chart_bar_label(result, "tap-toggle", "1", 5.25) == "5.25\n+5.0% vs plain\n+0.96% in start"
    assert be.chart_bar_label(result, "tap-toggle-direct", "1", 5.5) == "5.50\n+10.0% vs plain\n+10.00% in start"
    alone = {**be.analyze(setups[1:2]), "setups": setups[1:2]}  # no plain start: the reading within it alone
    assert be.chart_bar_label(alone, "tap-toggle", "1", 5.25) == "5.25\n+0.96% in start"


def test_the_gpu_scripts_cpu_split_gives_the_bench_two_disjoint_lists_of_whole_cores():
    """bench/gpu/split_cpus.py, which the GPU session runs before pinning: two CPU lists the
    bench's --server-cpus / --client-cpus accept, disjoint, covering this process's CPUs, each
    core's SMT siblings on one side."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "split_cpus.py"
    allowed = sorted(os.sched_getaffinity(0))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    cores = {frozenset(be.parse_cpu_list_unchecked(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/"
                                                        "thread_siblings_list").read_text())) & set(allowed)
             for cpu in allowed}
    if len(cores) < 2:
        assert run.returncode != 0 and "fewer than two physical cores" in run.stderr
        return
    server, client = (be.parse_cpu_list(text) for text in run.stdout.split())
    assert not set(server) & set(client) and sorted(server + client) == allowed
    assert all(core <= set(server) or core <= set(client) for core in cores)
    assert len(client) <= len(server)


def test_an_idle_runs_api_server_parts_are_split_into_running_and_paused():
    """The idle pairs' counters pool both states and keep the running requests apart
    (`*_running`): the paused requests' mean is what the pooled total leaves."""
    delivery = {"api_loop": {"first_chunk_out": {"count": 10, "mean_ms": 0.07},
                             "first_chunk_out_running": {"count": 5, "mean_ms": 0.12},
                             "request_way_in": {"count": 10, "mean_ms": 0.1},  # a run without the split
                             "vllm_to_first_chunk": {"count": 4, "mean_ms": 30.0},
                             "vllm_to_first_chunk_running": {"count": 4, "mean_ms": 30.0}}}  # no paused request
    parts = be.idle_api_parts(delivery)
    assert list(parts) == ["first_chunk_out"]
    assert parts["first_chunk_out"] == (pytest.approx(0.12), pytest.approx(0.02))
    assert be.idle_api_parts({}) == {}
    result = {"setups": [{"label": "tap-toggle", "kind": "tap-toggle", "results": {},
                          "idle_ttft_toggle": {"delivery": delivery}}]}
    assert any("The API server's parts of an idle request's TTFT (tap-toggle; running / paused, ms per request): "
               "the first chunk's way out of the middleware 0.120 / 0.020." in line
               for line in be.toggle_tables(result))
