"""GPU microbenchmark: device time the tap adds to one decode step, part by part.

No vLLM: the ops alone, on the GPU's compute stream, the way a step runs them. For each
row count (1, 8, 64, 1024 rows of Llama-3.1-8B's 4096-wide bf16 residual stream, two
tapped layers of 8 probe slots):

- ``torch op``: the op's arithmetic in plain torch (`ops.tap_torch`: cast, add, addmm, three
  to four kernels per layer), captured 200 steps to a CUDA graph and replayed: device
  microseconds per step;
- ``fused``: the Triton kernel the op runs on CUDA (`fused_tap.py`), captured the same way,
  with its largest difference from the torch version; ``fused_paused``: the same launches
  with the tap paused (its flag set: each program returns at once), what a switched-off tap
  still costs;
- ``copies_device`` / ``one_copy_device``: device-to-host copies of the score rows into pinned
  memory inside a CUDA graph, so device time only: one per layer, and one copy of both layers'
  rows side by side.

The engine benchmark (`python -m bench.engine`) shows the whole tap's cost in TPOT; this one
says which part of the device time is the op's arithmetic and which the copies.

    python3 -m bench.tap_op --out out/bench-tap-op.json     # needs a CUDA GPU, from the repository root
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HIDDEN = 4096
SLOTS = 8
LAYERS = 2
STEPS = 200


def _graph_us(fn, steps: int = STEPS, repeats: int = 5) -> float:
    """Device time per call of `fn` (µs): `steps` calls captured in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # warm-up (Triton compiles, cuBLAS picks its kernel) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / steps)
    return best


def measure(rows_list: list[int]) -> dict:
    from engine_worker.tap import kernel as fused_tap, ops

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    max_rows = max(rows_list)
    weight = [torch.randn(SLOTS, HIDDEN, device=device, generator=gen) / HIDDEN ** 0.5 for _ in range(LAYERS)]
    bias = [torch.randn(SLOTS, device=device, generator=gen) for _ in range(LAYERS)]
    scores = [torch.zeros(max_rows, SLOTS, device=device) for _ in range(LAYERS)]
    fused_scores = [torch.zeros(max_rows, SLOTS, device=device) for _ in range(LAYERS)]
    empty_index = torch.zeros(0, dtype=torch.long, device=device)
    empty_capture = torch.zeros(0, HIDDEN, device=device)
    fused = fused_tap.scores if fused_tap.triton is not None else None
    running, paused = (torch.full((1,), v, dtype=torch.int32, device=device) for v in (0, 1))
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hidden": HIDDEN,
                 "slots": SLOTS, "layers": LAYERS, "rows": {}}
    for rows in rows_list:
        hidden = torch.randn(rows, HIDDEN, device=device, generator=gen).to(torch.bfloat16)
        residual = torch.randn(rows, HIDDEN, device=device, generator=gen).to(torch.bfloat16)

        def torch_step():
            for layer in range(LAYERS):
                ops.tap_torch(hidden, residual, weight[layer], bias[layer], scores[layer],
                              empty_index, empty_capture)

        entry = {"torch_op_us": _graph_us(torch_step)}
        if fused is not None:
            def fused_step(flag=running):
                for layer in range(LAYERS):
                    fused(hidden, residual, weight[layer], bias[layer], fused_scores[layer], flag)

            entry["fused_us"] = _graph_us(fused_step)
            entry["fused_paused_us"] = _graph_us(lambda: fused_step(paused))  # the tap switched off at run time
            torch_step()
            fused_step()
            torch.cuda.synchronize()
            entry["fused_max_abs_diff"] = max(float((a[:rows] - b[:rows]).abs().max())
                                              for a, b in zip(scores, fused_scores))
            entry["score_scale"] = float(scores[0][:rows].abs().max())
        # The copies' own device time: captured in a CUDA graph (device-to-host copies into
        # pinned memory are capturable), so no host issue time is in it. One copy per layer,
        # and one copy of both layers' rows laid side by side.
        pinned = [torch.empty(max_rows, SLOTS, pin_memory=True) for _ in range(LAYERS)]
        side_by_side = torch.zeros(max_rows, SLOTS * LAYERS, device=device)
        pinned_wide = torch.empty(max_rows, SLOTS * LAYERS, pin_memory=True)

        def copy_per_layer():
            for layer in range(LAYERS):
                pinned[layer][:rows].copy_(scores[layer][:rows], non_blocking=True)

        def copy_once():
            pinned_wide[:rows].copy_(side_by_side[:rows], non_blocking=True)

        entry["copies_device_us"] = _graph_us(copy_per_layer)
        entry["one_copy_device_us"] = _graph_us(copy_once)
        # four significant digits for times; differences as measured (a rounded 0.0 says nothing)
        out["rows"][str(rows)] = {k: v if k.endswith("diff") or not isinstance(v, float) else float(f"{v:.4g}")
                                  for k, v in entry.items()}
        print(f"rows {rows:5d}: " + ", ".join(f"{k} {v:.3g}" for k, v in out["rows"][str(rows)].items()), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tap_op", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,64,1024")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_tap_op needs a CUDA GPU", file=sys.stderr)
        return 2
    result = measure([int(r) for r in args.rows.split(",")])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
