"""The project's benign hard negatives (probes/data/benign_hard_negatives.txt) and the demo
probe's contrast splits built from them."""

from collections import Counter

import pytest

from probes.datasets import (BENIGN, DONOTANSWER_CATEGORIES, HARMFUL, load_advbench, load_donotanswer,
                             load_harmbench, load_own_benign, load_temaq, normalise)

# The themes of the file and how many prompts each holds.
ORIGINAL_THEMES = {theme: 14 for theme in (
    "photography", "history", "medicine", "chemistry", "cooking", "games", "garden", "sports", "security",
    "language", "safety", "home")} | {"computing": 16}
CATEGORIES = {
    "sysadmin": 74, "kitchen-garden": 73, "sport-games": 75, "medical-safety": 76, "past-events": 75,
    "fiction-writing": 75, "figurative": 75, "safe-targets": 75, "defence": 75, "law-news": 72,
    "lab-safety": 70, "definitions": 66, "public-and-fictional-figures": 55, "nature-animals": 57, "arts-media": 42,
}


@pytest.fixture(scope="module")
def own():
    return load_own_benign()


def test_the_file_holds_the_themes_and_counts_it_claims(own):
    counts = Counter(e.source.removeprefix("own-benign/") for e in own)
    assert counts == Counter(ORIGINAL_THEMES | CATEGORIES)
    assert sum(CATEGORIES.values()) >= 1000
    assert {e.label for e in own} == {BENIGN}


def test_every_prompt_is_one_plain_request_seen_once(own):
    keys = Counter(normalise(e.text) for e in own)
    assert [k for k, n in keys.items() if n > 1] == []
    for e in own:
        assert 10 <= len(e.text) <= 300, e.ref
        assert not e.text.startswith("#"), e.ref
        assert e.text[-1] in "?.!'", e.ref  # a whole sentence, not a fragment cut off a template


def test_no_hard_negative_is_a_prompt_of_a_harmful_set(own):
    harmful = load_temaq() + load_advbench() + load_harmbench() + load_donotanswer(DONOTANSWER_CATEGORIES)
    harmful_keys = {normalise(e.text) for e in harmful if e.label == HARMFUL}
    assert len(harmful_keys) > 1000
    assert [e.ref for e in own if normalise(e.text) in harmful_keys] == []


def test_contrast_splits_are_kept_apart_from_training_and_cover_every_category():
    from probes.demo_data import HELD_OUT_THEMES, build_data

    data = build_data()
    train_keys = {normalise(e.text) for e in data.splits["train"]}
    validation_keys = {normalise(e.text) for e in data.splits["validation"]}
    contrast_test = data.eval_sets[data.contrast_test_name]
    for split in (data.contrast_validation, contrast_test):
        assert {e.label for e in split} == {BENIGN, HARMFUL}
        assert all(e.label == HARMFUL or e.source.startswith("own-benign/") for e in split)
        assert not {normalise(e.text) for e in split} & train_keys
    assert {normalise(e.text) for e in data.contrast_validation} <= validation_keys
    for category in CATEGORIES:
        source = f"own-benign/{category}"
        assert any(e.source == source for e in data.splits["train"]), category
        assert any(e.source == source for e in data.contrast_validation), category
    trained_themes = {e.source.removeprefix("own-benign/") for e in data.splits["train"]}
    assert not trained_themes & set(HELD_OUT_THEMES)
