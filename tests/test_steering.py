"""Steering without an engine: xargs, per-row buffer filling by the controller, the artifact, the middleware check."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_worker.scores.bookkeeping import StepView
from engine_worker.tap.controller import TapController, VectorSetRejected
from engine_worker.api_server.middleware import RequestRefused, check_steering, inspect_request
from engine_worker.tap.steer import ALPHA, GATE_COLUMN, GATE_ENABLED, THRESHOLD, VECTOR_SLOT, LayerSteer
from engine_worker.steering import SteerRequest, SteeringError, cache_salt, raw_threshold, steering_from_xargs
from engine_worker.tap.layer import LayerTap
from probes.artifact import ProbeArtifact, ProbeFormatError, ReadPoint, ServedModel, save_probe
from probes.steering import SteeringVector, difference_of_means, load_vector, save_vector

HIDDEN = 8


def served() -> ServedModel:
    return ServedModel.from_hf_config({"hidden_size": HIDDEN, "num_hidden_layers": 4}, name="toy")


# -- xargs ------------------------------------------------------------------------------------


def test_steering_xargs_parse_and_normalise():
    assert steering_from_xargs({"probex_capture": 1}) is None
    request = steering_from_xargs({"probex_steer": "v", "probex_steer_alpha": "2.5", "probex_steer_gate": "p",
                                   "probex_steer_threshold": 0.75, "probex_steer_window": "generation"})
    assert request == SteerRequest("v", 2.5, "p", 0.75, "generation")


@pytest.mark.parametrize(
    "xargs, message",
    [
        ({"probex_steer_alpha": 1.0}, "needs vllm_xargs.probex_steer "),
        ({"probex_steer": "v"}, "needs vllm_xargs.probex_steer_alpha"),
        ({"probex_steer": "v", "probex_steer_alpha": float("inf")}, "must be finite"),
        ({"probex_steer": "v", "probex_steer_alpha": True}, "must be a number"),
        ({"probex_steer": "", "probex_steer_alpha": 1}, "non-empty name"),
        ({"probex_steer": "v", "probex_steer_alpha": 1, "probex_steer_gate": "p"}, "needs vllm_xargs.probex_steer_threshold"),
        ({"probex_steer": "v", "probex_steer_alpha": 1, "probex_steer_threshold": 0.5}, "without vllm_xargs.probex_steer_gate"),
        ({"probex_steer": "v", "probex_steer_alpha": 1, "probex_steer_gate": "p", "probex_steer_threshold": 0},
         "strictly between 0 and 1"),
        ({"probex_steer": "v", "probex_steer_alpha": 1, "probex_steer_window": "decode"}, "must be one of"),
    ],
)
def test_malformed_steering_is_refused_by_name(xargs, message):
    with pytest.raises(SteeringError, match=message):
        steering_from_xargs(xargs)
    with pytest.raises(RequestRefused, match=message):
        inspect_request("/v1/chat/completions", {"messages": [], "vllm_xargs": dict(xargs)})


def test_probability_threshold_maps_to_the_raw_score_with_that_probability():
    raw = raw_threshold(0.8, slope=0.3, intercept=-0.1)
    assert 1 / (1 + math.exp(-(0.3 * raw - 0.1))) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="positive calibration slope"):
        raw_threshold(0.8, slope=-1.0, intercept=0.0)


def test_cache_salt_separates_configs_and_vector_contents():
    a = SteerRequest("v", 2.0)
    assert cache_salt(a, "d1") == cache_salt(SteerRequest("v", 2.0), "d1")
    salts = {cache_salt(a, "d1"), cache_salt(SteerRequest("v", 3.0), "d1"), cache_salt(a, "d2"),
             cache_salt(SteerRequest("v", 2.0, window="prompt"), "d1"), cache_salt(a, "d1", client_salt="tenant")}
    assert len(salts) == 5


LISTINGS = (
    {"steer_layers": [2], "gate_layers": {"2": [1, 2]},
     "vectors": [{"name": "v", "layer": 2, "digest": "abc"}]},
    {"probes": [{"name": "early", "layer": 1, "calibration": {"slope": 1.0, "intercept": 0.0}},
                {"name": "late", "layer": 3, "calibration": {"slope": 1.0, "intercept": 0.0}}]},
)


def test_middleware_checks_names_against_the_worker_and_salts_the_request():
    call = inspect_request("/v1/chat/completions", {"messages": [], "vllm_xargs": {
        "probex_steer": "v", "probex_steer_alpha": "1.5", "probex_steer_gate": "early", "probex_steer_threshold": 0.9}})
    salt = check_steering(call.body, call.steering, *LISTINGS)
    assert call.body["cache_salt"] == salt and salt.startswith("probex-steer-")
    assert call.body["vllm_xargs"]["probex_steer_alpha"] == 1.5
    for xargs, message in (
        ({"probex_steer": "w", "probex_steer_alpha": 1}, "unknown steering vector 'w'; loaded: v"),
        ({"probex_steer": "v", "probex_steer_alpha": 1, "probex_steer_gate": "late", "probex_steer_threshold": 0.5},
         "at or before the write"),
        ({"probex_steer": "v", "probex_steer_alpha": 1, "probex_steer_gate": "x", "probex_steer_threshold": 0.5},
         "gate probe 'x' is not loaded"),
    ):
        call = inspect_request("/v1/chat/completions", {"messages": [], "vllm_xargs": xargs})
        with pytest.raises(RequestRefused, match=message):
            check_steering(call.body, call.steering, *LISTINGS)


# -- the artifact ------------------------------------------------------------------------------


def test_vector_artifact_round_trips_and_is_validated(tmp_path):
    v = np.arange(HIDDEN, dtype=np.float32)
    path = save_vector(SteeringVector("v", 2, v, extra={"method": {"kind": "difference_of_means"}}), tmp_path / "v")
    loaded = load_vector(path, served())
    assert loaded.name == "v" and loaded.layer == 2 and np.array_equal(loaded.vector, v)
    assert loaded.extra["method"]["kind"] == "difference_of_means"
    bad = save_vector(SteeringVector("bad", 2, np.full(HIDDEN, np.nan, np.float32)), tmp_path / "bad")
    with pytest.raises(ProbeFormatError, match="non-finite"):
        load_vector(bad)
    with pytest.raises(ValueError, match="out of range"):
        load_vector(save_vector(SteeringVector("far", 9, v), tmp_path / "far"), served())
    with pytest.raises(ProbeFormatError, match="missing"):
        load_vector(tmp_path)


def test_difference_of_means():
    pos, neg = np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([[0.0, 1.0]])
    np.testing.assert_allclose(difference_of_means(pos, neg), [2.0, 2.0])


# -- the controller fills per-row buffers ---------------------------------------------------------


def make_controller(tmp_path: Path) -> TapController:
    taps = {1: LayerTap(1, HIDDEN, capacity=2, max_rows=32), 3: LayerTap(3, HIDDEN, capacity=2, max_rows=32)}
    steers = {2: LayerSteer(2, HIDDEN, capacity=2, max_rows=32, gate_taps=[taps[1]])}
    controller = TapController(taps, served(), steers=steers)
    weight = np.ones(HIDDEN, np.float32)
    probes = [save_probe(ProbeArtifact(name, layer, ReadPoint.LAST_PROMPT_TOKEN, weight, 0.0, slope=2.0,
                                       intercept=1.0), tmp_path / name) for name, layer in (("g", 1), ("late", 3))]
    controller.load([str(p) for p in probes])
    vectors = [save_vector(SteeringVector(n, 2, np.full(HIDDEN, i + 1, np.float32)), tmp_path / n)
               for i, n in enumerate(("a", "b"))]
    controller.load_vectors([str(v) for v in vectors])
    return controller


def test_controller_fills_rows_by_request_window_and_gate(tmp_path):
    controller = make_controller(tmp_path)
    steer = controller.steers[2]
    # x: prompt 4, 2 computed, 3 scheduled -> positions 2,3 (prompt) and 4 (generated): rows 0..2
    # y: decode, rows 3; z: unsteered prefill, rows 4..8; w: alpha 0 (rows 9)
    layout = StepView(["x", "y", "z", "w"], np.array([3, 1, 5, 1]), np.array([2, 7, 0, 3]), np.array([4, 5, 5, 2]))
    steering = {
        "x": SteerRequest("b", 2.0, window="generation"),
        "y": SteerRequest("a", -1.5, gate="g", threshold=0.75),
        "w": SteerRequest("a", 0.0),
    }
    controller.before_forward(layout, steering=steering)
    alpha = steer.row_params[:12, ALPHA].tolist()
    assert alpha == [0, 0, 2.0, -1.5, 0, 0, 0, 0, 0, 0, 0, 0]
    assert steer.row_index[[2, 3], VECTOR_SLOT].tolist() == [1, 0]
    assert steer.row_params[:4, GATE_ENABLED].tolist() == [0, 0, 0, 1]
    assert steer.row_index[3, GATE_COLUMN].item() == steer.gate_column(1, 0) == 0
    assert steer.row_params[3, THRESHOLD].item() == pytest.approx((math.log(3) - 1.0) / 2.0)
    # Prompt window of x: rows 0 and 1 only.
    controller.before_forward(layout, steering={"x": SteerRequest("a", 1.0, window="prompt")})
    assert steer.row_params[:4, ALPHA].tolist() == [1.0, 1.0, 0, 0]
    assert steer.row_params[3, GATE_ENABLED].item() == 0  # the previous step's gate is cleared
    # No steering at all: the device rows are cleared once, then nothing is copied.
    controller.before_forward(layout)
    assert torch.all(steer.row_params == 0)
    assert not steer.stage_rows(None, layout.num_rows)


def test_unknown_names_at_step_time_run_unsteered(tmp_path, caplog):
    controller = make_controller(tmp_path)
    layout = StepView(["x"], np.array([2]), np.array([0]), np.array([2]))
    for request in (SteerRequest("gone", 1.0), SteerRequest("a", 1.0, gate="late", threshold=0.5),
                    SteerRequest("a", 1.0, gate="nobody", threshold=0.5)):
        controller.before_forward(layout, steering={"x": request})
        assert torch.all(controller.steers[2].row_params == 0)
    assert "runs unsteered" in caplog.text


def test_vector_sets_are_validated_before_anything_changes(tmp_path):
    controller = make_controller(tmp_path)
    before = controller.steers[2].vectors.clone()
    wrong_layer = save_vector(SteeringVector("c", 1, np.ones(HIDDEN, np.float32)), tmp_path / "c")
    with pytest.raises(VectorSetRejected, match=r"steers only layers \[2\]"):
        controller.load_vectors([str(wrong_layer)])
    many = [save_vector(SteeringVector(f"m{i}", 2, np.ones(HIDDEN, np.float32)), tmp_path / f"m{i}") for i in range(3)]
    with pytest.raises(VectorSetRejected, match="exceed the 2 slots"):
        controller.load_vectors([str(m) for m in many])
    assert torch.equal(controller.steers[2].vectors, before)
    assert [v["name"] for v in controller.steering_listing()["vectors"]] == ["a", "b"]
