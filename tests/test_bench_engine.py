"""bench/engine: the model directory, probes and plans it writes, reading `vllm bench serve`'s
results, the analysis of tap-toggle's pairs, and (engine) its CPU smoke mode end to end, so
the GPU tooling cannot rot."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import vllm_bench
from bench.engine import analysis, cli, client, load, report, setups, stats
from probes.artifact import ServedModel, load_probe

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    """This checkout first on the path (`python -m bench...` from the repository root)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def test_plans_start_workers_and_stock_vllm_with_the_same_arguments(tmp_path):
    plans = setups.plan_setups(cli.parse_setups("plain,tap,eager,tap-toggle,plain"), tmp_path, [tmp_path / "p1"],
                               ["--load-format", "dummy"], "v1")
    assert [p.label for p in plans] == ["plain#1", "tap", "eager", "tap-toggle", "plain#2"]
    assert len({p.port for p in plans}) == 5
    plain, tap, eager, toggle, _ = plans
    assert plain.env_changes["VLLM_PLUGINS"] == setups.NO_PLUGINS == eager.env_changes["VLLM_PLUGINS"]
    assert tap.env_changes["VLLM_PLUGINS"] is None  # removed: the ProbeX plugin must load
    assert all(p.env_changes["VLLM_USE_V2_MODEL_RUNNER"] == "0" for p in plans)
    without_port = lambda plan: [a for a in plan.argv if a != str(plan.port)]  # noqa: E731
    assert without_port(eager) == without_port(plain) + ["--enforce-eager"]
    assert tap.argv[2:4] == ["probex.cli", "worker"] and f"--probe={tmp_path / 'p1'}" in tap.argv
    # tap-toggle's worker takes an admin token (its tap is paused through PUT /probex/tap), as do the
    # steered set-ups' (their requests carry engine controls); the tap alone needs none
    assert "--admin-token" not in tap.argv and toggle.argv[toggle.argv.index("--admin-token") + 1] == setups.ADMIN_TOKEN
    steered = setups.plan_setups(cli.parse_setups("steer-idle,steer-active"), tmp_path, [tmp_path / "p1"],
                                 ["--load-format", "dummy"], "v1", steer_dir=tmp_path / "v")
    assert ["--admin-token" in plan.argv for plan in steered] == [False, True]
    assert not any(k.startswith("PROBEX_") for p in plans for k in p.env_changes)
    with pytest.raises(SystemExit):
        cli.parse_setups("plain,tap-op-only")


def test_toggle_phases_alternate_abba_with_fresh_prompts_but_the_shared_one_first():
    assert load.toggle_order(2) == [False, True, True, False]
    assert load.toggle_order(1, first_paused=True) == [True, False]
    plan = load.toggle_phase_plan(load.toggle_order(2, first_paused=True), 123, 0, 8)
    assert [(paused, own) for paused, _, own in plan] == [(True, False), (False, True), (False, False), (True, False)]
    assert plan[1][1] == 123 and len({seed for _, seed, _ in plan}) == 4
    assert load.parse_toggle_pairs("3,8:5", [1, 8]) == {None: 3, 8: 5}
    with pytest.raises(ValueError):
        load.parse_toggle_pairs("3,64:5", [1, 8])
    with pytest.raises(ValueError):
        load.parse_toggle_pairs("8:5")


def test_a_vllm_bench_command_and_its_saved_result(tmp_path, monkeypatch):
    phase = vllm_bench.Load("http://127.0.0.1:9", "/models/m", "m", 8, 160, 1024, 256, seed=7,
                            extra_body={"vllm_xargs": {"probex_steer": "v"}})
    cmd = phase.command(tmp_path, "c8.json")
    joined = " ".join(cmd)
    for part in ("bench serve --backend vllm", "--dataset-name random", "--random-input-len 1024",
                 "--random-output-len 256", "--ignore-eos", "--num-prompts 160", "--max-concurrency 8", "--seed 7",
                 "--save-result", f"--result-dir {tmp_path}", "--result-filename c8.json", "--served-model-name m",
                 "--metric-percentiles 50,99"):
        assert part in joined, part
    assert json.loads(cmd[cmd.index("--extra-body") + 1]) == {"vllm_xargs": {"probex_steer": "v"}}
    steered = vllm_bench.Load("http://127.0.0.1:9", "/models/m", "m", 8, 160, 1024, 256, seed=7,
                              extra_body={"vllm_xargs": {"probex_steer": "v"}}, api_key="t0ken")
    assert steered.command(tmp_path, "c8.json") == cmd and "t0ken" not in " ".join(cmd)  # the key travels in the env
    seen = []

    def bench_serve(argv, env, **kwargs):  # vllm bench serve reads OPENAI_API_KEY into Authorization: Bearer
        seen.append(env.get("OPENAI_API_KEY"))
        (tmp_path / "c8.json").write_text("{}")
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(vllm_bench.subprocess, "run", bench_serve)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    for sent in (phase, steered):
        vllm_bench.run_load(sent, tmp_path, "c8.json")
    assert seen == [None, "t0ken"]
    saved = {"completed": 160, "failed": 0, "output_throughput": 900.0, "duration": 12.5,
             **{f"{stat}_{m}_ms": value for m in ("ttft", "tpot", "itl")
                for stat, value in (("mean", 2.0), ("median", 1.5), ("p50", 1.5), ("p99", 9.0))}}
    summary = vllm_bench.summary(saved)
    assert summary["tpot_ms"] == {"mean": 2.0, "p50": 1.5, "p99": 9.0}
    assert (summary["completed"], summary["failed"], summary["output_tokens_per_s"]) == (160, 0, 900.0)


def _entry(tpot: float, ttft: float = 10.0) -> dict:
    return {"tpot_ms": {"p50": tpot, "mean": tpot, "p99": tpot}, "ttft_ms": {"p50": ttft, "mean": ttft, "p99": ttft},
            "itl_ms": {"p50": tpot, "mean": tpot, "p99": tpot}, "output_tokens_per_s": 100.0 / tpot,
            "completed": 4, "failed": 0}


def test_analysis_overheads_toggled_phases_and_goals():
    runs = [{"label": "plain", "kind": "plain", "checks": {}, "results": {"1": _entry(5.0)}},
            {"label": "tap", "kind": "tap", "checks": {"probex_probes_listed": 8, "probex_probes_expected": 8},
             "results": {"1": _entry(5.1)},
             "scores": {"expected_probes": 8, "generated_tokens": 40, "scored_tokens": 40, "coverage": 1.0,
                        "requests_with_all_prompt_scores": 4, "requests": 4, "failed": 0, "problems": []}},
            {"label": "tap-toggle", "kind": "tap-toggle", "checks": {"probex_probes_listed": 8,
                                                                     "probex_probes_expected": 8},
             "results": {"1": _entry(5.02)},
             "toggle": {"1": [dict(_entry(5.02), paused=False), dict(_entry(5.0), paused=True),
                              dict(_entry(5.0), paused=True), dict(_entry(5.01), paused=False)]}}]
    result = analysis.analyze(runs)
    assert result["overhead_pct"]["tap_vs_plain"]["1"]["tpot_p50"] == pytest.approx(2.0)
    within = result["toggle_overhead_pct"]["1"]
    assert within["tpot_p50"] == pytest.approx(0.3) and within["phase_pairs"]["tpot_p50"] == pytest.approx([0.4, 0.2])
    assert result["goals"]["rows"][0]["source"] == "within the start" and result["goals"]["all_met"]
    assert result["problems"] == []
    table = report.markdown_tables({"setups": runs, **result})
    assert "| tap | 1 | +2.0% |" in table and "tap-toggle: the tap running over the tap paused" in table
    # missing scores, failures and a worker listing the wrong probes are problems
    bad = [dict(runs[1], scores=dict(runs[1]["scores"], scored_tokens=30, coverage=0.75),
                checks={"probex_probes_listed": 7, "probex_probes_expected": 8}, results={"1": dict(_entry(5.0), failed=2)})]
    problems = analysis.find_problems(bad)
    assert any("SCORES NOT FULLY DELIVERED" in p for p in problems) and any("lists 7 probes" in p for p in problems)
    assert any("2 failed requests" in p for p in problems)


def test_a_run_of_another_benchmark_is_not_reanalyzed(tmp_path):
    saved = tmp_path / "old.json"
    saved.write_text(json.dumps({"workload": {"arrivals": "staggered"}, "setups": [{"kind": "tap-op-only"}]}))
    with pytest.raises(SystemExit, match="not a run of this benchmark"):
        cli.load_saved_run(saved)


def test_stream_events_are_checked_for_a_score_on_every_token():
    def event(ids, probex=None):
        chunk = {"choices": [{"token_ids": ids}], **({"probex": probex} if probex else {})}
        return b"data: " + json.dumps(chunk).encode()

    scores = lambda offset, n: {"scores": {"p": {"generated": {"offset": offset, "scores": [0.1] * n},  # noqa: E731
                                                 "prompt": {"last_raw": 0.5}}}}
    events = [(0.01, event([5], scores(0, 1))), (0.02, event([6, 7], scores(1, 2))), (0.03, b"data: [DONE]")]
    result = client.read_events(events, ["p"])
    assert result.ok and result.ttft_s == 0.01 and result.output_tokens == 3 and result.scored_tokens == 3
    assert result.prompt_last_raw == {"p": 0.5}
    misaligned = client.read_events([(0.01, event([5, 6], scores(0, 1))), (0.02, b"data: [DONE]")], ["p"])
    assert misaligned.scored_tokens == 0 and misaligned.score_problems
    assert client.read_events([(0.01, event([5]))], None).error == "stream ended without [DONE]"


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
    model = setups.write_model_dir(setups.LLAMA_3_1_8B, _fake_tokenizer(tmp_path / "tok"), tmp_path / "model")
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
        setups.write_model_dir(setups.TINY_LLAMA, tmp_path / "empty", tmp_path / "model")


def test_probes_two_layers_four_each_unit_and_mixed_reads(tmp_path):
    assert setups.default_probe_layers(32) == (10, 20)
    assert setups.default_probe_layers(4) == (1, 2)
    specs = setups.write_probes(tmp_path, 4096, (10, 20))
    assert len(specs) == 8 and [s.layer for s in specs].count(10) == 4
    assert {s.read for s in specs} == {"last_prompt_token", "prompt_mean", "prompt_max"}
    served = ServedModel(4096, 32)
    for spec in specs:
        probe = load_probe(spec.path, served)
        assert probe.name == spec.name and probe.layer == spec.layer
        assert np.linalg.norm(probe.weight) == pytest.approx(1.0, rel=1e-5)



def test_profiled_set_ups_each_get_the_torch_profiler_writing_to_their_own_folder(tmp_path):
    plain, tap = setups.plan_setups(["plain", "tap"], tmp_path, [tmp_path / "p1"], [], "v2",
                                profile_dir=tmp_path / "profile")
    for plan in (plain, tap):
        config = json.loads(plan.argv[plan.argv.index("--profiler-config") + 1])
        assert config["profiler"] == "torch" and config["ignore_frontend"] is True
        assert config["torch_profiler_dir"] == str((tmp_path / "profile" / plan.label).resolve())
        assert plan.trace_dir == tmp_path / "profile" / plan.label  # where the profile phase looks
    assert "--profiler-config" not in setups.plan_setups(["plain"], tmp_path, [], [], "v2")[0].argv


def test_planned_set_ups_never_share_a_port(tmp_path, monkeypatch):
    """Side by side, set-ups start together: a port the OS hands out twice must not reach two."""
    handed_out = iter([5000, 5000, 5001, 5000, 5001, 5002])
    monkeypatch.setattr(setups, "free_port", lambda: next(handed_out))
    plans = setups.plan_setups(["plain", "tap", "plain"], tmp_path, [tmp_path / "p1"], [], "v2")
    assert [p.port for p in plans] == [5000, 5001, 5002]



def test_steer_vector_artifact_unit_random_at_the_middle_layer(tmp_path):
    from probes.steering import load_vector

    assert setups.default_steer_layer((10, 20)) == 15 and setups.default_steer_layer((2, 1)) == 1
    probes = setups.write_probes(tmp_path / "probes", 4096, (10, 20))
    steer = setups.write_steer_vector(tmp_path / "steering", 4096, setups.default_steer_layer((10, 20)), probes, alpha=1.0)
    vector = load_vector(steer.path, ServedModel(4096, 32))  # what `probex worker --steer-vector` loads
    assert (vector.name, vector.layer, steer.layer) == (setups.STEER_VECTOR_NAME, 15, 15)
    assert np.linalg.norm(vector.vector) == pytest.approx(1.0, rel=1e-5)
    assert steer.gate == "bench-l10-0"  # the earlier layer can gate a write at 15; layer 20 cannot
    again = setups.write_steer_vector(tmp_path / "again", 4096, 15, probes)
    assert load_vector(again.path).digest == vector.digest  # fixed seed
    assert load_vector(setups.write_steer_vector(tmp_path / "s1", 4096, 15, probes, seed=1).path).digest != vector.digest
    for probe in probes:  # not a probe direction
        assert abs(float(load_probe(probe.path).weight @ vector.vector)) < 0.2
    tiny = setups.write_steer_vector(tmp_path / "tiny", 256, setups.default_steer_layer((1, 2)),
                                 setups.write_probes(tmp_path / "tiny-probes", 256, (1, 2)))
    assert tiny.layer == 1 and tiny.gate == "bench-l1-0"
    assert setups.write_steer_vector(tmp_path / "early", 4096, 5, probes).gate is None


def test_steer_xargs_per_set_up_are_what_the_worker_accepts(tmp_path):
    from engine_worker.steering import steering_from_xargs

    steer = setups.SteerBench("v", 15, tmp_path, alpha=1.0, gate="bench-l10-0")
    assert steer.xargs("steer-idle") is None and steer.xargs("tap") is None
    active, gated = steer.xargs("steer-active"), steer.xargs("steer-gated")
    assert active == {"probex_steer": "v", "probex_steer_alpha": 1.0, "probex_steer_window": "all"}
    assert gated == dict(active, probex_steer_gate="bench-l10-0", probex_steer_threshold=0.5)
    request = steering_from_xargs(dict(gated))  # the worker's own parser of these keys
    assert (request.vector, request.alpha, request.gate, request.threshold, request.window) == (
        "v", 1.0, "bench-l10-0", 0.5, "all")
    assert steering_from_xargs(dict(active)).gate is None
    body = client.completion_body("m", [1, 2], 4, active)
    assert body["vllm_xargs"] == active and body["vllm_xargs"] is not active
    assert "vllm_xargs" not in client.completion_body("m", [1, 2], 4, None)
    with pytest.raises(ValueError):
        setups.SteerBench("v", 5, tmp_path, 1.0, gate=None).xargs("steer-gated")



def test_idle_pairs_are_also_read_by_rank():
    """The Hodges–Lehmann shift and its Wilcoxon interval, found by bisection, equal the
    textbook computation over all pairwise means; a few pairs that carry a jump of the host's
    state pull the mean and widen its interval, not the rank reading."""
    rng = np.random.default_rng(7)
    assert math.isnan(stats.hodges_lehmann_shift(rng.standard_normal(5))[1][0])  # too few for a 95% interval
    for n in (6, 40, 301):
        differences = rng.standard_t(2, n) + 0.3
        i, j = np.triu_indices(n)
        walsh = np.sort((differences[i] + differences[j]) / 2)
        k = math.floor(n * (n + 1) / 4 - 1.96 * math.sqrt(n * (n + 1) * (2 * n + 1) / 24))
        shift, (low, high) = stats.hodges_lehmann_shift(differences)
        assert shift == pytest.approx(np.median(walsh), abs=1e-9)
        assert (low, high) == pytest.approx((walsh[k], walsh[len(walsh) - 1 - k]), abs=1e-9)
    # ties (equal magnitudes) share a rank and still give the median of the pairwise means
    tied = np.array([1.0, 1.0, -1.0, 2.0, 2.0, 0.5])
    i, j = np.triu_indices(len(tied))
    assert stats.hodges_lehmann_shift(tied)[0] == pytest.approx(np.median((tied[i] + tied[j]) / 2), abs=1e-9)
    assert math.isnan(stats.hodges_lehmann_shift([1.0])[0])
    # 200 pairs 0.3 ms apart give or take 0.2 ms, and 20 that straddled a 4 ms change of state
    steady = [(30.3 + e, 30.0) for e in rng.normal(0, 0.2, 200)]
    jumps = [(34.3, 30.0) if n % 2 else (30.3, 34.0) for n in range(20)]
    clean, noisy = stats.paired_overhead(steady), stats.paired_overhead(steady + jumps)
    assert clean["hodges_lehmann"]["pct"] == pytest.approx(1.0, abs=0.1)
    assert noisy["hodges_lehmann"]["pct"] == pytest.approx(1.0, abs=0.15)
    ranked_width = noisy["hodges_lehmann"]["ci95_pct"][1] - noisy["hodges_lehmann"]["ci95_pct"][0]
    assert ranked_width < (noisy["ci95_pct"][1] - noisy["ci95_pct"][0]) / 3

def test_the_gpu_scripts_cpu_split_gives_the_bench_two_disjoint_lists_of_whole_cores():
    """bench/gpu/split_cpus.py, which the GPU session runs before pinning: two CPU lists the
    bench's --server-cpus / --client-cpus accept, disjoint, covering this process's CPUs, each
    core's SMT siblings on one side."""
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "split_cpus.py"
    allowed = sorted(os.sched_getaffinity(0))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    cores = {frozenset(setups.parse_cpu_list_unchecked(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/"
                                                        "thread_siblings_list").read_text())) & set(allowed)
             for cpu in allowed}
    if len(cores) < 2:
        assert run.returncode != 0 and "fewer than two physical cores" in run.stderr
        return
    server, client = (setups.parse_cpu_list(text) for text in run.stdout.split())
    assert not set(server) & set(client) and sorted(server + client) == allowed
    assert all(core <= set(server) or core <= set(client) for core in cores)
    assert len(client) <= len(server)




@pytest.mark.engine
def test_smoke_mode_runs_the_tap_toggled_within_its_start(tmp_path):
    """One run, one server: tap-toggle (paused and running phases at each concurrency,
    beginning paused, then idle pairs and one profiled request), each phase loaded by `vllm
    bench serve`. Plain, eager and the steering set-ups are left out to keep the suite's time
    (a server start is minutes on two cores): their plans are tested above, a plain start under
    `vllm bench serve` in test_serve_compare, the steering op in test_engine_steering."""
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "bench.engine", "--smoke", "--setups", "tap-toggle",
                           "--profile-requests", "1", "--idle-pairs", "3", "--toggle-first", "paused",
                           "--toggle-pairs", "1,2:1", "--out", str(out)],
                          capture_output=True, text=True, timeout=1500, cwd=ROOT,
                          env=_env())
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    result = json.loads((out / "bench_engine.json").read_text())
    assert result["problems"] == [] and result["workload"]["client"] == "vllm bench serve"
    assert result["model"]["config"]["vocab_size"] == 128256 and len(result["probes"]) == 8
    (toggle,) = result["setups"]
    assert toggle["label"] == "tap-toggle"
    for setup in (toggle,):
        assert "error" not in setup and set(setup["results"]) == {"1", "2"}
        for c, entry in setup["results"].items():
            assert entry["completed"] == 4 and entry["failed"] == 0 and entry["tpot_ms"]["p50"] > 0
            assert "bench" in entry["command"] and (out / entry["result_file"]).is_file()
    assert [p["paused"] for p in toggle["toggle"]["1"]] == [True, False]
    assert [p["paused"] for p in toggle["toggle"]["2"]] == [True, False]
    assert toggle["scores"]["coverage"] == 1.0 and toggle["scores"]["requests"] == 4
    idle = toggle["idle_toggle"]
    assert idle["requests"] == 6 and idle["failed"] == 0 and idle["running_over_paused"]["pairs"] == 3
    assert idle["running_without_scores"] == 0 and idle["paused_with_scores"] == 0
    assert "1" in result["toggle_overhead_pct"] and "2" in result["toggle_overhead_pct"]
    assert toggle["profile"]["requests"] == 1
    assert "| tap-toggle | 1 |" in proc.stdout
    again = subprocess.run([sys.executable, "-m", "bench.engine", "--reanalyze", str(out / "bench_engine.json")],
                           capture_output=True, text=True, timeout=120, cwd=ROOT,
                           env=_env())
    assert again.returncode == 0 and "| tap-toggle | 1 |" in again.stdout, again.stderr[-2000:]
