"""Adapter for vLLM's engine core process (`vllm/v1/engine/core.py`, `EngineCoreProc`).

The only module that reads engine-core internals. `EngineCoreProc` puts each step's outputs
on `self.output_queue`, and one thread of its own (`process_output_sockets`, started at the
end of its `__init__`, after vLLM has loaded the plugins in that process) takes them off,
encodes them and sends them to the API server processes. Wrapping that thread's function
lets the queue run ProbeX's work once a step's outputs are taken (after_output.py): a
prompt-sized step's score consume then follows its first token out instead of holding it,
where the engine thread reaches the tokens after they are ready. Patched only with that
experiment switched on (PROBEX_PROMPT_SCORES_AFTER_OUTPUT=1; engine_worker/plugin.py).

An engine core without that queue or thread (the in-process `EngineCore` of offline `LLM`
use, a vLLM that renamed them) is left as it is: `after_output.available()` stays false and
the scores are consumed as before.
"""

from __future__ import annotations

import functools
import logging
import queue

from engine_worker import after_output

log = logging.getLogger("vllm.probex.engine_core")

_PATCHED_MARK = "_probex_output_afterwork"


def patch_engine_core_output() -> bool:
    """Patch `EngineCoreProc.process_output_sockets`; False where it is not there."""
    try:
        from vllm.v1.engine.core import EngineCoreProc
    except Exception:
        return False
    original = getattr(EngineCoreProc, "process_output_sockets", None)
    if original is None:
        return False
    if getattr(original, _PATCHED_MARK, False):
        return True
    EngineCoreProc.process_output_sockets = _with_afterwork(original)
    return True


def _with_afterwork(process_output_sockets):
    @functools.wraps(process_output_sockets)
    def wrapper(self, *args, **kwargs):
        output_queue = getattr(self, "output_queue", None)
        if isinstance(output_queue, queue.Queue):
            try:
                after_output.install(output_queue)
                log.info("probex: the engine core's output thread can run work after each step's outputs")
            except Exception:  # vLLM's outputs go out as before; ProbeX consumes as before
                log.exception("probex: the engine's output queue cannot run work after outputs")
        try:
            return process_output_sockets(self, *args, **kwargs)
        finally:
            after_output.uninstall()

    setattr(wrapper, _PATCHED_MARK, True)
    return wrapper
