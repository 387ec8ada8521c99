"""On a bare GPU machine (torch and Triton only): does `fused_tap.warm_up` compile every
variant of the tap's kernel that serving launches? After it, a decode-sized and a
prefill-sized step must launch without compiling (no new entry in Triton's kernel cache,
milliseconds not hundreds of them) and compute what the torch version does.

    python3 bench/gpu/warm_check.py OUT.json [HIDDEN] [SLOTS]   # Llama-3.1-8B's 4096, 8 slots
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="probex-warm-check-")  # nothing cached on disk
sys.path.insert(0, ".")

import torch  # noqa: E402

from engine_worker.tap import kernel as fused_tap
from engine_worker.tap import ops  # noqa: E402


def compiled_variants() -> int | None:
    """Kernels in Triton's in-memory cache for `_tap_rows` (None where this Triton keeps them
    elsewhere: the timings still tell)."""
    caches = getattr(fused_tap._tap_rows, "device_caches", None)
    if not caches:
        return 0 if caches is not None else None
    return sum(len(entry[0]) for entry in caches.values())


def timed_step(rows: int, width: int, slots: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(rows)
    hidden = torch.randn(rows, width, generator=g, device="cuda").to(torch.bfloat16)
    residual = torch.randn(rows, width, generator=g, device="cuda").to(torch.bfloat16)
    weight = torch.randn(slots, width, generator=g, device="cuda")
    bias = torch.randn(slots, generator=g, device="cuda")
    out, reference = torch.zeros(rows, slots, device="cuda"), torch.zeros(rows, slots, device="cuda")
    running = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    fused_tap.scores(hidden, residual, weight, bias, out, running)
    torch.cuda.synchronize()
    launch_ms = (time.perf_counter() - start) * 1e3
    ops.tap_torch(hidden, residual, weight, bias, reference, torch.zeros(0, dtype=torch.long, device="cuda"),
                  torch.zeros(0, width, device="cuda"))
    diff = (out - reference).abs().max().item() / max(reference.abs().max().item(), 1.0)
    return {"rows": rows, "launch_ms": launch_ms, "relative_diff": diff, "variants_after": compiled_variants()}


def main() -> int:
    path = sys.argv[1]
    width = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    slots = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    report = {"device": torch.cuda.get_device_name(), "triton_enabled": fused_tap.enabled(),
              "variants_before": compiled_variants()}
    start = time.perf_counter()
    report["warm_up_launches"] = fused_tap.warm_up(width, slots, 8192, torch.bfloat16, torch.device("cuda"))
    torch.cuda.synchronize()
    report["warm_up_s"] = time.perf_counter() - start
    report["variants_after_warm_up"] = compiled_variants()
    report["steps"] = [timed_step(rows, width, slots) for rows in (1, 5, 64, 200, 1024)]
    variants = [step["variants_after"] for step in report["steps"]]
    report["ok"] = bool(
        report["warm_up_launches"] == 2
        and all(step["launch_ms"] < 50 and step["relative_diff"] < 1e-4 for step in report["steps"])
        and (report["variants_after_warm_up"] is None or set(variants) == {report["variants_after_warm_up"]})
    )
    with open(path, "w") as out:
        json.dump(report, out, indent=1)
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
