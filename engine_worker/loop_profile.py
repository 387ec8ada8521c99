"""Where the API server's event loop spends its time: a sampling profiler of one thread.

ProbeX's own timers (`ScoreHub.intake`, `.chunks`) count only the work they wrap; they
cannot say what else the loop does, nor how much of the loop's time the tap adds inside
vLLM's own code (every monitored request asks for token ids, for one). This samples the
loop's thread instead: a daemon thread wakes every `interval_s`, reads the loop thread's
innermost Python frame (`sys._current_frames`) and books the time since its previous
sample to what that frame belongs to. Time-weighted, because a sample can only be taken
when the sampler gets the GIL: while the loop runs Python that can take up to the
interpreter's switch interval (5 ms), and the sample taken then stands for that whole
wait.

Books are kept two ways, as seconds:
- `by_owner`: "probex" when a ProbeX frame (engine_worker/, probes/) is found walking out
  from the innermost frame before any frame of vLLM or the ASGI server stack (so asyncio
  or ZMQ calls made by ProbeX count as ProbeX, while vLLM's app, which runs inside the
  middleware's call, does not); "vllm", "server" (uvicorn, starlette, fastapi, h11,
  httptools), "idle" (no Python frame above the loop's run call: waiting for events, or
  uvloop's own C work), or "other";
  Garbage collections hold the GIL until they end, so the sample after one lands in the
  collection timer's callback (`ScoreHub.collections`, passed as `collection_hooks`): that
  time is booked as "gc";
- `by_frame`: the innermost frame's "package/file.py:function", the functions themselves.

Diagnostics, off unless `PROBEX_LOOP_PROFILE_MS` is set (the sampling interval): the
sampler costs the loop a GIL hand-over and a few microseconds per sample.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter

ENV_LOOP_PROFILE_MS = "PROBEX_LOOP_PROFILE_MS"

_OWN_PACKAGES = ("engine_worker", "probes")
_VLLM_PACKAGES = ("vllm",)
_SERVER_PACKAGES = ("uvicorn", "starlette", "fastapi", "h11", "httptools")
# Frames that only run the loop: the thread is waiting for events, or in the loop's C code.
_LOOP_RUNNERS = {("asyncio", "runners.py"), ("asyncio", "base_events.py"), ("uvloop", "__init__.py"),
                 ("", "selectors.py")}
_WALK_LIMIT = 24  # frames looked at outward from the innermost for the owner


def _package_and_file(filename: str) -> tuple[str, str]:
    """("vllm", "serving.py") for ".../site-packages/vllm/entrypoints/openai/serving.py": the
    top-level package (the directory under site-packages or the repository; "" for the
    standard library's top level) and the file name."""
    parts = filename.replace("\\", "/").split("/")
    name = parts[-1]
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            index = len(parts) - 1 - parts[::-1].index(marker)
            return (parts[index + 1] if index + 2 < len(parts) else ""), name
    for package in (*_OWN_PACKAGES, *_VLLM_PACKAGES, *_SERVER_PACKAGES):
        if package in parts[:-1]:
            return package, name
    # the standard library: its package directory if any (asyncio/...), else ""
    return (parts[-2] if len(parts) >= 2 and not parts[-2].startswith("python") else ""), name


class LoopProfiler:
    """Samples one thread (the event loop's) every `interval_s` from a daemon thread."""

    def __init__(self, interval_s: float, thread_id: int | None = None, collection_hooks: tuple = ()) -> None:
        """`collection_hooks`: functions in `gc.callbacks` whose frames stand for the collection
        that just ended."""
        if interval_s <= 0:
            raise ValueError("the sampling interval must be positive")
        self.interval_s = interval_s
        self.thread_id = thread_id if thread_id is not None else threading.get_ident()
        self.samples = 0
        self.seconds = 0.0
        self.by_owner: Counter[str] = Counter()
        self.by_frame: Counter[str] = Counter()
        self._collection_codes = {getattr(hook, "__func__", hook).__code__ for hook in collection_hooks}
        self._files: dict[str, tuple[str, str]] = {}  # filename -> (package, file): one split per file
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last = 0.0

    def start(self) -> None:
        if self._thread is not None:
            return
        self._last = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="probex-loop-profile", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        frame = sys._current_frames().get(self.thread_id)
        now = time.perf_counter()
        weight, self._last = now - self._last, now
        if frame is None:
            return
        owner, innermost = self._classify(frame)
        self.samples += 1
        self.seconds += weight
        self.by_owner[owner] += weight
        self.by_frame[innermost] += weight

    def _where(self, code) -> tuple[str, str]:
        where = self._files.get(code.co_filename)
        if where is None:
            where = self._files[code.co_filename] = _package_and_file(code.co_filename)
        return where

    def _classify(self, frame) -> tuple[str, str]:
        package, name = self._where(frame.f_code)
        innermost = f"{package}/{name}:{frame.f_code.co_name}" if package else f"{name}:{frame.f_code.co_name}"
        if (package, name) in _LOOP_RUNNERS and frame.f_code.co_name in (
                "run", "run_until_complete", "run_forever", "_run_once", "select"):
            return "idle", innermost
        if frame.f_code in self._collection_codes:
            return "gc", innermost
        owner = None
        walked = 0
        while frame is not None and walked < _WALK_LIMIT:
            package = self._where(frame.f_code)[0]
            if package in _OWN_PACKAGES:
                owner = "probex"
                break
            if package in _VLLM_PACKAGES:
                owner = "vllm"
                break
            if package in _SERVER_PACKAGES:
                owner = "server"
                break
            frame = frame.f_back
            walked += 1
        return owner or "other", innermost

    def as_dict(self, top: int = 300) -> dict:
        """Cumulative books (readers take differences between snapshots): seconds by owner and
        for the `top` innermost frames."""
        return {"interval_s": self.interval_s, "samples": self.samples, "seconds": self.seconds,
                "by_owner": dict(self.by_owner), "by_frame": dict(self.by_frame.most_common(top))}


def profiler_from_env(collection_hooks: tuple = ()) -> LoopProfiler | None:
    """A profiler of the calling thread if PROBEX_LOOP_PROFILE_MS asks for one (not started)."""
    value = os.environ.get(ENV_LOOP_PROFILE_MS, "").strip()
    if not value:
        return None
    try:
        interval_ms = float(value)
    except ValueError:
        raise ValueError(f"{ENV_LOOP_PROFILE_MS} must be a number of milliseconds, not {value!r}") from None
    return LoopProfiler(interval_ms / 1e3, collection_hooks=collection_hooks) if interval_ms > 0 else None
