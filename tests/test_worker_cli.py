"""`probex worker` refuses bad probes, bad vLLM options and settings it no longer reads before any
engine starts, naming the file, the option or the setting and the problem."""

import os
import subprocess
import sys

import numpy as np
import pytest

from probes.artifact import ProbeArtifact, ReadPoint, save_probe
from tests.engine_harness import model_dir


def run_worker(*args):
    return subprocess.run([sys.executable, "-m", "probex.cli", "worker", "--model", str(model_dir()), *args],
                          capture_output=True, text=True, timeout=120)


def probe(tmp_path, name, hidden=576, layer=3, weight=None):
    w = np.ones(hidden, np.float32) if weight is None else weight
    return save_probe(ProbeArtifact(name=name, layer=layer, read=ReadPoint.LAST_PROMPT_TOKEN, weight=w, bias=0.0),
                      tmp_path / name)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("hidden", "has hidden_size 512 but the served model has hidden_size 576"),
        ("layer", "reads layer 30, out of range for a model with 30 decoder layers"),
        ("nan", "non-finite values"),
    ],
)
def test_bad_probe_is_a_startup_refusal(tmp_path, kind, message):
    if kind == "hidden":
        path = probe(tmp_path, "p", hidden=512)
    elif kind == "layer":
        path = probe(tmp_path, "p", layer=30)
    else:
        path = probe(tmp_path, "p", weight=np.full(576, np.nan, np.float32))
    result = run_worker("--probe", str(path))
    assert result.returncode != 0
    assert message in result.stderr and str(path) in result.stderr


def test_out_of_range_extra_layer_and_no_tap_are_refused(tmp_path):
    result = run_worker("--layer", "99")
    assert result.returncode != 0 and "--layer 99 is out of range" in result.stderr
    result = run_worker()
    assert result.returncode != 0 and "at least one --probe or --layer" in result.stderr


def test_bad_steering_options_are_startup_refusals(tmp_path):
    from probes.steering import SteeringVector, save_vector

    nan = save_vector(SteeringVector("v", 3, np.full(576, np.nan, np.float32)), tmp_path / "nan")
    result = run_worker("--layer", "3", "--steer-vector", str(nan))
    assert result.returncode != 0 and "non-finite values" in result.stderr and str(nan) in result.stderr
    result = run_worker("--layer", "3", "--steer-layer", "30")
    assert result.returncode != 0 and "--steer-layer 30 is out of range" in result.stderr
    two = [save_vector(SteeringVector(f"v{i}", 3, np.ones(576, np.float32)), tmp_path / f"v{i}") for i in range(2)]
    result = run_worker("--layer", "3", "--steer-vectors", "1", *[f"--steer-vector={p}" for p in two])
    assert result.returncode != 0 and "exceed --steer-vectors 1" in result.stderr


@pytest.mark.parametrize("passthrough", [["--api-server-count", "0"], ["--api-server-count=two"], ["-asc"]])
def test_an_api_server_count_that_is_not_a_whole_number_of_processes_is_refused(passthrough):
    result = run_worker("--layer", "3", *passthrough)
    assert result.returncode != 0 and "refusing to start" in result.stderr
    assert "number of API server processes" in result.stderr


@pytest.mark.parametrize("passthrough", [["--data-parallel-size", "2"], ["-dp=4"], ["--data_parallel_size", "x"]])
def test_data_parallel_engines_are_refused(passthrough):
    """Each data-parallel engine would publish its scores on the one socket the worker has."""
    result = run_worker("--layer", "3", *passthrough)
    assert result.returncode != 0 and "refusing to start" in result.stderr and "one engine per worker" in result.stderr


@pytest.mark.parametrize("passthrough, count", [([], 1), (["--api-server-count", "1"], 1), (["--api-server-count", "2"], 2),
                                                (["--api-server-count=4"], 4), (["-asc", "2"], 2),
                                                (["--api_server_count", "3"], 3)])
def test_several_api_server_processes_are_started_by_vllm_serve_and_told_their_count(passthrough, count):
    """One API server process: vLLM's api_server module. Several: vLLM's `serve` (only it
    starts them), through engine_worker.vllm.serve; every process reads the count from the tap
    configuration in PROBEX_TAP_CONFIG and so tags its requests (middleware.py). The count is a
    run field: vLLM's compile-cache key does not change with it."""
    import argparse
    import json

    from engine_worker.settings import TAP_CONFIG
    from engine_worker.tap.config import TapConfig
    from engine_worker.vllm.launch import add_worker_arguments, build_worker_command

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    argv, env = build_worker_command(parser.parse_args(["--model", "smollm2-135m-instruct", "--layer", "3"]),
                                     passthrough)
    assert TapConfig.from_json(env[TAP_CONFIG]).api_server_count == count
    assert "api_server_count" not in json.loads(argv[argv.index("--additional-config") + 1])["probex"]
    module = argv[argv.index("-m") + 1]
    if count == 1:
        assert module == "vllm.entrypoints.openai.api_server"
        assert argv[argv.index("--api-server-count") + 1] == "1"  # data parallelism must not raise it
    else:
        assert module == "engine_worker.vllm.serve" and "--model" not in argv  # serve takes it positionally
        assert argv[argv.index("-m") + 2].endswith("smollm2-135m-instruct")
    assert argv[-len(passthrough):] == passthrough if passthrough else True


def test_a_model_given_by_name_is_served_under_that_name_and_its_path():
    import argparse

    from engine_worker.vllm.launch import add_worker_arguments, build_worker_command

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    by_name, _ = build_worker_command(parser.parse_args(["--model", "smollm2-135m-instruct", "--layer", "3"]), [])
    at = by_name.index("--served-model-name")
    assert by_name[at + 1 : at + 3] == ["smollm2-135m-instruct", str(model_dir())]
    by_path, _ = build_worker_command(parser.parse_args(["--model", str(model_dir()), "--layer", "3"]), [])
    assert "--served-model-name" not in by_path


def test_restarts_and_other_probe_files_keep_the_compile_cache_key(tmp_path):
    """vLLM hashes additional_config into its compile-cache key: only graph-shaping fields go there.

    Two starts with other probe files, capture folders and (always new) score sockets must hand
    vLLM the same additional_config, or every start compiles the model again; the engine still
    gets the whole configuration, from PROBEX_TAP_CONFIG.
    """
    import argparse
    import json

    from engine_worker.tap.config import ENV_TAP_CONFIG, TapConfig
    from engine_worker.vllm.launch import add_worker_arguments, build_worker_command

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)

    def start(name):
        args = parser.parse_args(["--model", str(model_dir()), "--probe", str(probe(tmp_path, name)),
                                  "--capture-dir", str(tmp_path / f"capture-{name}")])
        argv, env = build_worker_command(args, [])
        return json.loads(argv[argv.index("--additional-config") + 1]), env

    (first, first_env), (second, second_env) = start("a"), start("b")
    assert first == second
    engine_config = TapConfig.for_engine(first, environ=first_env)
    assert engine_config.probe_dirs == (str((tmp_path / "a").resolve()),)
    assert engine_config.capture_dir == str((tmp_path / "capture-a").resolve())
    assert engine_config.score_address == json.loads(first_env[ENV_TAP_CONFIG])["probex"]["score_address"]
    assert engine_config.score_address != TapConfig.for_engine(second, environ=second_env).score_address
    assert engine_config.layers == (3,) and engine_config.capture_enabled
    # An engine process without the environment refuses to start instead of serving without probes.
    with pytest.raises(ValueError, match="has no PROBEX_TAP_CONFIG"):
        TapConfig.for_engine(first, environ={})
    assert first_env["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"].split(",")[-1] == "PROBEX_"  # Ray workers get it
    # Graphs and environment must agree: another tap's environment is refused, not half used.
    other = TapConfig(layers=(5,)).to_json()
    with pytest.raises(ValueError, match="disagrees with vLLM's additional_config on capture_rows, layers"):
        TapConfig.for_engine(first, environ={ENV_TAP_CONFIG: other})
    # vLLM started by hand with everything in additional_config needs no environment.
    whole = engine_config.to_additional_config(run_fields=True)
    assert TapConfig.for_engine(whole, environ={}) == engine_config
    assert TapConfig.from_json(first_env[ENV_TAP_CONFIG]) == engine_config  # the API server's reading


def _worker_parser():
    import argparse

    from engine_worker.vllm.launch import add_worker_arguments

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser


@pytest.mark.parametrize("name, value, replacement", [
    ("PROBEX_SCORE_RING", "0", "score ring -> score formatter -> API servers"),
    ("PROBEX_SCORE_FORMATTER", "off", "score ring -> score formatter -> API servers"),
    ("PROBEX_DELIVERY", "off", "PUT /probex/tap"),
    ("PROBEX_TAP_KERNEL", "torch", "Triton on CUDA, torch elsewhere"),
    ("PROBEX_TAP_BUFFERS", "in-model", "allocated after the weights"),
    ("PROBEX_API_SERVER_COUNT", "2", "--api-server-count"),
    ("PROBEX_MODEL_DIR", "/models/x", "model directory in the tap configuration"),
])
def test_a_setting_the_worker_no_longer_reads_stops_it_with_one_line_naming_the_replacement(monkeypatch, name, value,
                                                                                             replacement):
    from engine_worker.vllm.launch import build_worker_command

    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as refused:
        build_worker_command(_worker_parser().parse_args(["--model", str(model_dir()), "--layer", "3"]), [])
    message = str(refused.value.code)
    assert "\n" not in message and message.startswith("probex worker:")
    assert name in message and replacement in message and "unset it" in message


def test_each_removed_setting_still_set_is_named_on_a_line_of_its_own(monkeypatch):
    from engine_worker.settings import refuse_removed_settings

    refuse_removed_settings({"PROBEX_ADMIN_TOKEN": "t", "PROBEX_SCORE_WAIT_S": "3", "PROBEX_CACHE": "/c"})  # read ones pass
    with pytest.raises(SystemExit) as refused:
        refuse_removed_settings({"PROBEX_SCORE_RING": "1", "PROBEX_STEP_TIMING": "1", "PROBEX_SCORE_WAIT_S": "3"})
    lines = str(refused.value.code).split("\n")
    assert len(lines) == 2 and all(line.startswith("probex worker: ") for line in lines)
    assert "PROBEX_SCORE_RING" in lines[0] and "PROBEX_STEP_TIMING" in lines[1]


@pytest.mark.parametrize("flag", ["--score-formatter", "--no-score-formatter"])
def test_the_score_formatter_flags_are_refused_with_one_line(flag):
    from engine_worker.vllm.launch import build_worker_command

    with pytest.raises(SystemExit) as refused:
        build_worker_command(_worker_parser().parse_args(["--model", str(model_dir()), "--layer", "3", flag]), [])
    message = str(refused.value.code)
    assert "\n" not in message and message.startswith("probex worker:")
    assert "--no-score-formatter" in message and "always runs" in message


def test_probex_worker_refuses_a_removed_flag_and_setting_before_anything_starts():
    """The command line end to end: exit status 1 and the one-line reason on stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBEX_")}
    for args, extra_env, named in ((["--no-score-formatter"], {}, "--no-score-formatter"),
                                   ([], {"PROBEX_SCORE_RING": "0"}, "PROBEX_SCORE_RING")):
        result = subprocess.run([sys.executable, "-m", "probex.cli", "worker", "--model", str(model_dir()),
                                 "--layer", "3", *args], env={**env, **extra_env}, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 1, result.stderr[-2000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and named in lines[0], result.stderr[-2000:]


def test_the_served_model_directory_travels_in_the_tap_configuration(monkeypatch):
    import json

    from engine_worker.settings import TAP_CONFIG
    from engine_worker.tap.config import TapConfig
    from engine_worker.vllm.launch import build_worker_command

    argv, env = build_worker_command(_worker_parser().parse_args(["--model", "smollm2-135m-instruct", "--layer", "3"]),
                                     [])
    assert TapConfig.from_json(env[TAP_CONFIG]).model_dir == str(model_dir())
    assert "model_dir" not in json.loads(argv[argv.index("--additional-config") + 1])["probex"]  # a run field


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "[::]", "worker.example"])
def test_a_worker_listening_beyond_loopback_without_an_admin_token_is_refused_with_one_line(monkeypatch, host):
    from engine_worker.vllm.launch import build_worker_command

    monkeypatch.delenv("PROBEX_ADMIN_TOKEN", raising=False)
    # refused before the model is looked at: no such model directory is needed
    args = _worker_parser().parse_args(["--model", "/nonexistent/model", "--layer", "3", "--host", host])
    with pytest.raises(SystemExit) as refused:
        build_worker_command(args, [])
    message = str(refused.value.code)
    assert "\n" not in message and message.startswith(f"probex worker: --host {host} is beyond loopback")
    assert "--admin-token" in message and "PROBEX_ADMIN_TOKEN" in message


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_a_loopback_worker_starts_without_an_admin_token(monkeypatch, host):
    from engine_worker.settings import ADMIN_TOKEN
    from engine_worker.vllm.launch import build_worker_command

    monkeypatch.delenv("PROBEX_ADMIN_TOKEN", raising=False)
    argv, env = build_worker_command(_worker_parser().parse_args(["--model", str(model_dir()), "--layer", "3",
                                                                  "--host", host]), [])
    assert argv[argv.index("--host") + 1] == host and ADMIN_TOKEN not in env


@pytest.mark.parametrize("from_environment", [False, True])
def test_a_worker_beyond_loopback_starts_with_an_admin_token(monkeypatch, from_environment):
    from engine_worker.settings import ADMIN_TOKEN
    from engine_worker.vllm.launch import build_worker_command

    monkeypatch.delenv("PROBEX_ADMIN_TOKEN", raising=False)
    given = ["--admin-token", "t0ken"]
    if from_environment:
        monkeypatch.setenv("PROBEX_ADMIN_TOKEN", "t0ken")
        given = []
    argv, env = build_worker_command(_worker_parser().parse_args(["--model", str(model_dir()), "--layer", "3",
                                                                  "--host", "0.0.0.0", *given]), [])
    assert argv[argv.index("--host") + 1] == "0.0.0.0" and env[ADMIN_TOKEN] == "t0ken"
    assert "t0ken" not in argv  # the token reaches the API servers through the environment only


def test_probex_worker_beyond_loopback_without_a_token_exits_with_one_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBEX_")}
    result = subprocess.run([sys.executable, "-m", "probex.cli", "worker", "--model", str(model_dir()), "--layer", "3",
                             "--host", "0.0.0.0"], env=env, capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "--admin-token" in lines[0], result.stderr[-2000:]
