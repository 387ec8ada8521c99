"""Retention math, ref resolution and RTN fake-quantization on synthetic data (no model)."""

import numpy as np
import pytest
import torch

from probes.artifact import ProbeArtifact, ReadPoint
from probes.datasets import LabelledPrompt, MissingDataFileError, resolve_refs
from probes.retention import NoRetentionReference, relative_retention, retention_set
from probex.quantize import fake_quantize


def planted(n=400, h=32, seed=0, shift=None):
    rng = np.random.default_rng(seed)
    labels = np.repeat([1, 0], n // 2)
    direction = np.zeros(h)
    direction[0] = 1.0
    x = rng.standard_normal((n, h)) + np.outer(labels, shift if shift is not None else 3 * direction)
    return x, labels, direction


def test_retention_is_one_on_the_reference_data_and_falls_when_the_separation_moves():
    x, y, w = planted()
    diff = x[y == 1].mean(0) - x[y == 0].mean(0)
    reference = float(w @ diff / np.linalg.norm(diff))
    assert relative_retention(w, x, y, reference) == pytest.approx(1.0)
    rotated = np.zeros(32)
    rotated[1] = 3.0  # the classes now separate along another axis
    x2, y2, _ = planted(seed=1, shift=rotated)
    assert relative_retention(w, x2, y2, reference) < 0.3


def test_refs_resolve_to_prompts_and_unknown_refs_are_named():
    known = [LabelledPrompt(f"p{i}", i % 2, "s", f"pkg==1:f.txt#{i}") for i in range(1, 6)]
    assert [e.text for e in resolve_refs({"pkg==1:f.txt": "1-2,5"}, known)] == ["p1", "p2", "p5"]
    with pytest.raises(MissingDataFileError, match="pkg==1:f.txt#9"):
        resolve_refs({"pkg==1:f.txt": "9"}, known)


def test_probe_without_retention_reference_is_refused_clearly():
    probe = ProbeArtifact(name="p", layer=1, read=ReadPoint.LAST_PROMPT_TOKEN, weight=np.ones(4, np.float32), bias=0)
    with pytest.raises(NoRetentionReference, match="no retention reference"):
        retention_set(probe, known=[])


def test_rtn_error_grows_as_scales_get_coarser_and_int8_is_tight():
    torch.manual_seed(0)
    w = torch.randn(64, 128) * torch.logspace(-2, 0, 128)  # columns of very different size
    err = {g: float((fake_quantize(w, 4, g) - w).norm() / w.norm()) for g in (32, 0, -1)}
    assert err[32] < err[0] < err[-1]
    assert float((fake_quantize(w, 8, 32) - w).norm() / w.norm()) < 0.01
    q = fake_quantize(w, 4, 32).reshape(64, 4, 32)
    scale = w.reshape(64, 4, 32).abs().amax(-1, keepdim=True) / 7
    assert torch.allclose(q / scale, torch.round(q / scale), atol=1e-3)  # values sit on the int4 grid
    with pytest.raises(SystemExit, match="does not divide"):
        fake_quantize(w, 4, 48)


def test_eval_plots_are_written(tmp_path):
    from pathlib import Path

    from probex.eval_served import plot

    rng = np.random.default_rng(0)
    labels = np.repeat([1, 0], 20)
    raw = labels * 2 + rng.standard_normal(40)
    report = {"splits": {"test": {"offline": {"auroc": 0.9}, "served": {"auroc": 0.9}}},
              "_scores": {"test": (raw, raw + 1e-5, labels)}}
    demo = Path(__file__).resolve().parent.parent / "config" / "probes" / "harmful-request"
    (path,) = plot(report, demo, tmp_path)
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"
