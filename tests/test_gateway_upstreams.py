"""The gateway's health checks: a busy worker is not taken out for one late answer; a gone one is at once."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.metrics import GatewayMetrics
from gateway.upstreams import UNHEALTHY_AFTER_CHECKS, NoHealthyUpstream, UpstreamPool

URL = "http://worker-a:8100"


class Worker:
    """A worker's health routes, answering as told: "ok", "late" (read timeout), "500", or "gone" (refused)."""

    def __init__(self) -> None:
        self.answers: list[str] = []
        self.now = "ok"  # the answer of the check under way (its /health and its /v1/models)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            self.now = self.answers.pop(0) if self.answers else "ok"
        answer = self.now
        if answer == "gone":
            raise httpx.ConnectError("connection refused", request=request)
        if answer == "late":
            raise httpx.ReadTimeout("no answer within 2 s", request=request)
        if answer == "500":
            return httpx.Response(500, json={"error": "busy"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200)


def run_checks(worker: Worker, answers: list[str]) -> list[bool]:
    """The pool's view of the worker after each of the health checks answered by `answers`."""

    async def go() -> list[bool]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(worker)) as client:
            pool = UpstreamPool([URL], client, GatewayMetrics())
            worker.answers = list(answers)
            seen = []
            for _ in answers:
                await pool.check_all()
                seen.append(pool.upstreams[0].healthy)
            return seen

    return asyncio.run(go())


def test_a_worker_late_to_answer_stays_in_until_it_misses_several_checks_in_a_row():
    misses = ["late"] * (UNHEALTHY_AFTER_CHECKS - 1)
    assert run_checks(Worker(), [*misses, "ok", *misses, "ok"]) == [True] * (2 * len(misses) + 2)
    mixed = ["late", "500"] * UNHEALTHY_AFTER_CHECKS  # late answers and error statuses count together
    assert run_checks(Worker(), mixed[:UNHEALTHY_AFTER_CHECKS])[-1] is False


@pytest.mark.parametrize("failure", ["late", "500"])
def test_a_worker_that_keeps_failing_its_checks_is_taken_out_and_one_pass_brings_it_back(failure):
    answers = [failure] * UNHEALTHY_AFTER_CHECKS + ["ok"]
    seen = run_checks(Worker(), answers)
    assert seen == [True] * (UNHEALTHY_AFTER_CHECKS - 1) + [False, True]


def test_a_worker_that_refuses_connections_is_taken_out_at_once():
    assert run_checks(Worker(), ["gone", "ok"]) == [False, True]


def test_requests_are_refused_while_no_worker_is_in():
    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(Worker())) as client:
            pool = UpstreamPool([URL], client, GatewayMetrics())
            pool.upstreams[0].healthy = False
            with pytest.raises(NoHealthyUpstream):
                pool.pick()

    asyncio.run(go())
