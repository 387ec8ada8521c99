"""What the API server keeps of each request's scores, and the probe columns they are in.

Shared by the score formatter (which lays scores out) and the hub in each API server
process (which files them): plain data, no I/O.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec


@dataclass
class ProbeInfo:
    name: str
    read: str
    slope: float
    intercept: float
    layer: int


class ProbeColumns(list):
    """One probe-table version's probes in the order of their columns in a step's scores, and
    the JSON a stream chunk's scores are written into: `generated_json_parts` holds the bytes
    around each probe's offset and scores, `{"<name>":{"generated":{"offset":` OFFSET
    `,"scores":[` SCORES `]}},"<name>"...`, with the offsets at [1::4] and the scores at
    [3::4] (render.generated_scores_json)."""

    def __init__(self, probes: list[ProbeInfo]) -> None:
        super().__init__(probes)
        parts: list[bytes | None] = []
        for column, probe in enumerate(probes):
            parts += [(b"{" if column == 0 else b"]}},") + msgspec.json.encode(probe.name) + b':{"generated":{"offset":',
                      None, b',"scores":[', None]
        self.generated_json_parts = parts + [b"]}}}"] if parts else [b"{}"]


@dataclass
class RequestScores:
    """Everything that arrived for one request (one prompt of one API call)."""

    prompt: dict | None = None  # the summary of the prompt's raw scores (bookkeeping's prompt summary)
    prompt_fields: dict[str, dict] | None = None  # and each probe's calibrated part (render.prompt_fields)
    prompt_probes: ProbeColumns | None = None  # the probe set `prompt_fields` were laid out for
    prompt_json_parts: list[bytes | None] | None = None  # and as the first chunk writes them (render.prompt_json_parts)
    # (token 0's scores, the prompt_json_parts, the first chunk's scores JSON written from them):
    # render.write_first_chunk_ahead, as the prompt's step comes in
    first_chunk_json: tuple[tuple[float, ...], list, bytes] | None = None
    # A spliced stream's tokens' scores as their one-token chunks carry them, written as each
    # token comes in (render.token_scores_json) and taken by the chunk: the hub takes in a
    # step's scores well ahead of the step's chunks, which come in a burst, one per stream,
    # where a first token can wait behind the others. None: not written (not a stream, or its
    # chunk with the prompt's scores has not gone out). Only tokens from `token_json_from` on,
    # the first whose chunk has not gone out, are written: one that came in late stays out.
    token_json: dict[int, bytes] | None = None
    token_json_from: int = 0
    # Each generated token's calibrated scores, a tuple of floats: the garbage collector stops
    # tracking such a tuple the first time it sees it, so a long stream's tokens do not add to
    # what every later collection of the API server scans (a list, or a tuple holding the
    # probe set, would stay tracked until the request ends).
    tokens: dict[int, tuple[float, ...]] = field(default_factory=dict)
    token_probes: ProbeColumns | None = None  # the probe set that scored the request's first token in
    other_probes: dict[int, ProbeColumns] = field(default_factory=dict)  # tokens a different set scored
    contiguous: int = 0  # tokens 0..contiguous-1 are all in: O(1) answers for every stream chunk
    finished: bool = False
    touched: float = field(default_factory=time.monotonic)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    latest: int = -1  # the highest token index in
    lost: bool = False  # the worker could not send a step of this request's: waits end at once

    def add_token(self, index: int, scores: tuple[float, ...], probes: ProbeColumns) -> None:
        """`scores`: calibrated, one per probe of `probes` (the set that scored this token)."""
        self.tokens[index] = scores
        if self.token_probes is None:
            self.token_probes = probes
        elif probes is not self.token_probes:
            self.other_probes[index] = probes  # a probe swap while the request ran
        elif self.other_probes:
            self.other_probes.pop(index, None)  # the token came again, scored by the first set
        while self.contiguous in self.tokens:
            self.contiguous += 1
        if index > self.latest:
            self.latest = index

    def probes_of(self, index: int) -> ProbeColumns | None:
        """The probe set that scored token `index` (None if it has not come in)."""
        if index not in self.tokens:
            return None
        return self.other_probes.get(index, self.token_probes) if self.other_probes else self.token_probes

    def has(self, *, prompt: bool, tokens: int) -> bool:
        """The prompt summary (if asked) and tokens [0, tokens) are all in, or as far in as they
        will ever be. Steps arrive in order and a prompt's summary comes with its first token,
        so once a later token is in, an earlier one missing (and a summary missing) was lost
        on the way or fell in a pause: waiting for it would only hold the chunk."""
        if self.lost:
            return True
        if prompt and self.prompt is None and self.latest < 0:
            return False
        return self.contiguous >= tokens or self.latest >= tokens - 1
