"""The middleware's checks of a monitored request before vLLM sees it: refusals (400 naming the
field), the fast path that passes the usual request on as sent, odd bodies and routes."""

import asyncio
import json

import pytest

from engine_worker.api_server.requests import RequestRefused, body_as_sent, inspect_request
from engine_worker.scores.wire import external_request_id
from engine_worker.tap.config import TapConfig
from engine_worker.vllm.api_server import VllmMiddleware as ProbexMiddleware
from tests.middleware_fixtures import (ADMIN, ADMIN_TOKEN, call_route, FakeEngineClient, idle_hub, post_raw,
                                       post_raw_paused, post_through, RecordingApp, response_body)


def test_engine_suffix_is_stripped():
    assert external_request_id("chatcmpl-probex-abc-0123abcd") == "chatcmpl-probex-abc"
    assert external_request_id("cmpl-probex-abc-1-0123abcd") == "cmpl-probex-abc-1"


@pytest.mark.parametrize(
    "body, message",
    [
        ({"vllm_xargs": {"probex_recompute": "maybe"}}, "must be true or false"),
        ({"vllm_xargs": {"probex_colour": 1}}, "unknown ProbeX option vllm_xargs.probex_colour"),
        ({"vllm_xargs": "x"}, "vllm_xargs must be an object"),
        ({"n": 2}, "n=2"),
        ({"use_beam_search": True}, "beam search"),
        # vLLM would leave out the token ids each chunk's scores are placed by
        ({"include_reasoning": False}, "include_reasoning: false"),
        # vLLM reads "false" as false; taken as true, its JSON answer would be relayed as a stream
        ({"stream": "false"}, "stream must be true or false"),
        ({"stream": 1}, "stream must be true or false"),
    ],
)
def test_bad_probex_requests_are_refused(body, message):
    with pytest.raises(RequestRefused, match=message):
        inspect_request("/v1/chat/completions", {"messages": [], **body})


def test_xargs_are_normalised_and_token_ids_requested():
    call = inspect_request("/v1/chat/completions", {"vllm_xargs": {"probex_recompute": "true", "other": 3}})
    assert call.body["vllm_xargs"] == {"probex_recompute": 1, "other": 3}
    assert call.body["return_token_ids"] is True and not call.wants_token_ids
    assert call.key(0).startswith("chatcmpl-probex-")
    completion = inspect_request("/v1/completions", {"prompt": ["a", "b"]})
    assert completion.num_prompts == 2 and completion.key(1).endswith("-1")


def test_request_bodies_python_json_accepts_are_monitored_and_passed_on_unchanged(monkeypatch):
    """vLLM's server reads bodies with Python's json, which takes NaN and Infinity; the
    middleware's faster parser does not. Such a body must still be checked (a bad probex
    option refused, an engine control without the admin token refused) and monitored, and
    reach vLLM with its NaN intact, not as null."""
    monkeypatch.setenv("PROBEX_ADMIN_TOKEN", ADMIN_TOKEN)
    colour = b'{"prompt": "x", "max_tokens": 2, "top_p": NaN, "vllm_xargs": {"probex_colour": 1}}'
    app, status, answer = post_raw(colour, ADMIN)
    assert status == 400 and b"probex_colour" in answer and app.bodies == []
    app, status, answer = post_raw(colour.replace(b"probex_colour", b"probex_recompute"))
    assert status == 401 and b"vllm_xargs.probex_recompute" in answer and app.bodies == []
    app, status, _ = post_raw(b'{"prompt": [1, 2, 3], "max_tokens": 2, "top_p": NaN, "name": "caf\\u00e9"}')
    assert status == 200 and app.request_ids[0] is not None  # monitored: the middleware's own id
    forwarded = json.loads(app.bodies[0])
    assert forwarded["top_p"] != forwarded["top_p"]  # NaN, still
    assert forwarded["prompt"] == [1, 2, 3] and forwarded["name"] == "café" and forwarded["return_token_ids"] is True
    # a plain body takes the fast path and arrives with the same content
    app, status, _ = post_raw(b'{"prompt": [1, 2, 3], "max_tokens": 2, "name": "caf\\u00e9"}')
    forwarded = json.loads(app.bodies[0])
    assert status == 200 and forwarded["name"] == "café" and forwarded["prompt"] == [1, 2, 3]
    # not JSON at all: vLLM answers with its own validation error, the body untouched
    app, status, _ = post_raw(b"{not json")
    assert app.bodies == [b"{not json"] and app.request_ids == [None]


def test_the_usual_request_reaches_vllm_as_the_client_sent_it():
    """A request with nothing for ProbeX to check or rewrite is not decoded and re-encoded:
    vLLM gets the client's bytes, under ProbeX's request id, with `return_token_ids` added
    where the client did not send it; paused, the bytes alone."""
    asked = b'{"prompt": [5, 6, 7], "max_tokens": 2, "stream": true, "return_token_ids": true, "top_p": 0.50}'
    app, status, _ = post_raw(asked)
    assert status == 200 and app.bodies == [asked] and app.request_ids[0].startswith(b"probex-")
    plain = b'{"prompt": "caf\\u00e9", "max_tokens": 2, "vllm_xargs": {"other": 1}}\n'
    app, status, _ = post_raw(plain)
    assert status == 200 and app.bodies == [plain.rstrip()[:-1] + b',"return_token_ids":true}']
    assert json.loads(app.bodies[0]) == {**json.loads(plain), "return_token_ids": True}
    app, status = post_raw_paused(plain)
    assert status == 200 and app.bodies == [plain] and app.request_ids == [None]
    call, body = body_as_sent("/v1/chat/completions", b'{"messages": [], "stream": true}', owner="ab12cd34")
    assert call.stream and not call.wants_token_ids and call.key(0).startswith("chatcmpl-probex-ab12cd34")


@pytest.mark.parametrize("raw", [
    b'{"prompt": "x", "n": 2}', b'{"prompt": "x", "best_of": 3}', b'{"prompt": "x", "use_beam_search": true}',
    b'{"prompt": "x", "echo": true}', b'{"prompt": "x", "include_reasoning": false}',
    b'{"prompt": "x", "vllm_xargs": {"probex_recompute": "true"}}', b'{"prompt": "x", "vllm_xargs": "x"}',
    b'{"prompt": ["a", "b"]}', b'{"prompt": [[1, 2], [3]]}', b'{"prompt": "x", "return_token_ids": false}',
    b'{"prompt": "x", "top_p": NaN}', b"{}", b"[1, 2]", b"{not json",
])
def test_requests_with_anything_to_check_or_rewrite_take_the_full_path(raw):
    assert body_as_sent("/v1/completions", raw) is None


def test_a_refused_field_is_still_refused_when_the_rest_is_usual():
    app, status, answer = post_raw(b'{"prompt": [1, 2], "max_tokens": 2, "n": 3}')
    assert status == 400 and b"n=3" in answer and app.bodies == []
    app, status, answer = post_raw(b'{"prompt": [1, 2], "max_tokens": 2, "stream": "false"}')
    assert status == 400 and b'"param":"stream"' in answer.replace(b" ", b"") and app.bodies == []


def test_odd_requests_to_the_worker_get_4xx_openai_errors(monkeypatch):
    """What a fuzzing review of the worker found: bodies nested too deeply for Python's parsers
    (500s), vLLM's other generating routes (served unscored), capture asked of a worker without
    capture mode (silently not captured), a non-UTF-8 admin token and wrong methods on
    ProbeX's routes."""
    monkeypatch.setenv("PROBEX_ADMIN_TOKEN", ADMIN_TOKEN)
    admin = ADMIN
    deep = "[" * 1000 + "]" * 1000

    async def go():
        app, engine = RecordingApp(), FakeEngineClient()
        middleware = ProbexMiddleware(app, hub=idle_hub(), tap_config=TapConfig(layers=(3,)))
        for raw in ('{"prompt": "hi", "x": %s}' % deep, '{"prompt": "hi", "top_p": NaN, "x": %s}' % deep):
            status, answer = await call_route(middleware, "POST", "/v1/completions", raw.encode())
            assert status == 400 and answer["error"]["message"] == "request body is nested too deeply"
        for path in ("/invocations", "/v1/responses", "/v1/messages", "/v1/chat/completions/batch"):
            status, answer = await call_route(middleware, "POST", path, b'{"model": "m", "messages": []}')
            assert status == 404 and answer["error"]["code"] == "unmonitored_route"
        capture = json.dumps({"prompt": "x", "vllm_xargs": {"probex_capture": True}}).encode()
        status, answer = await call_route(middleware, "POST", "/v1/completions", capture, admin)
        assert status == 400 and answer["error"]["code"] == "capture_off"
        assert app.bodies == []  # none of these reached vLLM
        status, answer = await call_route(middleware, "PUT", "/probex/tap", ('{"paused": %s}' % deep).encode(), admin,
                                          engine)
        assert status == 400 and engine.calls == []
        status, answer = await call_route(middleware, "PUT", "/probex/tap", b'{"paused": true}',
                                          [(b"authorization", b"Bearer caf\xe9")], engine)
        assert status == 401 and engine.calls == []
        status, answer = await call_route(middleware, "POST", "/probex/tap", b"{}", admin, engine)
        assert status == 405 and answer["error"]["type"] == "invalid_request_error"
        status, answer = await call_route(middleware, "POST", "/probex/health")
        assert status == 405 and "error" in answer

    asyncio.run(go())


# Engine controls: every `probex_*` key of `vllm_xargs`, known or not, and a steering request.
CONTROLS = [{"probex_recompute": True}, {"probex_capture": True}, {"probex_steer": "v", "probex_steer_alpha": 1.0},
            {"probex_colour": 1}]


def control_answer(body: dict, headers=(), path: str = "/v1/completions"):
    """`body` posted through a capturing worker (its admin token, if any, from the environment):
    (the status, the answer, the bodies that reached vLLM)."""
    async def go():
        app = RecordingApp()
        capturing = TapConfig(layers=(3,), capture_rows=16, capture_dir="/tmp/probex-test-captures")
        middleware = ProbexMiddleware(app, hub=idle_hub(), tap_config=capturing)
        sent = await post_through(middleware, path, json.dumps(body).encode(), headers=headers)
        return sent[0]["status"], json.loads(response_body(sent)), app.bodies

    return asyncio.run(go())


@pytest.mark.parametrize("xargs", CONTROLS, ids=lambda xargs: next(iter(xargs)))
@pytest.mark.parametrize("headers", [(), [(b"authorization", b"Bearer wrong")], [(b"authorization", b"secret")],
                                     [(b"x-probex-admin-token", b"secre")]],
                         ids=["no token", "wrong token", "no bearer", "wrong header token"])
def test_an_engine_control_without_the_admin_token_is_refused_naming_the_key(monkeypatch, xargs, headers):
    monkeypatch.setenv("PROBEX_ADMIN_TOKEN", ADMIN_TOKEN)
    status, answer, reached = control_answer({"prompt": "x", "max_tokens": 2, "vllm_xargs": {"other": 1, **xargs}},
                                             headers)
    first = min(xargs)
    assert status == 401 and reached == []
    assert answer["error"]["type"] == "authentication_error" and answer["error"]["code"] == "admin_token_required"
    assert answer["error"]["param"] == f"vllm_xargs.{first}" and f"vllm_xargs.{first}" in answer["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_engine_controls_with_the_admin_token_pass(monkeypatch, path):
    monkeypatch.setenv("PROBEX_ADMIN_TOKEN", ADMIN_TOKEN)
    body = {"prompt": "x", "messages": [], "max_tokens": 2, "vllm_xargs": {"probex_recompute": "true",
                                                                           "probex_capture": True}}
    for headers in (ADMIN, [(b"x-probex-admin-token", ADMIN_TOKEN.encode())]):
        status, _, reached = control_answer(body, headers, path)
        assert status == 200 and json.loads(reached[0])["vllm_xargs"] == {"probex_recompute": 1, "probex_capture": 1}
    # with the token, a control the worker does not know is still refused as before
    status, answer, reached = control_answer({"prompt": "x", "vllm_xargs": {"probex_colour": 1}}, ADMIN, path)
    assert status == 400 and answer["error"]["param"] == "vllm_xargs.probex_colour" and reached == []


def test_a_worker_without_an_admin_token_refuses_engine_controls_saying_how_to_enable_them(monkeypatch):
    monkeypatch.delenv("PROBEX_ADMIN_TOKEN", raising=False)
    for headers in ((), ADMIN):
        status, answer, reached = control_answer({"prompt": "x", "vllm_xargs": {"probex_capture": True}}, headers)
        assert status == 403 and reached == [] and answer["error"]["type"] == "permission_error"
        assert answer["error"]["param"] == "vllm_xargs.probex_capture"
        assert "--admin-token" in answer["error"]["message"] and "PROBEX_ADMIN_TOKEN" in answer["error"]["message"]


@pytest.mark.parametrize("token", [None, ADMIN_TOKEN])
def test_a_request_without_engine_controls_needs_no_token(monkeypatch, token):
    if token:
        monkeypatch.setenv("PROBEX_ADMIN_TOKEN", token)
    else:
        monkeypatch.delenv("PROBEX_ADMIN_TOKEN", raising=False)
    for body in ({"prompt": "x", "max_tokens": 2}, {"prompt": "x", "vllm_xargs": {"other": 1}},
                 {"prompt": "x", "top_k": 2, "n": 1, "vllm_xargs": {"other": 1}, "return_token_ids": False}):
        status, _, reached = control_answer(body)
        assert status == 200 and len(reached) == 1
    # a body the fast path does not take (Python's json only) still passes without controls
    app, status, _ = post_raw(b'{"prompt": "x", "top_p": NaN, "vllm_xargs": {"other": 1}}')
    assert status == 200 and len(app.bodies) == 1
