import numpy as np

from engine_worker.scores.bookkeeping import ProbeTable, ScoreBook, StepView, StepReader, gather_scores, step_message
from engine_worker.tap.layer import ProbeSlot

TABLE = ProbeTable(version=1, slots=(ProbeSlot("a", 3, 0, "last_prompt_token", 1.0, 0.0),))


def layout(reqs):
    """reqs: list of (id, scheduled, computed, prompt_len)."""
    return StepView(
        req_ids=[r[0] for r in reqs],
        num_scheduled=np.array([r[1] for r in reqs]),
        num_computed=np.array([r[2] for r in reqs]),
        num_prompt=np.array([r[3] for r in reqs]),
    )


def rows_by_position(step, values_by_req):
    """Build the step's raw [rows, 1] so that row value = values_by_req[req][position]."""
    out = []
    for i, req in enumerate(step.req_ids):
        c, n = int(step.num_computed[i]), int(step.num_scheduled[i])
        out += [values_by_req[req][p] for p in range(c, c + n)]
    return np.array(out, dtype=np.float32)[:, None]


def test_rows_map_to_requests_across_chunked_prefill_and_decode():
    values = {"long": np.arange(100, 110, dtype=np.float32), "short": np.arange(200, 205, dtype=np.float32)}
    book = ScoreBook()
    # step 1: "long" (prompt 7) gets its first 4 rows, "short" (prompt 3) its whole prompt
    s1 = layout([("long", 4, 0, 7), ("short", 3, 0, 3)])
    e1 = book.record_step(s1, TABLE, rows_by_position(s1, values))
    assert [p["req"] for p in e1.prompt] == ["short"]
    assert e1.prompt[0]["last_raw"] == [202.0] and e1.prompt[0]["max_raw"] == [202.0]
    assert e1.prompt[0]["mean_raw"] == [201.0] and e1.prompt[0]["tokens_scored"] == 3
    assert e1.tokens == [{"req": "short", "index": 0, "raw": [202.0]}]  # long: no sample mid-prefill
    # step 2: decode for "short" first (runner order), rest of "long"'s prompt
    s2 = layout([("short", 1, 3, 3), ("long", 3, 4, 7)])
    e2 = book.record_step(s2, TABLE, rows_by_position(s2, values))
    assert [(t["req"], t["index"], t["raw"]) for t in e2.tokens] == [("short", 1, [203.0]), ("long", 0, [106.0])]
    assert e2.prompt[0]["req"] == "long" and e2.prompt[0]["tokens_scored"] == 7
    assert e2.prompt[0]["mean_raw"] == [103.0] and e2.prompt[0]["last_raw"] == [106.0]


def test_prefix_cached_rows_are_not_counted_as_scored():
    book = ScoreBook()
    step = layout([("r", 2, 256, 258)])  # 256 tokens came from the prefix cache
    events = book.record_step(step, TABLE, np.array([[1.0], [3.0]], dtype=np.float32))
    assert events.prompt[0]["tokens_scored"] == 2 and events.prompt[0]["prompt_tokens"] == 258
    assert events.prompt[0]["mean_raw"] == [2.0] and events.prompt[0]["last_raw"] == [3.0]


def test_recompute_after_preemption_does_not_duplicate_tokens():
    book = ScoreBook()
    book.record_step(layout([("r", 3, 0, 3)]), TABLE, np.array([[1.0], [2.0], [3.0]], dtype=np.float32))
    book.record_step(layout([("r", 1, 3, 3)]), TABLE, np.array([[4.0]], dtype=np.float32))
    # preempted: recomputes prompt + the generated token, then samples token 2
    e = book.record_step(layout([("r", 5, 0, 3)]), TABLE, np.arange(5, dtype=np.float32)[:, None])
    assert e.prompt == []
    assert e.tokens == [{"req": "r", "index": 2, "raw": [4.0]}]


def test_swap_mid_prefill_restarts_the_prompt_aggregate():
    book = ScoreBook()
    book.record_step(layout([("r", 2, 0, 4)]), TABLE, np.array([[1.0], [1.0]], dtype=np.float32))
    table2 = ProbeTable(version=2, slots=TABLE.slots)
    e = book.record_step(layout([("r", 2, 2, 4)]), table2, np.array([[5.0], [7.0]], dtype=np.float32))
    assert e.prompt[0]["tokens_scored"] == 2 and e.prompt[0]["mean_raw"] == [6.0]


def test_finish_forgets_requests():
    book = ScoreBook()
    book.record_step(layout([("r", 2, 0, 4)]), TABLE, np.zeros((2, 1), np.float32))
    assert len(book) == 1
    assert book.finish({"r", "unknown"}) == ["r"]
    assert len(book) == 0


def test_gather_orders_columns_by_table():
    table = ProbeTable(
        version=1,
        slots=(ProbeSlot("x", 5, 1, "last_prompt_token", 1, 0), ProbeSlot("y", 2, 0, "last_prompt_token", 1, 0)),
    )
    raw = gather_scores(table, 2, {5: np.array([[0, 10], [0, 11], [9, 9]]), 2: np.array([[20], [21], [9]])})
    np.testing.assert_array_equal(raw, [[10, 20], [11, 21]])


def test_an_empty_probe_set_still_reports_prompt_completion():
    """Capture mode and the response path both rely on knowing when a prompt finished."""
    empty = ProbeTable(version=3, slots=())
    book = ScoreBook()
    events = book.record_step(layout([("r", 3, 0, 3)]), empty, np.zeros((3, 0), np.float32))
    assert [p["req"] for p in events.prompt] == ["r"] and events.prompt[0]["last_raw"] == []
    assert events.tokens == [{"req": "r", "index": 0, "raw": []}]


def test_a_step_read_from_the_wire_gives_the_events_of_the_same_step_booked_locally():
    """The worker sends layout + raw block; the API server's reader must book it exactly as
    a ScoreBook next to the engine would, across steps (prefill chunks, decode, finish)."""
    table = ProbeTable(version=4, slots=(ProbeSlot("x", 5, 1, "prompt_mean", 2.0, -1.0),
                                         ProbeSlot("y", 2, 0, "last_prompt_token", 1.0, 0.0)))
    steps = [
        (layout([("a", 3, 0, 5), ("b", 2, 0, 2)]), []),  # a: first chunk of 5; b: whole prompt
        (layout([("a", 2, 3, 5), ("b", 1, 2, 2)]), []),  # a: rest of its prompt; b decodes
        (layout([("b", 1, 3, 2), ("a", 1, 5, 5)]), ["c"]),  # rows in another order; c unknown
        (layout([]), ["a", "b"]),  # an idle step that only ends requests
    ]
    rng = np.random.default_rng(0)
    local, reader = ScoreBook(), StepReader()
    for step_layout, finished in steps:
        raw = rng.standard_normal((step_layout.num_rows, 2)).astype(np.float32)
        want = local.record_step(step_layout, table, raw)
        want.finished = local.finish(finished)
        got = reader.read(step_message(table, step_layout, raw, finished))
        assert got.prompt == want.prompt and got.tokens == want.tokens and got.finished == want.finished
        assert got.table.names == table.names and got.table.version == 4
    assert len(reader.book) == 0 and len(local) == 0


def test_a_lone_requests_steps_are_booked_as_beside_another_request():
    """Steps of one request take a shortcut (plain ints): a whole prompt, its decodes, a
    chunked prompt, a preempted recompute and the end give the same events as when another
    request shares each step (the general path)."""
    table = ProbeTable(version=3, slots=(ProbeSlot("x", 5, 0, "prompt_mean", 1.0, 0.0),
                                         ProbeSlot("y", 5, 1, "prompt_max", 1.0, 0.0)))
    rng = np.random.default_rng(2)
    alone, shared = ScoreBook(), ScoreBook()
    steps = [("a", 5, 0, 5), ("a", 1, 5, 5), ("a", 1, 6, 5),  # whole prompt, two decodes
             ("a", 7, 0, 5),  # preempted: prompt + 2 generated tokens recomputed, no second summary
             ("b", 3, 0, 8), ("b", 5, 3, 8), ("b", 1, 8, 8),  # a prompt in two chunks, then a decode
             ("c", 4, 2, 6)]  # the rest of a prompt whose start came from the prefix cache
    for req, scheduled, computed, prompt in steps:
        rows = rng.standard_normal((scheduled, 2)).astype(np.float32)
        one = alone.record_step(layout([(req, scheduled, computed, prompt)]), table, rows)
        other = rng.standard_normal((1, 2)).astype(np.float32)
        two = shared.record_step(layout([(req, scheduled, computed, prompt), ("z", 1, 9, 4)]), table,
                                 np.concatenate([rows, other]))
        assert one.prompt == two.prompt
        assert one.tokens == [t for t in two.tokens if t["req"] == req]
    assert alone.finish(["a", "b", "c"]) == shared.finish(["a", "b", "c"]) == ["a", "b", "c"]


def test_a_complete_prompt_keeps_only_a_marker_and_a_recomputed_prompt_is_not_reported_twice():
    """After the summary the prompt's rows are freed; a preempted request that recomputes
    its prompt (num_computed back to 0) must neither crash nor send a second summary."""
    table = ProbeTable(version=1, slots=(ProbeSlot("x", 5, 0, "prompt_mean", 1.0, 0.0),))
    book = ScoreBook()
    first = book.record_step(layout([("a", 4, 0, 4)]), table, np.arange(4, dtype=np.float32).reshape(4, 1))
    assert [p["mean_raw"] for p in first.prompt] == [[1.5]]
    assert book._prompts["a"].raw.size == 0  # only the marker is left
    again = book.record_step(layout([("a", 6, 0, 4)]), table, np.ones((6, 1), np.float32))  # recompute 4 + 2
    assert again.prompt == [] and again.token_indexes == [2]
    assert book.finish(["a"]) == ["a"] and len(book) == 0


def test_a_request_recomputed_after_preemption_is_read_from_the_wire_without_a_first_summary():
    """A resumed request whose first step recomputes prompt + generated tokens (no summary: its
    first sampled index is above 0) and then recomputes again: the book must own its rows,
    since the message's rows are a read-only view that the next message does not extend."""
    table = ProbeTable(version=1, slots=(ProbeSlot("x", 5, 0, "prompt_mean", 1.0, 0.0),))
    reader = StepReader()
    for scheduled in (6, 7):  # prompt 4 plus 2, then plus 3 generated tokens, from position 0
        step = layout([("a", scheduled, 0, 4)])
        raw = np.arange(scheduled, dtype=np.float32).reshape(scheduled, 1)
        events = reader.read(step_message(table, step, raw, []))
        assert events.prompt == [] and events.token_indexes == [scheduled - 4]


def test_books_left_open_by_a_lost_end_are_forgotten_after_the_retention_window():
    table = ProbeTable(version=1, slots=(ProbeSlot("x", 5, 0, "prompt_mean", 1.0, 0.0),))
    book = ScoreBook()
    book.record_step(layout([("a", 2, 0, 8)]), table, np.zeros((2, 1), np.float32))  # half a prompt
    assert book.forget_stale(idle_s=60.0) == 0 and len(book) == 1
    assert book.forget_stale(idle_s=60.0, now=book._prompts["a"].touched + 61) == 1 and len(book) == 0


def test_a_decode_only_step_books_its_tokens_as_the_general_path_does():
    """Steps where every request decodes one token take a shortcut; beside a prefilling
    request (the general path) the same decoding requests get the same tokens."""
    values = {"a": np.arange(100, 110, dtype=np.float32), "b": np.arange(200, 210, dtype=np.float32),
              "new": np.arange(300, 304, dtype=np.float32)}
    decoding = [("a", 1, 5, 3), ("b", 1, 3, 3)]  # a: its third generated token; b: its first decode step
    alone, beside = layout(decoding), layout(decoding + [("new", 4, 0, 4)])
    raw_alone = rows_by_position(alone, values)
    shortcut = ScoreBook().record_step(alone, TABLE, raw_alone)
    general = ScoreBook().record_step(beside, TABLE, rows_by_position(beside, values))
    assert shortcut.tokens == [t for t in general.tokens if t["req"] != "new"]
    assert shortcut.tokens == [{"req": "a", "index": 3, "raw": [105.0]}, {"req": "b", "index": 1, "raw": [203.0]}]
    assert shortcut.prompt == [] and not np.shares_memory(shortcut.token_raw, raw_alone)
    # a request still in its prompt, one row at a time, is not a decode step
    prompt_row = layout([("a", 1, 5, 3), ("slow", 1, 1, 3)])
    events = ScoreBook().record_step(prompt_row, TABLE, rows_by_position(prompt_row, {**values, "slow": values["b"]}))
    assert [t["req"] for t in events.tokens] == ["a"]


def test_rows_of_a_request_listed_as_finished_are_dropped_not_booked():
    """An engine that schedules a step ahead computes a row for a request that already ended;
    the step lists it as finished (engine_worker/step.py): released, its row no token."""
    reader = StepReader()
    reader.read(step_message(TABLE, layout([("a", 2, 0, 2), ("b", 2, 0, 2)]),
                             np.array([[1], [2], [3], [4]], dtype=np.float32), []))
    step = layout([("a", 1, 2, 2), ("b", 1, 2, 2)])
    events = reader.read(step_message(TABLE, step, np.array([[5], [6]], dtype=np.float32), ["a"]))
    assert [(t["req"], t["index"], t["raw"]) for t in events.tokens] == [("b", 1, [6.0])]
    assert events.finished == ["a"] and len(reader.book) == 1
