"""On a bare GPU machine (torch and numpy only, before vLLM is installed): does the score ring's
device path hold? The device copies a step's rows into the registered shared memory and writes
the entry's ticket behind them; a reader polling the ring must find every landed step's rows
complete (never the ticket before the rows), for whole-step copies and for the mid-forward
ones, while the device is kept busy ahead of them. Also times the engine thread's submit.

    python3 bench/gpu/ring_check.py OUT.json [DEVICE]   # cuda by default

msgspec may be missing there: a stand-in encoder (pickle) is used, which is all the check needs.
"""

from __future__ import annotations

import json
import pickle
import sys
import threading
import time
import types

try:
    import msgspec  # noqa: F401
except ImportError:  # the bare image: the ring's publisher only needs an encoder
    stand_in = types.ModuleType("msgspec")
    stand_in.msgpack = types.SimpleNamespace(Encoder=lambda: types.SimpleNamespace(encode=pickle.dumps))
    sys.modules["msgspec"] = stand_in

sys.path.insert(0, ".")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine_worker.tap.ring_copies import RingTransfer  # noqa: E402
from engine_worker.scores.ring import STEP, RingPublisher, RingReader, ScoreRing  # noqa: E402

LAYERS = (5, 17)
ROWS, WIDTH = 8192, 8


def main(out_path: str, device_name: str = "cuda") -> None:
    device = torch.device(device_name)
    sources = {layer: torch.zeros(ROWS, WIDTH, device=device) for layer in LAYERS}
    ring = ScoreRing.create({layer: (ROWS, WIDTH) for layer in LAYERS}, slots=16)
    publisher = RingPublisher(ring, heartbeat_s=0)
    transfer = RingTransfer(sources, publisher, lambda rows, context, scores: {"step": context, "rows": rows})
    reader = RingReader(ScoreRing.attach(ring.fd))
    busy = torch.randn(4096 if device.type == "cuda" else 64, 4096 if device.type == "cuda" else 64, device=device)
    expected: dict[int, tuple[int, float]] = {}  # ticket -> (rows, value)
    problems: list[str] = []
    seen = {"steps": 0, "early_polls": 0}
    done = threading.Event()

    def read() -> None:
        while not done.is_set() or not publisher.drained():
            entry = reader.poll()
            if entry is None:
                if reader.waiting_for_device():
                    seen["early_polls"] += 1
                time.sleep(20e-6)
                continue
            kind, meta, scores = entry
            ticket = reader.next + 1
            rows, value = expected[ticket]
            for layer in LAYERS:
                got = scores[layer][:rows]
                want = value + layer
                if not np.all(got == want):
                    problems.append(f"ticket {ticket} layer {layer}: {int(np.sum(got != want))} of {got.size} wrong")
            seen["steps"] += kind == STEP
            reader.done()

    thread = threading.Thread(target=read)
    thread.start()
    submit_s = []
    for step in range(300):
        rows = 1 + (step * 37) % 4000
        mid_forward = step % 3 == 0
        if mid_forward:
            mid_forward = transfer.reserve_step(rows)  # False where the copies are synchronous (CPU)
        for _ in range(2):  # keep the device busy ahead of the copies
            busy = torch.tanh(busy @ busy * 1e-3)
        for layer in LAYERS:
            sources[layer][:rows].fill_(step + layer)
            if mid_forward:
                transfer.copy_layer_now(layer)
        ticket = publisher.produced + (0 if mid_forward else 1)
        expected[ticket] = (rows, float(step))
        started = time.perf_counter()
        transfer.submit(rows, step)
        submit_s.append(time.perf_counter() - started)
        if step % 50 == 0 and device.type == "cuda":
            torch.cuda.synchronize()
    if device.type == "cuda":
        torch.cuda.synchronize()
    done.set()
    thread.join(timeout=30)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "steps_read": seen["steps"], "problems": problems[:20],
              "polls_before_landing": seen["early_polls"], "submit_us_p50": float(np.median(submit_s) * 1e6),
              "submit_us_mean": float(np.mean(submit_s) * 1e6), "transfer": transfer.describe(),
              "ok": not problems and seen["steps"] == 300}
    print(json.dumps(result, indent=1))
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
