"""Reading and writing response JSON on the relay's path: decoding requests, finding where a
stream chunk's scores go without decoding it (splicing), cutting prompt token ids out."""

from __future__ import annotations

import json
from typing import Any, Callable, NamedTuple

import msgspec

from engine_worker.api_server.requests import _TOO_DEEP, RequestRefused

# Request bodies, and the stream chunks that are not spliced, are decoded and re-encoded on
# the API server's event loop, which at high concurrency is the busiest thread of the worker:
# msgspec (a vLLM dependency) is several times faster than the json module at it.
_json_decoder = msgspec.json.Decoder()

_json_encoder = msgspec.json.Encoder()

def _decode_request(raw: bytes) -> tuple[Any, Callable[[Any], bytes]]:
    """A request body as vLLM's server will read it (None if it is not JSON), and the encoder
    that writes it back the same way.

    msgspec first (a 1024-token prompt: 20 µs against 44 µs for json.loads on the dev
    machine, and the re-encoding 5 µs against 48 µs, all on the request's way to its first
    token); Python's json, which vLLM's server uses, for what msgspec refuses and it accepts
    (NaN, Infinity): such a body must still be checked here, or it would reach the engine
    unmonitored, and written back with json.dumps (msgspec would write NaN as null)."""
    try:
        return _json_decoder.decode(raw), _encode_json
    except (msgspec.DecodeError, UnicodeDecodeError):
        pass
    except RecursionError:
        raise RequestRefused(_TOO_DEEP) from None
    try:
        return json.loads(raw), _encode_python_json
    except (ValueError, UnicodeDecodeError):
        return None, _encode_json
    except RecursionError:
        raise RequestRefused(_TOO_DEEP) from None

def _encode_python_json(payload: Any) -> bytes:
    return json.dumps(payload).encode()

def _decode_json(raw: bytes) -> Any:
    try:
        return _json_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None

def _encode_json(payload: Any) -> bytes:
    return _json_encoder.encode(payload)

_TOKEN_IDS_MEMBER = b',"token_ids":['
_IDS_KEY_END, _PROMPT_IDS_KEY_START = b'token_ids"', b'"prompt_'

_NULL_PROMPT_IDS_MEMBER = b',"prompt_token_ids":null'

_FIRST_CHOICE_INDEX = b'"choices":[{"index":'

_NEXT_CHOICE = b'},{"index":'

_DIGITS_AND_COMMAS = b"0123456789,"
_COMMA, _CLOSING_BRACE = ord(","), ord("}")


class SplicePoints(NamedTuple):
    """Where a stream chunk's scores go (`_splice_points`)."""

    index: int  # the choice's
    tokens: int  # in the chunk
    cut_from: int  # the bytes [cut_from, cut_to) to cut for a client that did not ask for token ids
    cut_to: int

def _splice_points(event: bytes, prompt_ids_kept: bool = False) -> SplicePoints | None:
    """What a stream chunk's bytes say of its tokens, read without decoding it, or None unless
    the chunk is in vLLM's compact form with one choice, at least one token and no list of
    prompt token ids (`prompt_ids_kept`: the client asked for token ids, so nothing will be
    cut, and one `prompt_token_ids` member, a list or null, may stand right before the
    choice's `token_ids`, as in a completion's first chunk, or be the chunk's last member, as
    in a chat's). An unescaped quote cannot occur inside a JSON string, so what is found here
    by its quotes is structure, not text.

    vLLM writes a choice's `token_ids` last. A completion's choice has
    `"prompt_token_ids":null` right before them in every chunk after the first (vLLM sets
    the field explicitly): the bytes cut then start there, as the decoded path drops that
    key too. Runs once per chunk of every stream: as few passes over the bytes as the
    checks allow."""
    member = event.rfind(_TOKEN_IDS_MEMBER)
    first = member + len(_TOKEN_IDS_MEMBER)
    end = event.find(b"]", first)
    if member < 0 or end < 0 or event[-1] != _CLOSING_BRACE or event[end + 1] not in (_COMMA, _CLOSING_BRACE):
        return None
    ids = event[first:end]
    if not ids or ids.translate(None, _DIGITS_AND_COMMAS) or ids[0] == _COMMA or ids[-1] == _COMMA:
        return None  # no token, or not a plain list of ids
    cut_from = member - len(_NULL_PROMPT_IDS_MEMBER) if event.endswith(_NULL_PROMPT_IDS_MEMBER, 0, member) else member
    before, after = event.find(_IDS_KEY_END, 0, cut_from), event.find(_IDS_KEY_END, end)
    if before >= 0 or after >= 0:  # another choice's ids, or the prompt's (a first chunk), or a null one elsewhere
        if not prompt_ids_kept or (before >= 0 and after >= 0):
            return None
        other = before if before >= 0 else after
        # The prompt's ids, kept: no other member may follow them before the chunk's ids (or the
        # chunk's end): no quote at all, found with a one-byte search over their 5 KB.
        if (not event.endswith(_PROMPT_IDS_KEY_START, 0, other)
                or event.find(b'"', other + len(_IDS_KEY_END), cut_from if before >= 0 else len(event)) >= 0):
            return None
    where = event.find(_FIRST_CHOICE_INDEX, 0, member)
    if where < 0:
        return None
    where += len(_FIRST_CHOICE_INDEX)
    digits = event[where : event.find(b",", where, member + 1)]  # the index's comma may be the member's
    if not digits.isdigit():
        return None
    # The ids found last must be the first choice's: a second choice opening before them means
    # they are a later choice's (the first has none), whose scores would go to the wrong choice.
    # (A chat delta's list of tool calls looks the same and goes the decoded way too.) Kept
    # prompt ids right before them hold no quote (checked above): the search stops at them
    # rather than scanning a first chunk's 5 KB of ids again.
    if event.find(_NEXT_CHOICE, where, before if before >= 0 else member) >= 0:
        return None
    return SplicePoints(int(digits), ids.count(b",") + 1, cut_from, end + 1)

_PROMPT_IDS_MEMBER = b'"prompt_token_ids":['

_INTEGER_LIST_BYTES = b"0123456789,-"

def _without_prompt_token_ids(payload: bytes) -> bytes:
    """`payload` with its `"prompt_token_ids":[...]` members cut out of the bytes, unparsed.

    The middleware asks vLLM for token ids (to count each chunk's tokens) and strips them
    again for clients that did not. vLLM is made to build no prompt ids for those clients
    (vllm_openai.py); where it still writes them (a vLLM whose response classes that patch
    does not find), they arrive with the first chunk, 1024 of them for a 1024-token prompt,
    on that chunk's way to the client's first token, and the hub counts each cut
    (`chunks["prompt_ids_cut"]`). Cutting them out first saves decoding and re-encoding them.
    Only vLLM's compact form is cut: a member right after `{` or `,`, whose list holds nothing
    but digits, commas and minus signs and is followed by `,` or `}`; the bytes cannot occur
    inside a JSON string, where quotes are escaped. Anything else is returned unchanged, for the
    decoded path, which drops the key as well."""
    start = payload.find(_PROMPT_IDS_MEMBER)
    while start > 0:
        first = start + len(_PROMPT_IDS_MEMBER)
        end = payload.find(b"]", first)
        before, after = payload[start - 1 : start], payload[end + 1 : end + 2]
        if (end < 0 or before not in (b",", b"{") or after not in (b",", b"}")
                or payload[first:end].translate(None, _INTEGER_LIST_BYTES)):  # anything but digits, commas, signs
            return payload
        if before == b",":  # drop the comma ahead of the member
            payload = payload[: start - 1] + payload[end + 1 :]
        elif after == b",":  # first member: drop the comma after it
            payload = payload[:start] + payload[end + 2 :]
        else:  # the only member
            payload = payload[:start] + payload[end + 1 :]
        start = payload.find(_PROMPT_IDS_MEMBER, start - 1)
    return payload
