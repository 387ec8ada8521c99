"""A prompt step's scores consumed after its first token's output (PROBEX_PROMPT_SCORES_AFTER_OUTPUT,
an experiment: off unless set to 1).

The engine core's output queue runs registered work once the outputs put after it are taken
(engine_worker/after_output.py); the score transfer hands such a step to it when vLLM reads
tokens that were ready already, and its own consumes leave that step alone until then."""

from __future__ import annotations

import logging
import queue
import threading
from types import SimpleNamespace

import pytest
import torch

from engine_worker import after_output
from engine_worker.after_output import MOST_ITEMS_AHEAD, OutputQueueWithAfterwork
from engine_worker.controller import TapController
from engine_worker.score_transfer import LARGE_STEP_ROWS, ScoreTransfer
from tests.test_controller import LandingDriver

PROMPT_ROWS = LARGE_STEP_ROWS + 44


def test_the_experiment_is_off_unless_switched_on(monkeypatch):
    from engine_worker.tap_config import ENV_PROMPT_SCORES_AFTER_OUTPUT, prompt_scores_after_output

    monkeypatch.delenv(ENV_PROMPT_SCORES_AFTER_OUTPUT, raising=False)
    assert prompt_scores_after_output() is False
    monkeypatch.setenv(ENV_PROMPT_SCORES_AFTER_OUTPUT, "1")
    assert prompt_scores_after_output() is True
    monkeypatch.setenv(ENV_PROMPT_SCORES_AFTER_OUTPUT, "off")
    assert prompt_scores_after_output() is False


@pytest.fixture
def output_queue():
    installed = after_output.install(queue.Queue())
    yield installed
    after_output.uninstall()


def test_work_runs_once_the_outputs_put_after_it_are_taken_and_not_before(output_queue):
    ran = []
    output_queue.put_nowait("earlier step")
    assert after_output.run_after_next_output(lambda: ran.append("scores"))
    assert output_queue.get() == "earlier step"  # put before the work: it is not what the work waits for
    with pytest.raises(queue.Empty):
        output_queue.get(timeout=0.01)  # the queue ran dry, but nothing was put since: the work waits
    assert ran == []
    output_queue.put_nowait("this step, API server 0")
    output_queue.put_nowait("this step, API server 1")
    assert output_queue.get() == "this step, API server 0"
    assert output_queue.get() == "this step, API server 1" and ran == []  # the step's outputs go out first
    with pytest.raises(queue.Empty):
        output_queue.get(timeout=0.01)  # the reader comes back: the work runs, then it waits
    assert ran == ["scores"]
    output_queue.put_nowait("next step")
    assert output_queue.get() == "next step" and ran == ["scores"]  # once only


def test_work_with_outputs_still_coming_waits_for_a_few_items_at_most(output_queue):
    ran = []
    after_output.run_after_next_output(lambda: ran.append("scores"))
    for i in range(MOST_ITEMS_AHEAD + 3):
        output_queue.put_nowait(i)
    taken = [output_queue.get() for _ in range(MOST_ITEMS_AHEAD)]
    assert taken == list(range(MOST_ITEMS_AHEAD)) and ran == []
    assert output_queue.get() == MOST_ITEMS_AHEAD and ran == ["scores"]


def test_work_that_fails_is_logged_and_the_reader_goes_on(output_queue, caplog):
    ran = []
    after_output.run_after_next_output(lambda: 1 / 0)
    after_output.run_after_next_output(lambda: ran.append("second"))
    output_queue.put_nowait("outputs")
    assert output_queue.get() == "outputs"
    with caplog.at_level(logging.ERROR, logger="vllm.probex.after_output"):
        output_queue.put_nowait("more")
        assert output_queue.get() == "more"  # not empty: the work waits, none of it lost
        with pytest.raises(queue.Empty):
            output_queue.get(timeout=0.01)
    assert ran == ["second"] and "work after an engine output failed" in caplog.text


def test_an_output_thread_waiting_for_outputs_runs_the_work_right_after_taking_them(output_queue):
    sent, ran, done = [], [], threading.Event()

    def output_thread():
        while True:
            item = output_queue.get()
            if item is None:
                return
            sent.append(item)
            if item == "first token":
                ran.append(("sent before the work", list(sent)))

    reader = threading.Thread(target=output_thread)
    reader.start()
    after_output.run_after_next_output(lambda: (ran.append("scores"), done.set()))
    output_queue.put_nowait("first token")
    assert done.wait(5)
    output_queue.put_nowait(None)
    reader.join(5)
    assert ran == [("sent before the work", ["first token"]), "scores"] and reader.name != threading.current_thread().name


def test_a_queue_made_with_the_afterwork_has_it_from_the_start():
    made = OutputQueueWithAfterwork()
    ran = []
    made.after_next_put(lambda: ran.append("work"))
    made.put_nowait("outputs")
    assert made.get() == "outputs"
    with pytest.raises(queue.Empty):
        made.get(timeout=0.01)
    assert ran == ["work"]


def test_installing_keeps_the_queues_items_and_refuses_other_kinds():
    engine_queue = queue.Queue()
    engine_queue.put_nowait("already there")
    try:
        assert after_output.install(engine_queue) is engine_queue and after_output.available()
        assert engine_queue.get_nowait() == "already there"
        with pytest.raises(TypeError, match="queue.Queue"):
            after_output.install(queue.SimpleQueue())
    finally:
        after_output.uninstall()
    assert not after_output.available()
    assert after_output.run_after_next_output(lambda: None) is False  # nobody to run it: the caller does it


def prompt_transfer(driver=None, **kwargs):
    driver = driver or LandingDriver()
    seen = []

    def consume(step):
        seen.append((step.context, threading.current_thread().name))

    kwargs.setdefault("depth", 4)
    kwargs.setdefault("threaded", False)
    transfer = ScoreTransfer({0: torch.zeros(PROMPT_ROWS, 1)}, consume, driver=driver, consumer="engine",
                             prompt_scores_after_output=kwargs.pop("after_output", True), **kwargs)
    return transfer, driver, seen


def watched_transfer(depth: int):
    """With the watchdog running (which never takes a step as stale here), as the engine runs it."""
    transfer, driver, seen = prompt_transfer(depth=depth, threaded=True, stale_after_s=60.0)
    transfer.token_reads_checked = True
    return transfer, driver, seen


def wait_until(condition) -> None:
    for _ in range(500):
        if condition():
            return
        threading.Event().wait(0.01)


def test_a_prompt_step_whose_tokens_were_ready_is_consumed_after_their_output_and_the_engine_leaves_it(output_queue):
    transfer, driver, seen = prompt_transfer()
    assert transfer.defers_prompt_scores
    transfer.token_reads_checked = True  # the runner adapter checks each step's tokens where vLLM reads them
    transfer.submit(1, "decode")
    transfer.submit(PROMPT_ROWS, "prompt")
    driver.land(*driver.recorded)  # the prompt's forward is done: its copies and its tokens are in
    transfer.submit(1, "next decode")  # a later step's hook takes what landed in passing...
    assert [context for context, _ in seen] == ["decode"]  # ...but not the prompt step: its token read decides
    transfer.consume_after_output(2)  # vLLM read the prompt's tokens, which were ready
    driver.land(*driver.recorded)
    transfer.consume_landed()  # the engine thread's own hooks leave it to the output thread...
    transfer.submit(1, "after")
    assert [context for context, _ in seen] == ["decode"] and transfer.leaves_steps_to_output_thread()
    output_queue.put_nowait("the prompt's first token")  # vLLM puts the step's outputs
    engine_thread = threading.current_thread().name
    results = []
    reader = threading.Thread(target=lambda: results.extend([output_queue.get(), _drained(output_queue)]),
                              name="output-thread")
    reader.start()
    reader.join(5)
    assert results == ["the prompt's first token", True]
    assert seen[1:] == [("prompt", "output-thread")]  # the handed steps only, after the token went out
    assert transfer.after_output_steps == 1 and not transfer.leaves_steps_to_output_thread()
    driver.land(*driver.recorded)
    transfer.consume_landed()  # the engine's again, in order
    assert [context for context, _ in seen] == ["decode", "prompt", "next decode", "after"]
    assert seen[-1][1] == engine_thread
    settings = transfer.describe()
    assert settings["prompt_scores_after_output"] is True and settings["after_output_steps"] == 1


def _drained(q) -> bool:
    try:
        q.get(timeout=0.01)
    except queue.Empty:
        return True
    return False


def test_without_an_output_queue_or_switched_off_the_engine_consumes_as_before(output_queue):
    after_output.uninstall()
    transfer, driver, seen = prompt_transfer()
    assert not transfer.defers_prompt_scores
    transfer.submit(PROMPT_ROWS, "prompt")
    driver.land(*driver.recorded)
    transfer.submit(1, "decode")
    assert [context for context, _ in seen] == ["prompt"]  # taken in passing, as before
    transfer.consume_after_output(2)  # nobody to hand it to: consumed here and now
    assert [context for context, _ in seen] == ["prompt", "decode"] and transfer.after_output_steps == 0
    after_output.install(queue.Queue())
    off, _, _ = prompt_transfer(after_output=False)
    side, _, _ = prompt_transfer(copy_stream="side")
    assert not off.defers_prompt_scores and not side.defers_prompt_scores


def test_an_output_thread_that_cannot_use_the_device_hands_every_step_back_to_the_engine(output_queue, caplog):
    class NoContextDriver(LandingDriver):
        def bind_thread(self):
            raise RuntimeError("no context on this thread")

    transfer, driver, seen = prompt_transfer(driver=NoContextDriver())
    transfer.submit(PROMPT_ROWS, "prompt")
    driver.land(*driver.recorded)
    transfer.consume_after_output(1)
    output_queue.put_nowait("outputs")
    with caplog.at_level(logging.ERROR, logger="probex.transfer"):
        reader = threading.Thread(target=lambda: (output_queue.get(), _drained(output_queue)))
        reader.start()
        reader.join(5)
    assert transfer.after_output_failures == 1 and not transfer.defers_prompt_scores
    assert "the engine thread consumes them from now on" in caplog.text
    transfer.consume_landed()
    assert [context for context, _ in seen] == ["prompt"]


def test_the_controller_defers_a_prompt_steps_scores_only_when_its_tokens_are_ready(output_queue, caplog):
    transfer, driver, seen = prompt_transfer()
    controller = SimpleNamespace(transfer=transfer, tokens_ready_errors=0)

    def after(mark, ready):
        return TapController.scores_after_output(controller, mark, ready)

    transfer.submit(1, "decode")
    assert after(1, lambda: True) is False  # no prompt-sized step among them: ahead of the tokens, as before
    transfer.submit(PROMPT_ROWS, "prompt")
    assert after(2, lambda: False) is False  # the device still samples: consumed meanwhile, for free
    assert after(2, lambda: True) is True
    with caplog.at_level(logging.ERROR, logger="probex.controller"):
        assert after(2, lambda: 1 / 0) is False and after(2, lambda: 1 / 0) is False
    assert controller.tokens_ready_errors == 2 and caplog.text.count("tokens are ready failed") == 1
    transfer.consume_after_output(2)
    transfer.submit(1, "decode after it")
    assert after(3, lambda: False) is True  # steps ahead wait for the output thread: this one follows them
    after_output.uninstall()
    assert after(3, lambda: True) is False


def test_prompt_steps_whose_tokens_are_never_checked_are_consumed_in_passing_as_before(output_queue):
    """A model whose steps never come to the checked token read (a pooling model's: vLLM never
    samples) keeps its landed prompt steps consumed at later hooks, queue or not."""
    transfer, driver, seen = prompt_transfer()
    transfer.submit(PROMPT_ROWS, "prompt")
    driver.land(*driver.recorded)
    transfer.submit(PROMPT_ROWS, "next prompt")
    assert [context for context, _ in seen] == ["prompt"]


def test_the_output_thread_never_waits_for_the_books_another_thread_holds(output_queue):
    """Where the engine thread holds the transfer's lock (through a device wait, say) when the
    output thread comes to the handed steps, the output thread hands them to the watchdog and
    goes back to sending outputs; the watchdog consumes them once the lock is free, in order."""
    transfer, driver, seen = watched_transfer(depth=4)
    transfer.submit(PROMPT_ROWS, "prompt")
    transfer.submit(1, "decode")
    driver.land(*driver.recorded)
    transfer.consume_after_output(1)
    transfer.consume_after_output(2)  # the step behind it follows it there
    output_queue.put_nowait("first token")
    taken = []
    with transfer._pending_lock:  # the engine thread's, for as long as this block lasts
        reader = threading.Thread(target=lambda: taken.extend([output_queue.get(), _drained(output_queue)]),
                                  name="output-thread")
        reader.start()
        reader.join(5)
        assert taken == ["first token", True] and seen == []  # it went on without the books
    wait_until(lambda: len(seen) == 2)
    assert seen == [("prompt", "probex-score-watchdog"), ("decode", "probex-score-watchdog")]
    assert transfer.beside_steps == 2 and transfer.after_output_steps == 0
    transfer.close()


def test_steps_handed_on_one_after_another_are_consumed_in_order_with_the_watchdog_running(output_queue):
    transfer, driver, seen = watched_transfer(depth=8)
    sent = []
    reader = threading.Thread(target=lambda: [sent.append(item) for item in iter(output_queue.get, None)],
                              name="output-thread")
    reader.start()
    for number, (rows, context) in enumerate([(PROMPT_ROWS, "prompt a"), (1, "decode"), (PROMPT_ROWS, "prompt b"),
                                              (3, "decodes")], 1):
        transfer.submit(rows, context)
        driver.land(*driver.recorded)
        transfer.consume_after_output(number)
        output_queue.put_nowait(f"outputs of step {number}")
    wait_until(lambda: len(seen) == 4)  # the reader, once it has taken the outputs, comes back and runs the work
    output_queue.put_nowait(None)
    reader.join(5)
    assert [context for context, _ in seen] == ["prompt a", "decode", "prompt b", "decodes"]
    assert {name for _, name in seen} <= {"output-thread", "probex-score-watchdog"}
    assert sent == [f"outputs of step {n}" for n in range(1, 5)]
    transfer.close()
