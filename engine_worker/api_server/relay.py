"""Relaying vLLM's responses with the `probex` field attached: whole bodies and stream chunks,
each waiting (bounded) for the scores of the tokens it carries."""

from __future__ import annotations

import logging

from engine_worker.api_server.asgi import Send
from engine_worker.api_server.hub import ScoreHub
from engine_worker.api_server.requests import MonitoredCall
from engine_worker.api_server.splice import (SplicePoints, _decode_json, _encode_json, _splice_points, _without_prompt_token_ids)
from engine_worker.scores import render as responses
from engine_worker.scores.columns import RequestScores

log = logging.getLogger("probex.middleware")


class BodyRelay:
    """Non-streaming: hold the JSON body, attach scores when they are in, fix Content-Length."""

    def __init__(self, hub: ScoreHub, call: MonitoredCall, send: Send, wait_s: float) -> None:
        self.hub, self.call, self._send, self._wait_s = hub, call, send, wait_s
        self._pauses_at_start = hub.pauses
        self._start: dict | None = None
        self._chunks: list[bytes] = []

    @property
    def wait_s(self) -> float:
        return _score_wait(self.hub, self._pauses_at_start, self._wait_s)

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self._start = message
            return
        if message["type"] != "http.response.body":
            return await self._send(message)
        self._chunks.append(message.get("body", b""))
        if message.get("more_body"):
            return
        body = b"".join(self._chunks)
        if self._start and self._start["status"] == 200:
            body = await self._decorate(body)
        headers = [(k, v) for k, v in self._start["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self._send(dict(self._start, headers=headers))
        await self._send({"type": "http.response.body", "body": body})

    async def _decorate(self, body: bytes) -> bytes:
        try:
            payload = _decode_json(body if self.call.wants_token_ids else _without_prompt_token_ids(body))
        except ValueError:
            return body  # as vLLM wrote it
        choices = payload.get("choices") or []
        per_choice = []
        for choice in choices:
            key = self.call.key(choice.get("index", 0))
            generated = len(choice.get("token_ids") or ())
            await self.hub.wait_for(key, prompt=True, tokens=generated, timeout=self.wait_s)
            per_choice.append(responses.full_scores(self.hub.get(key), generated))
            if not self.call.wants_token_ids:
                choice.pop("token_ids", None)
        if not self.call.wants_token_ids:
            payload.pop("prompt_token_ids", None)
            for choice in choices:
                choice.pop("prompt_token_ids", None)
        if len(per_choice) == 1:
            payload["probex"] = per_choice[0]
        elif per_choice:
            for choice, scores in zip(choices, per_choice):
                choice["probex"] = scores
        return _encode_json(payload)

class StreamRelay:
    """Streaming: pass SSE events through one by one, each with the scores of its tokens.

    Chunks in vLLM's compact form have their scores spliced into their bytes; any other form
    is decoded, decorated and encoded again."""

    def __init__(self, hub: ScoreHub, call: MonitoredCall, send: Send, wait_s: float) -> None:
        self.hub, self.call, self._send, self._wait_s = hub, call, send, wait_s
        self._pauses_at_start = hub.pauses
        self._is_sse = False
        self._pending = b""
        self._generated: dict[int, int] = {}
        self._prompt_sent: set[int] = set()
        self._first_splice_waited = False  # the chunk being decorated waited for its scores in `_splice_first`

    @property
    def wait_s(self) -> float:
        return _score_wait(self.hub, self._pauses_at_start, self._wait_s)

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self._is_sse = message["status"] == 200 and any(
                k == b"content-type" and v.startswith(b"text/event-stream") for k, v in message["headers"]
            )
            return await self._send(message)
        if message["type"] != "http.response.body" or not self._is_sse:
            return await self._send(message)
        body = message.get("body", b"")
        more = message.get("more_body", False)
        # One whole event with no line break inside, as vLLM sends them: a one-byte search for
        # the first break (memchr) says so, where splitting at "\n\n" scans a first chunk's
        # kilobytes of prompt ids byte by byte, on the way to the first token
        if not self._pending and body.find(b"\n") == len(body) - 2 and body.endswith(b"\n\n"):
            decorated = await self._decorate_event(body[:-2])
            return await self._send({"type": "http.response.body", "body": decorated + b"\n\n", "more_body": more})
        events = (self._pending + body).split(b"\n\n")
        self._pending = events.pop()  # what follows the last complete event: b"" as vLLM sends them
        out = [await self._decorate_event(event) + b"\n\n" for event in events]
        if not more and self._pending:
            out.append(self._pending)
            self._pending = b""
        await self._send({"type": "http.response.body", "body": b"".join(out), "more_body": more})

    async def _decorate_event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return event
        points = _splice_points(event, self.call.wants_token_ids)
        if points is None or points.index not in self._prompt_sent:
            self._first_splice_waited = False
            first = await self._splice_first(event, points)
            if first is not None:
                return first
            # (the first splice may have waited for the scores already: this path waits no more)
            return await self._decode_and_decorate(event, wait=not self._first_splice_waited)
        # Chunks in vLLM's compact form once their choice's prompt scores have gone out, nearly
        # all of a stream's: the scores of their tokens are spliced into the bytes and the token
        # ids cut out, the chunk never decoded. The first chunk with tokens, which carries the
        # prompt's scores, is spliced too where it can be (`_splice_first`); chunks without
        # tokens and any other form take the decoded path.
        index, new_tokens, cut_from, cut_to = points
        key = self.call.key(index)
        start = self._generated.get(index, 0)
        stop = self._generated[index] = start + new_tokens
        state = self.hub.get(key)
        if not self.hub.scores_in(state, prompt=False, tokens=stop):
            await self.hub.wait_more(key, prompt=False, tokens=stop, timeout=self.wait_s)
        scores = _take_written(state, start, stop) or responses.generated_scores_json(state, start, stop)
        if not self.call.wants_token_ids:
            event = event[:cut_from] + event[cut_to:]
        return event[:-1] + b',"probex":{"scores":' + scores + b"}}"

    async def _splice_first(self, event: bytes, points: SplicePoints | None) -> bytes | None:
        """A choice's first chunk with tokens, its prompt's scores and its tokens' spliced into
        its bytes, or None for the decoded path: a chunk not in vLLM's compact form with one
        choice and tokens, or whose scores cannot be written directly (a probe swap between the
        prompt and the tokens, a prompt whose scores never came). `points`: the chunk's, read
        by the caller (None where it could not read them).

        On every request's way to its first token, so it does not read the chunk's bytes
        again (but where it must cut ids, below) and writes nothing the hub could write ahead
        (`responses.write_first_chunk_ahead`). A completion's first chunk carries the prompt's
        token ids (1024 for a 1024-token prompt) only where the client asked for token ids:
        they stay, and the splice points are read around them; for other clients vLLM is made
        to leave them out (engine_worker/vllm/openai.py). Where an engine still writes them for
        such a client they are cut out here first."""
        if points is None:
            if self.call.wants_token_ids:
                return None
            cut = event[:6] + _without_prompt_token_ids(event[6:])
            if len(cut) == len(event):
                return None  # nothing to cut: not a chunk the splice can read
            points, event = _splice_points(cut), cut
            if points is None:
                return None
        if points.index in self._prompt_sent:
            return None
        index, new_tokens, cut_from, cut_to = points
        key = self.call.key(index)
        start = self._generated.get(index, 0)
        stop = start + new_tokens
        state = self.hub.get(key)
        if not self.hub.scores_in(state, prompt=True, tokens=stop):
            self._first_splice_waited = True
            await self.hub.wait_more(key, prompt=True, tokens=stop, timeout=self.wait_s)
        scores = responses.first_chunk_scores_json(state, start, stop)
        if scores is None:
            return None
        self._generated[index] = stop
        self._prompt_sent.add(index)
        _write_tokens_ahead(state, stop)
        # The client's token ids stay as vLLM wrote them, or go
        base = event if self.call.wants_token_ids else event[:cut_from] + event[cut_to:]
        return base[:-1] + b',"probex":{"scores":' + scores + b"}}"

    async def _decode_and_decorate(self, event: bytes, wait: bool = True) -> bytes:
        """`wait`: False where this chunk already waited for its scores (`_splice_first`)."""
        include_prompt = False
        payload = event[6:]
        if not self.call.wants_token_ids:
            payload = _without_prompt_token_ids(payload)
        try:
            chunk = _decode_json(payload)
        except ValueError:
            return event
        choices = chunk.get("choices") or []
        if len(choices) == 1:
            choice = choices[0]
            index = choice.get("index", 0)
            key = self.call.key(index)
            start = self._generated.get(index, 0)
            new_tokens = len(choice.get("token_ids") or ())
            stop = self._generated[index] = start + new_tokens
            need_prompt = index not in self._prompt_sent and (new_tokens > 0 or choice.get("finish_reason"))
            state = self.hub.get(key)
            if wait and (need_prompt or stop > start) and not self.hub.scores_in(state, prompt=bool(need_prompt),
                                                                                  tokens=stop):
                await self.hub.wait_more(key, prompt=bool(need_prompt), tokens=stop, timeout=self.wait_s)
            _take_written(state, start, stop)  # written ahead for spliced chunks: this one is decoded
            include_prompt = index not in self._prompt_sent and state.prompt is not None
            if include_prompt:
                _write_tokens_ahead(state, stop)  # a chat stream's role chunk comes this way
                self._prompt_sent.add(index)
            if include_prompt or stop > start:
                chunk["probex"] = responses.chunk_scores(state, start, stop, include_prompt)
            if not self.call.wants_token_ids:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
        if not self.call.wants_token_ids:
            chunk.pop("prompt_token_ids", None)
        return b"data: " + _encode_json(chunk)

def _write_tokens_ahead(state: RequestScores, sent_through: int) -> None:
    """A stream's chunks up to token `sent_through` (exclusive) have gone out, its prompt's
    scores with them: the hub writes the later tokens' JSON as they come in
    (`RequestScores.token_json`), for the chunks that will carry them."""
    if state.token_json is None:
        state.token_json = {}
    state.token_json_from = sent_through

def _take_written(state: RequestScores, start: int, stop: int) -> bytes | None:
    """A chunk carrying tokens [start, stop) goes out: the JSON the hub wrote ahead for it if it
    holds one token (None if none was written), and none is written for those tokens from now on
    (a chunk of several, where vLLM merged tokens, has its own written at once by the caller)."""
    written = state.token_json
    if written is None:
        return None
    state.token_json_from = stop
    if stop == start + 1:
        return written.pop(start, None)
    for token in range(start, stop):
        written.pop(token, None)
    return None

def _score_wait(hub: ScoreHub, pauses_at_start: int, wait_s: float) -> float:
    """How long a response may wait for its scores: not at all once the tap has been paused
    since the request came in (the tokens of the pause never get scores, and those after it
    would wait for them)."""
    return wait_s if hub.pauses == pauses_at_start else 0.0
