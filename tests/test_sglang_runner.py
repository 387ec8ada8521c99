"""The SGLang adapter's hooks (engine_worker/sglang/runner.py, controls.py) against stand-ins
that follow SGLang 0.5.14's call order: the overlap scheduler's loop (launch step N, then
process step N-1), the normal loop, the engine RPC and the mid-forward hook."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from engine_worker.sglang import runner as sgl
from engine_worker.sglang.controls import answer
from engine_worker.tap.config import TapConfig
from engine_worker.tap.layer import LayerTap
from tests.fixtures.sglang_standins import Mode


class Req:
    def __init__(self, rid, prompt, custom_params=None):
        self.rid, self.origin_input_ids = rid, list(range(prompt))
        self.sampling_params = SimpleNamespace(custom_params=custom_params)
        self.finished_reason = None

    def finished(self):
        return self.finished_reason is not None


def prefill(reqs):
    lens = [len(r.origin_input_ids) for r in reqs]
    return SimpleNamespace(forward_mode=Mode("EXTEND"), reqs=list(reqs), prefix_lens=[0] * len(reqs),
                           extend_lens=lens, extend_num_tokens=sum(lens), seq_lens_cpu=np.array(lens))


def decode(reqs, seq_lens):
    return SimpleNamespace(forward_mode=Mode("DECODE"), reqs=list(reqs), seq_lens_cpu=np.array(seq_lens),
                           input_ids=None)


class RecordingController:
    def __init__(self, taps=(1,)):
        self.calls = []
        self.taps = {layer: None for layer in taps}
        self.needs_view_before_forward = False
        self.reads_scores = True

    def before_forward(self, view, capture, steering=None):
        self.calls.append(("before", list(view.req_ids), sorted(capture)))

    def open_mid_forward_copies(self, rows):
        self.calls.append(("open", rows))

    def close_mid_forward_copies(self, launched=True):
        self.calls.append(("close", launched))

    def layer_scores_final(self, layer):
        self.calls.append(("final", layer))

    def after_forward(self, view):
        self.calls.append(("after", list(view.req_ids), view.num_computed.tolist(), list(view.finished)))

    def after_idle_step(self, finished):
        self.calls.append(("idle", list(finished)))


def make_scheduler_class():
    class Scheduler:
        """What the adapter reads of SGLang's Scheduler: `run_batch` numbers the batch,
        `process_batch_result` finishes the requests `ends` names for that step."""

        enable_overlap = True

        def __init__(self, runner, ends=None):
            self.tp_worker = SimpleNamespace(model_runner=runner)
            self.forward_ct = 0
            self.ends = ends or {}

        def run_batch(self, batch):
            self.forward_ct += 1
            batch.forward_iter = self.forward_ct
            return SimpleNamespace(step=self.forward_ct)

        def process_batch_result(self, batch, result):
            for req in batch.reqs:
                if req.rid in self.ends.get(batch.forward_iter, ()) and not req.finished():
                    req.finished_reason = "stop"

        def set_internal_state(self, recv_req):
            return "sglang's own answer"

    assert sgl.patch_scheduler_class(Scheduler, rpc_output=lambda result: result)
    assert not sgl.patch_scheduler_class(Scheduler)
    return Scheduler


class Runner:
    """A model runner stand-in (weakly referable, as SGLang's ModelRunner is)."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


def attached(controller):
    runner = Runner()
    sgl._STATES[runner] = sgl.RunnerState(controller)
    return runner


def steps(controller):
    return [c for c in controller.calls if c[0] in ("after", "idle")]


def test_overlap_loop_hands_each_step_over_after_the_previous_results_and_drops_overshoot():
    controller = RecordingController()
    runner = attached(controller)
    a, b = Req("a", 3), Req("b", 2)
    # a ends with its first token (step 1); b with its second (step 2).
    scheduler = make_scheduler_class()(runner, ends={1: {"a"}, 2: {"b"}})
    queue, last = [], None
    for batch in [prefill([a, b]), decode([a, b], [4, 3]), decode([b], [4]), None]:
        if batch is not None:  # the overlap loop: launch this step, then process the last one
            queue.append((batch, scheduler.run_batch(batch)))
        if last is not None:
            scheduler.process_batch_result(*queue.pop(0))
        last = batch
    assert controller.calls[:2] == [("open", 5), ("close", True)]
    assert steps(controller) == [
        ("after", ["a", "b"], [0, 0], []),
        ("after", ["a", "b"], [3, 2], ["a"]),  # a ran past its end: released, its row dropped
        ("after", ["b"], [3], ["b"]),
    ]


def test_normal_loop_hands_each_step_over_before_its_results_and_ends_go_at_once():
    controller = RecordingController()
    runner = attached(controller)
    a, b = Req("a", 3), Req("b", 2)
    scheduler = make_scheduler_class()(runner, ends={1: {"a"}, 2: {"b"}})
    scheduler.enable_overlap = False
    for batch in [prefill([a, b]), decode([b], [3])]:
        scheduler.process_batch_result(batch, scheduler.run_batch(batch))
    assert steps(controller) == [("after", ["a", "b"], [0, 0], []), ("idle", ["a"]),
                                 ("after", ["b"], [2], []), ("idle", ["b"])]


def test_capture_requests_are_staged_before_the_forward():
    controller = RecordingController()
    controller.needs_view_before_forward = True
    runner = attached(controller)
    scheduler = make_scheduler_class()(runner)
    scheduler.run_batch(prefill([Req("a", 2, {"probex_capture": 1}), Req("b", 2)]))
    assert controller.calls[0] == ("before", ["a", "b"], ["a"])


def test_a_failed_forward_gives_its_reserved_entry_back():
    controller = RecordingController()
    runner = attached(controller)
    cls = make_scheduler_class()
    scheduler = cls(runner)

    def broken(self, batch):
        raise RuntimeError("the forward failed")

    scheduler.run_batch = sgl._run_batch(broken).__get__(scheduler)
    with pytest.raises(RuntimeError, match="the forward failed"):
        scheduler.run_batch(prefill([Req("a", 2)]))
    assert controller.calls == [("open", 2), ("close", False)]
    assert runner and sgl.state_of(runner).sequence.pending is None


def test_schedulers_without_a_tap_are_left_alone():
    scheduler = make_scheduler_class()(Runner())
    batch = prefill([Req("a", 2)])
    result = scheduler.run_batch(batch)
    assert result.step == 1 and scheduler.process_batch_result(batch, result) is None
    assert scheduler.set_internal_state(SimpleNamespace(server_args={"pp_max_micro_batch_size": 2})) \
        == "sglang's own answer"


def test_engine_rpc_hands_the_waiting_step_over_first_then_answers():
    controller = RecordingController()
    runner = attached(controller)
    scheduler = make_scheduler_class()(runner)
    scheduler.run_batch(prefill([Req("a", 2)]))
    assert steps(controller) == []
    answered = scheduler.set_internal_state(SimpleNamespace(server_args={sgl.RPC_KEY: {"method": "nope"}}))
    assert answered == {"ok": False, "error": "unknown ProbeX call 'nope'"}
    assert steps(controller) == [("after", ["a"], [0], [])]


class ControlledStub:
    def __init__(self):
        self.paused, self.pause_changes, self.vector_version = False, 0, 0
        self.table = SimpleNamespace(version=3)

    def listing(self):
        return {"version": self.table.version, "paused": self.paused}

    def set_paused(self, paused):
        self.paused, self.pause_changes = paused, self.pause_changes + 1

    def load(self, dirs):
        from engine_worker.tap.controller import ProbeSetRejected

        raise ProbeSetRejected(f"bad set {dirs}")

    def steering_listing(self):
        return {"version": 0, "steer_layers": [], "vectors": []}


def test_rpc_answers_as_the_vllm_worker_extension_does():
    stub = ControlledStub()
    assert answer(stub, {"method": "probex_list_probes"}) == {"version": 3, "paused": False}
    assert answer(stub, {"method": "probex_set_paused", "args": [True]}) == {"ok": True, "paused": True,
                                                                             "sequence": 1}
    assert answer(stub, {"method": "probex_load_probes", "args": [["/x"]]}) == {
        "ok": False, "error": "bad set ['/x']", "version": 3}
    assert answer(stub, {"method": "probex_load_steering", "args": [["/v"]]})["error"] == \
        "steering is not available on SGLang"
    assert answer(None, {"method": "probex_list_probes"})["ok"] is False
    assert answer(stub, {"method": "probex_set_paused"})["ok"] is False  # a missing argument is an answer


def test_mid_forward_hook_fires_before_the_next_layers_attention():
    controller = RecordingController(taps=(1, 3))
    runner = attached(controller)

    class Backend:
        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            return ("attention", layer.layer_id)

    backend, other = Backend(), Backend()
    assert sgl.hook_mid_forward(runner, backend) == [1, 3]
    assert backend.forward(None, None, None, SimpleNamespace(layer_id=2), None) == ("attention", 2)
    backend.forward(None, None, None, SimpleNamespace(layer_id=1), None)
    backend.forward(None, None, None, SimpleNamespace(layer_id=4), None)
    other.forward(None, None, None, SimpleNamespace(layer_id=2), None)  # another runner's backend
    assert controller.calls == [("final", 1), ("final", 3)]
    assert sgl.hook_mid_forward(Runner(), Backend()) == []  # no tap on that runner


class TinyModel(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.taps = nn.ModuleList([LayerTap(layer, 4, 2, 16, device="meta") for layer in layers])


def test_install_gives_the_buffers_storage_and_refuses_missing_layers(tmp_path):
    runner = Runner(model=TinyModel([1]), device="cuda", tp_rank=0, dtype=None,
                             model_config=SimpleNamespace(hf_config=SimpleNamespace(hidden_size=4,
                                                                                    num_hidden_layers=3),
                                                          model_path=str(tmp_path)))
    rings = []
    state = sgl.install_controller(runner, TapConfig(layers=(1,)), start_ring=lambda c, t: rings.append(t))
    tap = runner.model.taps[0]
    assert not tap.scores.is_meta and tap.scores.device.type == "cpu" and float(tap.scores.abs().sum()) == 0
    assert rings == [{1: tap}] and state.controller.taps == {1: tap}
    assert sgl.install_controller(runner, TapConfig(layers=(1,))) is state  # once per runner
    other = Runner(model=TinyModel([1]), model_config=runner.model_config)
    with pytest.raises(RuntimeError, match=r"layers \[2\] were asked to be tapped"):
        sgl.install_controller(other, TapConfig(layers=(1, 2)), start_ring=lambda c, t: None)
    assert sgl.install_controller(Runner(), None) is None  # no PROBEX_TAP_CONFIG: no tap
