"""`probex worker --engine sglang` (engine_worker/sglang/launch.py, serve.py): the command line
it builds and what it refuses, without starting SGLang."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from probes.artifact import ProbeArtifact, ReadPoint, save_probe
from engine_worker.sglang import launch, serve
from engine_worker.settings import TAP_CONFIG
from engine_worker.tap.config import TapConfig
from engine_worker.worker_launch import add_worker_arguments


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "tiny-llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 4,
                                                  "architectures": ["LlamaForCausalLM"]}))
    return path


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_known_args(list(argv))


def test_the_command_starts_sglang_through_serve_with_the_tap_in_the_environment(model, tmp_path, monkeypatch):
    monkeypatch.delenv("PROBEX_ADMIN_TOKEN", raising=False)
    probe = save_probe(ProbeArtifact(name="p", layer=2, read=ReadPoint.LAST_PROMPT_TOKEN,
                                     weight=np.ones(8, np.float32), bias=0.0), tmp_path / "p")
    args, extra = parse("--engine", "sglang", "--model", str(model), "--probe", str(probe), "--layer", "1",
                        "--port", "9000", "--attention-backend", "triton", "--tp", "1")
    assert args.engine == "sglang"
    argv, env = launch.build_worker_command(args, extra)
    assert argv[argv.index("-m") + 1] == "engine_worker.sglang.serve"
    assert argv[argv.index("--model-path") + 1] == str(model)
    assert argv[argv.index("--port") + 1] == "9000" and argv[-4:] == ["--attention-backend", "triton", "--tp", "1"]
    assert "--served-model-name" not in argv and "--additional-config" not in argv
    tap = TapConfig.from_json(env[TAP_CONFIG])
    assert tap.layers == (1, 2) and tap.probe_dirs == (str(probe.resolve()),) and tap.api_server_count == 1
    assert tap.score_address.startswith("ipc://") and "PROBEX_ADMIN_TOKEN" not in env


def test_vllm_stays_the_default_engine(model):
    args, _ = parse("--model", str(model), "--layer", "1")
    assert args.engine == "vllm"


@pytest.mark.parametrize("extra, message", [
    (["--tp", "2"], "--tp 2: tensor parallelism is not available on SGLang yet"),
    (["--tp-size=2"], "--tp-size 2: tensor parallelism"),
    (["--tensor-parallel-size", "4"], "--tensor-parallel-size 4: tensor parallelism"),
    (["--dp", "2"], "--dp 2: ProbeX delivers the scores of one engine per worker"),
    (["--pp-size", "2"], "pipeline parallelism"),
    (["--enable-dp-attention"], "--enable-dp-attention: data-parallel attention"),
    (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm: speculative decoding is not available"),
    (["--chunked-prefill-size", "-1"], "--chunked-prefill-size -1: the tap needs chunked prefill"),
    (["--tokenizer-worker-num", "2"], "one tokenizer worker only"),
    (["--disaggregation-mode", "prefill"], "prefill/decode disaggregation"),
    (["--enable-two-batch-overlap"], "two-batch overlap"),
    (["--model-path", "/elsewhere"], "give the model with --model"),
])
def test_what_probex_does_not_serve_on_sglang_is_refused(model, extra, message):
    args, rest = parse("--engine", "sglang", "--model", str(model), "--layer", "1", *extra)
    with pytest.raises(SystemExit, match=message.replace("(", r"\(")):
        launch.build_worker_command(args, rest)


@pytest.mark.parametrize("extra", [["--steer-layer", "1"], ["--steer-vector", "/some/vector"]])
def test_steering_is_refused_on_sglang(model, extra):
    args, rest = parse("--engine", "sglang", "--model", str(model), "--layer", "1", *extra)
    with pytest.raises(SystemExit, match="steering is not available on SGLang"):
        launch.build_worker_command(args, rest)


def test_harmless_values_of_refused_flags_pass(model):
    args, rest = parse("--engine", "sglang", "--model", str(model), "--layer", "1", "--tp", "1",
                       "--disaggregation-mode", "null", "--chunked-prefill-size", "4096")
    argv, _ = launch.build_worker_command(args, rest)
    assert argv[-6:] == ["--tp", "1", "--disaggregation-mode", "null", "--chunked-prefill-size", "4096"]


def test_the_probe_checks_are_the_same_as_for_vllm(model):
    args, rest = parse("--engine", "sglang", "--model", str(model), "--layer", "4")
    with pytest.raises(SystemExit, match="--layer 4 is out of range"):
        launch.build_worker_command(args, rest)


def test_a_short_model_name_is_served_under_that_name(model):
    assert launch._served_name("smollm2-135m-instruct", []) == ["--served-model-name", "smollm2-135m-instruct"]
    assert launch._served_name(str(model), []) == []
    assert launch._served_name("x", ["--served-model-name=y"]) == []


def test_parsed_server_arguments_are_checked_again():
    fine = SimpleNamespace(tp_size=1, pp_size=1, dp_size=1, enable_dp_attention=False, speculative_algorithm=None,
                           enable_two_batch_overlap=False, enable_pdmux=False, disaggregation_mode="null",
                           tokenizer_worker_num=1, chunked_prefill_size=8192)
    assert serve.server_args_problem(fine) is None
    bad = SimpleNamespace(**{**vars(fine), "tp_size": 2, "chunked_prefill_size": -1, "speculative_algorithm": "EAGLE"})
    assert serve.server_args_problem(bad) == ("tensor parallelism (tp_size > 1) is not available on SGLang yet,"
                                              " speculative decoding, prefill without chunks (chunked_prefill_size <= 0)")


def test_the_plugin_must_be_registered_and_allowed(monkeypatch):
    plugin = SimpleNamespace(name="probex", value=serve.PLUGIN)
    monkeypatch.setattr(serve, "entry_points", lambda group: [plugin] if group == "sglang.srt.plugins" else [])
    assert serve.plugin_problem({}) is None
    assert serve.plugin_problem({"SGLANG_PLUGINS": "other, probex"}) is None
    assert "leaves out ProbeX's plugin" in serve.plugin_problem({"SGLANG_PLUGINS": "other"})
    monkeypatch.setattr(serve, "entry_points", lambda group: [])
    assert "not registered" in serve.plugin_problem({})


def test_the_cli_refuses_before_any_engine_starts(model):
    result = subprocess.run([sys.executable, "-m", "probex.cli", "worker", "--engine", "sglang", "--model", str(model),
                             "--layer", "1", "--tp", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "tensor parallelism is not available on SGLang yet" in result.stderr
