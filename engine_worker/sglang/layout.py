"""SGLang's batches as the core's step views, and the order in which steps are handed over.

Pure Python and numpy: nothing here imports sglang, so the CPU tests drive it with stand-in
batches. runner.py reads the real batch (SGLang 0.5.14's `ScheduleBatch`, as the scheduler
hands it to `run_batch`) through `snapshot_step` and feeds the scheduler's events to a
`StepSequence`.

Rows. A batch's rows follow `batch.reqs` (the forward batch's `rids`):
- EXTEND: request i owns `extend_lens[i]` consecutive rows at positions `prefix_lens[i] ...`,
  where the prefix is what already has KV: a radix-cache hit and earlier chunks of a chunked
  prefill alike. A retracted request prefilled again is an extend of its prompt and the
  tokens it generated, its prompt length unchanged (Retraction below).
- MIXED (`--enable-mixed-chunk`): the prefilling requests first, then the running ones with
  extend length 1 and the position of their next token as prefix.
- DECODE: one row per request at position `seq_lens[i] - 1` (the scheduler counts the token
  being decoded in `seq_lens`).
- IDLE: no rows.
So `num_computed` is the prefix (or `seq_lens - 1`), `num_scheduled` the extend length (or 1),
`num_prompt` the length of the request's `origin_input_ids`.

Order. SGLang's overlap scheduler launches step N before it processes step N-1's results,
so a request that ended with step N-1 (a stop token, its last allowed token, an abort) still
has a row in step N: SGLang computes it and throws its token away. A `StepSequence` hands
each step over after every earlier step's results were processed and before its own are, so
at hand-over every request that ended before the step is known: such a request is listed in
the step's `finished` though it has rows there, and the core releases it and drops those rows
(engine_worker/step.py). Requests that end with a step are learned from its results and go
out with the next hand-over, or on their own (an idle step) when no step is waiting. A step
launched ahead of the results being processed is handed over at the next launch or before
its own results, whichever comes first, not earlier: the scheduler picks the next batch in
between, and that is where it retracts requests.

Retraction. When the KV pool cannot hold the next decode step, the scheduler retracts running
requests (`ScheduleBatch.retract_decode`, from `update_running_batch` while it picks the next
batch): their KV is freed, `Req.reset_for_retract` sets `is_retracted` and counts up
`retraction_count`, and they go back to the waiting queue with their `output_ids` (priority
preemption and `pause_generation`'s retract mode release requests the same way). Under the
overlap scheduler the step launched before holds rows of such a request; its results are
skipped for it (`is_retracted`), so its rows are no tokens: the request is listed in the
step's `dropped` and goes on. (A request retracted and aborted instead, when even one request
no longer fits, is listed in `finished`: it gets no further results.) Later the request is
prefilled again from `origin_input_ids + output_ids`, a radix prefix and chunks as for any
prompt; only the step that reaches the end of those samples a token, the next one. A chunk
that stops short of the end delivers nothing (its rows are at positions whose scores went
out before, and it samples nothing), so its request is listed in `dropped`; the last chunk
goes to the core as it is, which scores its sampling row as that new token and nothing else
(engine_worker/step.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine_worker.step import StepView

# Forward modes whose rows ProbeX cannot place (speculative verification and drafting,
# PD-multiplexed split prefill, diffusion LLM blocks, disaggregated prebuilt batches): the
# launcher refuses the options that produce them.
_UNSUPPORTED_MODES = ("is_target_verify", "is_draft_extend_v2", "is_split_prefill", "is_dllm_extend", "is_prebuilt")


class UnsupportedBatch(ValueError):
    """A batch whose rows cannot be described as requests' tokens."""


@dataclass(frozen=True)
class StepSnapshot:
    """One launched step: its requests in row order and their counts, copied at launch (the
    scheduler keeps changing the batch's lists and tensors in place afterwards)."""

    forward_iter: int
    req_ids: tuple[str, ...]
    num_scheduled: np.ndarray
    num_computed: np.ndarray
    num_prompt: np.ndarray
    dropped: tuple[str, ...] = ()  # requests computed again whose rows here stop short of their end
    # The batch's requests and each one's (retraction_count, is_retracted) at launch, read
    # again at hand-over: what the scheduler retracted since then.
    reqs: tuple = field(default=(), compare=False, repr=False)
    marks: tuple[tuple[int, bool], ...] = field(default=(), compare=False, repr=False)

    @property
    def rows(self) -> int:
        return int(self.num_scheduled.sum())

    @property
    def has_prompt_rows(self) -> bool:
        """Some request is still in its prompt: the step carries a prompt chunk."""
        return bool((self.num_computed < self.num_prompt).any())

    def taken_back(self) -> tuple[list[str], list[str]]:
        """The requests of this step retracted since it was launched, as (queued again,
        aborted): the scheduler skips the step's results for both."""
        queued, aborted = [], []
        for req_id, req, (count, flag) in zip(self.req_ids, self.reqs, self.marks):
            now_count, now_flag = _retraction_mark(req)
            if now_count > count or (now_flag and not flag):
                (aborted if getattr(req, "to_finish", None) is not None else queued).append(req_id)
        return queued, aborted


def _mode(batch, name: str) -> bool:
    method = getattr(batch.forward_mode, name, None)
    return bool(method()) if method is not None else False


def _ints(values) -> np.ndarray:
    """A copy of a list, numpy array or CPU tensor of counts, as int64."""
    if values is None:
        raise UnsupportedBatch("the batch has no host copy of its per-request counts")
    if hasattr(values, "tolist") and not isinstance(values, np.ndarray):
        values = values.tolist()  # a torch tensor (on the host: SGLang keeps *_cpu mirrors)
    return np.array(values, dtype=np.int64, copy=True).reshape(-1)


def _retraction_mark(req) -> tuple[int, bool]:
    count = getattr(req, "retraction_count", 0)
    return (count if isinstance(count, int) else 0), getattr(req, "is_retracted", False) is True


def _computed_again(req_ids, reqs, computed: np.ndarray, scheduled: np.ndarray, prompt: np.ndarray) -> tuple:
    """The requests of an extend step that computes tokens they generated before (a retracted
    request prefilled again: `output_ids` is not empty) and stops short of their end: SGLang
    samples nothing for such a chunk, and its rows are at positions below the last generated
    token's, whose scores went out with the prompt's summary and those tokens."""
    again = []
    for i, req in enumerate(reqs):
        generated = len(getattr(req, "output_ids", None) or ())
        if generated and computed[i] + scheduled[i] < prompt[i] + generated:
            again.append(req_ids[i])
    return tuple(again)


def _first(batch, *names):
    for name in names:
        value = getattr(batch, name, None)
        if value is not None:
            return value
    return None


def _request_ids(batch) -> list[str]:
    rids = getattr(batch, "rids", None)
    if rids is None:
        rids = [req.rid for req in batch.reqs]
    return [str(rid) for rid in rids]


def _prompt_lengths(batch, prompt_lens) -> np.ndarray:
    if prompt_lens is not None:
        return _ints(prompt_lens)
    reqs = getattr(batch, "reqs", None)
    if reqs is None:
        raise UnsupportedBatch("prompt lengths come from the schedule batch's requests (origin_input_ids)")
    return np.fromiter((len(req.origin_input_ids) for req in reqs), dtype=np.int64, count=len(reqs))


def snapshot_step(batch, forward_iter: int, prompt_lens=None) -> StepSnapshot | None:
    """The step `batch` is about to run, or None for a batch of no rows (IDLE, or empty).

    `batch`: a `ScheduleBatch` (`reqs`, `prefix_lens`, `extend_lens`, `extend_num_tokens`,
    `seq_lens_cpu`, `forward_mode`) or a `ForwardBatch` (`rids`, `extend_prefix_lens_cpu`,
    `extend_seq_lens_cpu`, `seq_lens_cpu`), with `prompt_lens` then given from the schedule
    batch's requests."""
    for name in _UNSUPPORTED_MODES:
        if _mode(batch, name):
            raise UnsupportedBatch(f"ProbeX cannot place the rows of a {batch.forward_mode!r} batch")
    if _mode(batch, "is_idle"):
        return None
    req_ids = _request_ids(batch)
    n = len(req_ids)
    if n == 0:
        return None
    prompt = _prompt_lengths(batch, prompt_lens)
    extending = not _mode(batch, "is_decode")
    if not extending:
        computed = _ints(_first(batch, "seq_lens_cpu")) - 1
        scheduled = np.ones(n, dtype=np.int64)
        expected = None  # one row a request (`input_ids` may still be the previous step's placeholder)
    elif _mode(batch, "is_extend"):  # EXTEND and MIXED
        computed = _ints(_first(batch, "extend_prefix_lens_cpu", "prefix_lens"))
        scheduled = _ints(_first(batch, "extend_seq_lens_cpu", "extend_lens"))
        expected = _first(batch, "extend_num_tokens")
    else:
        raise UnsupportedBatch(f"ProbeX cannot place the rows of a {batch.forward_mode!r} batch")
    if not (len(computed) == len(scheduled) == len(prompt) == n):
        raise UnsupportedBatch(f"the batch's per-request counts disagree: {n} requests, {len(scheduled)} extend"
                               f" lengths, {len(computed)} prefixes, {len(prompt)} prompt lengths")
    if expected is not None and int(expected) != int(scheduled.sum()):
        raise UnsupportedBatch(f"the batch has {int(expected)} tokens but its requests' rows add up to"
                               f" {int(scheduled.sum())}")
    if (computed < 0).any() or (scheduled < 0).any():
        raise UnsupportedBatch("negative prefix or extend length in the batch")
    reqs = tuple(getattr(batch, "reqs", None) or ())
    if len(reqs) != n:  # a ForwardBatch alone: no requests to watch
        return StepSnapshot(int(forward_iter), tuple(req_ids), scheduled, computed, prompt)
    again = _computed_again(req_ids, reqs, computed, scheduled, prompt) if extending else ()
    return StepSnapshot(int(forward_iter), tuple(req_ids), scheduled, computed, prompt, again, reqs,
                        tuple(_retraction_mark(req) for req in reqs))


def view_of(snapshot: StepSnapshot, finished: tuple[str, ...] = (), dropped: tuple[str, ...] = ()) -> StepView:
    return StepView(req_ids=list(snapshot.req_ids), num_scheduled=snapshot.num_scheduled,
                    num_computed=snapshot.num_computed, num_prompt=snapshot.num_prompt, finished=tuple(finished),
                    dropped=tuple(dropped))


@dataclass(frozen=True)
class Handover:
    """What goes to the controller now: a step that ran (`step`, with the requests that ended
    before it or ran past their end in it, and those whose rows in it deliver nothing) or,
    `step` None, only requests that ended."""

    step: StepSnapshot | None
    finished: tuple[str, ...]
    dropped: tuple[str, ...] = ()


@dataclass
class StepSequence:
    """Hands each launched step over once the results of every earlier step are processed
    and before its own are, with the requests that ended in between (module docstring).

    The scheduler's events, in its order: `launching()` before a forward is enqueued (a step
    still waiting goes now: its rows must be copied before the next forward overwrites the
    buffers), `launched(snapshot)` after, `before_result(it)` and `after_result(it, ended)`
    around the processing of step `it`'s results, `flush()` whenever the scheduler is
    between steps with nothing in flight that could end a request (an engine RPC)."""

    # How many steps a request that ended is remembered for: the overlap scheduler runs a
    # request past its end by one step (two while a prefill is launched ahead of a decode).
    remember_steps: int = 8
    pending: StepSnapshot | None = None
    _ended: list[str] = field(default_factory=list)  # learned, not yet handed over
    _ended_at: dict[str, int] = field(default_factory=dict)  # request -> step whose results ended it
    _latest: int = 0

    def launching(self) -> Handover | None:
        return self._hand_over()

    def launched(self, snapshot: StepSnapshot | None) -> None:
        if snapshot is None:
            return
        self._latest = max(self._latest, snapshot.forward_iter)
        self.pending = snapshot

    def before_result(self, forward_iter: int) -> Handover | None:
        if self.pending is not None and self.pending.forward_iter <= forward_iter:
            return self._hand_over()
        return None

    def after_result(self, forward_iter: int, ended) -> Handover | None:
        self._latest = max(self._latest, forward_iter)
        for req_id in ended:
            if req_id not in self._ended_at:
                self._ended_at[req_id] = forward_iter
                self._ended.append(req_id)
        self._forget_old()
        if self.pending is not None:
            # Launched ahead of these results: it goes at the next launch or before its own
            # results, with these ends, once the scheduler has retracted what it retracts.
            return None
        if self._ended:
            finished, self._ended = tuple(self._ended), []
            return Handover(None, finished)
        return None

    def flush(self) -> Handover | None:
        return self._hand_over() if self.pending is not None else None

    def _hand_over(self) -> Handover | None:
        step, self.pending = self.pending, None
        if step is None:
            return None
        finished = list(self._ended)
        self._ended = []
        # Requests that ended before this step and still have rows in it: run past their end.
        listed = set(finished)
        finished += [r for r in step.req_ids if r in self._ended_at and r not in listed]
        # Requests retracted since the step was launched: no tokens of theirs in it.
        queued, aborted = step.taken_back()
        listed.update(finished)
        finished += [r for r in aborted if r not in listed]
        listed.update(finished)
        dropped = [r for r in dict.fromkeys((*step.dropped, *queued)) if r not in listed]
        return Handover(step, tuple(finished), tuple(dropped))

    def _forget_old(self) -> None:
        # Entries go in by step, so the oldest are first.
        oldest = self._latest - self.remember_steps
        while self._ended_at:
            req_id, at = next(iter(self._ended_at.items()))
            if at >= oldest:
                break
            del self._ended_at[req_id]
