"""Probe artifacts and the math around them.

Engine-agnostic on purpose: nothing here imports vLLM, FastAPI, torch, or the
other ProbeX packages, so the gateway can parse probe metadata without pulling
an engine into its container.
"""

from probes.artifact import (
    ProbeArtifact,
    ProbeFormatError,
    ProbeMismatchError,
    ReadPoint,
    ServedModel,
    load_probe,
    save_probe,
)
from probes.scoring import calibrate

__all__ = [
    "ProbeArtifact",
    "ProbeFormatError",
    "ProbeMismatchError",
    "ReadPoint",
    "ServedModel",
    "calibrate",
    "load_probe",
    "save_probe",
]
