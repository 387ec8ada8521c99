"""The labelled prompts a probe artifact carries: `prompts.jsonl` beside probe.yaml.

`probex train` writes there the prompts it read from the user's own files (refs
`file:<name>#<row>`): the refs it records in probe.yaml (splits, retention set) then
resolve from the artifact alone, wherever it is copied. Prompts of the built-in sets are
not copied; their refs resolve by fetching the set again (probes.datasets.load_all_known).

One JSON object per line: {"ref": "file:mine.csv#17", "label": 1, "text": "...", "source": "mine"}.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from probes.atomic_files import replacing
from probes.datasets import USER_FILE_REF, DatasetError, LabelledPrompt, _json_line, _parse_label, read_text_file

PROMPTS_FILE = "prompts.jsonl"


def save_probe_prompts(directory: str | Path, examples: Iterable[LabelledPrompt]) -> Path | None:
    """Write the user-file prompts among `examples` to `directory`/prompts.jsonl; None when there are none.

    Without any, a prompts.jsonl already there (from an earlier training into the same
    directory) is removed: its prompts would no longer be the ones the refs point at.
    """
    own = sorted((e for e in examples if e.ref.startswith(USER_FILE_REF)), key=lambda e: e.ref)
    path = Path(directory) / PROMPTS_FILE
    if not own:
        path.unlink(missing_ok=True)
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps({"ref": e.ref, "label": e.label, "text": e.text, "source": e.source}, ensure_ascii=False)
             for e in own)
    with replacing(path) as side:
        side.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def load_probe_prompts(directory: str | Path | None) -> list[LabelledPrompt]:
    """The prompts in `directory`/prompts.jsonl; [] when the artifact has none (or there is no directory)."""
    if directory is None:
        return []
    path = Path(directory) / PROMPTS_FILE
    if not path.is_file():
        return []
    examples = []
    for n, line in enumerate(read_text_file(path).splitlines(), start=1):
        if not line.strip():
            continue
        row = _json_line(path, n, line)
        if not isinstance(row, dict):
            raise DatasetError(f"{path}:{n}: expected a JSON object with 'ref', 'label' and 'text'")
        ref, text, source = row.get("ref"), row.get("text"), row.get("source", "")
        if not (isinstance(ref, str) and ref.rpartition("#")[2].isdigit()):
            raise DatasetError(f"{path}:{n}: 'ref' must be a string '<file ref>#<row>', got {ref!r:.80}")
        if not (isinstance(text, str) and text.strip()):
            raise DatasetError(f"{path}:{n}: 'text' must be a non-empty string")
        examples.append(LabelledPrompt(text, _parse_label(row.get("label"), f"{path}:{n}"),
                                       source if isinstance(source, str) else "", ref))
    return examples
