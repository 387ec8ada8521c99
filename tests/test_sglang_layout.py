"""SGLang's batches as step views (engine_worker/sglang/layout.py) with stand-in batches
shaped like SGLang 0.5.14's ScheduleBatch / ForwardBatch, and the overlap scheduler's order
of launches and results, down to what the score formatter books."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine_worker.scores.bookkeeping import ProbeSlot, ProbeTable, StepReader, step_message
from engine_worker.sglang.layout import (Handover, StepSequence, UnsupportedBatch, snapshot_step, view_of)
from tests.fixtures.sglang_standins import Mode


def req(rid: str, prompt: int):
    return SimpleNamespace(rid=rid, origin_input_ids=list(range(prompt)))


def extend(reqs, prefix, ext, mode="EXTEND"):
    return SimpleNamespace(forward_mode=Mode(mode), reqs=reqs, prefix_lens=list(prefix), extend_lens=list(ext),
                           extend_num_tokens=sum(ext), seq_lens_cpu=np.array(prefix) + np.array(ext))


def decode(reqs, seq_lens):
    return SimpleNamespace(forward_mode=Mode("DECODE"), reqs=reqs, seq_lens_cpu=np.array(seq_lens, dtype=np.int64),
                           input_ids=np.zeros(len(reqs)))


TABLE = ProbeTable(version=1, slots=(ProbeSlot("p", 3, 0, "last", 1.0, 0.0),))


def booked(reader: StepReader, handover: Handover):
    """What the score formatter books for a handed-over step: each row's raw score is its
    position plus 1000 x the request's number."""
    if handover.step is None:
        view = view_of(SimpleNamespace(req_ids=(), num_scheduled=np.zeros(0, np.int64),
                                       num_computed=np.zeros(0, np.int64), num_prompt=np.zeros(0, np.int64)),
                       handover.finished)
    else:
        view = view_of(handover.step, handover.finished, handover.dropped)
    raw = np.concatenate([1000 * int(r[1:]) + np.arange(c, c + n) for r, c, n in
                          zip(view.req_ids, view.num_computed, view.num_scheduled)] or [np.zeros(0)])
    message = step_message(TABLE, view, raw.astype(np.float32).reshape(-1, 1), list(view.finished))
    return reader.read(message)


def test_extend_only_batch():
    batch = extend([req("r1", 5), req("r2", 3)], [0, 0], [5, 3])
    snap = snapshot_step(batch, forward_iter=1)
    view = view_of(snap)
    assert view.req_ids == ["r1", "r2"] and snap.rows == 8 and snap.has_prompt_rows
    assert view.num_computed.tolist() == [0, 0] and view.num_prompt.tolist() == [5, 3]
    assert view.prompt_rows(1) == (5, 8, 0)
    assert view.sampled_rows == [4, 7]


def test_batch_lists_are_copied_at_launch():
    batch = decode([req("r1", 4)], [6])
    snap = snapshot_step(batch, 1)
    batch.seq_lens_cpu += 1  # the scheduler's prepare_for_decode adds in place
    assert snap.num_computed.tolist() == [5]


def test_decode_only_batch():
    snap = snapshot_step(decode([req("r1", 4), req("r2", 2)], [6, 3]), 2)
    view = view_of(snap)
    assert view.num_scheduled.tolist() == [1, 1] and view.num_computed.tolist() == [5, 2]
    assert not snap.has_prompt_rows
    assert [view.sampling_row(i) for i in range(2)] == [(0, 2), (1, 1)]


def test_forward_batch_fields_with_prompt_lengths_from_the_schedule_batch():
    fb = SimpleNamespace(forward_mode=Mode("EXTEND"), rids=["a1", "a2"], extend_prefix_lens_cpu=[2, 0],
                         extend_seq_lens_cpu=[3, 4], seq_lens_cpu=None, extend_num_tokens=7)
    view = view_of(snapshot_step(fb, 1, prompt_lens=[5, 4]))
    assert view.req_ids == ["a1", "a2"] and view.num_computed.tolist() == [2, 0]
    assert view.num_scheduled.tolist() == [3, 4]


def test_mixed_batch_prefill_first_then_running_requests():
    # r1 prefills its 6-token prompt; r2 (prompt 3, two tokens out) and r3 run beside it.
    batch = extend([req("r1", 6), req("r2", 3), req("r3", 2)], [0, 5, 4], [6, 1, 1], mode="MIXED")
    view = view_of(snapshot_step(batch, 3))
    assert view.num_rows == 8 and view.row_starts.tolist() == [0, 6, 7]
    assert [view.sampling_row(i) for i in range(3)] == [(5, 0), (6, 3), (7, 3)]


def test_chunked_prefill_across_steps_scores_every_prompt_row_once():
    reader = StepReader()
    r = req("r1", 10)
    prompts, tokens = [], []
    for it, (prefix, chunk) in enumerate([(0, 4), (4, 4), (8, 2)], start=1):
        snap = snapshot_step(extend([r], [prefix], [chunk]), it)
        events = booked(reader, Handover(snap, ()))
        prompts += events.prompt
        tokens += events.tokens
    assert len(prompts) == 1 and prompts[0]["tokens_scored"] == 10 and prompts[0]["prompt_tokens"] == 10
    assert prompts[0]["last_raw"] == [1009.0]
    assert [(t["req"], t["index"]) for t in tokens] == [("r1", 0)]


def test_radix_prefix_counts_as_computed_and_only_the_extend_is_scored():
    reader = StepReader()
    snap = snapshot_step(extend([req("r1", 8)], [6], [2]), 1)
    view = view_of(snap)
    assert view.prompt_rows(0) == (0, 2, 6)
    events = booked(reader, Handover(snap, ()))
    assert events.prompt[0]["tokens_scored"] == 2 and events.prompt[0]["prompt_tokens"] == 8
    assert events.prompt[0]["last_raw"] == [1007.0]


def test_idle_and_empty_batches_have_no_rows():
    assert snapshot_step(SimpleNamespace(forward_mode=Mode("IDLE"), reqs=[]), 1) is None
    assert snapshot_step(decode([], []), 1) is None
    seq = StepSequence()
    seq.launched(None)
    assert seq.launching() is None
    assert seq.after_result(1, ["r1"]) == Handover(None, ("r1",))


def test_speculative_and_inconsistent_batches_are_refused():
    with pytest.raises(UnsupportedBatch, match="TARGET_VERIFY"):
        snapshot_step(extend([req("r1", 3)], [0], [3], mode="TARGET_VERIFY"), 1)
    bad = extend([req("r1", 3)], [0], [3])
    bad.extend_num_tokens = 4
    with pytest.raises(UnsupportedBatch, match="4 tokens"):
        snapshot_step(bad, 1)
    with pytest.raises(UnsupportedBatch, match="disagree"):
        snapshot_step(extend([req("r1", 3)], [0, 0], [3, 1]), 1)


def test_overlap_scheduler_overshoot_row_is_dropped_and_the_request_released():
    """Step 2 (decode of r1, r2) is launched before step 1's results are processed; r1 ended
    with step 1, so its row in step 2 is no token of r1's."""
    reader = StepReader()
    r1, r2 = req("r1", 3), req("r2", 3)
    seq = StepSequence()
    out = []
    assert seq.launching() is None
    seq.launched(snapshot_step(extend([r1, r2], [0, 0], [3, 3]), 1))
    # The overlap loop: launch step 2, then process step 1.
    out.append(seq.launching())  # step 1 goes before step 2's forward overwrites the buffers
    seq.launched(snapshot_step(decode([r1, r2], [4, 4]), 2))
    assert seq.before_result(1) is None  # step 1 already went
    # r1's first token ended it; step 2 waits: the scheduler picks step 3 first (and may
    # retract requests of step 2 as it does)
    assert seq.after_result(1, ["r1"]) is None
    out.append(seq.launching())  # step 2 goes before step 3's forward, knowing r1 ended
    assert out[1].step.forward_iter == 2 and out[1].finished == ("r1",)
    seq.launched(snapshot_step(decode([r2], [5]), 3))
    assert seq.before_result(2) is None
    assert seq.after_result(2, ["r1"]) is None  # r1 shows finished again in step 2's batch: not again
    out.append(seq.before_result(3))  # no step 4: step 3 goes before its own results
    assert out[2].step.forward_iter == 3 and out[2].finished == ()
    out.append(seq.after_result(3, ["r2"]))
    assert out[3] == Handover(None, ("r2",))
    tokens, ended = [], []
    for handover in out:
        events = booked(reader, handover)
        tokens += [(t["req"], t["index"], t["raw"][0]) for t in events.tokens]
        ended += events.finished
    assert tokens == [("r1", 0, 1002.0), ("r2", 0, 2002.0), ("r2", 1, 2003.0), ("r2", 2, 2004.0)]
    assert ended == ["r1", "r2"] and len(reader.book) == 0


def test_a_request_that_ended_before_a_step_was_built_is_dropped_from_it_in_any_order():
    """Consecutive prefills run without overlap (step 1's results first), but step 2 was built
    before them: r1's row in it is still past its end."""
    seq = StepSequence()
    seq.launched(snapshot_step(extend([req("r1", 2)], [0], [2]), 1))
    first = seq.before_result(1)
    assert first.step.forward_iter == 1 and first.finished == ()
    assert seq.after_result(1, ["r1"]) == Handover(None, ("r1",))
    seq.launched(snapshot_step(extend([req("r2", 4), req("r1", 2)], [0, 2], [4, 1], mode="MIXED"), 2))
    second = seq.before_result(2)
    assert second.finished == ("r1",)
    events = booked(StepReader(), second)
    assert [t["req"] for t in events.tokens] == ["r2"]


def test_without_overlap_each_step_goes_before_its_results_and_ends_follow_at_once():
    seq = StepSequence()
    r1 = req("r1", 2)
    seq.launched(snapshot_step(extend([r1], [0], [2]), 1))
    handed = seq.before_result(1)
    assert handed.step.req_ids == ("r1",) and handed.finished == ()
    assert seq.after_result(1, []) is None
    seq.launched(snapshot_step(decode([r1], [3]), 2))
    assert seq.before_result(2).finished == ()
    assert seq.after_result(2, ["r1"]) == Handover(None, ("r1",))


def test_flush_hands_over_a_waiting_step_and_old_ends_are_forgotten():
    seq = StepSequence(remember_steps=2)
    seq.after_result(1, ["old"])
    seq.launched(snapshot_step(decode([req("r2", 2)], [3]), 5))
    assert seq.flush().finished == ()
    assert seq.flush() is None
    seq.after_result(6, ["x"])
    assert "old" not in seq._ended_at and "x" in seq._ended_at


def test_a_chunk_of_a_retracted_request_prefilled_again_short_of_its_end_is_dropped():
    """A retracted request keeps its `output_ids` and is prefilled again from its prompt and
    them: a chunk that stops short of that end samples nothing and every row of it was
    delivered before; the chunk that reaches it samples the next token and goes as it is."""
    again = req("r1", 4)
    again.output_ids = [7, 8, 9]
    assert snapshot_step(extend([again], [0], [5]), 1).dropped == ("r1",)
    assert snapshot_step(extend([again], [2], [1]), 1).dropped == ("r1",)
    assert snapshot_step(extend([again], [5], [2]), 2).dropped == ()
    fresh = req("r2", 6)
    fresh.output_ids = []
    assert snapshot_step(extend([fresh], [0], [3]), 3).dropped == ()  # a chunk of a prompt
    # MIXED: a running request decodes its next token beside a prefill
    assert snapshot_step(extend([fresh, again], [0, 6], [6, 1], mode="MIXED"), 4).dropped == ()


def test_a_request_retracted_after_its_step_was_launched_is_dropped_from_it_not_ended():
    r1, r2 = req("r1", 3), req("r2", 3)
    for r in (r1, r2):
        r.retraction_count, r.is_retracted, r.to_finish = 0, False, None
    seq = StepSequence()
    seq.launched(snapshot_step(decode([r1, r2], [4, 4]), 2))
    r2.retraction_count, r2.is_retracted = 1, True  # retract_decode, while step 2 is in flight
    handed = seq.launching()
    assert handed.finished == () and handed.dropped == ("r2",)
    events = booked(StepReader(), handed)
    assert [t["req"] for t in events.tokens] == ["r1"] and events.finished == []
