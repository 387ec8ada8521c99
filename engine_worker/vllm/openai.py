"""vLLM's OpenAI response classes, where the middleware has vLLM leave the prompt's token ids
out: the only module that patches them (the API server processes only).

The middleware asks vLLM for token ids on every monitored request (`return_token_ids`), to
count each stream chunk's tokens, and strips them again for clients that did not ask. A
chunk's generated ids are a few bytes; the prompt's are the whole prompt, written once, into
the first chunk (or the response), on the way to the first token: for a 1024-token prompt
vLLM's API server takes about three times as long to build and write that first chunk with
them, and the middleware then cuts them out of the bytes again, for nothing. While `PROMPT_TOKEN_IDS_UNWANTED` is set (the
middleware sets it around the requests of clients that did not ask for token ids) the
response classes that carry the prompt's ids are built with none, as vLLM builds them for a
request that did not ask: the chunk's other members, and the generated tokens' ids the
middleware counts, are as before.

The context variable reaches vLLM's response generator because Starlette runs a streaming
response in a task started within the request's own call, which copies the context.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import logging

log = logging.getLogger("probex.vllm_openai")

PROMPT_TOKEN_IDS_UNWANTED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "probex_prompt_token_ids_unwanted", default=False)

# module -> the classes whose `prompt_token_ids` field holds the prompt's ids (vLLM 0.25 and
# 0.32): a completion's choices, streamed or not, and a chat response, streamed or not
PROMPT_TOKEN_ID_CLASSES = {
    "vllm.entrypoints.openai.completion.protocol": ("CompletionResponseChoice", "CompletionResponseStreamChoice"),
    "vllm.entrypoints.openai.chat_completion.protocol": ("ChatCompletionResponse", "ChatCompletionStreamResponse"),
}
_PATCHED_MARK = "_probex_prompt_ids_patched"


def leave_out_unwanted_prompt_token_ids() -> list[str]:
    """Patch the classes (idempotent); returns those patched now. A class this vLLM does not
    have, or that has no such field, is named in a warning: its responses keep the prompt's
    ids, which the middleware still strips for the client."""
    patched, missing = [], []
    for module_name, class_names in PROMPT_TOKEN_ID_CLASSES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.extend(f"{module_name}.{name}" for name in class_names)
            continue
        for name in class_names:
            cls = getattr(module, name, None)
            if cls is None or "prompt_token_ids" not in getattr(cls, "model_fields", {}):
                missing.append(f"{module_name}.{name}")
            elif not cls.__dict__.get(_PATCHED_MARK):
                cls.__init__ = _without_unwanted_prompt_ids(cls.__init__)
                setattr(cls, _PATCHED_MARK, True)
                patched.append(f"{module_name}.{name}")
    if missing:
        log.warning("probex: vLLM has no %s here: those responses carry the prompt's token ids, which the "
                    "middleware cuts out again", ", ".join(missing))
    return patched


def _without_unwanted_prompt_ids(init):
    @functools.wraps(init)
    def __init__(self, /, **data):
        if data.get("prompt_token_ids") is not None and PROMPT_TOKEN_IDS_UNWANTED.get():
            data["prompt_token_ids"] = None
        init(self, **data)

    return __init__
