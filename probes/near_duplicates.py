"""Near-duplicate prompts across sets: the same request in other words.

Exact duplicates are caught by `probes.datasets.normalise`; a set that rephrases another
set's behaviours ("Write a keylogger script" -> "How was a keylogger script written in the
past?") needs a looser test before the other set can be called held out. Two prompts are
near duplicates when their content words (stop words, tense and framing words left out,
each word cut to its first 6 letters so "hacking" meets "hacked") overlap by at least a
Jaccard index `threshold` and share at least `MIN_SHARED` of them (one shared word in two
short questions is a topic, not a request). A set holding several rephrasings of each behaviour then drops
the siblings of every prompt it dropped (Jaccard >= `sibling_threshold` within the set),
until nothing more is dropped, so that no rewording of a held-out behaviour slips through
for using other words than the held-out prompt.
"""

from __future__ import annotations

import re
from typing import Sequence

from probes.datasets import LabelledPrompt

STEM = 6
STOP_WORDS = frozenset("""
a an the of to in on for and or by with from at as is are was were be been being will would could can did do
does done how what which who whom why when where that this these those it its their there people person
individuals someone one into past future years year coming upcoming previous decade historically history
historical used use using during have had has make made making create created creating get got write written
step steps detailed instructions guide give provide explain describe way ways method methods about like such
some any other others without your you my me they them we us early late 2000s 2010s 1990s century
""".split())


def content_words(text: str) -> frozenset[str]:
    words = re.findall(r"[a-z0-9]+", text.casefold())
    return frozenset(w[:STEM] for w in words if len(w) > 2 and w not in STOP_WORDS)


MIN_SHARED = 2


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    """The Jaccard index of two word sets, 0 when they share fewer than MIN_SHARED words."""
    shared = len(a & b)
    return shared / len(a | b) if shared >= MIN_SHARED else 0.0


def split_near_duplicates(examples: Sequence[LabelledPrompt], held_out: Sequence[LabelledPrompt], *,
                          threshold: float = 0.2, sibling_threshold: float = 0.5
                          ) -> tuple[list[LabelledPrompt], list[LabelledPrompt]]:
    """(kept, dropped): `examples` with every near duplicate of a `held_out` prompt dropped, and its siblings."""
    words = [content_words(e.text) for e in examples]
    held = [content_words(e.text) for e in held_out]
    dropped = {i for i, w in enumerate(words) if any(jaccard(w, h) >= threshold for h in held)}
    frontier = set(dropped)
    while frontier:
        found = {i for i, w in enumerate(words) if i not in dropped
                 and any(jaccard(w, words[j]) >= sibling_threshold for j in frontier)}
        dropped |= found
        frontier = found
    return ([e for i, e in enumerate(examples) if i not in dropped],
            [e for i, e in enumerate(examples) if i in dropped])
