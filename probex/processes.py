"""Waiting for a worker process we started to answer, shared by the commands that spawn one."""

from __future__ import annotations

import subprocess
import time

import httpx


class WorkerExited(RuntimeError):
    def __init__(self, returncode: int) -> None:
        super().__init__(f"worker exited with code {returncode}")
        self.returncode = returncode


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout_s: float | None = None, poll_s: float = 2.0) -> None:
    """Block until `url`/health answers 200; raise WorkerExited if the process dies first."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise WorkerExited(proc.returncode)
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {timeout_s} s")
        time.sleep(poll_s)
