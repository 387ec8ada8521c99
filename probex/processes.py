"""Waiting for a worker process we started to answer, shared by the commands that spawn one."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx


# Ports below this never come from the kernel's ephemeral range on a default Linux (32768-60999).
_LOWEST_PICKED_PORT = 20000


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a server about to start).

    Picked at random below the kernel's ephemeral range, not by binding port 0: a port the kernel
    hands out is just as likely to be handed out again, before our server binds it, to the next
    `bind(0)` or outgoing connection (vLLM's engine sockets, another test's worker), which made a
    worker start fail with EADDRINUSE now and then when two started side by side.
    """
    low, _ = _ephemeral_port_range()
    candidates = range(_LOWEST_PICKED_PORT, low) if low - _LOWEST_PICKED_PORT >= 1000 else range(1024, low)
    for _ in range(200):
        port = random.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port found in {candidates.start}-{candidates.stop - 1}")


def port_taken(host: str, port: int) -> bool:
    """Whether something listens on `host`:`port` now, so a server could not (IPv4 or IPv6, as
    the host resolves). With SO_REUSEADDR, as servers bind: a port left in TIME_WAIT by a server
    just stopped is free. A host that cannot be bound for another reason (not this machine's,
    unknown) raises OSError saying so."""
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM,
                                                              0, socket.AI_PASSIVE):
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
                raise
    return False


class Terminated(SystemExit):
    """SIGTERM, unwinding the process (see `unwind_on_sigterm`)."""


def _raise_terminated(signum: int, frame) -> None:
    raise Terminated(128 + signum)


def unwind_on_sigterm():
    """Make SIGTERM unwind this process (`Terminated`, a SystemExit) instead of ending it on the
    spot, so the `finally` blocks that stop its workers run: they are started in sessions of
    their own (a terminal's Ctrl-C must not reach vLLM ahead of the order they are stopped in),
    so nothing else stops them. Returns the handler it replaced (None off the main thread, where
    Python refuses a handler and nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


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


@contextlib.contextmanager
def logged_worker(cmd: list[str], env: dict[str, str], log_path: Path, url: str, label: str,
                  timeout_s: float = 900, stop_grace_s: float = 60) -> Iterator[float]:
    """Start `cmd` (output to `log_path`), wait until `url` serves, yield the seconds that took; stop it after.

    The process gets its own session so stopping it takes the engine's processes along: SIGTERM
    to the group, then SIGKILL to whatever of it is left after `stop_grace_s` (an engine process
    still holding GPU memory would starve the next worker started on the same card).
    """
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            try:
                wait_until_healthy(proc, url, timeout_s=timeout_s)
            except WorkerExited as exc:
                raise RuntimeError(f"{label} {exc}: " + log_path.read_text()[-3000:]) from None
            yield time.monotonic() - started
        finally:
            # The group outlives a worker that died on its own only while its engine processes
            # do; once all are gone there is nothing to signal, and the real error must surface.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            _end_group(proc, stop_grace_s)


def _end_group(proc: subprocess.Popen, grace_s: float) -> None:
    """Wait up to `grace_s` for the process and the rest of its group to exit, then kill what is left."""
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    while time.monotonic() < deadline:
        if not _group_running(proc.pid):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def _group_running(pgid: int) -> bool:
    """Whether a process of group `pgid` is still running. Zombies do not count: where nothing reaps
    the orphans of a stopped worker (a container whose first process does not), they linger as
    zombies that a signal still reaches but that hold no memory."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():  # no procfs: a signal tells whether the group exists at all
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc_dir.glob("[0-9]*/stat"):
        found = process_state(stat)
        if found is not None and found[1] == pgid and found[0] != "Z":
            return True
    return False


def process_state(stat: Path) -> tuple[str, int] | None:
    """(state letter, process group) from a /proc/<pid>/stat file; None once the process is gone."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()  # after the name: state, ppid, pgrp
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2])
