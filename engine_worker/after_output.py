"""Work that waits until the engine's next outputs have been sent: the engine core's output
queue, read by its output thread, runs it once it has taken those outputs.

Why: on a host whose CPU runs behind its GPU (the engine thread reaches a prompt step's
sampled tokens after they are ready), whatever the engine thread does before it hands those
tokens on sits between the prefill and the first token. The idea was to consume a
prompt-sized step's scores once its outputs are on their way to the API server, hoping they
would still arrive before the chunk that needs them. Measured on such an H100 (session 40,
docs/benchmarks.md) they mostly did not: the API server held the first chunk for them about
as long as the engine had saved, and under load the output thread's consumes took GIL time
from the engine thread. So this is an experiment, off unless PROBEX_PROMPT_SCORES_AFTER_OUTPUT=1
(the engine core's queue is then set up; otherwise vLLM's stays as it is).

Engine-agnostic: the runner's engine-core adapter (vllm_engine_core.py) hands over the
queue its output thread reads (`install`); the score transfer asks `run_after_next_output`.
The queue keeps its items and its order; the reader runs the work once the first item put
after the work was registered has been taken and the queue has run dry. A step's outputs
(one item per API server process) are put in one loop on the engine thread, which holds the
GIL through it, so the reader takes them all before the queue runs dry; an item put by
another thread between the registration and the step's outputs (vLLM's input thread puts
the odd error reply) would have the work run ahead of them, costing the first token what it
cost before this path existed.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger("vllm.probex.after_output")  # under "vllm": printed by its log handler

# The reader runs armed work once the queue is empty; with outputs still coming, at most this
# many items are taken first (a step puts one item per API server process it has outputs for).
MOST_ITEMS_AHEAD = 8

_installed: "OutputQueueWithAfterwork | None" = None
_install_lock = threading.Lock()


class OutputQueueWithAfterwork(queue.Queue):
    """A `queue.Queue` whose reader runs work registered by the writer once the items the
    writer put after registering it have been taken (`after_next_put`).

    Work is registered, then armed by the next put, then run by the reader at its next `get`
    once the queue is empty (or after MOST_ITEMS_AHEAD items), before it waits for more.
    Work registered while nothing more is ever put stays registered: its owner must not
    depend on it alone (the score transfer's watchdog consumes steps nobody came for)."""

    # Set by `_start_afterwork`, which `install` calls on an existing queue (the engine's,
    # created before any plugin could choose its class) before giving it this class.
    _registered: list
    _armed: list
    _items_ahead: int

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__(maxsize)
        _start_afterwork(self)

    def after_next_put(self, work: Callable[[], None]) -> None:
        with self.mutex:
            self._registered.append(work)

    def _put(self, item) -> None:  # called by put()/put_nowait() with the mutex held
        super()._put(item)
        if self._registered:
            self._armed.extend(self._registered)
            self._registered.clear()

    def get(self, block: bool = True, timeout: float | None = None):
        while True:
            with self.mutex:
                work = None
                if self._armed and (not self._qsize() or self._items_ahead >= MOST_ITEMS_AHEAD):
                    work, self._armed, self._items_ahead = self._armed, [], 0
            if work is None:
                break
            for task in work:
                try:
                    task()
                except Exception:  # the reader is the engine's output thread: it must go on
                    log.exception("probex: work after an engine output failed")
        item = super().get(block, timeout)
        with self.mutex:
            if self._armed:
                self._items_ahead += 1
        return item


def _start_afterwork(target: queue.Queue) -> None:
    with target.mutex:
        target._registered = []
        target._armed = []
        target._items_ahead = 0


def install(output_queue: queue.Queue) -> OutputQueueWithAfterwork:
    """Give the engine's output queue (read by one thread) the afterwork behaviour, in place:
    its items, its waiters and every reference to it stay as they are."""
    global _installed
    with _install_lock:
        if not isinstance(output_queue, OutputQueueWithAfterwork):
            if type(output_queue) is not queue.Queue:
                raise TypeError(f"expected a queue.Queue, not {type(output_queue).__name__}")
            _start_afterwork(output_queue)  # before the class: a put meanwhile finds its lists
            output_queue.__class__ = OutputQueueWithAfterwork
        _installed = output_queue
        return output_queue


def uninstall() -> None:
    """Forget the installed queue (tests; an engine that shuts down)."""
    global _installed
    with _install_lock:
        _installed = None


def run_after_next_output(work: Callable[[], None]) -> bool:
    """Run `work` on the engine's output thread once the next outputs put are taken. False,
    nothing registered, where this process has no such queue (another engine core class, an
    in-process engine without an output thread, a worker in its own process): the caller
    then does the work itself."""
    target = _installed
    if target is None:
        return False
    target.after_next_put(work)
    return True


def available() -> bool:
    return _installed is not None
