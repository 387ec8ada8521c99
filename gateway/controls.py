"""Which request fields the gateway forwards to a worker, and which it refuses.

Only fields known to leave monitoring intact go through for every caller. Engine controls
(fields that change the token a probe reads, what the engine computes, or how scores reach
the gateway) go through only for a tenant the policy grants them to
(`tenants.<name>.allow`) and for admin keys; anything else is refused with a 400 naming
the field, so that a new engine option is never forwarded before someone has decided it
is harmless.
"""

from __future__ import annotations

from typing import get_args

from gateway.errors import ApiError
from gateway.policy import Control

# -- forwarded for every caller ------------------------------------------------------------

# The OpenAI chat completions request: content the probes read (messages, tools), sampling
# settings, output formats and bookkeeping. None of them moves the probe's read point or
# changes what the engine computes from the prompt the probes see.
OPENAI_CHAT_FIELDS = frozenset({
    "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n", "stop",
    "temperature", "top_p", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs",
    "seed", "response_format", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
    "user", "metadata", "store", "service_tier", "reasoning_effort", "modalities", "audio", "prediction",
    "prompt_cache_key", "safety_identifier", "verbosity", "web_search_options",
})

# The OpenAI (legacy) completions request: the prompt, the same sampling settings, and
# output formats (`echo` repeats the prompt, `suffix` is text after the completion).
OPENAI_COMPLETION_FIELDS = frozenset({
    "model", "prompt", "stream", "stream_options", "max_tokens", "n", "stop", "temperature", "top_p",
    "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "seed", "best_of", "echo", "suffix", "user",
})

# vLLM's extra sampling parameters: they shape which tokens are sampled (each generated
# token is still scored as it is produced) or what the answer reports. Truncating the prompt
# changes what the model and the probes see alike.
VLLM_SAMPLING_FIELDS = frozenset({
    "top_k", "min_p", "repetition_penalty", "length_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "bad_words",
    "allowed_token_ids", "use_beam_search", "prompt_logprobs", "truncate_prompt_tokens", "priority",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "return_tokens_as_token_ids", "return_token_ids",
})

# Forwarded fields that must be JSON objects: vLLM's server reads `structured_outputs` as one
# before validating it, and answers any other type with a 500.
OBJECT_FIELDS = ("structured_outputs",)

# `vllm_xargs` carries per-request arguments to the deployment's logits processors; its
# `probex_*` keys are ProbeX controls, checked one by one below.
XARGS_FIELD = "vllm_xargs"

FORWARDED = {
    "/v1/chat/completions": OPENAI_CHAT_FIELDS | VLLM_SAMPLING_FIELDS | {XARGS_FIELD},
    "/v1/completions": OPENAI_COMPLETION_FIELDS | VLLM_SAMPLING_FIELDS | {XARGS_FIELD},
}

# -- engine controls: only where granted -----------------------------------------------------

CONTROLS: tuple[str, ...] = get_args(Control)
TOP_LEVEL_CONTROLS = frozenset(CONTROLS) - {"recompute", "steer", "capture"}
_XARG_CONTROLS = {"probex_recompute": "recompute", "probex_capture": "capture", "probex_steer": "steer"}


def xarg_control(key: str) -> str | None:
    """The grant a `vllm_xargs` key needs; None for a key that is not ProbeX's. An unknown
    `probex_*` key needs a grant no tenant can hold (admin keys only)."""
    if not key.startswith("probex_"):
        return None
    if key.startswith("probex_steer"):
        return "steer"
    return _XARG_CONTROLS.get(key, key)


def check_request(path: str, body: dict, granted: frozenset[str], is_admin: bool,
                  extra: frozenset[str] = frozenset()) -> None:
    """Raise a 400 for the first field this caller may not send (`extra`: the policy's forward_fields)."""
    allowed = FORWARDED[path]
    for name in body:
        if name in allowed or name in extra:
            continue
        if name in TOP_LEVEL_CONTROLS:
            if not (is_admin or name in granted):
                raise _refused(name, f"'{name}' is an engine control this API key is not granted"
                                     f" (policy: tenants.<name>.allow: [{name}])")
            continue
        raise _refused(name, f"unsupported request field '{name}'")
    for name in OBJECT_FIELDS:
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise _refused(name, f"'{name}' must be an object")
    xargs = body.get(XARGS_FIELD)
    if xargs is None:
        return
    if not isinstance(xargs, dict):
        raise _refused(XARGS_FIELD, "'vllm_xargs' must be an object")
    if is_admin:
        return
    for key in xargs:
        control = xarg_control(key)
        if control is not None and control not in granted:
            param = f"{XARGS_FIELD}.{key}"
            if control in CONTROLS:
                raise _refused(param, f"'{param}' is an engine control this API key is not granted"
                                      f" (policy: tenants.<name>.allow: [{control}])")
            raise _refused(param, f"unknown ProbeX control '{param}'")


def with_policy_xargs(xargs: dict | None, added: dict) -> dict:
    """The client's vllm_xargs with the policy's additions: a client key of the same control
    (probex_recompute; every probex_steer* key when the policy steers) goes first."""
    kept = dict(xargs or {})
    if any(key.startswith("probex_steer") for key in added):
        kept = {k: v for k, v in kept.items() if not k.startswith("probex_steer")}
    for key in added:
        kept.pop(key, None)
    kept.update(added)
    return kept


def _refused(param: str, message: str) -> ApiError:
    return ApiError(400, message, code="unsupported_parameter", param=param)
