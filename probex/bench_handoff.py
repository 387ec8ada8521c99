"""CPU benchmark of the worker's per-step hand-off: what ProbeX runs in the engine process per step.

No engine and no GPU: CPU `LayerTap`s (2 layers x 4 probes, like `probex bench engine`), a
`TapController` writing its shared-memory score ring, and a loop standing in for the engine
thread that calls `after_forward` once per decode step of N requests, running Python for
`--python-us` (vLLM's scheduling and output processing) and then waiting with the GIL
released for `--wait-us` (the GPU) between steps. A second process follows the ring and
keeps the books, as the API server does. Reported per step:

- `hook_us`: the engine thread's time in ProbeX (layout meta, the rows' copy, the post);
- `step_us`: the whole stand-in step; against `baseline_step_us` (the same loop without
  ProbeX) it is the slowdown;
- `reader_ingest_us`: the reading process's books per step (not in the engine process).

On a GPU the copy is an asynchronous DMA and the post a CUDA host function, so `hook_us`
there is the same Python minus the memcpy.

    python3 -m probex.bench_handoff --out out/bench-handoff.json
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

HIDDEN = 64


def _controller(root: Path):
    from engine_worker.controller import TapController
    from engine_worker.tap import LayerTap
    from probes.artifact import ProbeArtifact, ReadPoint, ServedModel, save_probe

    served = ServedModel.from_hf_config({"model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": 4,
                                         "architectures": ["LlamaForCausalLM"]}, name="bench")
    taps = {1: LayerTap(1, HIDDEN, capacity=4, max_rows=8192), 3: LayerTap(3, HIDDEN, capacity=4, max_rows=8192)}
    reads = [ReadPoint.LAST_PROMPT_TOKEN, ReadPoint.PROMPT_MEAN]
    rng = np.random.default_rng(0)
    probes = [save_probe(ProbeArtifact(name=f"p{i}", layer=1 if i < 4 else 3, read=reads[i % 2],
                                       weight=rng.standard_normal(HIDDEN).astype(np.float32), bias=0.0,
                                       model={"name": "bench"}), root / f"p{i}") for i in range(8)]
    controller = TapController(taps, served, str(root / "scores.ring"))
    controller.load([str(p) for p in probes])
    return controller


def follow_ring(path: str, steps: int) -> dict:
    """The API server's side, in its own process: read `steps` steps (after the table) through the books."""
    from engine_worker.bookkeeping import StepReader
    from engine_worker.score_ring import KIND_TABLE, ScoreRingReader

    ring, books = ScoreRingReader(path), StepReader()
    deadline = time.monotonic() + 60
    while not ring.attach():
        if time.monotonic() > deadline:
            raise SystemExit(f"no ring at {path}")
        time.sleep(0.01)
    read = tokens = 0
    ingest_s = 0.0
    while read < steps:
        count = ring.wait(10.0)
        if not count:
            raise SystemExit(f"the writer stopped after {read} of {steps} steps")
        for _ in range(count):
            record = ring.read()
            started = time.perf_counter()
            if record.kind == KIND_TABLE:
                books.read_table(record.meta)
            else:
                tokens += len(books.read_step(record.meta, record.raw_by_layer).token_req_ids)
                ingest_s += time.perf_counter() - started
                read += 1
            ring.release(record)
    return {"steps": read, "tokens": tokens, "ingest_us": ingest_s / read * 1e6}


def engine_steps(steps: int, python_us: float, wait_us: float, hook=None) -> tuple[float, float]:
    """(mean step, mean hook) in seconds of the stand-in engine loop, with or without a per-step hook."""
    hook_s = 0.0
    began = time.perf_counter()
    for step in range(steps):
        if hook is not None:
            started = time.perf_counter()
            hook(step)
            hook_s += time.perf_counter() - started
        spin_until = time.perf_counter() + python_us * 1e-6
        while time.perf_counter() < spin_until:
            pass
        if wait_us:
            time.sleep(wait_us * 1e-6)  # releases the GIL, as a wait for the GPU does
    return (time.perf_counter() - began) / steps, hook_s / steps


def wake_cost_us(sleep_s: float, repeats: int = 300) -> float:
    """Mean time to build one 8-request StepLayout right after sleeping `sleep_s` (0: tight loop).

    On a VM a thread back from a few milliseconds of sleep runs its first microseconds of
    work several times slower (cold caches and clocks); the stand-in loop sleeps every
    step, so its hook times carry that cost, which a GPU host's engine thread may not."""
    from engine_worker.bookkeeping import StepLayout

    ids = [f"req-{i}" for i in range(8)]
    total = 0.0
    for _ in range(repeats):
        if sleep_s:
            time.sleep(sleep_s)
        started = time.perf_counter()
        StepLayout(ids, np.ones(8, np.int64), np.full(8, 40), np.full(8, 32))
        total += time.perf_counter() - started
    return total / repeats * 1e6


def run(requests: int, steps: int, python_us: float, wait_us: float) -> dict:
    from engine_worker.bookkeeping import StepLayout

    with tempfile.TemporaryDirectory() as tmp:
        controller = _controller(Path(tmp))
        reader = subprocess.Popen([sys.executable, "-m", "probex.bench_handoff", "--follow", str(Path(tmp) / "scores.ring"),
                                   "--steps", str(steps + 1)], stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while (Path(tmp) / "scores.ring").exists():  # the reader unlinks the path once it has mapped the ring
            if time.monotonic() > deadline or reader.poll() is not None:
                raise SystemExit("the ring reader did not start")
            time.sleep(0.01)
        ids = [f"req-{i}" for i in range(requests)]
        prompt = 32
        controller.after_forward(StepLayout(ids, np.full(requests, prompt), np.zeros(requests, np.int64),
                                            np.full(requests, prompt)))
        step_s, hook_s = engine_steps(steps, python_us, wait_us, lambda step: controller.after_forward(
            StepLayout(ids, np.ones(requests, np.int64), np.full(requests, prompt + step), np.full(requests, prompt))))
        out, _ = reader.communicate(timeout=120)
        if reader.returncode != 0:
            raise SystemExit(f"the ring reader failed (exit {reader.returncode})")
        followed = json.loads(out)
    if followed["tokens"] != requests * (steps + 1) or controller.ring.dropped:
        raise SystemExit(f"the reader saw {followed['tokens']} tokens of {requests * (steps + 1)}"
                         f" ({controller.ring.dropped} steps dropped)")
    return {"hook_us": hook_s * 1e6, "step_us": step_s * 1e6, "reader_ingest_us": followed["ingest_us"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="8,64", help="decoding requests per step (comma-separated)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--python-us", type=float, default=1000.0, help="engine-thread Python work per step (µs)")
    parser.add_argument("--wait-us", type=float, default=4000.0,
                        help="engine-thread wait with the GIL released per step (µs), standing in for the GPU")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--follow", metavar="RING", help=argparse.SUPPRESS)  # the reading process
    args = parser.parse_args()
    if args.follow:
        print(json.dumps(follow_ring(args.follow, args.steps)))
        return
    results = []
    baseline_step_us = engine_steps(args.steps, args.python_us, args.wait_us)[0] * 1e6
    print(f"stand-in engine step without ProbeX: {baseline_step_us:.1f} µs", flush=True)
    for n in (int(x) for x in args.requests.split(",")):
        measured = run(n, args.steps, python_us=args.python_us, wait_us=args.wait_us)
        row = {"requests": n, "hook_us": round(measured["hook_us"], 1), "step_us": round(measured["step_us"], 1),
               "baseline_step_us": round(baseline_step_us, 1), "reader_ingest_us": round(measured["reader_ingest_us"], 1),
               "python_us": args.python_us, "wait_us": args.wait_us}
        results.append(row)
        print(f"{n:3d} requests: engine-thread hook {row['hook_us']:7.1f} µs, step {row['step_us']:7.1f} µs"
              f" ({args.python_us:.0f} python + {args.wait_us:.0f} wait; without ProbeX {baseline_step_us:.1f}),"
              f" reader process books {row['reader_ingest_us']:7.1f} µs per step", flush=True)
    wake = {"layout_us_tight_loop": round(wake_cost_us(0.0), 1),
            "layout_us_after_sleep": round(wake_cost_us(args.wait_us * 1e-6), 1)}
    print(f"one StepLayout: {wake['layout_us_tight_loop']} µs in a tight loop, {wake['layout_us_after_sleep']} µs"
          f" right after a {args.wait_us:.0f} µs sleep (how much of the hook is waking up)", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"benchmark": "handoff", "steps": args.steps, "results": results,
                                        "wake": wake}, indent=1) + "\n")


if __name__ == "__main__":
    main()
