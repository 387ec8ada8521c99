"""The package walls: probes/ and gateway/ import no engine, and gateway/ never imports engine_worker."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module, forbidden",
    [
        ("probes", ("torch", "vllm", "fastapi", "gateway", "engine_worker")),
        ("probes.retention", ("torch", "vllm", "fastapi", "gateway", "engine_worker")),
        ("probes.steering", ("torch", "vllm", "fastapi", "gateway", "engine_worker")),
        ("probes.models", ("torch", "vllm", "fastapi", "gateway", "engine_worker", "probex")),
        ("probes.demo", ("torch", "vllm", "fastapi", "gateway", "engine_worker", "probex")),
        ("engine_worker.launch", ("probex", "bench")),
        ("probex.cli", ("bench",)),
        ("engine_worker.steering", ("torch", "vllm", "fastapi", "gateway")),
        ("gateway.app", ("torch", "vllm", "engine_worker")),
        ("gateway.serving", ("torch", "vllm", "engine_worker")),
        ("engine_worker.middleware", ("gateway", "fastapi")),
    ],
)
def test_module_does_not_pull_in(module, forbidden):
    code = (f"import sys, {module}; bad = [m for m in {forbidden!r} if m in sys.modules]; "
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-500:]


def test_only_the_vllm_modules_of_engine_worker_touch_vllm():
    """Engine internals live behind `engine_worker/vllm_*.py` (one adapter per model runner)."""
    import ast
    from pathlib import Path

    offenders = []
    for path in sorted(Path(__file__).resolve().parents[1].joinpath("engine_worker").glob("*.py")):
        if path.name.startswith("vllm_"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n == "vllm" or n.startswith("vllm.")]
    assert not offenders, offenders
