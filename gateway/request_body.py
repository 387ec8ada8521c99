"""Reading and parsing a completion request's body (size and nesting limits, exact re-encoding)."""

from __future__ import annotations

import json
import re

from gateway.errors import ApiError, ClientGone
from gateway.jsoncodec import loads_strict


async def read_body(receive, limit: int, declared: bytes | None) -> bytes:
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body larger than {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone()
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body larger than {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# Deeper request bodies are refused: the standard library's parser, which the gateway uses to
# re-encode a body exactly and the worker's server uses to read it, recurses once per level and
# fails near 1000; no OpenAI request nests anywhere near this.
MAX_JSON_DEPTH = 256


def too_deep() -> ApiError:
    return ApiError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels")


def parse_body(raw: bytes) -> tuple[dict, bool]:
    """The body, and whether it is plain UTF-8 JSON that can be forwarded as it came."""
    try:
        body, plain = loads_strict(raw), True
    except RecursionError:  # the standard library's parser where orjson is not installed
        raise too_deep() from None
    except ValueError:
        try:  # NaN / Infinity, lone surrogates, UTF-16: what the standard library accepts
            body, plain = json.loads(raw), False
        except RecursionError:
            raise too_deep() from None
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    if nested_deeper_than(raw, body, MAX_JSON_DEPTH):
        raise too_deep()
    # In UTF-8 JSON a surrogate can only come as a \u escape (a body that is not plain may be UTF-16).
    if (not plain or b"\\u" in raw) and holds_lone_surrogate(body):
        # Not Unicode, so no text a model reads: vLLM's tokenizer refuses it in a prompt, and in a stop
        # string (or any other field sent on to its engine) it fails the request with a 500.
        raise ApiError(400, "request body holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), "
                            "which is not valid Unicode")
    return body, plain


def holds_lone_surrogate(body: dict) -> bool:
    """Whether any key or string in `body` holds an unpaired surrogate (JSON's \\u escapes allow them;
    a pair of escapes decodes to one character outside the BMP). Walked without recursion."""
    pending: list = [body]
    while pending:
        value = pending.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            for text in (key, child):
                if isinstance(text, str) and _SURROGATE.search(text):
                    return True
            if isinstance(child, (dict, list)):
                pending.append(child)
    return False


_SURROGATE = re.compile("[\ud800-\udfff]")


def nested_deeper_than(raw: bytes, body: dict, limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` levels in `body` (parsed from `raw`).
    A body with no more brackets than that cannot (the usual case, counted in C); the rest are
    walked without recursion."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    pending: list[tuple[dict | list, int]] = [(body, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
