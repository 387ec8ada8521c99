"""Request controls belong to the policy: what the gateway forwards, refuses, and sends to workers only."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import yaml

from gateway.policy import PolicyError, parse_policy
from tests.fixtures.mock_upstream import MODEL
from tests.gateway_fixtures import base_policy, start_stack

KEYS = {"k-plain": "plain", "k-granted": "granted"}


@pytest.fixture
def stack(tmp_path):
    policy = base_policy(api_keys=KEYS, admin_keys=["k-admin"],
                         tenants={"plain": {}, "granted": {"allow": ["chat_template", "recompute", "steer"]}})
    s = start_stack(tmp_path, policy)
    yield s
    s.stop()


def post(stack, key, path="/v1/chat/completions", **fields):
    body = {"model": MODEL, "max_tokens": 2, **fields}
    if path == "/v1/chat/completions":
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        body.setdefault("prompt", "hi")
    return httpx.post(stack.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10)


CONTROLS = [
    ({"vllm_xargs": {"probex_steer": "v", "probex_steer_alpha": 4.0}}, "vllm_xargs.probex_steer"),
    ({"vllm_xargs": {"probex_steer_alpha": 4.0}}, "vllm_xargs.probex_steer_alpha"),
    ({"vllm_xargs": {"probex_steer_gate": "harmful-request"}}, "vllm_xargs.probex_steer_gate"),
    ({"vllm_xargs": {"probex_recompute": True}}, "vllm_xargs.probex_recompute"),
    ({"vllm_xargs": {"probex_capture": True}}, "vllm_xargs.probex_capture"),
    ({"vllm_xargs": {"probex_colour": 1}}, "vllm_xargs.probex_colour"),
    ({"chat_template": "{{ 'x' }}"}, "chat_template"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"cache_salt": "s"}, "cache_salt"),
    ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
    ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ({"custom_params": {"a": 1}}, "custom_params"),
    ({"rid": "someone-elses-id"}, "rid"),
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"custom_logit_processor": "x"}, "custom_logit_processor"),
    ({"request_id": "someone-elses-id"}, "request_id"),  # not a known field: refused as well
    ({"mock_tokens_per_s": 1}, "mock_tokens_per_s"),
    ({"vllm_xargs": "probex_steer=v"}, "vllm_xargs"),
]


@pytest.mark.parametrize("fields, param", CONTROLS, ids=[p for _, p in CONTROLS])
def test_engine_controls_and_unknown_fields_are_refused_without_a_grant(stack, fields, param):
    seen = len(stack.state.requests_seen)
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = post(stack, "k-plain", path, **fields)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and param.split(".")[-1] in error["message"]
        assert error["type"] == "invalid_request_error"
    r = post(stack, "k-plain", stream=True, **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert len(stack.state.requests_seen) == seen  # nothing reached the worker


def test_standard_sampling_fields_and_foreign_xargs_pass(stack):
    fields = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3, "stop": ["x"], "n": 1,
              "stream_options": {"include_usage": True}, "repetition_penalty": 1.1, "logprobs": True,
              "top_logprobs": 2, "user": "u", "vllm_xargs": {"my_logits_processor_arg": 2}}
    assert post(stack, "k-plain", **fields).status_code == 200
    assert stack.state.requests_seen[-1] == {"model": MODEL, "max_tokens": 2,
                                             "messages": [{"role": "user", "content": "hi"}], **fields}
    assert post(stack, "k-plain", "/v1/completions", echo=True, suffix="s", best_of=1).status_code == 200


def test_structured_outputs_that_is_not_an_object_is_a_400_before_the_worker(stack):
    """vLLM answers `structured_outputs` of any other type with a 500 (found by tests/test_fuzz_stack.py)."""
    seen = len(stack.state.requests_seen)
    for value in (5, "regex", [], True, [{"regex": "a+"}]):
        for path in ("/v1/chat/completions", "/v1/completions"):
            for stream in (False, True):
                r = post(stack, "k-admin", path, structured_outputs=value, stream=stream)
                assert r.status_code == 400, (value, r.text)
                error = r.json()["error"]
                assert error["param"] == "structured_outputs" and error["type"] == "invalid_request_error"
    assert len(stack.state.requests_seen) == seen
    assert post(stack, "k-plain", structured_outputs={"regex": "a+"}).status_code == 200
    assert post(stack, "k-plain", structured_outputs=None).status_code == 200
    assert stack.state.requests_seen[-2]["structured_outputs"] == {"regex": "a+"}


def test_granted_tenants_and_admins_may_use_controls_and_the_policy_still_decides(stack):
    assert post(stack, "k-granted", chat_template="{{ 'x' }}").status_code == 200
    assert stack.state.requests_seen[-1]["chat_template"] == "{{ 'x' }}"
    r = post(stack, "k-granted", vllm_xargs={"probex_recompute": False, "probex_steer": "v", "probex_steer_alpha": 1})
    assert r.status_code == 200 and stack.state.requests_seen[-1]["vllm_xargs"]["probex_steer"] == "v"
    for fields, param in (({"vllm_xargs": {"probex_capture": True}}, "vllm_xargs.probex_capture"),
                          ({"cache_salt": "s"}, "cache_salt")):
        r = post(stack, "k-granted", **fields)
        assert r.status_code == 400 and r.json()["error"]["param"] == param  # not in its grant
    for fields, _ in CONTROLS[:-3]:
        assert post(stack, "k-admin", **fields).status_code == 200, fields
    assert post(stack, "k-admin", request_id="x").status_code == 400  # unknown fields: for admins too

    # The policy's own additions replace the client's keys of the same control.
    stack.write_policy(base_policy(
        api_keys=KEYS, admin_keys=["k-admin"],
        probes={"harmful-request": {"path": "probes/harmful-request"}},
        rules=[{"probe": "harmful-request", "prompt": {"flag": 0.5, "block": 0.9},
                "steer": {"vector": "refusal18", "alpha": 6.0, "gated": False}}],
        tenants={"plain": {}, "granted": {"allow": ["steer", "recompute"]}}))
    assert httpx.post(stack.url + "/admin/reload", headers={"Authorization": "Bearer k-admin"}).status_code == 200
    r = post(stack, "k-granted", vllm_xargs={"probex_steer": "mine", "probex_steer_alpha": 99,
                                             "probex_steer_gate": "harmful-request", "other": 1})
    assert r.status_code == 200
    assert stack.state.requests_seen[-1]["vllm_xargs"] == {"other": 1, "probex_steer": "refusal18",
                                                           "probex_steer_alpha": 6.0, "probex_steer_window": "all"}


def test_the_policy_can_forward_further_fields_but_not_controls(stack):
    assert post(stack, "k-plain", my_field=1).status_code == 400
    stack.write_policy(base_policy(api_keys=KEYS, admin_keys=["k-admin"], tenants={"plain": {}, "granted": {}},
                                   forward_fields=["my_field"]))
    assert httpx.post(stack.url + "/admin/reload", headers={"Authorization": "Bearer k-admin"}).status_code == 200
    assert post(stack, "k-plain", my_field=1).status_code == 200 and stack.state.requests_seen[-1]["my_field"] == 1
    for control in ("chat_template", "vllm_xargs", "probex_steer"):
        with pytest.raises(PolicyError, match="engine control"):
            parse_policy(yaml.safe_dump({"forward_fields": [control]}))


def test_the_policy_names_only_known_controls():
    good = parse_policy(yaml.safe_dump({"tenants": {"t": {"allow": ["steer", "chat_template"]}}}))
    assert good.tenant("t").granted == {"steer", "chat_template"} and not good.tenant("other").granted
    with pytest.raises(PolicyError, match="tenants.t.allow"):
        parse_policy(yaml.safe_dump({"tenants": {"t": {"allow": ["stear"]}}}))


def test_the_worker_token_goes_on_every_call_to_the_workers(stack):
    assert post(stack, "k-plain").status_code == 200
    assert post(stack, "k-plain", stream=True).status_code == 200
    assert httpx.get(stack.url + "/v1/models", headers={"Authorization": "Bearer k-plain"}).status_code == 200
    deadline = time.monotonic() + 10
    while "/probex/health" not in {path for path, _ in stack.state.authorizations}:  # polled every 5 s
        assert time.monotonic() < deadline, stack.state.authorizations
        time.sleep(0.1)
    paths = {path for path, _ in stack.state.authorizations}
    assert {"/health", "/v1/models", "/v1/chat/completions", "/probex/health"} <= paths
    assert {auth for _, auth in stack.state.authorizations} == {"Bearer worker-token"}


def test_the_worker_token_goes_to_no_other_url():
    from gateway.upstream_http import UpstreamClient
    from gateway.upstreams import WorkerAuth

    seen: dict[str, str | None] = {}

    def answer(request: httpx.Request) -> httpx.Response:
        seen[str(request.url)] = request.headers.get("authorization")
        return httpx.Response(200)

    async def calls() -> None:
        auth = WorkerAuth("secret", ["http://127.0.0.1:81", "http://worker:8100/base/"])
        async with httpx.AsyncClient(auth=auth, transport=httpx.MockTransport(answer)) as client:
            for url in ("http://127.0.0.1:81/health", "http://worker:8100/base/v1/models",
                        "http://127.0.0.1:8100/health", "http://worker:8100/other", "http://evil.example/x",
                        "http://127.0.0.1:810/x"):
                await client.get(url)

    asyncio.run(calls())
    assert seen == {"http://127.0.0.1:81/health": "Bearer secret", "http://worker:8100/base/v1/models": "Bearer secret",
                    "http://127.0.0.1:8100/health": None, "http://worker:8100/other": None,
                    "http://evil.example/x": None, "http://127.0.0.1:810/x": None}

    async def origins() -> tuple[bytes, bytes]:
        client = UpstreamClient(1, 1, token="secret", upstream_urls=["http://127.0.0.1:81"])
        return client._origin("http://127.0.0.1:81").auth_header, client._origin("http://127.0.0.1:82").auth_header

    assert asyncio.run(origins()) == (b"authorization: Bearer secret\r\n", b"")
