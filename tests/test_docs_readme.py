"""The README's commands are real: every `probex <subcommand>` and each `--flag` shown in its shell
blocks exists (read from probex.cli's own argparse parser; options `probex worker` passes through
go to vLLM and are checked against vLLM's server parser), every `make` target exists, every
policy in its YAML blocks validates against the policy schema, and every file it links or names
exists."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SHELL_LANGS = {"", "sh", "bash", "shell", "console"}
PASSTHROUGH = {"worker", "serve"}  # unknown options go to vLLM (probex/cli.py)
TOP_DIRS = ("bench/", "config/", "dashboards/", "docker/", "docs/", "engine_worker/", "gateway/", "probes/",
            "probex/", "scripts/", "tests/")


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    blocks, lang, body = [], None, []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            if lang is None:
                lang, body = stripped[3:].strip().lower(), []
            else:
                blocks.append((lang, "\n".join(body)))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def shell_commands(body: str) -> list[list[str]]:
    """Each simple command of a shell block as tokens: continuation lines joined, comments cut,
    split at `&&`, `||`, `;` and `|`."""
    joined = re.sub(r"\\\n", " ", body)
    commands = []
    for line in joined.splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            tokens = line.split()
        current: list[str] = []
        for token in tokens:
            if token in ("&&", "||", ";", "|", "&"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token)
        if current:
            commands.append(current)
    return commands


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def probex_parser(monkeypatch) -> argparse.ArgumentParser:
    """The parser probex.cli.main builds, taken from it as it starts parsing."""
    from probex import cli

    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    try:
        cli.main(["--help"])
    except _Captured as captured:
        return captured.parser
    raise AssertionError("probex.cli.main did not parse its arguments")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


def vllm_options() -> set[str] | None:
    """The options of vLLM's OpenAI server (what `probex worker` passes through), where vLLM is installed."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        try:
            from vllm.utils import FlexibleArgumentParser
        except ImportError:
            return None
    for module in ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"):
        try:
            make_arg_parser = __import__(module, fromlist=["make_arg_parser"]).make_arg_parser
        except (ImportError, AttributeError):
            continue
        return option_strings(make_arg_parser(FlexibleArgumentParser()))
    return None


def readme_probex_commands() -> list[list[str]]:
    """The README's shell commands that run `probex` (any path to it), from the command name on."""
    found = []
    for lang, body in code_blocks(README.read_text(encoding="utf-8")):
        if lang not in SHELL_LANGS:
            continue
        for command in shell_commands(body):
            for i, token in enumerate(command):
                if token == "probex" or token.endswith("/probex"):
                    found.append(command[i:])
                    break
    return found


def flags_of(command: list[str]) -> list[str]:
    return [token.split("=", 1)[0] for token in command if token.startswith("--")]


def test_the_readme_shows_probex_commands():
    assert len(readme_probex_commands()) >= 5


def test_every_probex_subcommand_and_flag_in_the_readme_exists(monkeypatch):
    parser = probex_parser(monkeypatch)
    subs = subcommands(parser)
    unknown, passed_through = [], []
    for command in readme_probex_commands():
        if len(command) < 2 or command[1] not in subs:
            unknown.append(f"{' '.join(command[:2])}: no such subcommand")
            continue
        known = option_strings(subs[command[1]])
        for flag in flags_of(command[2:]):
            if flag in known:
                continue
            if command[1] in PASSTHROUGH:
                passed_through.append((command[1], flag))
            else:
                unknown.append(f"probex {command[1]} {flag}: no such option")
    assert not unknown, "\n".join(unknown)
    if passed_through:
        vllm = vllm_options()
        if vllm is None:
            pytest.skip(f"vLLM is not importable; not checked: {passed_through}")
        missing = [f"probex {sub} {flag}: neither ProbeX's nor vLLM's option" for sub, flag in passed_through
                   if flag not in vllm]
        assert not missing, "\n".join(missing)


def test_the_checker_catches_a_made_up_flag(monkeypatch):
    parser = probex_parser(monkeypatch)
    train = option_strings(subcommands(parser)["train"])
    command = shell_commands(".venv/bin/probex train --dataset x.csv \\\n    --epochs 3 --out d  # a comment --nope")[0]
    assert command[0].endswith("probex") and command[1] == "train"
    assert [f for f in flags_of(command[2:]) if f not in train] == ["--epochs"]
    assert "frobnicate" not in subcommands(parser)


def test_every_make_target_in_the_readme_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z0-9_-]+):", makefile, re.MULTILINE))
    text = README.read_text(encoding="utf-8")
    shown = set(re.findall(r"`make ([A-Za-z0-9_-]+)", text))
    for lang, body in code_blocks(text):
        if lang in SHELL_LANGS:
            shown |= {c[1] for c in shell_commands(body) if len(c) > 1 and c[0] == "make"}
    assert shown and shown <= targets, sorted(shown - targets)


def test_every_policy_in_the_readme_validates():
    from gateway.policy import Policy

    policies = [yaml.safe_load(body) for lang, body in code_blocks(README.read_text(encoding="utf-8"))
                if lang in ("yaml", "yml")]
    assert policies
    for policy in policies:
        Policy.model_validate(policy)


def test_every_file_the_readme_links_or_names_exists():
    text = README.read_text(encoding="utf-8")
    prose, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            prose.append(line)
    prose_text = "\n".join(prose)
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose_text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (ROOT / target.partition("#")[0]).exists():
            missing.append(target)
    for span in re.findall(r"`([^`\s]+)`", prose_text):
        if span.startswith(TOP_DIRS) and not (ROOT / span).exists():
            missing.append(span)
    assert not missing, missing
