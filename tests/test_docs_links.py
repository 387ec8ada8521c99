"""Every relative link in the README and docs/ leads to a file that exists and, where it names
one, to a heading in it: the docs point into each other by section (docs/benchmarks.md's
sessions above all), and a renamed heading must not leave a link going nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (letters, digits, `_`
    and `-` kept), spaces made `-`; inline code marks go too."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors_of(path: Path) -> set[str]:
    anchors, seen = set(), {}
    for line in prose_lines(path):
        match = HEADING.match(line)
        if match:
            anchor = github_anchor(match.group(1))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            anchors.add(anchor if count == 0 else f"{anchor}-{count}")  # GitHub numbers repeated headings
    return anchors


def test_github_anchors_are_made_as_github_makes_them():
    assert github_anchor("Session 27: the engine consumer spinning; 26 more pairs") == \
        "session-27-the-engine-consumer-spinning-26-more-pairs"
    assert github_anchor("Model runner V2 (vLLM 0.25.0's default here): tap and steering") == \
        "model-runner-v2-vllm-0250s-default-here-tap-and-steering"
    assert github_anchor("Tensor parallel (TP=2)") == "tensor-parallel-tp2"
    assert github_anchor("`make bench`: the gateway") == "make-bench-the-gateway"


def test_every_relative_link_in_the_docs_leads_somewhere():
    broken = []
    for doc in DOCS:
        for line in prose_lines(doc):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                linked = (doc.parent / path).resolve() if path else doc
                if not linked.exists():
                    broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
                elif anchor and linked.suffix == ".md" and anchor not in anchors_of(linked):
                    broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
