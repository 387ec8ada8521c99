"""What the middleware checks and rewrites in a monitored request before vLLM sees it.

Monitored routes, the `probex_*` keys and what ProbeX refuses (400 naming the field), the id
the middleware gives each request so its scores can be matched before the response exists,
and the fast path that finds the usual request needs nothing but `return_token_ids`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine_worker.steering import STEERING_XARGS, SteeringError, SteerRequest, cache_salt, steering_from_xargs

MONITORED_PATHS = {"/v1/chat/completions": "chatcmpl", "/v1/completions": "cmpl"}

BOOLEAN_XARGS = ("probex_recompute", "probex_capture")

class RequestRefused(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

def openai_error(message: str, *, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(status)
    if kind is None:
        kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

# vLLM's other routes that generate text (those of vLLM 0.25-0.32 that a chat model can serve):
# ProbeX monitors only MONITORED_PATHS, so a monitored worker refuses these instead of serving
# them unscored (and, for steered requests, without the prefix-cache salt that keeps them apart).
UNMONITORED_GENERATION_PATHS = frozenset({
    "/invocations", "/v1/chat/completions/batch", "/v1/responses", "/v1/messages", "/inference/v1/generate",
    "/cohere/v2/chat", "/generative_scoring", "/v1/systemone",
})

# A request body nested deeper than Python's parsers can follow (they recurse once per level).
_TOO_DEEP = "request body is nested too deeply"

def _truthy(key: str, value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)) and value in (0, 1):
        return int(value)
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return int(value.lower() in ("true", "1"))
    raise RequestRefused(f"vllm_xargs.{key} must be true or false, got {value!r}", param=f"vllm_xargs.{key}")

@dataclass
class MonitoredCall:
    """What the middleware learned from a request body before passing it on."""

    key_prefix: str
    stream: bool
    wants_token_ids: bool
    num_prompts: int = 1
    body: dict = field(default_factory=dict)
    steering: SteerRequest | None = None

    def key(self, choice_index: int) -> str:
        return self.key_prefix if self.key_prefix.startswith("chatcmpl-") else f"{self.key_prefix}-{choice_index}"

def inspect_request(path: str, body: Any, owner: str = "") -> MonitoredCall | None:
    """Validate ProbeX-relevant fields and rewrite the body; None = not ours to monitor (pass through)."""
    if not isinstance(body, dict):
        return None
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise RequestRefused("vllm_xargs must be an object", param="vllm_xargs")
    if xargs:
        for key in list(xargs):
            if key.startswith("probex_") and key not in STEERING_XARGS:
                if key not in BOOLEAN_XARGS:
                    raise RequestRefused(
                        f"unknown ProbeX option vllm_xargs.{key}; known: {', '.join(BOOLEAN_XARGS + STEERING_XARGS)}",
                        param=f"vllm_xargs.{key}",
                    )
                xargs[key] = _truthy(key, xargs[key])
    try:
        steering = steering_from_xargs(xargs)
    except SteeringError as exc:
        raise RequestRefused(str(exc), param=exc.param) from None
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        # vLLM reads "false" as false: taken as true here, its JSON answer would go out as a broken stream
        raise RequestRefused("stream must be true or false", param="stream")
    for name in ("n", "best_of"):
        value = body.get(name)
        if value not in (None, 1):
            raise RequestRefused(
                f"{name}={value!r}: ProbeX scores one sequence per request; send separate requests instead",
                param=name,
            )
    if body.get("use_beam_search"):
        raise RequestRefused("beam search is not supported with ProbeX monitoring", param="use_beam_search")
    if path == "/v1/completions" and body.get("echo"):
        raise RequestRefused("echo is not supported with ProbeX monitoring", param="echo")
    if body.get("include_reasoning") is False:
        # vLLM then leaves out the token ids that say which tokens each chunk carries (where a
        # reasoning or tool parser is on): the generated tokens' scores could not be placed.
        raise RequestRefused("include_reasoning: false is not supported with ProbeX monitoring",
                             param="include_reasoning")

    num_prompts = 1
    prompt = body.get("prompt")
    if path == "/v1/completions" and isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        num_prompts = len(prompt)

    wants_token_ids = bool(body.get("return_token_ids"))
    # Token ids tell us exactly how many generated tokens each chunk carries; we strip
    # them again unless the client asked for them.
    body["return_token_ids"] = True
    # `owner`: this API server process's tag where there are several (delivery.owner_tag), so
    # its hub can tell its requests' rows from the others'; the id stays 32 hex digits.
    request_id = f"probex-{owner}{uuid.uuid4().hex[len(owner):]}"
    return MonitoredCall(
        key_prefix=f"{MONITORED_PATHS[path]}-{request_id}",
        stream=bool(body.get("stream")),
        wants_token_ids=wants_token_ids,
        num_prompts=num_prompts,
        body=body,
        steering=steering,
    )

class _RequestFields(msgspec.Struct):
    """The fields of a request body that `inspect_request` looks at; the prompt or messages are
    only skipped over (`msgspec.Raw`), not turned into Python objects."""

    prompt: msgspec.Raw = msgspec.Raw()
    stream: Any = None
    n: Any = None
    best_of: Any = None
    use_beam_search: Any = None
    echo: Any = None
    include_reasoning: Any = None
    return_token_ids: Any = None
    vllm_xargs: Any = None

_request_fields = msgspec.json.Decoder(_RequestFields)

_ASK_FOR_TOKEN_IDS = b',"return_token_ids":true}'

def body_as_sent(path: str, raw: bytes, owner: str = "") -> tuple[MonitoredCall, bytes] | None:
    """The usual request, monitored without decoding and re-encoding its body: (its call, the
    body for vLLM), or None for anything `inspect_request` must see (a ProbeX option, a
    steering request, a field it refuses or checks, a batch of prompts, a body msgspec does
    not take, which may still be JSON that Python's parser takes).

    The body for vLLM is the client's own bytes, with `"return_token_ids":true` added
    before the closing brace if the client did not send the key. What it saves is on every
    request's way to its first token: a 1024-token request is passed on in less than half the
    time it takes decoded, checked and re-encoded."""
    try:
        fields = _request_fields.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None  # the full path answers (a body nested too deeply is refused there)
    xargs = fields.vllm_xargs
    if xargs is not None and (not isinstance(xargs, dict) or any(str(key).startswith("probex_") for key in xargs)):
        return None
    if (fields.n not in (None, 1) or fields.best_of not in (None, 1) or fields.use_beam_search
            or not isinstance(fields.stream, (bool, type(None)))
            or (path == "/v1/completions" and fields.echo) or fields.include_reasoning is False):
        return None
    if path == "/v1/completions" and _lists_several_prompts(bytes(fields.prompt)):
        return None
    if fields.return_token_ids is True:
        body = raw
    elif fields.return_token_ids is None:
        stripped = raw.rstrip()
        if not stripped.endswith(b"}") or stripped[:-1].rstrip().endswith(b"{"):
            return None  # an empty object: vLLM's own validation answers it, from the full path
        body = stripped[:-1] + _ASK_FOR_TOKEN_IDS
    else:
        return None  # asked not to have them, or something else: the full path sets the field
    request_id = f"probex-{owner}{uuid.uuid4().hex[len(owner):]}"
    call = MonitoredCall(key_prefix=f"{MONITORED_PATHS[path]}-{request_id}", stream=bool(fields.stream),
                         wants_token_ids=fields.return_token_ids is True)
    return call, body

def _lists_several_prompts(prompt: bytes) -> bool:
    """Does a completion's raw `prompt` hold a list of prompts (strings or token lists),
    whose choices are scored one by one, rather than one text or one list of token ids?"""
    text = prompt.lstrip()
    return text.startswith(b"[") and text[1:].lstrip()[:1] in (b'"', b"[")

def check_steering(body: dict, request: SteerRequest, steering: dict, probes: dict) -> str:
    """Check a steering request against what the worker has loaded; normalise its xargs and
    set its `cache_salt`. `steering` / `probes` are the worker's listings. Returns the salt."""
    if not steering.get("steer_layers"):
        raise RequestRefused("this worker steers no layer (start it with --steer-layer L)", param="vllm_xargs.probex_steer")
    vector = next((v for v in steering["vectors"] if v["name"] == request.vector), None)
    if vector is None:
        known = ", ".join(v["name"] for v in steering["vectors"]) or "none"
        raise RequestRefused(f"unknown steering vector {request.vector!r}; loaded: {known}",
                             param="vllm_xargs.probex_steer", code="unknown_steering_vector")
    if request.gate is not None:
        probe = next((p for p in probes["probes"] if p["name"] == request.gate), None)
        if probe is None:
            known = ", ".join(p["name"] for p in probes["probes"]) or "none"
            raise RequestRefused(f"gate probe {request.gate!r} is not loaded; loaded: {known}",
                                 param="vllm_xargs.probex_steer_gate", code="unknown_gate_probe")
        if probe["layer"] not in steering["gate_layers"].get(str(vector["layer"]), []):
            raise RequestRefused(
                f"gate probe {request.gate!r} reads layer {probe['layer']}, but steering vector {request.vector!r}"
                f" writes at layer {vector['layer']}: a gate must be at a tapped layer at or before the write",
                param="vllm_xargs.probex_steer_gate")
        if not probe["calibration"]["slope"] > 0:
            raise RequestRefused(f"gate probe {request.gate!r} has a non-positive calibration slope, so a"
                                 " probability threshold cannot be turned into a raw one",
                                 param="vllm_xargs.probex_steer_gate")
    xargs = body["vllm_xargs"]
    xargs["probex_steer_alpha"] = request.alpha
    xargs["probex_steer_window"] = request.window
    if request.threshold is not None:
        xargs["probex_steer_threshold"] = request.threshold
    salt = cache_salt(request, vector["digest"], body.get("cache_salt"))
    body["cache_salt"] = salt
    return salt
