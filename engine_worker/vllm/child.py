"""vLLM's server as a child of `probex worker`: its output streamed through, signals passed on, and a
start that fails explained in one line.

vLLM reports a failed start with a traceback from each of its processes, the root cause buried in
the first. The worker watches the output; when vLLM exits before it serves, the worker prints
`probex worker: <root cause>; <what to change>` last, and exits non-zero.
"""

from __future__ import annotations

import collections
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
from typing import IO

# uvicorn's line once vLLM's server listens: a later exit is not a failed start.
READY_MARKER = "Application startup complete"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_TAIL_LINES = 2000
_LONGEST_LINE = 1 << 16  # of a line kept for the explanation
_PR_SET_PDEATHSIG = 1

# "(EngineCore pid=12) ERROR 12-07 02:53:40 [core.py:1510] " before the text of vLLM's log lines.
_PREFIX = re.compile(r"^(?:\([\w.-]+ pid=\d+\)\s*)?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) [\d-]+ [\d:.]+ \[[^\]]*\]\s?)?")
_EXCEPTION = re.compile(r"^((?:[A-Za-z_]\w*\.)*(?:[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)|Exception)): (.+)$")
# Exceptions that only say another process failed ("See root cause above").
_WRAPPERS = ("root cause", "initialization failed", "EngineDeadError", "Engine core proc")


def _exception_lines(lines: list[str]) -> list[tuple[str, str]]:
    found = []
    for line in lines:
        match = _EXCEPTION.match(_PREFIX.sub("", line.rstrip()))
        if match:
            found.append((match.group(1), match.group(2).strip()))
    return found


def root_cause(lines: list[str]) -> str | None:
    """The exception a failed start comes down to: the first one raised that is not another
    process's failure relayed; else the last exception line; None if there is none."""
    found = _exception_lines(lines)
    for name, message in found:
        if not any(w in f"{name}: {message}" for w in _WRAPPERS):
            return f"{name}: {message}"
    return f"{found[-1][0]}: {found[-1][1]}" if found else None


def _first_sentence(text: str) -> str:
    head = re.split(r"(?<=[.)])\s+(?=[A-Z])", text, maxsplit=1)[0]
    return head.rstrip(".")


def explain_failed_start(lines: list[str], returncode: int, host: str, port: int) -> str:
    """One line, `probex worker: <root cause>; <what to change>`, for vLLM's output of a failed start."""
    text = "\n".join(lines)
    cause = root_cause(lines)
    message = cause.split(": ", 1)[1] if cause else ""
    if "Address already in use" in text:
        return (f"probex worker: port {port} on {host} is in use; pass another --port, or stop what listens there")
    if "less than desired CPU memory utilization" in message or "less than desired GPU memory utilization" in message:
        return (f"probex worker: not enough free memory for the engine's --gpu-memory-utilization"
                f" ({_first_sentence(message)}); lower --gpu-memory-utilization, or leave it out on the CPU backend"
                " to let the worker size the KV cache, or free memory")
    if "less than requested memory for kv" in message:
        requested = re.search(r"requested memory for kv \((-?[\d.]+)", message)
        if requested and float(requested.group(1)) <= 0:
            return ("probex worker: --gpu-memory-utilization leaves no memory for the KV cache once the model is"
                    f" loaded ({_first_sentence(message)}); raise it, or leave it out on the CPU backend to let the"
                    " worker size the KV cache")
        return (f"probex worker: not enough memory for the KV cache ({_first_sentence(message)}); lower"
                " --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE, or free memory")
    if "No available memory for the cache blocks" in message or "Cannot auto-fit max_model_len" in message:
        return ("probex worker: no memory is left for the KV cache once the model is loaded; raise"
                " --gpu-memory-utilization or --kv-cache-memory-bytes, or serve a smaller model")
    if "To serve at least one request with the model's max seq len" in message:
        estimate = re.search(r"estimated maximum model length is (\d+)", message)
        hint = f" (at most {estimate.group(1)} fits)" if estimate else ""
        return ("probex worker: the KV cache cannot hold one sequence of the model's maximum length; lower"
                f" --max-model-len{hint}, or give the KV cache more memory (--kv-cache-memory-bytes,"
                " --gpu-memory-utilization)")
    if "OutOfMemoryError" in (cause or "") or "CUDA out of memory" in text:
        return ("probex worker: the GPU ran out of memory while the engine started; lower"
                " --gpu-memory-utilization, --max-model-len or --max-num-seqs, or free GPU memory")
    if ("Invalid repository ID or local directory" in text or "is not a local folder and is not a valid model" in text
            or ("config.json" in message and ("No such file" in message or "does not appear to have" in message))):
        return (f"probex worker: the engine found no model at a path or name it was given ({cause}); pass a model"
                " directory holding config.json, a Hugging Face id, or smollm2-135m-instruct")
    if returncode < 0:
        name = signal.Signals(-returncode).name
        oom = " (the kernel's out-of-memory killer sends it)" if -returncode == signal.SIGKILL else ""
        return (f"probex worker: the engine was killed by {name} before it served{oom}; free memory or lower"
                " --kv-cache-memory-bytes, --max-model-len or --max-num-seqs")
    if cause:
        return f"probex worker: the engine failed to start: {cause}; see its output above for where"
    return f"probex worker: the engine exited with status {returncode} before it served; see its output above"


def _die_with_parent(parent: int):
    """For the child, before vLLM runs: SIGTERM it if `probex worker` is killed outright."""
    def set_up() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            return  # no prctl: nothing to set
        if os.getppid() != parent:  # the worker died before that took hold
            os.kill(os.getpid(), signal.SIGTERM)
    return set_up


class _Output:
    """Copies one of the child's streams to ours as it comes (progress bars' carriage returns too),
    keeping its last lines."""

    def __init__(self, source: IO[bytes], sink: IO[bytes], tail: collections.deque, ready: threading.Event,
                 lock: threading.Lock) -> None:
        self.source, self.sink, self.tail, self.ready, self.lock = source, sink, tail, ready, lock
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _line(self, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip("\r")
        with self.lock:
            self.tail.append(line)
        if not self.ready.is_set() and READY_MARKER in line:
            self.ready.set()

    def _pump(self) -> None:
        pending = b""
        while chunk := os.read(self.source.fileno(), 1 << 16):
            try:
                self.sink.write(chunk)
                self.sink.flush()
            except (OSError, ValueError):
                pass  # our own output is gone: keep draining the child's
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                self._line(raw)
            pending = pending[-_LONGEST_LINE:]
        if pending:
            self._line(pending)


def run_engine(argv: list[str], env: dict[str, str], host: str = "127.0.0.1", port: int = 0) -> int:
    """Run `argv` (vLLM's server) in a process group of its own until it exits; the exit status to end with.

    SIGTERM, SIGINT and SIGHUP sent to the worker go to that group, as they would to vLLM run
    alone. Output passes through unchanged; a start that fails adds the one-line explanation."""
    env = {**env, "PYTHONUNBUFFERED": "1"}  # vLLM's lines as they are written, not at exit
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0,
                             preexec_fn=_die_with_parent(os.getpid()) if sys.platform.startswith("linux") else None)
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    ready, lock, signalled = threading.Event(), threading.Lock(), []

    def forward(signum, _frame) -> None:
        signalled.append(signum)
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        outputs = [_Output(child.stdout, sys.stdout.buffer, tail, ready, lock),
                   _Output(child.stderr, sys.stderr.buffer, tail, ready, lock)]
        returncode = child.wait()
        try:  # what the group still holds (an engine process whose server died) goes with it
            os.killpg(child.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        for output in outputs:  # the rest of the output, while those processes end
            output.thread.join(timeout=10)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if returncode != 0 and not ready.is_set() and not signalled:
        with lock:
            lines = list(tail)
        print(explain_failed_start(lines, returncode, host, port), file=sys.stderr, flush=True)
        return returncode if returncode > 0 else 128 - returncode
    return returncode if returncode >= 0 else 128 - returncode
