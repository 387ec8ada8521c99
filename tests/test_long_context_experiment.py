"""bench/long_context_experiment.py's model-free parts: the passage split and the augmentation."""

from bench.long_context_experiment import augment, per_class_sample, split_passages
from probes.datasets import BENIGN, HARMFUL, LabelledPrompt


def test_passage_split_is_disjoint_and_covers_all():
    passages = [f"Passage number {i}, " + "words " * 60 for i in range(200)]
    train, held = split_passages(passages + passages[:5])
    assert train and held and not set(train) & set(held)
    assert sorted(train + held) == sorted(passages)
    assert split_passages(passages) == (train, held)  # the same on every run


def test_augment_keeps_labels_balanced_and_nests_shares():
    examples = [LabelledPrompt(f"request {i}", HARMFUL if i % 3 else BENIGN, "x", f"x#{i}") for i in range(90)]
    short = per_class_sample(examples, 20, seed=0)
    assert sum(e.label for e in short) == 20 and len(short) == 40
    passages = [f"Some passage {i} " + "text " * 80 for i in range(50)]
    half, quarter = augment(short, passages, 0.5, seed=0), augment(short, passages, 0.25, seed=0)
    assert sum(e.label for e in half) == 10 and len(half) == 20
    assert sum(e.label for e in quarter) == 5 and len(quarter) == 10
    assert {e.text for e in quarter} <= {e.text for e in half}
    originals = {e.ref: e for e in short}
    for e in half:
        assert e.label == originals[e.ref].label and originals[e.ref].text in e.text and len(e.text) >= 4600
        assert e.source.endswith(("+long-end", "+long-middle"))
    assert augment(short, passages, 0.0, seed=0) == []
