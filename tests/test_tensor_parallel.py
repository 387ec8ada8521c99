"""Multi-rank paths without an engine: sequence parallelism turned off while tapping, one delivering rank,
and every rank building the same full-width tap (tests/test_engine_tp.py runs a real TP=2 worker)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from engine_worker.vllm import models as vllm_models
from engine_worker.vllm import worker as vllm_worker
from engine_worker.tap.layer import LayerTap
from engine_worker.tap.config import TapConfig


@dataclass
class FakePassConfig:
    """The flags of vLLM versions that have sequence parallelism (0.12-era names and older ones)."""

    enable_sp: bool | None = None
    fuse_gemm_comms: bool | None = None
    enable_sequence_parallelism: bool | None = None
    enable_async_tp: bool | None = None
    fuse_allreduce_rms: bool | None = None


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def records():
    handler = Records()
    vllm_models.log.addHandler(handler)
    yield handler
    vllm_models.log.removeHandler(handler)


def test_sequence_parallelism_and_async_tp_are_turned_off_with_one_log_line(records):
    passes = FakePassConfig(enable_sp=True, fuse_gemm_comms=True, fuse_allreduce_rms=True)
    turned_off = vllm_models.turn_off_sequence_parallelism(SimpleNamespace(pass_config=passes))
    assert turned_off == ["enable_sp", "fuse_gemm_comms"]
    assert passes.enable_sp is False and passes.fuse_gemm_comms is False
    assert passes.fuse_allreduce_rms is True  # keeps the residual whole on every rank: left alone
    assert len(records.messages) == 1 and "enable_sp, fuse_gemm_comms" in records.messages[0]
    # Every decoder layer's build calls it; only the first finds anything to do.
    assert vllm_models.turn_off_sequence_parallelism(SimpleNamespace(pass_config=passes)) == []
    assert len(records.messages) == 1


def test_older_flag_names_are_turned_off_too(records):
    passes = FakePassConfig(enable_sequence_parallelism=True, enable_async_tp=True)
    assert vllm_models.turn_off_sequence_parallelism(SimpleNamespace(pass_config=passes)) == [
        "enable_sequence_parallelism", "enable_async_tp"]
    assert not passes.enable_sequence_parallelism and not passes.enable_async_tp


def test_installed_vllm_config_is_accepted_and_nothing_is_logged_when_off(records):
    from vllm.config import CompilationConfig

    assert vllm_models.turn_off_sequence_parallelism(CompilationConfig()) == []
    assert records.messages == []


def fake_vllm_config(passes: FakePassConfig, tap: TapConfig):
    return SimpleNamespace(
        additional_config=tap.to_additional_config(run_fields=True),  # whole: no PROBEX_TAP_CONFIG needed
        compilation_config=SimpleNamespace(pass_config=passes),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=4),
        model_config=SimpleNamespace(get_hidden_size=lambda: 4096),
    )


def test_layer_build_turns_sequence_parallelism_off_and_taps_the_full_hidden(monkeypatch, records):
    import vllm.config

    passes = FakePassConfig(enable_sp=True)
    config = fake_vllm_config(passes, TapConfig(layers=(3,)))
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: config)
    # Under TP the decoder layer keeps the model's full hidden size (its linears are the sharded part).
    layer = SimpleNamespace(hidden_size=4096)
    vllm_models._attach_tap(layer, "model.layers.3")
    assert passes.enable_sp is False
    assert isinstance(layer.probex_tap, LayerTap) and layer.probex_tap.hidden_size == 4096
    assert any("enable_sp" in m for m in records.messages)


def test_engines_without_a_tap_keep_their_sequence_parallelism(monkeypatch):
    import vllm.config

    passes = FakePassConfig(enable_sp=True)
    config = SimpleNamespace(additional_config={}, compilation_config=SimpleNamespace(pass_config=passes))
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: config)
    vllm_models._attach_tap(SimpleNamespace(hidden_size=4096), "model.layers.3")
    assert passes.enable_sp is True


@pytest.mark.parametrize(("tp_rank", "last_pp", "delivers"), [(0, True, True), (1, True, False), (0, False, False)])
def test_only_tp_rank_zero_of_the_last_pipeline_stage_publishes(monkeypatch, tp_rank, last_pp, delivers):
    import vllm.distributed.parallel_state as ps

    monkeypatch.setattr(ps, "get_tp_group", lambda: SimpleNamespace(rank_in_group=tp_rank))
    monkeypatch.setattr(ps, "get_pp_group", lambda: SimpleNamespace(is_last_rank=last_pp))
    assert vllm_worker._is_delivering_rank() is delivers


class FakeEngineConfig:
    """Stands in for vLLM's VllmConfig: records what the pass flags were when its own validation ran."""

    def __init__(self, passes: FakePassConfig, additional_config: dict | None) -> None:
        self.compilation_config = SimpleNamespace(pass_config=passes)
        self.additional_config = additional_config
        self.__post_init__()

    def __post_init__(self) -> None:
        self.flags_seen_by_validation = dict(vars(self.compilation_config.pass_config))


def test_engine_config_validation_sees_sequence_parallelism_off_when_tapping(records):
    class Config(FakeEngineConfig):
        __post_init__ = FakeEngineConfig.__post_init__

    assert vllm_models._patch_config_class(Config)
    assert not vllm_models._patch_config_class(Config)  # a second plugin load patches nothing
    tapping = Config(FakePassConfig(enable_sp=True, fuse_gemm_comms=True),
                     TapConfig(layers=(1,), probe_dirs=()).to_additional_config(run_fields=True))
    seen = tapping.flags_seen_by_validation
    assert seen["enable_sp"] is False and seen["fuse_gemm_comms"] is False
    # Unset flags are pinned off too: an optimisation level's defaults only fill unset ones.
    assert seen["enable_sequence_parallelism"] is False and seen["enable_async_tp"] is False
    assert seen["fuse_allreduce_rms"] is None
    assert len(records.messages) == 1 and "enable_sp, fuse_gemm_comms" in records.messages[0]

    plain = Config(FakePassConfig(enable_sp=True), additional_config=None)  # no tap: the user's choice stands
    assert plain.flags_seen_by_validation["enable_sp"] is True
    assert plain.flags_seen_by_validation["fuse_gemm_comms"] is None


def test_installed_vllm_config_class_is_patched_by_the_plugin():
    from vllm.config import VllmConfig

    from engine_worker.vllm import plugin

    plugin.register()
    assert getattr(VllmConfig.__dict__["__post_init__"], vllm_models._PATCHED_MARK, False)
