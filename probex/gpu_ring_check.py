"""GPU check of the score ring (engine_worker/score_ring.py) without an engine, in seconds.

Stands in for the engine loop: each step keeps the GPU busy with a matmul (the forward),
fills two tapped layers' static score buffers with values that name the step, and
publishes the step to the ring; the next step overwrites the buffers straight away, as
the next forward would. A reader in a second process follows the ring as the API server
does. Checks that

- every step arrives, in order, with its own values (the copies ran in stream order,
  before the next step overwrote the buffers);
- `publish_step` returns without waiting for the GPU (its time per step is printed and
  compared with the step's GPU time).

Like an engine, the loop runs at most two steps ahead of the GPU (vLLM waits for a step's
sampled tokens before scheduling the one after next); unbounded, it would fill the ring
and measure the ring's back-pressure instead.

    python3 -m probex.gpu_ring_check [--steps 300] [--rows 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def follow(path: str, steps: int, rows: int, capacity: int) -> dict:
    from engine_worker.score_ring import ScoreRingReader

    reader = ScoreRingReader(path)
    while not reader.attach():
        time.sleep(0.01)
    bad, landed = [], []
    while len(landed) < steps:
        posted = reader.wait(10.0)
        if not posted:
            return {"error": f"nothing posted after {len(landed)} steps"}
        for _ in range(posted):
            record = reader.read()
            step = record.meta["step"]
            want = np.full((rows, capacity), float(step), np.float32)
            if record.seq != len(landed) + 1 or not (np.array_equal(record.raw_by_layer[10], want)
                                                      and np.array_equal(record.raw_by_layer[20], -want)):
                bad.append(step)
            landed.append((time.monotonic_ns() - record.submitted_ns) / 1e6)
            reader.release(record)
    return {"steps": len(landed), "wrong_values": bad[:10], "wrong_count": len(bad),
            "landed_ms_mean": float(np.mean(landed)), "landed_ms_max": float(np.max(landed))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the same steps (no timing claims)")
    parser.add_argument("--follow", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.follow:
        path, steps, rows, capacity = args.follow
        print(json.dumps(follow(path, int(steps), int(rows), int(capacity))))
        return

    import torch

    from engine_worker.score_ring import ScoreRingWriter

    capacity = 4
    cuda = args.device == "cuda"
    sources = {layer: torch.zeros(8192, capacity, device=args.device) for layer in (10, 20)}
    path = str(Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)) / "check.ring")
    writer = ScoreRingWriter(path, sources)
    reader = subprocess.Popen([sys.executable, "-m", "probex.gpu_ring_check", "--follow", path, str(args.steps),
                               str(args.rows), str(capacity)], stdout=subprocess.PIPE, text=True)
    while Path(path).exists():  # the reader unlinks it once mapped
        time.sleep(0.01)
    a = torch.randn(4096 if cuda else 256, 4096 if cuda else 256, device=args.device, dtype=torch.bfloat16)
    publish_s, gpu_s = [], []
    for step in range(args.steps):
        if cuda:
            began = torch.cuda.Event(enable_timing=True)
            ended = torch.cuda.Event(enable_timing=True)
            began.record()
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)  # ~1-2 ms of GPU work: the forward
        for layer, buffer in sources.items():
            buffer[: args.rows].fill_(float(step) if layer == 10 else -float(step))
        if cuda:
            ended.record()
            gpu_s.append((began, ended))
        started = time.perf_counter()
        writer.publish_step(args.rows, {"step": step})
        publish_s.append(time.perf_counter() - started)
        if cuda and step >= 2:
            gpu_s[step - 2][1].synchronize()  # the engine waits for a step's tokens two steps later
    writer.flush()
    out, _ = reader.communicate(timeout=120)
    followed = json.loads(out)
    gpu_ms = float(np.mean([b.elapsed_time(e) for b, e in gpu_s])) if cuda else float("nan")
    result = {"publish_us_mean": float(np.mean(publish_s) * 1e6), "publish_us_p99": float(np.percentile(publish_s, 99) * 1e6),
              "gpu_ms_per_step": gpu_ms, "dropped": writer.dropped, "waits_for_space": writer.waits_for_space,
              **followed}
    print(json.dumps(result, indent=1))
    ok = (followed.get("steps") == args.steps and followed.get("wrong_count") == 0 and writer.dropped == 0
          and (not cuda or result["publish_us_mean"] * 1e-3 < gpu_ms / 20))
    print("ring check:", "ok" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
