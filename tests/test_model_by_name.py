"""`--model` takes a directory, the demo model's short name, or a Hugging Face id resolved through the
local Hugging Face cache (no network here: the cache is laid out as huggingface_hub lays it out)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine_harness import MODEL_NAME, model_dir

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch):
    """HF_HUB_CACHE with the demo model as HUB_ID: a snapshot of links to its files, and refs/main."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for source in model_dir().iterdir():
        if source.is_file():
            (snapshot / source.name).symlink_to(source)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _worker_args(model: str) -> argparse.Namespace:
    from engine_worker.vllm.launch import add_worker_arguments

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args(["--model", model, "--layer", "3"])


def test_a_hugging_face_id_in_the_local_cache_resolves_to_its_snapshot(hub_cache):
    from engine_worker.vllm.launch import build_worker_command, resolve_model

    snapshot = hub_cache / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / REVISION
    assert resolve_model(HUB_ID) == snapshot
    argv, _ = build_worker_command(_worker_args(HUB_ID), [])
    assert argv[argv.index("--model") + 1] == str(snapshot)
    at = argv.index("--served-model-name")  # served under the id clients ask for
    assert argv[at + 1 : at + 3] == [HUB_ID, str(snapshot)]


def test_the_short_name_and_directories_still_resolve(hub_cache):
    from engine_worker.vllm.launch import resolve_model

    assert resolve_model(MODEL_NAME) == model_dir()
    assert resolve_model(str(model_dir())) == model_dir().resolve()


def test_an_id_absent_from_the_cache_offline_is_one_clear_error(hub_cache):
    from engine_worker.vllm.launch import resolve_model

    with pytest.raises(SystemExit) as refused:
        resolve_model("SomeOrg/NoSuchModel")
    message = str(refused.value.code)
    assert "\n" not in message and "'SomeOrg/NoSuchModel'" in message
    assert str(hub_cache) in message and "HF_HUB_OFFLINE" in message and "--model /path/to/model" in message


def test_an_incomplete_cache_entry_is_not_served(hub_cache):
    """A snapshot without config.json (an interrupted download) is not a model: offline, it is an error."""
    from engine_worker.vllm.launch import resolve_model

    snapshot = hub_cache / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / REVISION
    (snapshot / "config.json").unlink()
    with pytest.raises(SystemExit, match="not in the Hugging Face cache"):
        resolve_model(HUB_ID)


def test_probex_worker_names_an_absent_id_in_one_line_on_stderr(tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
    result = subprocess.run([sys.executable, "-m", "probex.cli", "worker", "--model", "SomeOrg/NoSuchModel",
                             "--layer", "3"], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "'SomeOrg/NoSuchModel'" in lines[0] and "--model /path/to/model" in lines[0]


@pytest.mark.parametrize("name", ["./models/x", "/nonexistent/model", "not-a-known-name"])
def test_a_missing_directory_or_unknown_name_says_what_model_can_be(name):
    from engine_worker.vllm.launch import resolve_model

    with pytest.raises(SystemExit) as refused:
        resolve_model(name)
    message = str(refused.value.code)
    assert f"{name!r} not found" in message and "Hugging Face id" in message and MODEL_NAME in message
