"""The product's docs and code comments speak of the product, not of how it was built.

No numbered work sessions, issue numbers or the machines and tools used during development may
appear in README.md, docs/*.md, or the comments and docstrings of the installed packages
(engine_worker/, gateway/, probes/, probex/). `test_docs_have_no_development_history` and
`test_code_comments_have_no_development_history` can be run on their own (`-k docs` / `-k code`);
the planted-line tests show the checker catches what it is meant to.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ["engine_worker", "gateway", "probes", "probex"]

HISTORY = [re.compile(p, re.IGNORECASE) for p in (
    r"\bsessions? \d+",              # "session 41", "sessions 38-42"
    r"\bissues? #?\d+",              # "issue 5", "issue #7"
    r"\bkit call",                   # the development tool's transfers
    r"\bdevice[- ]minutes?\b",
    r"\bdevice-s\b",
    r"\bleased?\b|\bleases\b",
    r"\bdev machine\b",
    r"\bcarry \[",                   # the tool's `carry [...]` argument
    r"\bwas the default until\b",
    r"\b(?:since|before|until|after) session\b",
)]


def history_hits(text: str) -> list[tuple[int, str]]:
    """(line number, the line) for every line of `text` that matches a development-history pattern."""
    hits = []
    for number, line in enumerate(text.splitlines(), start=1):
        if any(p.search(line) for p in HISTORY):
            hits.append((number, line.strip()))
    return hits


def check_markdown(path: Path) -> list[str]:
    return [f"{path}:{n}: {line}" for n, line in history_hits(path.read_text(encoding="utf-8"))]


def comment_and_docstring_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment and docstring line of a Python source."""
    lines: list[tuple[int, str]] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines.append((token.start[0], token.string))
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                first = body[0].value.lineno
                for offset, text in enumerate(body[0].value.value.splitlines()):
                    lines.append((first + offset, text))
    return lines


def check_python(path: Path) -> list[str]:
    found = []
    for number, text in sorted(comment_and_docstring_lines(path.read_text(encoding="utf-8"))):
        if any(p.search(text) for p in HISTORY):
            found.append(f"{path}:{number}: {text.strip()}")
    return found


def product_python_files() -> list[Path]:
    return sorted(f for package in PACKAGES for f in (ROOT / package).rglob("*.py"))


def test_docs_have_no_development_history():
    found = [hit for doc in DOCS for hit in check_markdown(doc)]
    assert not found, "development history in the docs:\n" + "\n".join(found)


def test_code_comments_have_no_development_history():
    found = [hit for f in product_python_files() for hit in check_python(f)]
    assert not found, "development history in product comments and docstrings:\n" + "\n".join(found)


def test_a_planted_history_line_in_a_doc_is_found(tmp_path):
    doc = tmp_path / "planted.md"
    doc.write_text("# Speed\n\nThe tap is cheap.\nMeasured in session 41 on the dev machine (3 device-minutes).\n")
    found = check_markdown(doc)
    assert len(found) == 1 and ":4:" in found[0]
    for line in ("see issue #7", "fixed in issue 8", "the fourth kit call", "lease lost", "12 device-s",
                 "sessions 38-42 met six", "carry [\".gpukit/p4\"]", "the formatter was the default until then"):
        assert history_hits(line), line


def test_a_planted_history_comment_in_code_is_found(tmp_path):
    module = tmp_path / "planted.py"
    module.write_text('"""A module.\n\nMeasured in session 12."""\n\nx = "session 3 in a string is code, not prose"\n'
                      "# the lease ran out here\ny = 1\n")
    found = check_python(module)
    assert [hit.split(":")[1] for hit in found] == ["3", "6"]


def test_ordinary_words_are_not_history():
    for line in ("release the slot", "a test session", "the session's cookie", "device time of the forward",
                 "issues a warning", "carry the checkout"):
        assert not history_hits(line), line
