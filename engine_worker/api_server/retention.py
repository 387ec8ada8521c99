"""The calibration-retention check the API server runs for each probe set swapped in."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import atexit
from pathlib import Path
from typing import Callable


log = logging.getLogger("probex.middleware")


def _shared_dir(score_address: str | None) -> Path | None:
    """A directory every API server process of one worker finds: beside the score socket
    (launch.py names it anew for each start)."""
    if not score_address or not score_address.startswith("ipc://"):
        return None
    return Path(score_address[len("ipc://"):] + ".shared")

class RetentionTracker:
    """Relative calibration retention of the loaded probes, recomputed at startup and after each swap.

    The work (HF forward passes over each probe's retention set, on the model directory the
    engine serves) runs in a thread so requests keep flowing; a newer swap supersedes an
    older computation.
    """

    def __init__(self, model_dir: str | None, shared_dir: Path | None = None) -> None:
        """`shared_dir`: where several API server processes share the worker, a directory they
        all see: one of them computes each probe set's retention, the others read its result."""
        self.model_dir = model_dir
        self.shared_dir = shared_dir
        if shared_dir is not None:
            # Whichever process leaves first takes it along: the worker's start names a new one
            # (launch.py), so nothing in it serves a later start.
            atexit.register(shutil.rmtree, shared_dir, ignore_errors=True)
        self.values: dict[str, float | None] = {}
        self.status = "not computed"
        self._generation = 0

    def schedule(self, probe_dirs: list[str]) -> None:
        if not self.model_dir:
            self.status = "unavailable: the worker's tap configuration names no model directory"
            return
        self._generation += 1
        generation = self._generation
        self.status = "computing"

        async def job() -> None:
            from probes.retention import compute_retention

            try:
                if self.shared_dir is None:
                    results = await asyncio.to_thread(compute_retention, self.model_dir, probe_dirs)
                else:
                    results = await asyncio.to_thread(computed_once, self.shared_dir, self.model_dir, probe_dirs,
                                                      compute_retention)
            except Exception as exc:  # no datasets offline, odd artifact...: say so, keep serving
                if generation == self._generation:
                    self.status = f"unavailable: {type(exc).__name__}: {exc}"
                log.warning("probex: retention not computed: %s", exc)
                return
            if generation == self._generation:
                self.values = {name: r["retention"] for name, r in results.items()}
                self.status = "ready"
                log.info("probex: calibration retention %s", self.values)

        asyncio.get_running_loop().create_task(job())

def computed_once(shared_dir: Path, model_dir: str, probe_dirs: list[str], compute: Callable[[str, list[str]], dict]) -> dict:
    """`compute(model_dir, probe_dirs)`, run by one process of several for the same model and
    probe files: the first takes a lock and writes the result into `shared_dir`, the others
    wait for the lock and read it (HF forward passes over every retention set, and the model
    in memory, once instead of once per API server process). Keyed by the probe files' paths,
    sizes and times, so a probe rewritten in place is computed again."""
    import fcntl
    import hashlib

    from probes.atomic_files import replacing

    stats = [(d, f.name, f.stat().st_size, f.stat().st_mtime_ns)
             for d in probe_dirs for f in sorted(Path(d).iterdir()) if f.is_file()]
    key = hashlib.sha256(json.dumps([model_dir, stats]).encode()).hexdigest()[:24]
    shared_dir.mkdir(parents=True, exist_ok=True)
    result_path = shared_dir / f"retention-{key}.json"
    with open(shared_dir / "retention.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not result_path.exists():
            try:
                outcome = {"results": compute(model_dir, probe_dirs)}
            except Exception as exc:  # the others would only fail the same way, one after another
                outcome = {"error": f"{type(exc).__name__}: {exc}"}
            with replacing(result_path) as side:
                side.write_text(json.dumps(outcome))
        outcome = json.loads(result_path.read_text())
    if "error" in outcome:
        raise RuntimeError(outcome["error"])
    return outcome["results"]
