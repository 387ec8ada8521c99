"""Retraction on SGLang 0.5.14 (engine_worker/sglang/layout.py, runner.py), down to what the
score formatter books: each generated token's score is delivered once, and the prompt's once.

The stand-ins follow 0.5.14's objects and order:
- `Req` keeps the fields retraction touches (`output_ids`, `is_retracted`, `retracted_stain`,
  `retraction_count`, `to_finish`, `inflight_middle_chunks`); `reset_for_retract` is
  schedule_batch.py's, less the KV bookkeeping.
- The scheduler picks the next batch (where `update_running_batch` retracts) before it
  launches it; the overlap loop then processes the previous step's results
  (`event_loop_overlap`), the normal loop the step's own (`event_loop_normal`).
- `process_batch_result` skips a retracted request's row, in a prefill
  (batch_result_processor.py L219) and, under overlap, in a decode (L679), and a chunk that
  stops short of the request's end samples no token.
- A retracted request is prefilled again from `origin_input_ids + output_ids`, after a radix
  prefix; `prepare_for_extend` clears `is_retracted` (schedule_batch.py L2132).
"""

from __future__ import annotations

from array import array
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest

from engine_worker.scores.bookkeeping import ProbeSlot, ProbeTable, StepReader, step_message
from engine_worker.sglang import runner as sgl
from engine_worker.step import StepView
from tests.fixtures.sglang_standins import Mode

TABLE = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last", 1.0, 0.0),))


class Req:
    def __init__(self, rid: str, prompt: int, max_new: int):
        self.rid, self.origin_input_ids = rid, array("q", range(prompt))
        self.output_ids = array("q")
        self.sampling_params = SimpleNamespace(custom_params=None)
        self.finished_reason = self.to_finish = None
        self.is_retracted = self.retracted_stain = False
        self.retraction_count = 0
        self.inflight_middle_chunks = 0
        self.max_new = max_new
        self.kv = 0  # tokens with KV once the steps launched so far have run (seq_lens - 1 of its next decode)

    def finished(self):
        return self.finished_reason is not None

    def reset_for_retract(self):
        self.retraction_count += 1
        self.is_retracted = self.retracted_stain = True
        self.kv = self.inflight_middle_chunks = 0


def retract(req: Req, abort: bool = False) -> None:
    """`ScheduleBatch.retract_decode`: the request's KV is released (`release_req`), or, the
    last request that no longer fits, it is aborted as well."""
    if abort:
        req.to_finish = "abort"
    req.reset_for_retract()


def retract_then_decode(retracted: Req, *running: Req):
    """A pick that retracts `retracted` (the scheduler, while it picks the next batch) and then
    decodes the requests still running."""

    def pick():
        retract(retracted)
        return decode(*running)

    return pick


def extend(*parts):
    """A prefill batch: (request, radix prefix or earlier chunks, rows)."""
    reqs, prefix, rows = [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts]
    for req, c, n in parts:
        req.is_retracted = False  # prepare_for_extend
        req.inflight_middle_chunks += int(c + n < len(req.origin_input_ids) + len(req.output_ids))
        req.kv = c + n
    return SimpleNamespace(forward_mode=Mode("EXTEND"), reqs=reqs, prefix_lens=prefix, extend_lens=rows,
                           extend_num_tokens=sum(rows), seq_lens_cpu=np.array(prefix) + np.array(rows))


def decode(*reqs):
    seq_lens = np.array([r.kv + 1 for r in reqs])
    for r in reqs:
        r.kv += 1
    return SimpleNamespace(forward_mode=Mode("DECODE"), reqs=list(reqs), seq_lens_cpu=seq_lens, input_ids=None)


class Scheduler:
    def __init__(self, runner, overlap: bool):
        self.tp_worker = SimpleNamespace(model_runner=runner)
        self.enable_overlap = overlap
        self.forward_ct = 0

    def run_batch(self, batch):
        self.forward_ct += 1
        batch.forward_iter = self.forward_ct
        return SimpleNamespace()

    def process_batch_result(self, batch, result):
        for req in batch.reqs:
            if batch.forward_mode.is_extend():
                if req.finished() or req.is_retracted:
                    continue
                if req.inflight_middle_chunks > 0:  # a chunk short of the end: no token
                    req.inflight_middle_chunks -= 1
                    continue
            elif self.enable_overlap and (req.finished() or req.is_retracted):
                continue
            req.output_ids.append(len(req.output_ids))
            if len(req.output_ids) >= req.max_new:
                req.finished_reason = "length"

    def set_internal_state(self, recv_req):
        return None


sgl.patch_scheduler_class(Scheduler, rpc_output=lambda result: result)


class BookingController:
    """The controller's part as the score formatter sees it: each handed-over step goes
    through the wire message into the books. A row's raw score is its position, plus 1000 x
    the request's number, plus 100000 x the step's number in hand-over order."""

    taps = {3: None}
    needs_view_before_forward = False
    reads_scores = True

    def __init__(self):
        self.reader = StepReader()
        self.handed = 0
        self.prompts: dict[str, list[dict]] = {}
        self.tokens: dict[str, list[tuple[int, float]]] = {}
        self.ended: list[str] = []

    def open_mid_forward_copies(self, rows):
        pass

    def close_mid_forward_copies(self, launched=True):
        pass

    def after_forward(self, view: StepView):
        self.handed += 1
        raw = np.concatenate([100000 * self.handed + 1000 * int(r[1:]) + np.arange(c, c + n) for r, c, n in
                              zip(view.req_ids, view.num_computed, view.num_scheduled)])
        self._book(step_message(TABLE, view, raw.astype(np.float64).reshape(-1, 1), list(view.finished)))

    def after_idle_step(self, finished):
        self._book(step_message(TABLE, StepView.empty(finished), np.zeros((0, 1)), list(finished)))

    def _book(self, message):
        events = self.reader.read(message)
        for summary in events.prompt:
            self.prompts.setdefault(summary["req"], []).append(summary)
        for token in events.tokens:
            self.tokens.setdefault(token["req"], []).append((token["index"], token["raw"][0]))
        self.ended += events.finished


def run(picks, overlap: bool) -> BookingController:
    """Each pick stands for `get_next_batch_to_run` (retractions happen in it) and returns the
    batch to launch, or None; the loop is SGLang's overlap or normal one."""
    controller = BookingController()
    runner = type("Runner", (), {})()
    sgl._STATES[runner] = sgl.RunnerState(controller)
    scheduler = Scheduler(runner, overlap)
    queue, last = deque(), None
    for pick in picks:
        batch = pick()
        if not overlap:
            if batch is not None:
                scheduler.process_batch_result(batch, scheduler.run_batch(batch))
            continue
        if batch is not None:
            queue.append((batch, scheduler.run_batch(batch)))
        if last is not None:
            scheduler.process_batch_result(*queue.popleft())
        last = batch
    return controller


def step_of(raw: float) -> int:
    return int(raw // 100000)


def position_of(raw: float) -> int:
    return int(raw % 1000)


def assert_delivered_once(controller: BookingController, reqs: list[Req]) -> None:
    """Per request: one prompt summary, and one score per token the client gets, read at the
    row that sampled it (position P - 1 + j)."""
    for req in reqs:
        tokens = controller.tokens.get(req.rid, [])
        assert [j for j, _ in tokens] == list(range(len(req.output_ids))), (req.rid, tokens)
        prompt = len(req.origin_input_ids)
        assert [position_of(raw) for _, raw in tokens] == [prompt - 1 + j for j in range(len(tokens))]
        assert len(controller.prompts.get(req.rid, [])) == 1, req.rid


@pytest.mark.parametrize("prefix", [0, 3, 4])
def test_overlap_drops_the_row_of_a_request_retracted_while_its_step_is_in_flight(prefix):
    """r2 is retracted while step 2 (its decode of token 1) is in flight: SGLang skips that
    row, prefills r2 again (prompt 4 + token 0, after a radix prefix) and samples token 1
    there. The in-flight row is dropped; token 1's score comes from the prefill again."""
    r1, r2 = Req("r1", 3, max_new=4), Req("r2", 4, max_new=4)

    controller = run([
        lambda: extend((r1, 0, 3), (r2, 0, 4)),
        lambda: decode(r1, r2),  # step 2: r2's row at position 4 (token 1)
        retract_then_decode(r2, r1),  # step 3, while step 2 is in flight
        lambda: extend((r2, prefix, 5 - prefix)),  # step 4: prompt + token 0 again, samples token 1
        lambda: decode(r1, r2),
        lambda: decode(r1, r2),
        lambda: decode(r2),
        lambda: None,
    ], overlap=True)
    assert list(r2.output_ids) == [0, 1, 2, 3] and r2.retraction_count == 1
    assert_delivered_once(controller, [r1, r2])
    assert step_of(dict(controller.tokens["r2"])[1]) == 4  # from the prefill again, not step 2
    assert controller.prompts["r2"][0]["tokens_scored"] == 4 and step_of(controller.prompts["r2"][0]["last_raw"][0]) == 1
    assert sorted(controller.ended) == ["r1", "r2"] and len(controller.reader.book) == 0


def test_overlap_drops_a_prefill_in_flight_and_the_prompt_goes_out_from_the_prefill_again():
    """r2 is retracted before its prefill's results are processed (SGLang merges the prefill
    into the running batch first): it has no token yet, so the prefill again is its prompt,
    and that one delivers the prompt's scores and token 0."""
    r1, r2 = Req("r1", 3, max_new=2), Req("r2", 6, max_new=2)

    controller = run([
        lambda: extend((r1, 0, 3), (r2, 0, 6)),
        retract_then_decode(r2, r1),
        lambda: extend((r2, 0, 6)),
        lambda: decode(r2),
        lambda: None,
    ], overlap=True)
    assert list(r2.output_ids) == [0, 1]
    assert_delivered_once(controller, [r1, r2])
    summary = controller.prompts["r2"][0]
    assert summary["tokens_scored"] == 6 and step_of(summary["last_raw"][0]) == 3
    assert sorted(controller.ended) == ["r1", "r2"]


def test_without_overlap_a_chunked_prefill_again_delivers_only_its_new_token():
    """The normal loop retracts between steps, so no row is in flight; r2 (prompt 4, three
    tokens out) is prefilled again in two chunks of 5 and 2 rows. The first chunk ends past
    the prompt but samples nothing; the second samples token 3."""
    r1, r2 = Req("r1", 3, max_new=5), Req("r2", 4, max_new=5)

    controller = run([
        lambda: extend((r1, 0, 3), (r2, 0, 4)),
        lambda: decode(r1, r2),
        lambda: decode(r1, r2),
        retract_then_decode(r2, r1),
        lambda: extend((r2, 0, 5)),  # positions 0-4: the prompt and tokens 0-1, all delivered before
        lambda: extend((r2, 5, 2)),  # positions 5-6: samples token 3
        lambda: decode(r1, r2),
        lambda: None,
    ], overlap=False)
    assert list(r1.output_ids) == list(range(5)) and list(r2.output_ids) == list(range(5))
    assert_delivered_once(controller, [r1, r2])
    assert step_of(dict(controller.tokens["r2"])[3]) == 6
    assert sorted(controller.ended) == ["r1", "r2"]


def test_overlap_chunked_prefill_again_after_a_row_in_flight():
    """Both cases at once: r2's decode row is in flight when it is retracted, and it is
    prefilled again in chunks, the first stopping inside the prompt, the second inside the
    generated tokens, the third at the end."""
    r1, r2 = Req("r1", 2, max_new=6), Req("r2", 5, max_new=4)

    controller = run([
        lambda: extend((r1, 0, 2), (r2, 0, 5)),
        lambda: decode(r1, r2),
        lambda: decode(r1, r2),  # r2's token 2, in flight when it is retracted
        retract_then_decode(r2, r1),
        lambda: extend((r2, 0, 3)),
        lambda: extend((r2, 3, 3)),
        lambda: extend((r2, 6, 1)),  # prompt 5 + tokens 0-1: samples token 2
        lambda: decode(r1, r2),
        lambda: decode(r1),
        lambda: None,
    ], overlap=True)
    assert list(r2.output_ids) == [0, 1, 2, 3]
    assert_delivered_once(controller, [r1, r2])
    assert sorted(controller.ended) == ["r1", "r2"]


def test_a_request_retracted_and_aborted_ends_with_the_tokens_it_got():
    """When even the last request does not fit, retract_decode aborts it (`to_finish`) as it
    releases it: its row in flight is skipped and it gets no further results, so it ends."""
    r1 = Req("r1", 3, max_new=8)

    def abort_r1():
        retract(r1, abort=True)
        return None

    controller = run([lambda: extend((r1, 0, 3)), lambda: decode(r1), abort_r1, lambda: None], overlap=True)
    assert list(r1.output_ids) == [0]
    assert_delivered_once(controller, [r1])
    assert controller.ended == ["r1"] and len(controller.reader.book) == 0
