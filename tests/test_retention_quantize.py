"""Retention math, ref resolution and RTN fake-quantization on synthetic data (no model)."""

import numpy as np
import pytest
import torch

from probes.artifact import ProbeArtifact, ReadPoint, save_probe
from probes.datasets import DatasetError, LabelledPrompt, MissingDataFileError, resolve_refs
from probes.extract_hf import LayerActivations
from probes.probe_prompts import PROMPTS_FILE, load_probe_prompts, save_probe_prompts
from probes.retention import NoRetentionReference, compute_retention, relative_retention, retention_set
from probes.train import retention_reference
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


def test_a_probe_artifacts_own_prompts_resolve_first_and_spare_fetching_the_built_in_sets(tmp_path):
    mine = [LabelledPrompt(f"mine {i}", i % 2, "mine", f"file:mine.csv#{i}") for i in range(2, 6)]
    builtin = [LabelledPrompt("b1", 0, "s", "pkg==1:f.txt#1")]
    assert save_probe_prompts(tmp_path, mine + builtin) == tmp_path / PROMPTS_FILE
    local = load_probe_prompts(tmp_path)
    assert local == mine  # the built-in set's prompt is not copied

    def no_fetch():
        raise AssertionError("the built-in sets were fetched")

    assert [e.text for e in resolve_refs({"file:mine.csv": "2-3,5"}, no_fetch, local=local)] == ["mine 2", "mine 3",
                                                                                                  "mine 5"]
    both = resolve_refs({"file:mine.csv": "4", "pkg==1:f.txt": "1"}, lambda: builtin, local=local)
    assert [e.text for e in both] == ["mine 4", "b1"]
    # A user file's ref is looked up in the artifact only: no fetch before the refusal.
    with pytest.raises(MissingDataFileError, match="ref file:mine.csv#17 does not resolve to a known prompt"):
        resolve_refs({"file:mine.csv": "17"}, no_fetch, local=local)
    assert load_probe_prompts(tmp_path / "elsewhere") == [] and load_probe_prompts(None) == []
    # Trained again on the built-in sets only: the old prompts file goes.
    assert save_probe_prompts(tmp_path, builtin) is None and not (tmp_path / PROMPTS_FILE).exists()


def test_a_malformed_prompts_file_is_refused_naming_its_line(tmp_path):
    (tmp_path / PROMPTS_FILE).write_text('{"ref": "file:a.csv#2", "label": 1, "text": "x"}\n{"ref": "file:a.csv#3"}\n')
    with pytest.raises(DatasetError, match=f"{PROMPTS_FILE}:2: 'text' must be a non-empty string"):
        load_probe_prompts(tmp_path)


def test_probe_without_retention_reference_is_refused_clearly():
    probe = ProbeArtifact(name="p", layer=1, read=ReadPoint.LAST_PROMPT_TOKEN, weight=np.ones(4, np.float32), bias=0)
    with pytest.raises(NoRetentionReference, match="no retention reference"):
        retention_set(probe, known=[])


def test_a_zero_reference_is_refused_rather_than_divided_by():
    x, y, w = planted()
    with pytest.raises(ValueError, match="reference cosine must be a non-zero finite number"):
        relative_retention(w, x, y, 0.0)


# --------------------------------------------------------------------------- compute_retention, model-free

HIDDEN = 8
KNOWN = [LabelledPrompt(f"prompt {i}", i % 2, "s", f"pkg==1:f.txt#{i}") for i in range(1, 41)]


def fake_extraction(monkeypatch, calls=None):
    """Each prompt's vectors differ per reading: the classes separate along e0 in the mean over
    all prompt rows, along e1 in the user-message mean, and not at all in the last token."""
    import probes.extract_hf
    import probes.retention

    by_text = {e.text: e for e in KNOWN}

    def rows(texts):
        labels = np.array([by_text[t].label for t in texts], dtype=np.float32)
        seeds = [int(t.split()[-1]) for t in texts]
        noise = np.stack([np.random.default_rng(s).standard_normal(HIDDEN) for s in seeds]).astype(np.float32)
        all_mean, user_mean = noise.copy(), noise.copy()
        all_mean[:, 0] += 10 * labels
        user_mean[:, 1] += 10 * labels
        return noise, user_mean, all_mean

    def extract(texts, model_dir, layers, **kwargs):
        if calls is not None:
            calls.append(list(texts))
        last, user_mean, all_mean = rows(list(texts))
        offsets = np.arange(len(texts), dtype=np.int64)  # one user token per prompt: the user mean itself
        return {l: LayerActivations(l, last, user_mean, all_mean, user_mean.copy(), offsets) for l in layers}

    monkeypatch.setattr(probes.extract_hf, "extract_activations", extract)
    monkeypatch.setattr(probes.retention, "load_all_known", lambda: KNOWN)
    return rows


def saved_probe(tmp_path, rows, name, read, axis, features, read_span=None):
    """A probe along `axis` whose reference is measured on `features` of its retention set, as at training."""
    retention_set_ = KNOWN[:20]
    last, user_mean, all_mean = rows([e.text for e in retention_set_])
    vectors = {"last prompt token": last, "user-message mean": user_mean, "mean of all prompt rows": all_mean}[features]
    weight = np.zeros(HIDDEN, np.float32)
    weight[axis] = 1.0
    reference = retention_reference(weight, vectors, np.array([e.label for e in retention_set_]))
    extra = {"retention": {"reference_cosine": round(reference, 6), "layer": 3, "features": features,
                           "set": [e.ref for e in retention_set_]},
             "splits": {"seed": 0, "test": {"refs": {"pkg==1:f.txt": "21-40"}}}}
    if read_span:
        extra["read_span"] = read_span
    probe = ProbeArtifact(name=name, layer=3, read=read, weight=weight, bias=-5.0, extra=extra)
    return save_probe(probe, tmp_path / name)


def test_retention_and_eval_auroc_read_the_features_the_probe_was_trained_on(tmp_path, monkeypatch):
    """On the unchanged model every probe's retention is ~1 and its eval AUROC is what training saw.

    Reading the last token for every probe gave a prompt_mean probe of `probex train` 0.35 on the
    same model (and a false calibration alarm in the worker)."""
    rows = fake_extraction(monkeypatch)
    dirs = [
        saved_probe(tmp_path, rows, "all-rows-mean", ReadPoint.PROMPT_MEAN, 0, "mean of all prompt rows"),
        saved_probe(tmp_path, rows, "user-mean", ReadPoint.PROMPT_MEAN, 1, "user-message mean", "user_message"),
        saved_probe(tmp_path, rows, "user-max", ReadPoint.PROMPT_MAX, 1, "user-message mean", "user_message"),
    ]
    results = compute_retention(tmp_path / "model", dirs, eval_split="test")
    for name, entry in results.items():
        assert entry["retention"] == pytest.approx(1.0, abs=1e-5), (name, entry)
        assert entry["retention_prompts"] == 20
        assert entry["auroc_test"]["auroc"] == 1.0, (name, entry)
        assert entry["auroc_test"]["n_harmful"] + entry["auroc_test"]["n_benign"] == 20


def test_features_come_from_the_read_when_the_artifact_does_not_record_them(tmp_path, monkeypatch):
    import yaml

    rows = fake_extraction(monkeypatch)
    path = saved_probe(tmp_path, rows, "p", ReadPoint.PROMPT_MEAN, 0, "mean of all prompt rows")
    meta = yaml.safe_load((path / "probe.yaml").read_text())
    del meta["retention"]["features"]  # a prompt_mean probe without read_span: every prompt row, as served
    (path / "probe.yaml").write_text(yaml.safe_dump(meta))
    assert compute_retention(tmp_path / "model", [path])["p"]["retention"] == pytest.approx(1.0, abs=1e-5)


def test_an_eval_split_the_probe_does_not_record_is_named_before_any_extraction(tmp_path, monkeypatch):
    calls = []
    rows = fake_extraction(monkeypatch, calls)
    path = saved_probe(tmp_path, rows, "p", ReadPoint.LAST_PROMPT_TOKEN, 0, "last prompt token")
    with pytest.raises(ValueError, match=r"records no split 'held_out' \(splits with refs: test\)"):
        compute_retention(tmp_path / "model", [path], eval_split="held_out")
    assert calls == []


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
