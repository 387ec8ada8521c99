"""The package walls: probes/ and gateway/ import no engine, and gateway/ never imports engine_worker."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module, forbidden",
    [
        ("probes", ("torch", "vllm", "fastapi", "gateway", "engine_worker")),
        ("probes.retention", ("torch", "vllm", "fastapi", "gateway", "engine_worker")),
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
