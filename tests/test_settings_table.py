"""The environment variables the product reads: settings an operator sets, at most eight, each in
docs/settings.md; the removed switches are refused, never read."""

from __future__ import annotations

import re
from pathlib import Path

from engine_worker.settings import REMOVED, refuse_removed_settings

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"""["'](PROBEX_[A-Z0-9_]+)["']""")


def read_names() -> set[str]:
    names: set[str] = set()
    for package in ("engine_worker", "gateway", "probes", "probex"):
        for path in (ROOT / package).rglob("*.py"):
            names |= set(NAME.findall(path.read_text()))
    return names - set(REMOVED)


def test_at_most_eight_settings_and_each_is_in_the_settings_table():
    names = read_names()
    table = (ROOT / "docs" / "settings.md").read_text()
    assert 0 < len(names) <= 8, sorted(names)
    assert not [name for name in names if f"`{name}`" not in table], sorted(names)


def test_a_removed_switch_still_set_stops_the_worker_naming_its_replacement():
    with pytest.raises(SystemExit) as stopped:
        refuse_removed_settings({"PROBEX_SCORE_RING": "0", "PATH": "/bin"})
    message = str(stopped.value)
    assert message.count("\n") == 0 and "PROBEX_SCORE_RING is no longer read" in message and "score ring" in message
