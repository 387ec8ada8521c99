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

from probes.artifact import (
    ProbeFormatError,
    ServedModel,
    check_direction,
    check_fits_model,
    check_unique_names,
    metadata_field,
    read_metadata,
    read_tensors,
)

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
        check_fits_model(self.source or self.name, f"steering vector {self.name!r}", self.hidden_size,
                         f"is for layer {self.layer}", self.layer, served)

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
    root = Path(directory)
    meta, meta_path, tensor_path = read_metadata(root, VECTOR_METADATA_FILE, VECTOR_FILE, "steering-vector")
    if meta.get("kind", "steering_vector") != "steering_vector":
        raise ProbeFormatError(f"{meta_path}: kind {meta.get('kind')!r} is not 'steering_vector'")
    name = metadata_field(meta, meta_path, "name", str)
    layer = metadata_field(meta, meta_path, "layer", int)
    hidden_size = metadata_field(meta, meta_path, "hidden_size", int)
    model = metadata_field(meta, meta_path, "model", dict, {})
    values = read_tensors(tensor_path, ("vector",))["vector"]
    check_direction(values, "vector", tensor_path, root, VECTOR_METADATA_FILE, hidden_size)
    vector = SteeringVector(name=name, layer=layer, vector=values, model=model,
                            extra={k: v for k, v in meta.items() if k not in _KNOWN_KEYS}, source=root)
    if served is not None:
        vector.check_fits(served)
    return vector


def check_vector_set(vectors: list[SteeringVector]) -> None:
    """Requests pick vectors by name, so names must be unique in a loaded set."""
    check_unique_names(vectors, "steering vectors")


def difference_of_means(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """mean(positive) - mean(negative) over rows ([n, hidden] each), in float64, returned as float32."""
    if positive.ndim != 2 or negative.ndim != 2 or positive.shape[1] != negative.shape[1]:
        raise ValueError("difference_of_means: both sets must be [n, hidden] with the same hidden size")
    if not len(positive) or not len(negative):
        raise ValueError("difference_of_means: both sets need at least one row")
    diff = positive.astype(np.float64).mean(axis=0) - negative.astype(np.float64).mean(axis=0)
    return diff.astype(np.float32)
