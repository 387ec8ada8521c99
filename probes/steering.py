"""The steering-vector artifact: a directory holding `vector.safetensors` and `vector.yaml`.

See docs/steering.md for the format. Like probes (probes/artifact.py), loading validates
the artifact on its own (shape, dtype, finiteness, fields) and, given the served model,
against it (hidden size, layer range); every refusal names the file and the problem.
No torch here: the gateway and the middleware read these files too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from probes.artifact import ProbeFormatError, ProbeMismatchError, ServedModel

VECTOR_FILE = "vector.safetensors"
VECTOR_METADATA_FILE = "vector.yaml"
VECTOR_FORMAT_VERSION = 1

_KNOWN_KEYS = {"format_version", "kind", "name", "layer", "hidden_size", "model"}


@dataclass
class SteeringVector:
    name: str
    layer: int  # added to the residual stream at the output of decoder block `layer`
    vector: np.ndarray  # float32 [hidden_size]
    model: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    source: Path | None = None

    @property
    def hidden_size(self) -> int:
        return int(self.vector.shape[0])

    @property
    def digest(self) -> str:
        """Content hash (name, layer, values): a replaced vector must never share KV cache with the old one."""
        h = hashlib.sha256(f"{self.name}\0{self.layer}\0".encode())
        h.update(np.ascontiguousarray(self.vector, dtype=np.float32).tobytes())
        return h.hexdigest()[:16]

    def check_fits(self, served: ServedModel) -> None:
        where = self.source or self.name
        if self.hidden_size != served.hidden_size:
            raise ProbeMismatchError(
                f"{where}: steering vector {self.name!r} has hidden_size {self.hidden_size} but the served model"
                f" has hidden_size {served.hidden_size}"
            )
        if not 0 <= self.layer < served.num_hidden_layers:
            raise ProbeMismatchError(
                f"{where}: steering vector {self.name!r} is for layer {self.layer}, out of range for a model with"
                f" {served.num_hidden_layers} decoder layers (valid: 0..{served.num_hidden_layers - 1})"
            )

    def metadata(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format_version": VECTOR_FORMAT_VERSION,
            "kind": "steering_vector",
            "name": self.name,
            "layer": self.layer,
            "hidden_size": self.hidden_size,
            "model": dict(self.model),
        }
        data.update(self.extra)
        return data


def save_vector(vector: SteeringVector, directory: str | Path) -> Path:
    from safetensors.numpy import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"vector": np.ascontiguousarray(vector.vector, dtype=np.float32)}, str(out / VECTOR_FILE))
    (out / VECTOR_METADATA_FILE).write_text(yaml.safe_dump(vector.metadata(), sort_keys=False))
    return out


def load_vector(directory: str | Path, served: ServedModel | None = None) -> SteeringVector:
    """Load and validate a steering-vector directory; with `served`, also check it fits that model."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    root = Path(directory)
    meta_path, tensor_path = root / VECTOR_METADATA_FILE, root / VECTOR_FILE
    if not root.is_dir():
        raise ProbeFormatError(f"{root}: steering-vector directory not found")
    for path in (meta_path, tensor_path):
        if not path.is_file():
            raise ProbeFormatError(
                f"{path}: missing (a steering-vector directory holds {VECTOR_METADATA_FILE} and {VECTOR_FILE})"
            )
    try:
        meta = yaml.safe_load(meta_path.read_text())
    except yaml.YAMLError as exc:
        raise ProbeFormatError(f"{meta_path}: not valid YAML ({exc})") from None
    if not isinstance(meta, dict):
        raise ProbeFormatError(f"{meta_path}: expected a mapping at the top level")
    if meta.get("kind", "steering_vector") != "steering_vector":
        raise ProbeFormatError(f"{meta_path}: kind {meta.get('kind')!r} is not 'steering_vector'")

    def required_int(key: str) -> int:
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProbeFormatError(f"{meta_path}: field {key!r} must be an integer, got {value!r}")
        return value

    name = meta.get("name")
    if not (isinstance(name, str) and name.strip()):
        raise ProbeFormatError(f"{meta_path}: field 'name' must be a non-empty string, got {name!r}")
    layer = required_int("layer")
    hidden_size = required_int("hidden_size")
    model = meta.get("model", {})
    if not isinstance(model, dict):
        raise ProbeFormatError(f"{meta_path}: field 'model' must be a mapping, got {model!r}")
    try:
        tensors = load_file(str(tensor_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ProbeFormatError(f"{tensor_path}: cannot read safetensors ({exc})") from None
    if "vector" not in tensors:
        raise ProbeFormatError(f"{tensor_path}: tensor 'vector' is missing")
    values = tensors["vector"]
    if values.dtype != np.float32 or values.ndim != 1:
        raise ProbeFormatError(
            f"{tensor_path}: 'vector' must be float32 of shape [hidden_size], got {values.dtype} {list(values.shape)}"
        )
    if values.shape[0] != hidden_size:
        raise ProbeFormatError(
            f"{root}: {VECTOR_METADATA_FILE} says hidden_size {hidden_size} but 'vector' has {values.shape[0]} values"
        )
    if not np.isfinite(values).all():
        bad = int((~np.isfinite(values)).sum())
        raise ProbeFormatError(f"{tensor_path}: 'vector' holds {bad} non-finite values (NaN or inf)")
    vector = SteeringVector(name=name, layer=layer, vector=values, model=model,
                            extra={k: v for k, v in meta.items() if k not in _KNOWN_KEYS}, source=root)
    if served is not None:
        vector.check_fits(served)
    return vector


def check_vector_set(vectors: list[SteeringVector]) -> None:
    """Requests pick vectors by name, so names must be unique in a loaded set."""
    seen: dict[str, SteeringVector] = {}
    for vector in vectors:
        if vector.name in seen:
            raise ProbeFormatError(
                f"two steering vectors are named {vector.name!r} ({seen[vector.name].source} and {vector.source});"
                " names must be unique"
            )
        seen[vector.name] = vector


def difference_of_means(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """mean(positive) - mean(negative) over rows ([n, hidden] each), in float64, returned as float32."""
    if positive.ndim != 2 or negative.ndim != 2 or positive.shape[1] != negative.shape[1]:
        raise ValueError("difference_of_means: both sets must be [n, hidden] with the same hidden size")
    if not len(positive) or not len(negative):
        raise ValueError("difference_of_means: both sets need at least one row")
    diff = positive.astype(np.float64).mean(axis=0) - negative.astype(np.float64).mean(axis=0)
    return diff.astype(np.float32)
