"""bench/sglang_smoke's parts that need no engine: the HF reference on a tiny random Llama, the
tolerances on made-up served responses, argument parsing and the check runner."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from bench import sglang_smoke_analysis as sa
from bench.gpu_smoke import forced_pairs, teacher_forced_summary
from probes.artifact import ProbeArtifact, ReadPoint
from probes.scoring import calibrate

HIDDEN = 64


def tiny_skeleton(tmp_path):
    from transformers import LlamaConfig

    skeleton = tmp_path / "skeleton"
    LlamaConfig(vocab_size=96, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
                bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(skeleton)
    (skeleton / "tokenizer_config.json").write_text("{}")
    return skeleton


def probe(name="p", layer=1, read=ReadPoint.LAST_PROMPT_TOKEN, seed=0, bias=0.1):
    rng = np.random.default_rng(seed)
    return ProbeArtifact(name=name, layer=layer, read=read, weight=rng.standard_normal(HIDDEN).astype(np.float32)
                         / np.sqrt(HIDDEN), bias=bias)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("models")
    return sa.build_models(tiny_skeleton(tmp), tmp / "work")


def test_the_reference_reads_the_residual_after_layer_L(tiny_models):
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tiny_models[("llama", "float32")]
    ids = [5, 17, 3, 44, 9, 60]
    rows = sa.Reference(model_dir).rows(ids, [1, 3])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen = {}
    for layer in (1,):  # hooked independently of output_hidden_states: what decoder layer L returns
        model.model.layers[layer].register_forward_hook(
            lambda m, args, out, layer=layer: seen.__setitem__(layer, (out[0] if isinstance(out, tuple) else out)[0]))
    with torch.no_grad():
        model(torch.tensor([ids]))
    np.testing.assert_allclose(rows[1], seen[1].double().numpy(), rtol=1e-6, atol=1e-7)
    assert rows[3].shape == (len(ids), HIDDEN)

    p = probe(layer=1)
    want = sa.reference_scores(rows, [p], prompt_len=4, generated=2)["p"]
    raw = rows[1] @ p.weight.astype(np.float64) + p.bias
    assert want["last"] == pytest.approx(raw[3]) and want["mean"] == pytest.approx(raw[:4].mean())
    assert want["max"] == pytest.approx(raw[:4].max())
    assert want["generated"] == pytest.approx([raw[3], raw[4]])  # token j is read at the row that sampled it


def test_the_bf16_copy_holds_the_fp32_weights_rounded_and_qwen2_has_biases(tiny_models):
    from safetensors.numpy import load_file
    import torch

    full = load_file(str(tiny_models[("llama", "float32")] / "model.safetensors"))
    with torch.no_grad():
        from safetensors.torch import load_file as load_torch

        half = load_torch(str(tiny_models[("llama", "bfloat16")] / "model.safetensors"))
        name = "model.layers.0.mlp.down_proj.weight"
        assert half[name].dtype == torch.bfloat16
        assert torch.equal(half[name], torch.from_numpy(full[name]).to(torch.bfloat16))
    qwen = json.loads((tiny_models[("qwen2", "float32")] / "config.json").read_text())
    assert qwen["architectures"] == ["Qwen2ForCausalLM"] and qwen["hidden_size"] == HIDDEN
    biases = load_file(str(tiny_models[("qwen2", "float32")] / "model.safetensors"))["model.layers.0.self_attn.q_proj.bias"]
    assert np.abs(biases).max() > 0
    assert (tiny_models[("qwen2", "bfloat16")] / "tokenizer_config.json").exists()


class FakeTokenizer:
    def __init__(self, adds_bos):
        self.adds_bos = adds_bos

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt
        return f"<s>user: {messages[0]['content']}\nassistant:"

    def encode(self, text, add_special_tokens=True):
        ids = [len(word) for word in text.split()]
        return ([1] if self.adds_bos and add_special_tokens else []) + ids


def test_chat_prompt_ids_render_then_encode_as_sglang_does():
    assert sa.chat_prompt_ids(FakeTokenizer(adds_bos=True), "a bb") == [8, 1, 2, 10]  # no second BOS
    assert sa.chat_prompt_ids(FakeTokenizer(adds_bos=False), "a bb") == [8, 1, 2, 10]


# -- served responses --------------------------------------------------------------------------------

def response(prompt_raw: dict, generated_raw: dict, tokens=(7, 8, 9), prompt_tokens=5):
    scores = {}
    for name, (last, mean, peak) in prompt_raw.items():
        scores[name] = {"prompt": {"last": calibrate(last, 1, 0), "last_raw": last, "mean": calibrate(mean, 1, 0),
                                   "max": calibrate(peak, 1, 0), "tokens_scored": prompt_tokens,
                                   "prompt_tokens": prompt_tokens},
                        "generated": {"scores": [calibrate(x, 1, 0) for x in generated_raw[name]]}}
    return {"id": "chatcmpl-x", "probex": {"scores": scores}, "usage": {"prompt_tokens": prompt_tokens},
            "choices": [{"meta_info": {"output_token_logprobs": [[-1.0, t, "t"] for t in tokens]}}]}


def test_served_scores_are_read_back_raw():
    p = probe()
    record = sa.record_of(response({"p": (0.3, -0.2, 1.5)}, {"p": [0.1, -2.0, 3.0]}), [p])
    assert record["tokens"] == [7, 8, 9]
    got = record["scores"]["p"]
    assert got["last"] == 0.3 and got["mean"] == pytest.approx(-0.2, abs=1e-12)
    assert got["max"] == pytest.approx(1.5, abs=1e-12)
    np.testing.assert_allclose(got["generated"], [0.1, -2.0, 3.0], atol=1e-12)
    assert np.isnan(sa.raw_of(None)) and np.isnan(sa.raw_of(1.0))


def expected(rng, n_generated=6):
    values = rng.standard_normal(3 + n_generated)
    return {"p": {"last": values[0], "mean": values[1], "max": values[2], "generated": values[3:].tolist()}}


def served_from(want, shift=0.0, noise=0.0, rng=None):
    rng = rng or np.random.default_rng(1)
    got = {}
    for name, w in want.items():
        jitter = lambda x: x + shift + noise * rng.standard_normal()
        got[name] = {"last": jitter(w["last"]), "mean": jitter(w["mean"]), "max": jitter(w["max"]),
                     "generated": [jitter(x) for x in w["generated"]], "tokens_scored": 5, "prompt_tokens": 5}
    return got


def test_fp32_parity_passes_rounding_and_fails_a_planted_wrong_score():
    rng = np.random.default_rng(0)
    want = expected(rng)
    rows, problems = sa.parity_rows(served_from(want, noise=1e-6), want)
    assert not problems and sa.parity_summary(rows, "float32", problems, [0.99999, 1.0])["pass"]
    wrong = served_from(want)
    wrong["p"]["generated"][3] += 0.05
    rows, problems = sa.parity_rows(wrong, want)
    summary = sa.parity_summary(rows, "float32", problems)
    assert not summary["pass"] and summary["worst"]["what"] == "generated 3"
    # the residual rows must agree too
    rows, _ = sa.parity_rows(served_from(want), want)
    assert not sa.parity_summary(rows, "float32", (), [0.9999, 0.9990])["pass"]


def test_a_planted_off_by_one_row_fails_parity_and_is_not_closest_to_its_own_row():
    want = expected(np.random.default_rng(3), n_generated=8)
    shifted = served_from(want)
    shifted["p"]["generated"] = want["p"]["generated"][1:] + [want["p"]["generated"][-1]]  # row j+1's score at j
    rows, problems = sa.parity_rows(shifted, want)
    assert not sa.parity_summary(rows, "float32", problems)["pass"]
    closest, compared = sa.own_row_closest(shifted["p"]["generated"], want["p"]["generated"])
    assert compared == 8 and closest <= 1
    assert sa.own_row_closest(want["p"]["generated"], want["p"]["generated"]) == (8, 8)


def test_a_missing_or_short_generated_list_is_a_problem():
    want = expected(np.random.default_rng(4))
    short = served_from(want)
    short["p"]["generated"] = short["p"]["generated"][:-1]
    rows, problems = sa.parity_rows(short, want)
    assert problems and not sa.parity_summary(rows, "float32", problems)["pass"]
    rows, problems = sa.parity_rows({}, want)
    assert problems == ["p: no scores served"]


def test_bf16_parity_is_judged_against_hf_bf16s_own_rounding():
    rng = np.random.default_rng(5)
    want = expected(rng)
    hf16 = served_from(want, noise=0.01, rng=np.random.default_rng(6))  # HF's own bf16 distance: ~0.01
    near = served_from(want, noise=0.01, rng=np.random.default_rng(7))
    far = served_from(want, shift=0.2)
    rows, problems = sa.parity_rows(near, want, hf16)
    summary = sa.parity_summary(rows, "bfloat16", problems)
    assert summary["pass"] and 0 < summary["hf_bf16_max_abs_diff"] < 0.05
    rows, problems = sa.parity_rows(far, want, hf16)
    assert not sa.parity_summary(rows, "bfloat16", problems)["pass"]


def records(generated, tokens=(1, 2, 3, 4), last=0.5):
    return {"tokens": list(tokens), "scores": {"p": {"last": last, "mean": 0.1, "max": 0.9, "tokens_scored": 5,
                                                     "generated": list(generated)}}}


def test_two_runs_compare_up_to_where_their_tokens_part():
    rng = np.random.default_rng(8)
    a = [records(rng.standard_normal(4)) for _ in range(3)]
    same = sa.compare_records(a, [dict(r) for r in a], "bfloat16")
    assert same["pass"] and same["identical_token_sequences"] == 3 and same["compared_generated"] == 12
    # tokens part at the third: its score (read before it was sampled) still agrees, the fourth's may not
    parted = [records(list(a[0]["scores"]["p"]["generated"][:3]) + [9.0], tokens=(1, 2, 7, 7))] + a[1:]
    result = sa.compare_records(a, parted, "bfloat16")
    assert result["pass"] and result["compared_generated"] == 11
    # an off-by-one in one request's rows is caught
    g = a[1]["scores"]["p"]["generated"]
    shifted = [a[0], records(list(g[1:]) + [g[-1]]), a[2]]
    assert not sa.compare_records(a, shifted, "bfloat16")["pass"]


def stream_chunks(extra_score_in=None, usage_at_end=True):
    gen = [0.1, 0.2, 0.3, 0.4]
    chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}}], "usage": {"completion_tokens": 0},
               "probex": {"scores": {"p": {"prompt": {"last": 0.6, "last_raw": 0.4, "mean": 0.5, "max": 0.7,
                                                      "tokens_scored": 5, "prompt_tokens": 5}}}}}]
    for i, (start, stop) in enumerate(((0, 1), (1, 3))):
        scores = gen[start:stop] + ([0.9] if extra_score_in == i else [])
        chunks.append({"choices": [{"delta": {"content": "x"}, "logprobs": {"content": [{"token": f"t{k}"} for k in range(start, stop)]}}],
                       "usage": {"completion_tokens": stop},
                       "probex": {"scores": {"p": {"generated": {"scores": scores, "offset": start}}}}})
    # the closing chunk without usage carries the textless last token
    chunks.append({"choices": [{"delta": {}, "finish_reason": "stop"}],
                   "probex": {"scores": {"p": {"generated": {"scores": gen[3:], "offset": 3}}}}})
    if usage_at_end:
        chunks.append({"choices": [], "usage": {"completion_tokens": 4}})
    return chunks


def test_stream_counts_pass_and_a_planted_extra_score_is_named():
    record, counts = sa.stream_record(stream_chunks(), [probe()])
    assert counts == {"ok": True, "tokens": 4, "problems": []}
    assert record["tokens"] == ["t0", "t1", "t2"] and len(record["scores"]["p"]["generated"]) == 4
    assert record["scores"]["p"]["last"] == 0.4
    _, counts = sa.stream_record(stream_chunks(extra_score_in=1), [probe()])
    assert not counts["ok"] and any("2 new tokens" in p for p in counts["problems"])
    _, counts = sa.stream_record(stream_chunks(usage_at_end=False), [probe()])
    assert not counts["ok"] and "no closing usage chunk" in counts["problems"]


def test_teacher_forced_pairs_catch_an_off_by_one():
    sampled = {"p": {"generated": {"scores": [0.1, 0.3, 0.5, 0.7]}}}
    own = [pair for j in (0, 1, 2) for pair in forced_pairs(sampled, {"p": {"prompt": {"last": 0.1 + 0.2 * j}}}, j)]
    assert teacher_forced_summary(own)["closest_to_own_token"] == 3
    shifted = [pair for j in (0, 1, 2) for pair in forced_pairs(sampled, {"p": {"prompt": {"last": 0.3 + 0.2 * j}}}, j)]
    summary = teacher_forced_summary(shifted)
    assert summary["closest_to_own_token"] == 0 and summary["with_neighbours"] == 3


def test_graph_lines_find_the_capture_lines():
    log = "x\n[2025] Capture target decode CUDA graph end. elapsed=3.1 s\nprobex: prompt scores of layers [10, 20] leave mid-forward\n"
    lines = sa.graph_lines(log, {"decode": "Capture target decode CUDA graph end", "prefill": "prefill CUDA graph end",
                                 "mid": "leave mid-forward"})
    assert len(lines["decode"]) == 1 and lines["prefill"] == [] and lines["mid"]


# -- runner and arguments ----------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_failing_check_is_recorded_and_the_next_one_runs():
    seen = []

    def boom(ctx):
        raise ValueError("planted")

    checks = [sa.Check("boom", boom), sa.Check("fine", lambda ctx: {"pass": True, "n": 1}),
              sa.Check("off", lambda ctx: {"pass": False})]
    results = sa.run_checks(checks, None, record=lambda r: seen.append(list(r)))
    assert results["boom"]["status"] == "error" and "ValueError: planted" in results["boom"]["error"]
    assert results["fine"]["status"] == "pass" and results["fine"]["n"] == 1
    assert results["off"]["status"] == "fail"
    assert seen == [["boom"], ["boom", "fine"], ["boom", "fine", "off"]]  # written after every check


def test_the_budget_skips_checks_that_would_overrun_and_runs_cheaper_ones():
    clock = Clock()

    def slow(ctx):
        clock.now += 80
        return {"pass": True}

    costs = {"first": 100, "second": 100, "cheap": 10}
    checks = [sa.Check(name, slow) for name in costs]
    results = sa.run_checks(checks, None, budget_s=150, estimate=lambda c: costs[c.name], clock=clock, started=0.0)
    assert results["first"]["status"] == "pass" and results["first"]["seconds"] == 80
    assert results["second"]["status"] == "skipped" and "budget" in results["second"]["reason"]
    assert results["cheap"]["status"] == "pass"


def test_arguments():
    from bench.sglang_smoke import CHECKS

    names = list(CHECKS)
    assert names[0] == "parity-llama-bf16"  # the most telling first
    args = sa.parse_args(["--skeleton", "s", "--out", "o"], names)
    assert args.checks == names and args.budget_s is None and args.chunked_prefill_size == 64
    args = sa.parse_args(["--skeleton", "s", "--out", "o", "--checks", "radix, graphs", "--budget-s", "900",
                          "--extra-arg=--mem-fraction-static", "--extra-arg", "0.5"], names)
    assert args.checks == ["radix", "graphs"] and args.budget_s == 900
    assert args.extra_arg == ["--mem-fraction-static", "0.5"]
    for bad in (["--checks", "parity"], ["--checks", ","], ["--chunked-prefill-size", "0"]):
        with pytest.raises(SystemExit):
            sa.parse_args(["--skeleton", "s", "--out", "o", *bad], names)
    with pytest.raises(SystemExit):
        sa.parse_args(["--out", "o"], names)
    assert sa.parse_args(["--report", "saved.json"], names).report.name == "saved.json"


def test_the_estimate_counts_only_workers_still_to_start(tmp_path):
    from bench import sglang_smoke as smoke_module

    args = sa.parse_args(["--skeleton", "s", "--out", str(tmp_path)], list(smoke_module.CHECKS))
    smoke = smoke_module.Smoke(args)
    checks = smoke_module.CHECKS
    start = smoke_module.START_S
    assert smoke.estimate(checks["radix"]) == start + smoke_module.CHECK_S
    smoke.engines.current = (smoke_module.LLAMA_BF16, "http://x", None)
    assert smoke.estimate(checks["radix"]) == smoke_module.CHECK_S
    smoke.engines.info["seen"] = {"ready_s": 70.0}
    assert smoke.estimate(checks["graphs"]) == 2 * 70.0 + smoke_module.CHECK_S
    smoke.engines.current = None
    smoke.batches[smoke_module.LLAMA_BF16] = []  # the default mode's batch is kept from parity
    assert smoke.estimate(checks["graphs"]) == 2 * 70.0 + smoke_module.CHECK_S


def test_worker_commands_and_requests(tmp_path):
    from bench import sglang_smoke as smoke_module

    specs = smoke_module.isolation_specs("m")
    assert len(specs) == 16 and sum(bool(s.get("stream")) for s in specs) == 8
    lengths = [len(s["messages"][0]["content"]) for s in specs]
    assert lengths == sorted(lengths) and len({s["max_tokens"] for s in specs}) > 8
    assert all(s["vllm_xargs"] == {"probex_recompute": True} for s in specs)
    whole = smoke_module.chat_body("m", "hi", 3)
    assert whole["logprobs"] and whole["return_meta_info"] and "stream" not in whole
    streamed = smoke_module.chat_body("m", "hi", 3, stream=True)
    assert "return_meta_info" not in streamed  # SGLang refuses it on streams
    assert streamed["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert smoke_module.MODES["prefill-graphs-off"] == ["--cuda-graph-backend-prefill", "disabled"]


def test_a_saved_run_is_reported_without_an_engine(tmp_path, capsys):
    from bench import sglang_smoke as smoke_module

    saved = {"versions": {"sglang": "0.5.14"}, "elapsed_s": 12.0, "engines": {
        "llama-bfloat16-graphs": {"ready_s": 80.0, "graphs_captured": {"decode": True, "prefill": True},
                                  "listing": {"transfer": {"mid_forward_steps": 9, "submitted_steps": 40}},
                                  "health": {"score_steps_lost": 0}}},
             "checks": {"parity-llama-bf16": {"status": "pass", "seconds": 20.0, "max_abs_diff": 0.01},
                        "radix": {"status": "error", "seconds": 1.0, "error": "Traceback\nValueError: planted\n"},
                        "graphs": {"status": "skipped", "reason": "budget: 1 s used"}}}
    (tmp_path / "s.json").write_text(json.dumps(saved))
    smoke_module.main(["--report", str(tmp_path / "s.json")])
    out = capsys.readouterr().out
    assert "parity-llama-bf16" in out and "ValueError: planted" in out and "budget" in out and "9/40" in out


def test_the_smoke_imports_no_engine():
    code = ("import sys, bench.sglang_smoke; "
            "assert not {'sglang', 'vllm', 'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
