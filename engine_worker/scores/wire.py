"""The score formatter's messages to the API server processes (ZMQ PUB/SUB), as both ends read them.

Topics: an API server process's own is its owner tag (8 hex digits, `owner_tag`); with one
API server process, whose ids carry no tag, every row goes to UNTAGGED; control messages
for every process go on BROADCAST. A step's rows for one process travel as a
`FormattedStep`, already booked, calibrated and written as JSON.
"""

from __future__ import annotations

import logging
import re
import uuid

import msgspec
import numpy as np

from engine_worker.scores import render
from engine_worker.scores.columns import ProbeColumns, ProbeInfo
from probes.scoring import calibrate_array

log = logging.getLogger("probex.scores")

_ENGINE_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


# Topics: an API server process's own is its owner tag (8 hex digits, `owner_tag`);
# with one API server process, whose ids carry no tag, every row goes to UNTAGGED.
BROADCAST = b"*"
UNTAGGED = b"-"
OWNER_MARKER = "-probex-"  # what precedes an owner tag in a request id (middleware.inspect_request)
PUBLISHER = "publisher"
# A hub that has heard nothing for this long (the formatter's heartbeats come every second)
# takes the formatter for gone: waits for scores end at once until it hears from it again.
SILENT_AFTER_S = 5.0


class FormattedPrompt(msgspec.Struct, array_like=True):
    """A prompt complete in this step: its summary (`bookkeeping._prompt_summary`), each probe's
    calibrated part (`responses.prompt_fields`) and the first chunk's JSON around its tokens'
    scores (`responses.prompt_json_parts`; None if it could not be written)."""

    request: str
    summary: dict
    fields: dict
    json_parts: list[bytes | None] | None


class FormattedStep(msgspec.Struct, array_like=True):
    """One step's rows of one API server process's requests, ready to file: tokens as parallel
    columns (calibrated scores, one float per probe, and the one-token chunk's JSON)."""

    publisher: int
    sequence: int
    version: int
    probes: msgspec.Raw  # the probe set's description (ProbeTable.describe); read once per version
    pause: tuple[int, bool] | None
    prompts: list[FormattedPrompt]
    token_requests: list[str]
    token_indexes: list[int]
    token_scores: list[tuple[float, ...]]
    token_json: list[bytes]
    finished: list[str]


def external_request_id(engine_request_id: str) -> str:
    return _ENGINE_SUFFIX.sub("", engine_request_id)


def owner_tag() -> str:
    """A random tag for one API server process: the first 8 hex digits of each request id it gives out."""
    return uuid.uuid4().hex[:8]


class ProbeSet:
    """One probe-table version as the hub sees it: names and calibration, vectorised."""

    def __init__(self, probes: list[ProbeInfo]) -> None:
        self.probes = ProbeColumns(probes)
        self._slope = np.array([p.slope for p in probes], dtype=np.float64)
        self._intercept = np.array([p.intercept for p in probes], dtype=np.float64)

    @classmethod
    def from_described(cls, described) -> "ProbeSet":
        """From a step's `probes` (ProbeTable.describe: name, read, slope, intercept, layer each)."""
        return cls([ProbeInfo(*p) for p in described])

    def calibrate(self, raw: np.ndarray) -> np.ndarray:
        """[n, k] raw -> calibrated, each column with its own probe's slope and intercept."""
        return calibrate_array(raw, self._slope, self._intercept)


def laid_out_prompt(summary: dict, probes: ProbeColumns) -> tuple[dict[str, dict], list[bytes | None] | None]:
    """A complete prompt's calibrated part per probe (`render.prompt_fields`) and its first
    chunk's JSON around the tokens' scores (`render.prompt_json_parts`; None where it could
    not be written: the first chunk then writes it itself). A bad summary gives no fields
    rather than costing the step's other scores."""
    try:
        fields = render.prompt_fields(summary, probes)
    except Exception:
        log.exception("probex: could not lay out a prompt's scores")
        fields = {}
    try:
        return fields, render.prompt_json_parts(fields)
    except Exception:
        log.exception("probex: could not write a prompt's scores as JSON")
        return fields, None
