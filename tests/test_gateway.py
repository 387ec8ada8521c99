"""Gateway behaviour against the mock upstream (real sockets, official openai SDK)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import yaml

from tests.fixtures.mock_upstream import MODEL
from gateway.policy import PolicyError, parse_policy, policy_json_schema
from probes.artifact import ReadPoint
from tests.gateway_fixtures import base_policy, start_stack

# A Redis database of this module's own in the test process's Redis (tests/conftest.py).
REDIS_DB = 1


@pytest.fixture
def stack(tmp_path):
    s = start_stack(tmp_path)
    yield s
    s.stop()


def client(stack, key="anything"):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)


def chat(c, text, max_tokens=8, **kw):
    return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                     max_tokens=max_tokens, **kw)


def test_allowed_requests_pass_unchanged_without_scores(stack):
    c = client(stack)
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4)
    assert raw.headers["x-probex-decision"] == "allow" and raw.headers["x-probex-policy-version"]
    result = raw.parse()
    assert result.choices[0].message.content and not (result.model_extra or {}).get("probex")
    completion = c.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert completion.choices[0].text
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chat(c, "hi", stream=True) if ch.choices)
    assert streamed.strip()


def test_prompt_block_raises_content_filter_error(stack):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client(stack), "how to build a bomb")
    assert err.value.code == "content_filter"
    with pytest.raises(openai.BadRequestError) as err:
        list(chat(client(stack), "how to build a bomb", stream=True))
    assert err.value.code == "content_filter"
    assert json.loads((stack.policy_path.parent / "audit.jsonl").read_text().splitlines()[0])["decision"] == "block"


def test_refusal_action_returns_content_filter_finish(stack):
    stack.write_policy(base_policy(on_block="refusal", refusal_message="No."))
    assert httpx.post(stack.url + "/admin/reload", timeout=10).status_code == 200
    result = chat(client(stack), "bomb please")
    assert result.choices[0].finish_reason == "content_filter" and result.choices[0].message.content == "No."
    chunks = list(chat(client(stack), "bomb please", stream=True))
    assert chunks[-1].choices[0].finish_reason == "content_filter"


def test_mid_stream_block_ends_cleanly_and_aborts_upstream(stack):
    # 2000 tokens at the mock's 500 a second: the upstream is still streaming when the gateway
    # blocks at token 5, however slowly a loaded machine runs the gateway (with 8 tokens the
    # mock could finish the whole stream first, and then there was nothing left to abort).
    chunks = list(chat(client(stack), "please escalate", max_tokens=2000, stream=True))
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "content_filter"
    # generated scores 0.1, 0.2, ... block at 0.6: token 5 is never relayed
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) == 5
    deadline = time.monotonic() + 3
    while stack.state.aborted == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.state.aborted == 1


def test_flags_are_audited_and_counted(stack):
    stack.write_policy(base_policy(rules=[{"probe": "harmful-request", "prompt": {"flag": 0.5}}]))
    httpx.post(stack.url + "/admin/reload", timeout=10)
    raw = client(stack).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "a bomb question"}], max_tokens=2)
    assert raw.headers["x-probex-decision"] == "flag"
    event = json.loads((stack.policy_path.parent / "audit.jsonl").read_text().splitlines()[-1])
    assert event["decision"] == "flag" and event["probe"] == "harmful-request" and "prompt" not in event
    metrics = httpx.get(stack.url + "/metrics").text
    assert 'probex_requests_total{decision="flag",probe="harmful-request",tenant="default"} 1.0' in metrics
    assert "probex_gateway_overhead_seconds_count" in metrics


def test_api_keys_tenants_and_admin_scores(tmp_path):
    policy = base_policy(api_keys={"k-alice": "alice"}, admin_keys=["k-admin"],
                         tenants={"alice": {"expose_scores": False}})
    s = start_stack(tmp_path, policy)
    try:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.post(s.url + "/v1/chat/completions", headers=headers, timeout=10,
                           json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert not (chat(client(s, "k-alice"), "hi").model_extra or {}).get("probex")
        admin_view = chat(client(s, "k-admin"), "hi")
        assert admin_view.model_extra["probex"]["scores"]["harmful-request"]["score"] == pytest.approx(0.05)
        assert httpx.post(s.url + "/admin/reload", headers={"Authorization": "Bearer k-alice"}).status_code == 401
    finally:
        s.stop()


def test_live_reload_from_file_changes_decisions_and_bad_files_keep_the_old_policy(stack):
    c = client(stack)
    assert chat(c, "hi").choices[0].finish_reason == "length"
    stack.write_policy(base_policy(rules=[{"probe": "harmful-request", "prompt": {"block": 0.01}}]))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            chat(c, "hi")
        except openai.BadRequestError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the edited policy never took effect")
    version = httpx.get(stack.url + "/admin/policy").json()["policy_version"]
    stack.policy_path.write_text("rules: [not: valid")
    r = httpx.post(stack.url + "/admin/reload")
    assert r.status_code == 400 and "not valid YAML" in r.json()["error"]["message"]
    assert httpx.get(stack.url + "/admin/policy").json()["policy_version"] == version
    assert 'probex_policy_reloads_total{result="error"}' in httpx.get(stack.url + "/metrics").text
    # A probe the worker refuses: the old policy stays as well.
    (stack.policy_path.parent / "probes" / "harmful-request").rename(stack.policy_path.parent / "probes" / "reject")
    stack.write_policy(base_policy(probes={"harmful-request": {"path": "probes/reject"}}))
    r = httpx.post(stack.url + "/admin/reload")
    assert r.status_code == 400 and "refused the probe set" in r.json()["error"]["message"]
    assert httpx.get(stack.url + "/admin/policy").json()["policy_version"] == version


def test_interior_probes_route_with_recompute(tmp_path):
    policy = base_policy(probes={"harmful-request": {"path": "probes/harmful-request"},
                                 "mean-probe": {"path": "probes/mean-probe"}},
                         rules=[{"probe": "mean-probe", "prompt": {"flag": 0.5}}])
    s = start_stack(tmp_path, policy, extra_probes=(("mean-probe", ReadPoint.PROMPT_MEAN),))
    try:
        chat(client(s), "hi")
        assert s.state.requests_seen[-1]["vllm_xargs"]["probex_recompute"] is True
        s.write_policy(base_policy())
        assert httpx.post(s.url + "/admin/reload").status_code == 200
        chat(client(s), "hi")
        assert "vllm_xargs" not in s.state.requests_seen[-1]
    finally:
        s.stop()


def test_bad_requests_get_openai_errors(stack):
    url = stack.url + "/v1/chat/completions"
    big = httpx.post(url, content=b"{" + b" " * 70_000 + b"}", headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert httpx.post(url, content=b"{nope").status_code == 400
    unknown = httpx.post(url, json={"model": "gpt-17", "messages": []})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_worker_down_fails_fast_with_502_and_ready_degrades(stack):
    stack.mock.stop()
    started = time.monotonic()
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=10,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code in (502, 504) and r.json()["error"]["code"] in ("upstream_unavailable", "upstream_timeout")
    assert time.monotonic() - started < 5
    deadline = time.monotonic() + 5
    while httpx.get(stack.url + "/ready").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    ready = httpx.get(stack.url + "/ready")
    assert ready.status_code == 503 and ready.json()["status"] == "degraded" and ready.json()["reasons"]


def test_retention_alarm_is_exported_and_degrades_ready(stack):
    stack.state.retention = {"harmful-request": 0.2}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if 'probex_calibration_alarm{probe="harmful-request"} 1.0' in httpx.get(stack.url + "/metrics").text:
            break
        time.sleep(0.2)
    else:
        pytest.fail("alarm never raised")
    ready = httpx.get(stack.url + "/ready").json()
    assert ready["status"] == "degraded" and "harmful-request" in ready["reasons"][0]


def test_policy_validation_messages(tmp_path):
    with pytest.raises(PolicyError, match="not listed under probes"):
        parse_policy(yaml.safe_dump({"rules": [{"probe": "x"}]}))
    with pytest.raises(PolicyError, match="above block threshold"):
        parse_policy("probes: {p: {path: nowhere}}\nrules: [{probe: p, prompt: {flag: 0.9, block: 0.5}}]\n")
    with pytest.raises(PolicyError, match="unknown tenant"):
        parse_policy("api_keys: {k1: ghost}\n")
    with pytest.raises(PolicyError, match="probe directory not found"):
        parse_policy("probes: {p: {path: /nonexistent}}\n")
    assert policy_json_schema()["title"] == "ProbeX gateway policy"


def test_flags_and_blocks_land_in_the_redis_stream(tmp_path, redis_server):
    import redis

    r = redis.Redis.from_url(redis_server.url(REDIS_DB))
    r.delete("probex:audit")
    s = start_stack(tmp_path, redis_url=redis_server.url(REDIS_DB))
    try:
        with pytest.raises(openai.BadRequestError):
            chat(client(s), "bomb")
        entries = r.xrange("probex:audit")
        assert len(entries) == 1
        fields = {k.decode(): v.decode() for k, v in entries[0][1].items()}
        assert fields["decision"] == "block" and fields["tenant"] == "default" and fields["policy_version"]
        assert json.loads(fields["scores"])["prompt"]["harmful-request"] == pytest.approx(0.95)
        assert json.loads(r.get("probex:policy_version"))["version"] == fields["policy_version"]
    finally:
        s.stop()


def test_redis_outage_buffers_audit_events_instead_of_dropping_them(tmp_path):
    s = start_stack(tmp_path, redis_url="redis://127.0.0.1:1/0")  # nothing listens on port 1
    try:
        for _ in range(3):
            with pytest.raises(openai.BadRequestError):
                chat(client(s), "bomb")
        metrics = httpx.get(s.url + "/metrics").text
        assert "probex_audit_backlog 3.0" in metrics
        assert 'probex_audit_events_total{result="retry",sink="redis"}' in metrics
    finally:
        s.stop()


def test_reload_under_load_fails_no_stream(tmp_path):
    import asyncio

    s = start_stack(tmp_path, tokens_per_s=40)
    try:
        async def scenario():
            async with httpx.AsyncClient(timeout=30) as http:
                async def one():
                    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                            "stream": True}
                    async with http.stream("POST", s.url + "/v1/chat/completions", json=body) as r:
                        assert r.status_code == 200
                        return [line async for line in r.aiter_lines() if line]

                streams = [asyncio.create_task(one()) for _ in range(8)]
                await asyncio.sleep(0.05)
                s.write_policy(base_policy(rules=[{"probe": "harmful-request", "prompt": {"block": 0.01}}]))
                results = await asyncio.gather(*streams)
                return results

        results = asyncio.run(scenario())
        assert all(lines[-1] == "data: [DONE]" for lines in results)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if httpx.post(s.url + "/v1/chat/completions", timeout=10,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}).status_code == 400:
                break
            time.sleep(0.05)
        else:
            pytest.fail("new policy not applied")
    finally:
        s.stop()


def test_odd_bodies_routes_and_methods_get_openai_errors(stack):
    """Bodies nested too deeply for the standard library's parser (which the gateway falls back
    to, and re-encodes with), unknown routes, wrong methods and a non-boolean `stream` (which
    the worker would read as false) are 4xx OpenAI errors, not 500s or an empty stream."""
    url = stack.url + "/v1/chat/completions"
    http = httpx.Client(timeout=10)
    nested = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    opening = json.dumps(nested)[:-1]  # the body without its closing brace, to add odd fields to

    def with_field(text: str) -> bytes:
        return (opening + ", " + text + "}").encode()

    for body in (b"[" * 1100 + b"]" * 1100,  # too deep for either parser
                 with_field('"metadata": ' + "[" * 990 + "]" * 990),  # orjson takes it, the standard library would not
                 with_field('"temperature": NaN, "metadata": ' + "[" * 990 + "]" * 990)):  # the standard library's to parse
        r = http.post(url, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "nested deeper than" in r.json()["error"]["message"], r.text
    r = http.post(url, content=with_field('"metadata": ' + "[" * 200 + "]" * 200), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text  # nested, within the limit: served
    missing = http.post(stack.url + "/v1/embeddings", json={})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = http.get(url)
    assert wrong.status_code == 405 and "POST" in wrong.headers["allow"] and "message" in wrong.json()["error"]
    for value in ("false", "true", 1, 0, []):
        r = http.post(url, json={**nested, "stream": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream", (value, r.text)
    assert http.post(url, json={**nested, "stream": False}).status_code == 200


def test_a_caller_hanging_up_on_a_whole_response_aborts_the_worker_request(tmp_path):
    """vLLM stops a non-streaming request whose caller left; behind the gateway the caller is
    the gateway, which must hang up too, or the worker generates up to max_tokens for nobody."""
    s = start_stack(tmp_path, tokens_per_s=10)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 100}  # 10 s
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
        deadline = time.monotonic() + 5
        while s.state.aborted == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.state.aborted == 1
        counted = 'probex_requests_total{decision="allow",probe="",tenant="default"} 1.0'
        while time.monotonic() < deadline:
            if counted in (metrics := httpx.get(s.url + "/metrics").text):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the abandoned request was never accounted")
        # the half second spent waiting for the worker is not the gateway's own time
        overhead = float(metrics.split("probex_gateway_overhead_seconds_sum ")[1].split()[0])
        assert overhead < 0.25
        # the gateway goes on serving
        quick = httpx.post(s.url + "/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=10)
        assert quick.status_code == 200
    finally:
        s.stop()


def test_fuzzed_bodies_never_cause_a_500(stack):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
        max_leaves=12,
    )
    bodies = st.one_of(
        st.binary(max_size=200),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.fixed_dictionaries({"model": st.just(MODEL) | st.text(max_size=8)},
                              optional={"messages": json_values, "stream": json_values, "max_tokens": json_values,
                                        "vllm_xargs": json_values, "prompt": json_values}).map(
            lambda d: json.dumps(d).encode()),
    )
    http = httpx.Client(timeout=10)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    def check(body, path):
        r = http.post(stack.url + path, content=body, headers={"content-type": "application/json"})
        assert r.status_code < 500, (body, r.status_code, r.text)
        if r.status_code >= 400:
            assert "error" in r.json()

    check()


def _stack_in_front_of(tmp_path, upstream_app, **config):
    """A gateway in front of an arbitrary upstream ASGI app (same policy as the mock stack)."""
    from gateway.app import GatewayConfig, create_app
    from gateway.metrics import GatewayMetrics
    from gateway.serving import ServerThread
    from tests.gateway_fixtures import write_probe

    write_probe(tmp_path / "probes", "harmful-request")
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(base_policy()))
    upstream = ServerThread(upstream_app).start()
    settings = dict(policy_path=tmp_path / "policy.yaml", upstreams=[upstream.url], audit_path=tmp_path / "audit.jsonl",
                    upstream_timeout_s=5, connect_timeout_s=1, health_interval_s=0.5)
    settings.update(config)
    gateway = ServerThread(create_app(GatewayConfig(**settings), GatewayMetrics())).start()
    return gateway, upstream


def test_client_disconnect_mid_stream_aborts_upstream_and_accounts(tmp_path):
    s = start_stack(tmp_path, tokens_per_s=10)
    try:
        # 10 s of stream: still running when the client hangs up, however loaded the machine
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 100, "stream": True}
        with httpx.Client(timeout=10) as http:
            with http.stream("POST", s.url + "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"content":""' not in line.replace(" ", ""):
                        break  # first content chunk: hang up
        deadline = time.monotonic() + 5
        while s.state.aborted == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.state.aborted == 1
        while time.monotonic() < deadline:
            metrics = httpx.get(s.url + "/metrics").text
            if 'probex_requests_total{decision="allow",probe="",tenant="default"} 1.0' in metrics:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the abandoned stream was never accounted")
    finally:
        s.stop()


def test_finished_streams_reuse_the_upstream_connection(tmp_path):
    s = start_stack(tmp_path, tokens_per_s=0)
    try:
        c = client(s)
        for _ in range(5):
            assert "".join(ch.choices[0].delta.content or "" for ch in chat(c, "hi", stream=True) if ch.choices)
        chat(c, "hi")
        ports = s.state.client_ports
        assert len(ports) == 6 and len(set(ports)) == 1, ports
    finally:
        s.stop()


def test_worker_5xx_is_502_client_errors_pass_through_and_timeouts_are_504(tmp_path):
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def completions(request):
        body = await request.json()
        if body["max_tokens"] == 1:
            return JSONResponse({"error": {"message": "worker exploded"}}, status_code=500)
        if body["max_tokens"] == 2:
            return JSONResponse({"error": {"message": "bad max_tokens", "type": "BadRequestError"}}, status_code=400)
        await asyncio.sleep(2)
        return Response(status_code=200)

    app = Starlette(routes=[Route("/health", lambda r: Response()),
                            Route("/v1/models", lambda r: JSONResponse({"data": [{"id": MODEL}]})),
                            Route("/v1/chat/completions", completions, methods=["POST"])])
    gateway, upstream = _stack_in_front_of(tmp_path, app, upstream_timeout_s=0.3)
    try:
        for stream in (False, True):
            def post(max_tokens):
                return httpx.post(gateway.url + "/v1/chat/completions", timeout=10,
                                  json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                        "max_tokens": max_tokens, "stream": stream})

            r = post(1)
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
            assert "worker exploded" in r.json()["error"]["message"]
            r = post(2)
            assert r.status_code == 400 and r.json()["error"]["message"] == "bad max_tokens"
            assert r.headers["x-probex-decision"] == "allow"
            r = post(3)
            assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        metrics = httpx.get(gateway.url + "/metrics").text
        assert 'kind="http_500"' in metrics and 'kind="timeout"' in metrics
    finally:
        gateway.stop()
        upstream.stop()


def test_unpaired_surrogates_are_refused_before_the_worker(stack):
    """JSON's \\u escapes can spell a lone surrogate, which is not Unicode: vLLM fails a request with one in
    a stop string with a 500 (found by tests/test_fuzz_stack.py), so the gateway refuses such bodies with a
    400 wherever the surrogate sits, and forwards a surrogate pair (one character) as before."""
    url = stack.url + "/v1/chat/completions"
    head = '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2' % MODEL
    seen = len(stack.state.requests_seen)
    for extra in (', "stop": "\\ud800"', ', "stop": ["a", "b\\udc00c"]', ', "user": "\\uDFFF"',
                  ', "metadata": {"\\ud800": 1}', ', "temperature": NaN, "stop": "\\ud800"'):
        for stream in (False, True):
            body = (head + extra + ', "stream": %s}' % json.dumps(stream)).encode()
            r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=10)
            assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], (body, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
    assert len(stack.state.requests_seen) == seen  # none reached the worker
    paired = (head + ', "stop": "\\ud83d\\ude00"}').encode()
    r = httpx.post(url, content=paired, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 200 and stack.state.requests_seen[-1]["stop"] == "\U0001F600"


def test_request_bodies_reach_the_worker_exactly(stack):
    big = 123456789012345678901234567890
    raw = ('{"model": "%s", "messages": [{"role": "user", "content": "caf\\u00e9 \\ud83d\\ude00"}], "max_tokens": 2, '
           '"seed": %d, "temperature": 0.1000000000000000055511151231257827}' % (MODEL, big)).encode()
    r = httpx.post(stack.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200
    seen = stack.state.requests_seen[-1]
    assert seen["seed"] == big and seen["messages"][0]["content"] == "caf\u00e9 \U0001F600"
    # What only the standard library parses (a NaN literal) is still accepted and forwarded.
    with_nan = raw.replace(b"0.1000000000000000055511151231257827", b"NaN")
    r = httpx.post(stack.url + "/v1/chat/completions", content=with_nan, headers={"content-type": "application/json"})
    assert r.status_code == 200 and stack.state.requests_seen[-1]["seed"] == big


def test_stream_judge_matches_merging_per_chunk_verdicts():
    import random

    from gateway.decisions import StreamJudge, judge_generated, judge_prompt
    from gateway.policy import Rule, TenantView, Thresholds

    rng = random.Random(7)
    probes = ["a", "b", "c"]
    for _ in range(2000):
        rules = []
        for _ in range(rng.randint(0, 4)):
            flag, block = sorted(rng.random() for _ in range(2))
            rules.append(Rule(probe=rng.choice(probes), prompt=Thresholds(flag=0.5),
                              generated=Thresholds(flag=rng.choice([None, flag]), block=rng.choice([None, block]))))
        tenant = TenantView("t", tuple(rules), "error", False)
        prompt = {"scores": {p: {"score": rng.random()} for p in probes if rng.random() < 0.7}}
        reference = start = judge_prompt(tenant, prompt, fail_closed=rng.random() < 0.3)
        judge = StreamJudge(tenant, start)
        for _ in range(rng.randint(0, 6)):
            chunk = {p: [rng.choice([None, rng.random()]) for _ in range(rng.randint(1, 3))]
                     for p in probes if rng.random() < 0.8}
            step = judge_generated(tenant, chunk)
            reference = reference.merge(step)
            assert judge.step(chunk) is step.decision
            got = judge.verdict
            assert (got.decision, got.probe, got.phase, got.scores) == \
                (reference.decision, reference.probe, reference.phase, reference.scores)


def steer_policy(**steer) -> dict:
    return base_policy(rules=[{"probe": "harmful-request", "prompt": {"flag": 0.5, "block": 0.9},
                               "generated": {"flag": 0.5, "block": 0.6},
                               "steer": {"vector": "refusal18", "alpha": 6.0, **steer}}])


def test_steer_rule_forwards_gated_steering_and_counts_steer_instead_of_block(tmp_path):
    s = start_stack(tmp_path, dict(steer_policy(), admin_keys=["k-admin"]))
    try:
        c = client(s)
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "how to build a bomb"}], max_tokens=4)
        assert raw.headers["x-probex-decision"] == "steer"  # would have been a block
        assert raw.parse().choices[0].message.content  # relayed, not refused
        xargs = s.state.requests_seen[-1]["vllm_xargs"]
        assert xargs == {"probex_steer": "refusal18", "probex_steer_alpha": 6.0, "probex_steer_window": "all",
                         "probex_steer_gate": "harmful-request", "probex_steer_threshold": 0.9}
        benign = client(s, "k-admin").chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_body={"vllm_xargs": {"probex_steer": "client-choice", "probex_steer_alpha": 99,
                                       "probex_steer_layer": 3}})
        assert benign.headers["x-probex-decision"] == "allow"
        # The policy's steering, none of the client's keys (an admin may send them; the policy still wins)
        assert s.state.requests_seen[-1]["vllm_xargs"] == xargs
        # Mid-stream crossing: the stream is relayed to its end (steered, not cut).
        chunks = list(chat(c, "please escalate", stream=True))
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
        metrics = httpx.get(s.url + "/metrics").text
        assert 'probex_requests_total{decision="steer",probe="harmful-request",tenant="default"} 2.0' in metrics
    finally:
        s.stop()


def test_ungated_steer_steers_every_request_and_policy_checks_steer_rules(tmp_path):
    s = start_stack(tmp_path, steer_policy(gated=False, window="generation"))
    try:
        raw = client(s).chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert raw.headers["x-probex-decision"] == "steer"
        xargs = s.state.requests_seen[-1]["vllm_xargs"]
        assert "probex_steer_gate" not in xargs and xargs["probex_steer_window"] == "generation"
    finally:
        s.stop()
    two = base_policy(probes={"a": {"path": "x"}, "b": {"path": "y"}},
                      rules=[{"probe": p, "steer": {"vector": "v", "alpha": 1.0, "threshold": 0.5}} for p in "ab"])
    with pytest.raises(PolicyError, match="at most one rule per rule set may steer"):
        parse_policy(yaml.safe_dump(two))
    with pytest.raises(PolicyError, match="gated steer needs steer.threshold"):
        parse_policy("probes: {p: {path: x}}\nrules: [{probe: p, steer: {vector: v, alpha: 1.0}}]\n")
    with pytest.raises(PolicyError, match="finite"):
        parse_policy("probes: {p: {path: x}}\nrules: [{probe: p, steer: {vector: v, alpha: .nan, threshold: 0.5}}]\n")


# -- the completion routes' HTTP client (gateway.upstream_http) against scripted servers -------


def _scripted_server(answers):
    """A TCP server answering the n-th request it reads with answers[n] (bytes; None: close without answering)."""
    import asyncio

    seen: list[bytes] = []

    async def start():
        async def handle(reader, writer):
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
                    return  # the client went away, or the test is over
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                seen.append(head + await reader.readexactly(length))
                answer = answers[len(seen) - 1]
                if answer is None:
                    writer.close()
                    return
                if callable(answer):
                    await answer(writer)
                    return
                writer.write(answer)
                await writer.drain()

        return await asyncio.start_server(handle, "127.0.0.1", 0)

    return start, seen


def _client_run(answers, scenario, read_timeout=2.0):
    import asyncio

    from gateway.upstream_http import UpstreamClient

    start, seen = _scripted_server(answers)

    async def main():
        server = await start()
        url = "http://127.0.0.1:%d" % server.sockets[0].getsockname()[1]
        client = UpstreamClient(connect_timeout=1.0, read_timeout=read_timeout)
        try:
            return await scenario(client, url)
        finally:
            client.close()
            server.close()

    return asyncio.run(main()), seen


_CHUNKED = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            b"7\r\ndata: 1\r\n6\r\n\n\ndata\r\n4\r\n: 2\n\r\n1\r\n\n\r\n0\r\n\r\n")


def test_upstream_client_reads_chunked_and_sized_bodies_and_reuses_the_connection():
    sized = b'HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 9\r\n\r\n{"a": 1} '

    async def scenario(client, url):
        first = await client.post(url, "/v1/chat/completions", b'{"x": 1}')
        status1, body1 = first.status, await first.read()
        first.release()
        second = await client.post(url, "/v1/completions", b"{}")
        status2, body2 = second.status, await second.read()
        second.release()
        return status1, body1, status2, body2, len(client.origins[url].idle)

    (status1, body1, status2, body2, idle), seen = _client_run([_CHUNKED, sized], scenario)
    assert (status1, body1) == (200, b"data: 1\n\ndata: 2\n\n")
    assert (status2, body2) == (404, b'{"a": 1} ')
    assert idle == 1 and len(seen) == 2  # both requests on one connection
    assert seen[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n") and seen[0].endswith(b'\r\n\r\n{"x": 1}')


def test_upstream_client_sends_again_when_an_idle_connection_was_closed():
    async def scenario(client, url):
        first = await client.post(url, "/v1/completions", b"{}")
        await first.read()
        first.release()
        second = await client.post(url, "/v1/completions", b"{}")  # the server closes: sent again, new connection
        return second.status, await second.read()

    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    (status, body), seen = _client_run([ok, None, ok], scenario)
    assert (status, body) == (200, b"ok") and len(seen) == 3


def test_a_hang_up_heard_after_the_answer_is_in_leaves_the_pooled_connection_alone():
    """The watch is stopped before the connection goes back to the pool; a disconnect whose
    receive completed in the same loop turn must not close it under the next request."""
    import asyncio

    from gateway.completions import CallerWatch

    class Conn:
        abandoned = 0

        def abandon(self):
            self.abandoned += 1

    async def scenario():
        hung_up, spoken = Conn(), Conn()
        heard = asyncio.get_running_loop().create_future()
        watch = CallerWatch(lambda: heard, spoken)
        heard.set_result({"type": "http.disconnect"})  # its callbacks are scheduled, not yet run
        watch.stop()
        live = CallerWatch(lambda: asyncio.sleep(0, {"type": "http.disconnect"}), hung_up)
        await asyncio.sleep(0.01)
        live.stop()
        return spoken.abandoned, hung_up.abandoned

    assert asyncio.run(scenario()) == (0, 1)


async def _never_answer(writer):
    import asyncio

    await asyncio.sleep(5)


async def _second_request_on_the_pooled_connection(client, url):
    """A first request answered and its connection pooled, then a second sent on it: its connection."""
    first = await client.post(url, "/v1/completions", b"{}")
    await first.read()
    first.release()
    return await client.send(url, "/v1/completions", b"{}")


def test_the_hang_up_watch_follows_a_request_sent_again_on_a_fresh_connection():
    """A stale pooled connection sends the request again on a new one: a caller hanging up
    after that must abandon the new connection, not the dead one."""
    import asyncio

    from gateway.completions import CallerWatch
    from gateway.upstream_http import UpstreamAbandoned

    async def scenario(client, url):
        conn = await _second_request_on_the_pooled_connection(client, url)  # which the server closes
        hang_up = asyncio.get_running_loop().create_future()
        watch = CallerWatch(lambda: hang_up, conn)
        asyncio.get_running_loop().call_later(0.3, hang_up.set_result, {"type": "http.disconnect"})
        started = time.monotonic()
        with pytest.raises(UpstreamAbandoned):
            await client.response(conn, watch.follow)
        watch.stop()
        return time.monotonic() - started

    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    waited, seen = _client_run([ok, None, _never_answer], scenario, read_timeout=4.0)
    assert len(seen) == 3 and waited < 2.0  # sent again once, then abandoned, not read to the timeout


def test_an_abandoned_request_on_a_reused_connection_is_not_sent_again():
    """A caller gone before the head closes the connection on purpose: unlike a keep-alive
    connection the worker closed, it must not count as stale and carry the request again."""
    import asyncio

    from gateway.upstream_http import UpstreamAbandoned

    async def scenario(client, url):
        conn = await _second_request_on_the_pooled_connection(client, url)
        asyncio.get_running_loop().call_later(0.1, conn.abandon)
        with pytest.raises(UpstreamAbandoned):
            await client.response(conn)
        await asyncio.sleep(0.3)  # time for a second send, were there one

    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    _, seen = _client_run([ok, _never_answer, ok], scenario)
    assert len(seen) == 2


def test_upstream_client_replaces_an_idle_connection_whose_transport_is_already_dead():
    # uvloop can close a reset connection's handle before `connection_lost` reaches the
    # protocol: the pooled connection still looks usable, and writing to it raises.
    async def scenario(client, url):
        first = await client.post(url, "/v1/completions", b"{}")
        await first.read()
        first.release()
        pooled = client.origins[url].idle[-1]

        def dead_write(data):
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

        pooled.transport.write = dead_write
        second = await client.post(url, "/v1/completions", b"{}")
        return second.status, await second.read(), second is pooled

    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    (status, body, reused_dead), seen = _client_run([ok, ok], scenario)
    assert (status, body) == (200, b"ok") and not reused_dead and len(seen) == 2


def test_upstream_client_errors_timeouts_and_connection_close():
    import asyncio

    from gateway.upstream_http import UpstreamError, UpstreamTimeout

    async def hang(writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await asyncio.sleep(5)

    async def timeout_scenario(client, url):
        response = await client.post(url, "/v1/completions", b"{}")
        assert await response.readany() == b"abc"
        with pytest.raises(UpstreamTimeout):
            await response.readany()
        response.close()
        return True

    assert _client_run([hang], timeout_scenario, read_timeout=0.3)[0]

    async def eof_body(writer):  # no length: the body ends with the connection, which is not reused
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
        await writer.drain()
        writer.close()

    async def eof_scenario(client, url):
        response = await client.post(url, "/v1/completions", b"{}")
        body = await response.read()
        response.release()
        return body, len(client.origins[url].idle)

    assert _client_run([eof_body], eof_scenario)[0] == (b"until the end", 0)

    async def garbage_scenario(client, url):
        with pytest.raises(UpstreamError):
            await client.post(url, "/v1/completions", b"{}")
        return True

    assert _client_run([b"SMTP ready\r\n\r\n"], garbage_scenario)[0]

    async def refused(client, url):
        with pytest.raises(UpstreamError, match="cannot connect"):
            await client.post("http://127.0.0.1:1", "/v1/completions", b"{}")
        return True

    assert _client_run([], refused)[0]


def test_bench_load_generator_reads_streams_and_mock_timestamps(tmp_path):
    import asyncio

    from tests.fixtures.mock_upstream import MockState, create_mock_app
    from gateway.serving import ServerThread
    from bench.gateway import _one_stream, _request_bytes, _Stream

    mock = ServerThread(create_mock_app(MockState(["harmful-request"], 0, timestamps=True))).start()
    port = int(mock.url.rsplit(":", 1)[1])
    try:
        async def main():
            _, conn = await asyncio.get_running_loop().create_connection(_Stream, "127.0.0.1", port)
            try:
                return [await _one_stream(conn, _request_bytes(port, 5, 1000.0), 5) for _ in range(2)]
            finally:
                conn.transport.close()

        for sample in asyncio.run(main()):
            assert len(sample["deliveries"]) == 5 and len(sample["gaps"]) == 4
            assert 0 < sample["transit"] <= sample["ttft"] and all(0 < d < 1 for d in sample["deliveries"])
            assert sample["total"] >= 4 / 1000.0  # paced at 1000 tokens/s
    finally:
        mock.stop()
