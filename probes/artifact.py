"""The probe artifact: a directory holding `probe.safetensors` and `probe.yaml`.

See docs/probe-format.md for the format. Loading validates the artifact on its own
(shapes, finiteness, known read point) and, when given the served model, against it
(hidden size, layer range); every refusal names the file and the problem.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

WEIGHTS_FILE = "probe.safetensors"
METADATA_FILE = "probe.yaml"
FORMAT_VERSION = 1


class ProbeFormatError(ValueError):
    """The artifact itself is malformed (missing file, bad field, bad tensor)."""


class ProbeMismatchError(ValueError):
    """The artifact is well formed but does not fit the model being served."""


class ReadPoint(str, enum.Enum):
    """Which prompt positions a probe's headline score is read from."""

    LAST_PROMPT_TOKEN = "last_prompt_token"
    PROMPT_MEAN = "prompt_mean"
    PROMPT_MAX = "prompt_max"

    @property
    def reads_interior_tokens(self) -> bool:
        # Interior reads need every prompt row computed, which prefix caching prevents.
        return self is not ReadPoint.LAST_PROMPT_TOKEN


@dataclass(frozen=True)
class ServedModel:
    """What a probe must agree with: the model the engine actually serves."""

    hidden_size: int
    num_hidden_layers: int
    name: str | None = None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str | None = None) -> "ServedModel":
        text_config = config.get("text_config", config)
        return cls(
            hidden_size=int(text_config["hidden_size"]),
            num_hidden_layers=int(text_config["num_hidden_layers"]),
            name=name,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ServedModel":
        import json

        path = Path(model_dir) / "config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise ProbeMismatchError(f"{path}: model config not found") from None
        return cls.from_hf_config(config, name=Path(model_dir).name)


@dataclass
class ProbeArtifact:
    name: str
    layer: int
    read: ReadPoint
    weight: np.ndarray  # float32 [hidden_size]
    bias: float
    slope: float = 1.0
    intercept: float = 0.0
    model: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    source: Path | None = None

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[0])

    def raw_score(self, activation: np.ndarray) -> np.ndarray:
        """w·x + b for one activation [hidden] or a batch [n, hidden]."""
        return np.asarray(activation, dtype=np.float64) @ self.weight.astype(np.float64) + self.bias

    def check_fits(self, served: ServedModel) -> None:
        where = self.source or self.name
        if self.hidden_size != served.hidden_size:
            raise ProbeMismatchError(
                f"{where}: probe {self.name!r} has hidden_size {self.hidden_size} but the served model"
                f" has hidden_size {served.hidden_size}"
            )
        if not 0 <= self.layer < served.num_hidden_layers:
            raise ProbeMismatchError(
                f"{where}: probe {self.name!r} reads layer {self.layer}, out of range for a model with"
                f" {served.num_hidden_layers} decoder layers (valid: 0..{served.num_hidden_layers - 1})"
            )

    def metadata(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "layer": self.layer,
            "read": self.read.value,
            "hidden_size": self.hidden_size,
            "calibration": {"slope": float(self.slope), "intercept": float(self.intercept)},
            "model": dict(self.model),
        }
        data.update(self.extra)
        return data


_KNOWN_KEYS = {"format_version", "name", "layer", "read", "hidden_size", "calibration", "model"}


def save_probe(probe: ProbeArtifact, directory: str | Path) -> Path:
    from safetensors.numpy import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            "weight": np.ascontiguousarray(probe.weight, dtype=np.float32),
            "bias": np.asarray([probe.bias], dtype=np.float32),
        },
        str(out / WEIGHTS_FILE),
    )
    (out / METADATA_FILE).write_text(yaml.safe_dump(probe.metadata(), sort_keys=False))
    return out


def load_probe(directory: str | Path, served: ServedModel | None = None) -> ProbeArtifact:
    """Load and validate a probe directory; with `served`, also check it fits that model."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    root = Path(directory)
    meta_path, weights_path = root / METADATA_FILE, root / WEIGHTS_FILE
    if not root.is_dir():
        raise ProbeFormatError(f"{root}: probe directory not found")
    for path in (meta_path, weights_path):
        if not path.is_file():
            raise ProbeFormatError(f"{path}: missing (a probe directory holds {METADATA_FILE} and {WEIGHTS_FILE})")

    try:
        meta = yaml.safe_load(meta_path.read_text())
    except yaml.YAMLError as exc:
        raise ProbeFormatError(f"{meta_path}: not valid YAML ({exc})") from None
    if not isinstance(meta, dict):
        raise ProbeFormatError(f"{meta_path}: expected a mapping at the top level")

    def field_of(key: str, kind: type, default: Any = ...) -> Any:
        if key not in meta:
            if default is ...:
                raise ProbeFormatError(f"{meta_path}: required field {key!r} is missing")
            return default
        value = meta[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ProbeFormatError(f"{meta_path}: field {key!r} must be an integer, got {value!r}")
        if kind is str and not (isinstance(value, str) and value.strip()):
            raise ProbeFormatError(f"{meta_path}: field {key!r} must be a non-empty string, got {value!r}")
        if kind is dict and not isinstance(value, dict):
            raise ProbeFormatError(f"{meta_path}: field {key!r} must be a mapping, got {value!r}")
        return value

    name = field_of("name", str)
    layer = field_of("layer", int)
    hidden_size = field_of("hidden_size", int)
    read_value = field_of("read", str)
    try:
        read = ReadPoint(read_value)
    except ValueError:
        valid = ", ".join(r.value for r in ReadPoint)
        raise ProbeFormatError(f"{meta_path}: read {read_value!r} is not one of {valid}") from None
    calibration = field_of("calibration", dict, {"slope": 1.0, "intercept": 0.0})
    slope, intercept = calibration.get("slope", 1.0), calibration.get("intercept", 0.0)
    for label, value in (("calibration.slope", slope), ("calibration.intercept", intercept)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ProbeFormatError(f"{meta_path}: {label} must be a finite number, got {value!r}")
    model = field_of("model", dict, {})

    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ProbeFormatError(f"{weights_path}: cannot read safetensors ({exc})") from None
    for key in ("weight", "bias"):
        if key not in tensors:
            raise ProbeFormatError(f"{weights_path}: tensor {key!r} is missing")
    weight, bias = tensors["weight"], tensors["bias"]
    if weight.dtype != np.float32 or weight.ndim != 1:
        raise ProbeFormatError(
            f"{weights_path}: 'weight' must be float32 of shape [hidden_size], got {weight.dtype} {list(weight.shape)}"
        )
    if bias.dtype != np.float32 or bias.shape != (1,):
        raise ProbeFormatError(f"{weights_path}: 'bias' must be float32 of shape [1], got {bias.dtype} {list(bias.shape)}")
    if weight.shape[0] != hidden_size:
        raise ProbeFormatError(
            f"{root}: probe.yaml says hidden_size {hidden_size} but 'weight' has {weight.shape[0]} values"
        )
    if not np.isfinite(weight).all():
        bad = int((~np.isfinite(weight)).sum())
        raise ProbeFormatError(f"{weights_path}: 'weight' holds {bad} non-finite values (NaN or inf)")
    if not np.isfinite(bias).all():
        raise ProbeFormatError(f"{weights_path}: 'bias' is not finite")

    probe = ProbeArtifact(
        name=name,
        layer=layer,
        read=read,
        weight=weight,
        bias=float(bias[0]),
        slope=float(slope),
        intercept=float(intercept),
        model=model,
        extra={k: v for k, v in meta.items() if k not in _KNOWN_KEYS},
        source=root,
    )
    if served is not None:
        probe.check_fits(served)
    return probe


def check_probe_set(probes: list[ProbeArtifact]) -> None:
    """Refuse a set in which two probes share a name: scores are keyed by name."""
    seen: dict[str, ProbeArtifact] = {}
    for probe in probes:
        if probe.name in seen:
            raise ProbeFormatError(
                f"two probes are named {probe.name!r} ({seen[probe.name].source} and {probe.source});"
                " names must be unique"
            )
        seen[probe.name] = probe
