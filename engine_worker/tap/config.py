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

from engine_worker.settings import PREFIX as ENV_PREFIX, TAP_CONFIG as ENV_TAP_CONFIG

ADDITIONAL_CONFIG_KEY = "probex"
# Read at run time, never baked into a graph: probe weights and vectors are copied into
# static buffers, captures written by the host, scores sent to the score address.
RUN_FIELDS = ("probe_dirs", "capture_dir", "score_address", "steer_vector_dirs", "model_dir", "api_server_count")
# additional_config's mark that RUN_FIELDS are in ENV_TAP_CONFIG (a constant: the key stays put).
RUN_FIELDS_FROM = "run_fields_from"


@dataclass(frozen=True)
class TapConfig:
    layers: tuple[int, ...]
    probe_dirs: tuple[str, ...] = ()
    # Slots per tapped layer. Live swaps copy into these, so capacity is fixed at startup.
    probes_per_layer: int = 8
    # Rows per step the capture buffer can hold; 0 turns capture mode off (and its cost with it).
    capture_rows: int = 0
    capture_dir: str | None = None
    # ZMQ address the API server processes take score messages from (the score formatter binds it).
    score_address: str | None = None
    # Decoder layers whose output gets a steering op, the vector slots per steered layer
    # (fixed at startup, like probe slots) and the vectors loaded at startup.
    steer_layers: tuple[int, ...] = ()
    steer_vectors_per_layer: int = 8
    steer_vector_dirs: tuple[str, ...] = ()
    # The served model's directory (the retention check reads it) and vLLM's API server
    # processes: with several, each tags its requests' ids and relays only their scores.
    model_dir: str | None = None
    api_server_count: int = 1
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
