"""A throwaway Redis for the tests: `redis-server` on a free port in a temporary directory, no persistence."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from probex.processes import free_port


class RedisServer:
    def __init__(self, persistent: bool = False) -> None:
        """`persistent`: every write is in its append-only file before Redis answers, so what was
        written survives `halt` and comes back with `start` (an outage test's server)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/setup.sh installs Debian's redis-server)")
        self.binary = binary
        self.persistence = ["--appendonly", "yes", "--appendfsync", "always"] if persistent else ["--appendonly", "no"]
        self.dir = Path(tempfile.mkdtemp(prefix="probex-redis-"))
        self.port = free_port()
        self.log = self.dir / "redis.log"
        self.start()

    def start(self) -> None:
        """Start (or start again, on the same port) and wait until it answers."""
        binary = self.binary
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *self.persistence,
             "--dir", str(self.dir), "--logfile", str(self.log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.proc.returncode}: "
                                   f"{self.log.read_text()[-500:] if self.log.exists() else ''}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.05)

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def halt(self) -> None:
        """Stop the server, keeping its port and directory for `start` (an outage)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
