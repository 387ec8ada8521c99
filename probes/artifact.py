"""The probe artifact: a directory holding `probe.safetensors` and `probe.yaml`.

See docs/probe-format.md for the format. Loading validates the artifact on its own
(shapes, finiteness, known read point) and, when given the served model, against it
(hidden size, layer range); every refusal names the file and the problem.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from probes.operating_points import OperatingPointError, OperatingPoints

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


class Features(str, enum.Enum):
    """The per-prompt vector a probe's direction was fitted on, and its retention reference measured on.

    The values are the words probe.yaml records under `retention.features`. A mean read
    does not say by itself which rows were averaged: `probex train` averages every prompt
    row (what the engine computes), `probes.demo` the user's message only (`read_span:
    user_message`), and a retention check on the other one measures a different quantity.
    """

    LAST_PROMPT_TOKEN = "last prompt token"
    USER_MESSAGE_MEAN = "user-message mean"
    ALL_ROWS_MEAN = "mean of all prompt rows"


READ_SPAN_USER_MESSAGE = "user_message"


def features_for(read: ReadPoint, read_span: str | None = None) -> Features:
    """What a probe read at `read` is fitted on: the one place training and retention agree on it.

    `read_span` is the artifact's `read_span` field; without it an interior read covers every
    prompt row, as the engine serves it. `prompt_max` is fitted on the mean too (probes/train.py).
    """
    if read is ReadPoint.LAST_PROMPT_TOKEN:
        return Features.LAST_PROMPT_TOKEN
    return Features.USER_MESSAGE_MEAN if read_span == READ_SPAN_USER_MESSAGE else Features.ALL_ROWS_MEAN


def is_finite_number(value: Any) -> bool:
    """A real int or float that float64 can hold (YAML gives ints of any size)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float's range
        return False


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

    @property
    def features(self) -> Features:
        """What the direction and retention reference were computed on: as recorded, else as the read implies."""
        recorded = (self.extra.get("retention") or {}).get("features")
        if recorded is not None:
            return Features(recorded)
        return features_for(self.read, self.extra.get("read_span"))

    @property
    def operating_points(self) -> OperatingPoints | None:
        """Thresholds by false-positive rate measured on benign prompts (probes/operating_points.py), if any."""
        data = self.extra.get("operating_points")
        return OperatingPoints.from_metadata(data) if data is not None else None

    def raw_score(self, activation: np.ndarray) -> np.ndarray:
        """w·x + b for one activation [hidden] or a batch [n, hidden]."""
        return np.asarray(activation, dtype=np.float64) @ self.weight.astype(np.float64) + self.bias

    def check_fits(self, served: ServedModel) -> None:
        check_fits_model(self.source or self.name, f"probe {self.name!r}", self.hidden_size,
                         f"reads layer {self.layer}", self.layer, served)

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
    root = Path(directory)
    meta, meta_path, weights_path = read_metadata(root, METADATA_FILE, WEIGHTS_FILE, "probe")

    def field_of(key: str, kind: type, default: Any = ...) -> Any:
        return metadata_field(meta, meta_path, key, kind, default)

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
        if not is_finite_number(value):
            raise ProbeFormatError(f"{meta_path}: {label} must be a finite number, got {_short(value)}")
    model = field_of("model", dict, {})
    check_read_span(meta, meta_path)
    if "retention" in meta:
        check_retention(field_of("retention", dict), meta_path, layer, read, meta.get("read_span"))
    if "operating_points" in meta:
        try:
            OperatingPoints.from_metadata(meta["operating_points"], f"{meta_path}: operating_points")
        except OperatingPointError as exc:
            raise ProbeFormatError(str(exc)) from None

    tensors = read_tensors(weights_path, ("weight", "bias"))
    weight, bias = tensors["weight"], tensors["bias"]
    check_direction(weight, "weight", weights_path, root, METADATA_FILE, hidden_size)
    if bias.dtype != np.float32 or bias.shape != (1,):
        raise ProbeFormatError(f"{weights_path}: 'bias' must be float32 of shape [1], got {bias.dtype} {list(bias.shape)}")
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


def _short(value: Any) -> str:
    # An int of 400 digits is still an int: name it without printing it whole.
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def check_read_span(meta: dict, meta_path: Path) -> None:
    if "read_span" in meta and meta["read_span"] != READ_SPAN_USER_MESSAGE:
        raise ProbeFormatError(
            f"{meta_path}: read_span must be {READ_SPAN_USER_MESSAGE!r} (or absent: every prompt row),"
            f" got {_short(meta['read_span'])}"
        )


_RETENTION_REF = re.compile(r".+#[0-9]+")  # the row after the last "#", as retention_set splits it


def check_retention(info: dict, meta_path: Path, layer: int, read: ReadPoint, read_span: str | None) -> None:
    """The retention reference as `probex train` and probes.demo write it; each field optional, none malformed.

    Retention runs in the worker after every probe swap, so a bad field must be refused when
    the probe is loaded, not surface later as a crash (or a division by zero) in that check.
    """
    where = f"{meta_path}: retention"
    if "set" in info:
        refs = info["set"]
        if not isinstance(refs, list):
            raise ProbeFormatError(f"{where}.set must be a list of prompt refs ('<file ref>#<row>'),"
                                   f" got {_short(refs)}")
        for ref in refs:
            if not (isinstance(ref, str) and _RETENTION_REF.fullmatch(ref)):
                raise ProbeFormatError(f"{where}.set: {_short(ref)} is not a prompt ref ('<file ref>#<row number>')")
    if "reference_cosine" in info:
        value = info["reference_cosine"]
        # Retention divides by it: zero would give no number at all, not a low one.
        if not is_finite_number(value) or value == 0:
            raise ProbeFormatError(f"{where}.reference_cosine must be a non-zero finite number, got {_short(value)}")
    if "layer" in info:
        value = info["layer"]
        if isinstance(value, bool) or not isinstance(value, int) or value != layer:
            raise ProbeFormatError(f"{where}.layer must be the probe's layer {layer}, got {_short(value)}")
    if "features" in info:
        value = info["features"]
        try:
            recorded = Features(value)
        except ValueError:
            valid = ", ".join(repr(f.value) for f in Features)
            raise ProbeFormatError(f"{where}.features {_short(value)} is not one of {valid}") from None
        if (recorded is Features.LAST_PROMPT_TOKEN) != (read is ReadPoint.LAST_PROMPT_TOKEN) or (
            read_span is not None and recorded is not features_for(read, read_span)
        ):
            span = f" and read_span {read_span!r}" if read_span is not None else ""
            raise ProbeFormatError(f"{where}.features {recorded.value!r} contradicts read {read.value!r}{span}")


def check_probe_set(probes: list[ProbeArtifact]) -> None:
    """Refuse a set in which two probes share a name: scores are keyed by name."""
    check_unique_names(probes, "probes")


# -- shared by every artifact kind kept in a directory (probes here, steering vectors in
# probes/steering.py): the same checks, the same error messages --------------------------------


def check_fits_model(where: Any, what: str, hidden_size: int, layer_phrase: str, layer: int,
                     served: ServedModel) -> None:
    if hidden_size != served.hidden_size:
        raise ProbeMismatchError(
            f"{where}: {what} has hidden_size {hidden_size} but the served model has hidden_size {served.hidden_size}"
        )
    if not 0 <= layer < served.num_hidden_layers:
        raise ProbeMismatchError(
            f"{where}: {what} {layer_phrase}, out of range for a model with"
            f" {served.num_hidden_layers} decoder layers (valid: 0..{served.num_hidden_layers - 1})"
        )


def read_metadata(root: Path, meta_file: str, tensor_file: str, what: str) -> tuple[dict, Path, Path]:
    """(metadata mapping, its path, the tensor file's path) of an artifact directory, or a ProbeFormatError."""
    meta_path, tensor_path = root / meta_file, root / tensor_file
    try:  # a path the system refuses (too long, unreadable) or a file not in UTF-8 is the artifact's fault too
        if not root.is_dir():
            raise ProbeFormatError(f"{root}: {what} directory not found")
        for path in (meta_path, tensor_path):
            if not path.is_file():
                raise ProbeFormatError(f"{path}: missing (a {what} directory holds {meta_file} and {tensor_file})")
        text = meta_path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProbeFormatError(f"{root}: cannot read this {what} directory ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ProbeFormatError(f"{meta_path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        meta = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProbeFormatError(f"{meta_path}: not valid YAML ({exc})") from None
    if not isinstance(meta, dict):
        raise ProbeFormatError(f"{meta_path}: expected a mapping at the top level")
    return meta, meta_path, tensor_path


def metadata_field(meta: dict, meta_path: Path, key: str, kind: type, default: Any = ...) -> Any:
    """meta[key], checked to be a `kind` (int, non-empty str or dict); `default` when absent, if given."""
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


def read_tensors(path: Path, required: tuple[str, ...]) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ProbeFormatError(f"{path}: cannot read safetensors ({exc})") from None
    for key in required:
        if key not in tensors:
            raise ProbeFormatError(f"{path}: tensor {key!r} is missing")
    return tensors


def check_direction(values: np.ndarray, key: str, tensor_path: Path, root: Path, meta_file: str,
                    hidden_size: int) -> None:
    """A direction in the residual stream: float32, [hidden_size] as the metadata says, finite."""
    if values.dtype != np.float32 or values.ndim != 1:
        raise ProbeFormatError(
            f"{tensor_path}: {key!r} must be float32 of shape [hidden_size], got {values.dtype} {list(values.shape)}"
        )
    if values.shape[0] != hidden_size:
        raise ProbeFormatError(
            f"{root}: {meta_file} says hidden_size {hidden_size} but {key!r} has {values.shape[0]} values"
        )
    if not np.isfinite(values).all():
        bad = int((~np.isfinite(values)).sum())
        raise ProbeFormatError(f"{tensor_path}: {key!r} holds {bad} non-finite values (NaN or inf)")


def check_unique_names(artifacts: list, what: str) -> None:
    """Requests and scores refer to artifacts by name, so a loaded set must not repeat one."""
    seen: dict[str, Any] = {}
    for artifact in artifacts:
        if artifact.name in seen:
            raise ProbeFormatError(
                f"two {what} are named {artifact.name!r} ({seen[artifact.name].source} and {artifact.source});"
                " names must be unique"
            )
        seen[artifact.name] = artifact
