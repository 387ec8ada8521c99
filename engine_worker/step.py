"""The one surface between the engine-agnostic core and an engine adapter: a step's view.

An engine adapter (engine_worker/vllm/, one folder per engine) owns one `TapController`
(engine_worker/tap/controller.py) and describes every forward to it as a `StepView`: which
request each row of the step's hidden states belongs to, and where in that request the rows
are. Nothing else about the engine reaches the core. Per step the adapter calls, on the
engine thread:

    controller.before_forward(view, capture_ids, steering)   # only if controller.needs_view_before_forward
    controller.open_mid_forward_copies(rows)                  # a step carrying a prompt chunk
    ... the forward is enqueued; the model's hook calls controller.layer_scores_final(layer) ...
    controller.close_mid_forward_copies(launched=True)
    controller.after_forward(view or DeferredStep(...))       # a step that ran
    controller.after_idle_step(finished)                      # a step that ran no forward

Rows are the step's scheduled tokens in batch order: request i owns rows
`row_starts[i] : row_starts[i] + num_scheduled[i]`, at positions `num_computed[i] ...`
of its sequence (prompt first, then generated tokens). `num_computed` counts every token of
the request whose KV already exists before this step: a prefix read from the engine's cache
(vLLM's prefix cache, SGLang's radix cache) and earlier chunks of a chunked prefill alike, so
the rows of a cached prefix are never in a step and never scored. A request samples a token
in this step when its rows reach the end of its prompt (`sampling_row`).

`finished` lists requests that ended before this step's rows: their books are released with
it. vLLM lists a request there in the step after the one that sampled its last token, so a
finished request has no rows in its step; an engine that schedules one step ahead (SGLang's
overlap scheduler) may still compute a row for a request that already ended, and the core
drops such overshoot rows instead of scoring them.

`dropped` lists requests that go on but whose rows in this step deliver nothing: the engine
took the request back after the step was launched and throws away what the step computed
for it (to compute it again later), or the step computes again positions whose scores were
delivered already and samples no new token for the request. The core drops their rows and
keeps their books. A request computed again from its start (prompt and the tokens it
generated, in one step or as the last part of several) needs no entry in its final step: the
books deliver a prompt's scores once and a generated token's score only from the row that
samples it, so that step delivers its one new token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class StepView:
    """A step's rows as requests: all arrays have one entry per request, in row order."""

    req_ids: list[str]
    num_scheduled: np.ndarray  # rows of each request in this step (its extend length)
    num_computed: np.ndarray  # tokens of each request computed before this step (cached prefix included)
    num_prompt: np.ndarray  # each request's prompt length
    finished: tuple[str, ...] = ()  # requests that ended before this step's rows (their rows here are dropped)
    dropped: tuple[str, ...] = ()  # requests that go on, whose rows here deliver nothing (dropped, books kept)

    def __post_init__(self) -> None:
        n = len(self.req_ids)
        if not (len(self.num_scheduled) == len(self.num_computed) == len(self.num_prompt) == n):
            raise ValueError("StepView: per-request arrays must have one entry per request")

    @classmethod
    def empty(cls, finished: tuple[str, ...] | list[str] = ()) -> "StepView":
        none = np.zeros(0, dtype=np.int64)
        return cls(req_ids=[], num_scheduled=none, num_computed=none, num_prompt=none, finished=tuple(finished))

    @property
    def row_starts(self) -> np.ndarray:
        cached = self.__dict__.get("_row_starts")
        if cached is None:  # computed once: per-request lookups would otherwise redo the cumsum
            cached = np.zeros(len(self.req_ids), dtype=np.int64)
            if len(self.req_ids) > 1:
                np.cumsum(self.num_scheduled[:-1], out=cached[1:])
            object.__setattr__(self, "_row_starts", cached)
        return cached

    @property
    def num_rows(self) -> int:
        return int(self.num_scheduled.sum())

    def prompt_rows(self, i: int) -> tuple[int, int, int]:
        """(first row, last row exclusive, first position) of request i's prompt rows in this step."""
        start, c, n, p = int(self.row_starts[i]), int(self.num_computed[i]), int(self.num_scheduled[i]), int(self.num_prompt[i])
        count = max(0, min(c + n, p) - c)
        return start, start + count, c

    def sampling_row(self, i: int) -> tuple[int, int] | None:
        """(row, generated-token index) if this step samples a new token for request i."""
        c, n, p = int(self.num_computed[i]), int(self.num_scheduled[i]), int(self.num_prompt[i])
        if c + n < p:
            return None  # a chunk of a longer prefill: nothing is sampled yet
        return int(self.row_starts[i]) + n - 1, c + n - p

    @property
    def sampled_rows(self) -> list[int]:
        """The rows that sample a token in this step, one per sampling request, in request order."""
        rows = (self.sampling_row(i) for i in range(len(self.req_ids)))
        return [row[0] for row in rows if row is not None]


@dataclass(frozen=True)
class DeferredStep:
    """A step whose view is built later, off the forward's launch path: its row count and
    finished requests now, and a function that builds the view from values the engine does
    not change afterwards (the step's own arrays, or copies of shared ones)."""

    rows: int
    build: Callable[[], StepView]
    finished: tuple[str, ...] = ()

    def view(self) -> StepView:
        view = self.build()
        if view.num_rows != self.rows:
            raise ValueError(f"the step's view has {view.num_rows} rows, {self.rows} were copied")
        return view
