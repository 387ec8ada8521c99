"""Forced recompute on SGLang (engine_worker/sglang/recompute.py) with a stand-in `Req`
shaped like SGLang 0.5.14's: only the flagged request reads no radix-cache prefix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine_worker.sglang.recompute import max_prefix_len, patch_req_class, wants_recompute


class FakeReq:
    """`_compute_max_prefix_len` as 0.5.14 writes it: input_len - 1, capped at the logprob start."""

    def __init__(self, custom_params=None, return_logprob=False, logprob_start_len=-1):
        self.sampling_params = SimpleNamespace(custom_params=custom_params)
        self.return_logprob, self.logprob_start_len = return_logprob, logprob_start_len

    def _compute_max_prefix_len(self, input_len: int) -> int:
        limit = input_len - 1
        if self.return_logprob and self.logprob_start_len >= 0:
            limit = min(limit, self.logprob_start_len)
        return max(limit, 0)


@pytest.mark.parametrize("params, wanted", [
    ({"probex_recompute": True}, True), ({"probex_recompute": 1}, True), ({"probex_recompute": "true"}, True),
    ({"probex_recompute": "1"}, True), ({"probex_recompute": False}, False), ({"probex_recompute": 0}, False),
    ({"probex_recompute": "false"}, False), ({}, False), (None, False), ("probex_recompute", False),
    ({"probex_recompute": [1]}, False),
])
def test_which_custom_params_ask_for_a_recompute(params, wanted):
    assert wants_recompute(params) is wanted


def test_the_decision_keeps_the_engines_limit_for_other_requests():
    assert max_prefix_len(9, FakeReq({"probex_recompute": 1})) == 0
    assert max_prefix_len(9, FakeReq({"other": 1})) == 9
    assert max_prefix_len(9, SimpleNamespace()) == 9  # no sampling params at all


def test_patched_class_reads_no_prefix_for_the_flagged_request_only():
    class Req(FakeReq):
        pass

    assert patch_req_class(Req) is True
    assert patch_req_class(Req) is False  # idempotent
    flagged = Req({"probex_recompute": 1, "__req__": object()})
    plain = Req({"__req__": object()})
    logprobs = Req(None, return_logprob=True, logprob_start_len=3)
    assert flagged._compute_max_prefix_len(12) == 0
    assert plain._compute_max_prefix_len(12) == 11
    assert logprobs._compute_max_prefix_len(12) == 3
    assert FakeReq({"probex_recompute": 1})._compute_max_prefix_len(12) == 11  # the base class is untouched
