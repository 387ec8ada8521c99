"""The tap configuration, carried to every vLLM process.

vLLM hashes `additional_config` into its compile-cache key, so the fields that shape the
compiled graphs (which layers carry an op, how many probe and vector slots, capture on or
off) travel there, in `additional_config["probex"]`: a graph compiled for another tap (or
none) is never reused for this one. The fields that do not (`RUN_FIELDS`: where the startup
probes and vectors are read from, where captures go, the score socket, which is new every
start) travel in the environment, `PROBEX_TAP_CONFIG`, which `probex worker` sets for the
vLLM server and so for every process it starts on this host (and asks vLLM's Ray executor
to copy to its workers): in the key they made every start compile the model again. A mark
in additional_config says the run fields are in the environment, so an engine process
without it refuses to start instead of serving with no probes and no score socket.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

ADDITIONAL_CONFIG_KEY = "probex"
# The whole configuration as JSON ({"probex": {...}}), run fields included.
ENV_TAP_CONFIG = "PROBEX_TAP_CONFIG"
ENV_PREFIX = "PROBEX_"  # every ProbeX setting an engine process reads starts so
# Read at run time, never baked into a graph: probe weights and vectors are copied into
# static buffers, captures written by the host, scores pushed to the socket.
RUN_FIELDS = ("probe_dirs", "capture_dir", "score_address", "steer_vector_dirs", "step_address")
# additional_config's mark that RUN_FIELDS are in ENV_TAP_CONFIG (a constant: the key stays put).
RUN_FIELDS_FROM = "run_fields_from"
# The admin routes' bearer token (live probe and vector swaps, pausing the tap); read by the
# API server's middleware, set by `probex worker --admin-token`.
ENV_ADMIN_TOKEN = "PROBEX_ADMIN_TOKEN"
# vLLM's --api-server-count as the worker's launcher started it: with several API server
# processes, each tags its requests' ids and relays only their scores (middleware.py).
ENV_API_SERVER_COUNT = "PROBEX_API_SERVER_COUNT"
# `probex worker` runs a score formatter (score_formatter.py) beside the worker, which turns
# each step into every API server process's own rendered scores; "0" (`--no-score-formatter`)
# leaves it out, and each API server process then reads every step itself.
ENV_SCORE_FORMATTER = "PROBEX_SCORE_FORMATTER"
# Diagnostic: "off" keeps the op in the graphs but never copies out or delivers its scores, so a
# benchmark can tell the op's device time from the host path's cost (set-up "tap-op-only").
ENV_DELIVERY = "PROBEX_DELIVERY"


# Who consumes each step's scores once its copies land: "engine" (the engine thread, the
# default in a one-GPU engine whose runner reads tokens through an async output: V2, and V1
# with async scheduling) or "thread" (a transfer thread, the default otherwise);
# engine_worker/score_transfer.py. Unset: the runner adapter's default.
ENV_SCORE_CONSUMER = "PROBEX_SCORE_CONSUMER"


# Diagnostic: the engine thread busy-waits this many microseconds (GIL held, like Python work)
# at the end of every tap hook (set-up "tap-slow-hook"). If TPOT grows by that much per step,
# engine-thread time is on the step's critical path; if not, the engine thread has slack.
ENV_HOOK_SPIN_US = "PROBEX_HOOK_SPIN_US"


# "side": score copies on a side stream (score_transfer.py), an experiment; "same" (the engine's
# stream) by default. Set-up "tap-side-copies" measures it against tap.
ENV_COPY_STREAM = "PROBEX_COPY_STREAM"


# On by default where a score formatter runs beside the worker: each step's scores go to it
# through a shared-memory ring (engine_worker/score_ring.py), copied there by the device, which
# also says when they have landed, so the engine process neither waits for the copies nor
# gathers, encodes or sends them. "0" is the older path, for comparison: the engine process
# consumes each step (score_transfer.py) and sends it to the formatter over ZMQ.
ENV_SCORE_RING = "PROBEX_SCORE_RING"


def score_ring_wanted() -> bool:
    return _env_switch(ENV_SCORE_RING)


# Diagnostic: "0" makes the engine consumer read a step's tokens first and consume its
# scores after them (the order before session 9), instead of consuming the scores while the
# device samples (set-up "tap-scores-after-tokens").
ENV_SCORES_AHEAD = "PROBEX_SCORES_AHEAD_OF_TOKENS"


# On by default; "0" is the older path, for comparison: a prompt-sized step's score rows are
# copied out *during* its forward, as soon as each tapped layer's scores are final (enqueued
# where the next decoder layer's attention runs from Python, between two CUDA-graph pieces),
# instead of behind the whole forward, so their consume overlaps the forward's remaining
# layers rather than sitting between the forward and the first token (`copy_scores_mid_forward`
# in engine_worker/vllm_models.py; score_transfer.py's `reserve_step`).
ENV_PROMPT_SCORES_MID_FORWARD = "PROBEX_PROMPT_SCORES_MID_FORWARD"


# Diagnostic: "in-model" allocates the tap's and steering's buffers while the model is built,
# between the tapped layer's weights and the next layer's (before session 11); by default they
# are allocated once the weights are loaded, so the weights are allocated as in plain vLLM
# (set-up "tap-buffers-in-model").
ENV_TAP_BUFFERS = "PROBEX_TAP_BUFFERS"
TAP_BUFFER_PLACES = ("after-weights", "in-model")


def buffers_after_weights() -> bool:
    value = os.environ.get(ENV_TAP_BUFFERS, "after-weights").strip().lower() or "after-weights"
    if value not in TAP_BUFFER_PLACES:
        raise ValueError(f"{ENV_TAP_BUFFERS} must be one of {', '.join(TAP_BUFFER_PLACES)}, not {value!r}")
    return value == "after-weights"


def scores_ahead_of_tokens() -> bool:
    return _env_switch(ENV_SCORES_AHEAD)


def prompt_scores_mid_forward() -> bool:
    return _env_switch(ENV_PROMPT_SCORES_MID_FORWARD)


def _env_switch(name: str) -> bool:
    return switch_is_on(os.environ.get(name))


def switch_is_on(value: str | None) -> bool:
    """A switch's setting: on unless "0", "off", "false" or "no" (any case, spaces ignored);
    unset or empty, on."""
    return (value or "").strip().lower() not in ("off", "0", "false", "no")


def hook_spin_s() -> float:
    value = os.environ.get(ENV_HOOK_SPIN_US, "").strip()
    if not value:
        return 0.0
    try:
        return max(0.0, float(value)) * 1e-6
    except ValueError:
        raise ValueError(f"{ENV_HOOK_SPIN_US} must be a number of microseconds, not {value!r}") from None


def scores_delivered() -> bool:
    return _env_switch(ENV_DELIVERY)


def score_formatter_wanted() -> bool:
    """`probex worker`'s default for `--score-formatter`: on unless PROBEX_SCORE_FORMATTER is off."""
    return _env_switch(ENV_SCORE_FORMATTER)


@dataclass(frozen=True)
class TapConfig:
    layers: tuple[int, ...]
    probe_dirs: tuple[str, ...] = ()
    # Slots per tapped layer. Live swaps copy into these, so capacity is fixed at startup.
    probes_per_layer: int = 8
    # Rows per step the capture buffer can hold; 0 turns capture mode off (and its cost with it).
    capture_rows: int = 0
    capture_dir: str | None = None
    # ZMQ address the API server processes take score messages from: the worker binds it, or the
    # score formatter where there is one (`step_address`).
    score_address: str | None = None
    # Decoder layers whose output gets a steering op, the vector slots per steered layer
    # (fixed at startup, like probe slots) and the vectors loaded at startup.
    steer_layers: tuple[int, ...] = ()
    steer_vectors_per_layer: int = 8
    steer_vector_dirs: tuple[str, ...] = ()
    # Where the worker sends its steps when a score formatter (score_formatter.py) turns them
    # into each API server process's rendered scores, sent on at `score_address`; None: the
    # worker sends them there itself, whole, and each API server process reads them.
    step_address: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("probex tap: at least one layer must be tapped")
        if any(isinstance(l, bool) or not isinstance(l, int) or l < 0 for l in self.layers):
            raise ValueError(f"probex tap: layers must be non-negative integers, got {list(self.layers)}")
        if self.probes_per_layer < 1:
            raise ValueError("probex tap: probes_per_layer must be at least 1")
        if self.capture_rows < 0:
            raise ValueError("probex tap: capture_rows must be >= 0")
        if any(isinstance(l, bool) or not isinstance(l, int) or l < 0 for l in self.steer_layers):
            raise ValueError(f"probex steering: layers must be non-negative integers, got {list(self.steer_layers)}")
        if self.steer_vectors_per_layer < 1:
            raise ValueError("probex steering: steer_vectors_per_layer must be at least 1")
        if self.capture_rows and not self.capture_dir:
            raise ValueError("probex tap: capture mode needs a capture_dir")

    @property
    def capture_enabled(self) -> bool:
        return self.capture_rows > 0

    def to_additional_config(self, run_fields: bool = False) -> dict[str, Any]:
        """What goes in vLLM's additional_config: the graph-shaping fields and the mark that the
        rest is in ENV_TAP_CONFIG; everything, run fields in place of the mark, with `run_fields`."""
        data = asdict(self)
        data["layers"] = list(self.layers)
        data["probe_dirs"] = list(self.probe_dirs)
        data["steer_layers"] = list(self.steer_layers)
        data["steer_vector_dirs"] = list(self.steer_vector_dirs)
        if not run_fields:
            for name in RUN_FIELDS:
                del data[name]
            data[RUN_FIELDS_FROM] = ENV_TAP_CONFIG
        return {ADDITIONAL_CONFIG_KEY: data}

    def to_json(self) -> str:
        """The whole configuration, for ENV_TAP_CONFIG."""
        return json.dumps(self.to_additional_config(run_fields=True))

    @classmethod
    def from_json(cls, raw: str) -> "TapConfig | None":
        """The whole configuration as `to_json` wrote it (the API server reads ENV_TAP_CONFIG so)."""
        return cls._from_fields(json.loads(raw).get(ADDITIONAL_CONFIG_KEY))

    @classmethod
    def for_engine(cls, additional_config: Any, environ: Any = None) -> "TapConfig | None":
        """The configuration an engine process runs with (None without a tap): vLLM's
        `additional_config["probex"]`, its run fields taken from ENV_TAP_CONFIG in `environ`
        (default os.environ) where additional_config says they are there.

        The environment must describe the same graphs: a stale PROBEX_TAP_CONFIG beside another
        additional_config is refused rather than loading one tap's probes into another's slots.
        """
        if not additional_config or ADDITIONAL_CONFIG_KEY not in additional_config:
            return None
        data = dict(additional_config[ADDITIONAL_CONFIG_KEY])
        if data.pop(RUN_FIELDS_FROM, None) is not None:
            raw = (os.environ if environ is None else environ).get(ENV_TAP_CONFIG)
            if not raw:
                raise ValueError(
                    f"probex tap: this engine process has no {ENV_TAP_CONFIG}, where its probe files and score "
                    f"socket are; start vLLM through `probex worker` (with Ray, keep "
                    f"VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY={ENV_PREFIX}, which it sets)")
            whole = json.loads(raw).get(ADDITIONAL_CONFIG_KEY, {})
            differing = sorted(k for k, v in data.items() if k in whole and whole[k] != v)
            if differing:
                raise ValueError(f"probex tap: {ENV_TAP_CONFIG} disagrees with vLLM's additional_config on "
                                 f"{', '.join(differing)}; start the engine through `probex worker`, or unset "
                                 f"{ENV_TAP_CONFIG}")
            data.update({name: whole[name] for name in RUN_FIELDS if name in whole})
        return cls._from_fields(data)

    @classmethod
    def _from_fields(cls, data: dict[str, Any] | None) -> "TapConfig | None":
        if data is None:
            return None
        data = dict(data)
        data["layers"] = tuple(sorted(set(data.get("layers", ()))))
        data["probe_dirs"] = tuple(data.get("probe_dirs", ()))
        data["steer_layers"] = tuple(sorted(set(data.get("steer_layers", ()))))
        data["steer_vector_dirs"] = tuple(data.get("steer_vector_dirs", ()))
        return cls(**data)
