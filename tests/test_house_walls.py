"""The house's walls on the whole tree, and the checker shown to catch a planted violation."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.house_walls import check_tree

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_keeps_its_walls():
    assert check_tree(ROOT) == []


@pytest.fixture()
def tree(tmp_path):
    for package in ("probes", "engine_worker", "gateway", "probex", "bench"):
        if (ROOT / package).is_dir():
            shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "data"))
    return tmp_path


@pytest.mark.parametrize("path, line, expected", [
    ("engine_worker/scores/render.py", "import vllm", "imports the engine vllm"),
    ("engine_worker/tap/controller.py", "from engine_worker.vllm.worker import state_of", "the core never imports"),
    ("gateway/policy.py", "import torch", "gateway/ may not"),
    ("gateway/policy.py", "from engine_worker.settings import ADMIN_TOKEN", "gateway/ may import only"),
    ("probes/scoring.py", "from probex import cli", "probes/ may import only"),
    ("probes/scoring.py", "import fastapi", "probes/ may not"),
    ("probex/cli.py", "import bench", "imports the lab"),
    ("engine_worker/scores/columns.py", "from engine_worker.scores import render", "import cycle"),
    ("engine_worker/scores/columns.py", "if False:\n    from engine_worker.scores.render import prompt_fields",
     "import cycle"),
])
def test_a_planted_violation_is_caught(tree, path, line, expected):
    target = tree / path
    target.write_text(target.read_text() + "\n" + line + "\n")
    problems = check_tree(tree)
    assert any(expected in p for p in problems), problems


def test_an_oversized_product_file_is_caught(tree):
    (tree / "probes" / "big.py").write_text("x = 1\n" * 601)
    assert any("big.py: 601 lines" in p for p in check_tree(tree))


@pytest.mark.parametrize("module, forbidden", [
    ("probes", ("torch", "vllm", "fastapi", "gateway", "engine_worker")),
    ("probes.retention", ("torch", "vllm", "fastapi", "gateway", "engine_worker")),
    ("probes.steering", ("torch", "vllm", "fastapi", "gateway", "engine_worker")),
    ("engine_worker.steering", ("torch", "vllm", "fastapi", "gateway")),
    ("engine_worker.scores.formatter", ("torch", "vllm")),
    ("engine_worker.api_server.middleware", ("torch", "vllm", "gateway", "fastapi")),
    ("gateway.app", ("torch", "vllm", "engine_worker")),
    ("gateway.serving", ("torch", "vllm", "engine_worker")),
    ("probex.cli", ("bench", "vllm")),
])
def test_module_does_not_pull_in(module, forbidden):
    """What importing a module loads at run time (the static check above reads the source)."""
    code = (f"import sys, {module}; bad = [m for m in {forbidden!r} if m in sys.modules]; "
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-500:]


def test_the_product_ships_no_test_doubles():
    assert not (ROOT / "gateway" / "mock_upstream.py").exists()  # the mock worker lives in tests/fixtures
