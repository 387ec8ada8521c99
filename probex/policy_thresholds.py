"""Writing a probe's prompt thresholds into a gateway policy file, keeping the rest of it as written.

The policy is edited in place, not re-dumped: the file is parsed into YAML nodes (which know
where in the text they start and end), and only the threshold values of the top-level rules for
the probe are replaced (or added), with one comment line above each rule's `prompt:` saying
where the numbers come from. Every other byte, comments and key order included, stays. A
re-dumped YAML file would lose the operator's comments; the policy's YAML stays plain PyYAML.
The result is parsed again and must equal the old policy with only those values changed.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

COMMENT_PREFIX = "# probex thresholds:"
KEYS = ("flag", "block")


class PolicyEditError(ValueError):
    """The policy file cannot be edited as asked; the message says why."""


@dataclass(frozen=True)
class _Edit:
    start: int
    end: int
    text: str


def _get(mapping: MappingNode, key: str) -> tuple[ScalarNode, Node] | None:
    for k, v in mapping.value:
        if isinstance(k, ScalarNode) and k.value == key:
            return k, v
    return None


def _line_start(text: str, index: int) -> int:
    return text.rfind("\n", 0, index) + 1


def _line_end(text: str, index: int) -> int:
    end = text.find("\n", index)
    return len(text) if end < 0 else end + 1


def _indent(text: str, line_start: int) -> str:
    line = text[line_start:_line_end(text, line_start)]
    return line[: len(line) - len(line.lstrip(" "))]


def _number(value: float) -> str:
    return repr(float(value))


def _comment_edit(text: str, anchor: int, comment: str) -> _Edit:
    """A comment line above the line holding `anchor`, replacing one this command wrote before."""
    start = _line_start(text, anchor)
    line = f"{_indent(text, start)}{COMMENT_PREFIX} {comment}\n"
    if start > 0:
        previous = _line_start(text, start - 1)
        if text[previous:start].strip().startswith(COMMENT_PREFIX):
            return _Edit(previous, start, line)
    return _Edit(start, start, line)


def _rule_edits(text: str, rule: MappingNode, values: dict[str, float], comment: str) -> list[_Edit]:
    found = _get(rule, "prompt")
    if found is None:
        flow = "{" + ", ".join(f"{k}: {_number(v)}" for k, v in values.items()) + "}"
        if rule.flow_style:  # `- {probe: x, ...}`: the new key goes before the closing brace
            close = rule.end_mark.index - 1
            return [_comment_edit(text, rule.start_mark.index, comment), _Edit(close, close, f", prompt: {flow}")]
        probe_key, probe_value = _get(rule, "probe")  # type: ignore[misc]
        after = _line_end(text, probe_value.end_mark.index)
        line = f"{' ' * probe_key.start_mark.column}prompt: {flow}\n"
        if after == len(text) and not text.endswith("\n"):
            line = "\n" + line
        return [_Edit(after, after, f"{' ' * probe_key.start_mark.column}{COMMENT_PREFIX} {comment}\n" + line)]
    key, prompt = found
    if not isinstance(prompt, MappingNode):
        raise PolicyEditError(f"line {key.start_mark.line + 1}: the rule's prompt must be a mapping of thresholds")
    edits = [_comment_edit(text, key.start_mark.index, comment)]
    for name, value in values.items():
        existing = _get(prompt, name)
        if existing is not None:
            node = existing[1]
            edits.append(_Edit(node.start_mark.index, node.end_mark.index, _number(value)))
        elif prompt.flow_style:
            close = prompt.end_mark.index - 1
            edits.append(_Edit(close, close, f"{', ' if prompt.value else ''}{name}: {_number(value)}"))
        else:
            first_key = prompt.value[0][0]
            after = _line_end(text, prompt.value[-1][1].end_mark.index)
            line = f"{' ' * first_key.start_mark.column}{name}: {_number(value)}\n"
            if after == len(text) and not text.endswith("\n"):
                line = "\n" + line
            edits.append(_Edit(after, after, line))
    return edits


def set_prompt_thresholds(text: str, probe: str, values: dict[str, float], comment: str) -> tuple[str, int]:
    """`text` with the prompt thresholds `values` ({"flag": t, "block": t}) in every top-level rule for `probe`.

    Returns the new text and the number of rules changed. Tenants' rules are left alone.
    """
    unknown = set(values) - set(KEYS)
    if unknown or not values:
        raise PolicyEditError(f"thresholds are flag and block, got {sorted(values)}")
    for name, value in values.items():
        if not (isinstance(value, float) and math.isfinite(value) and 0.0 <= value <= 1.0):
            raise PolicyEditError(f"the {name} threshold must be a number in [0, 1], got {value!r}")
    if "\n" in comment:
        raise PolicyEditError("the comment must be one line")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        old = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyEditError(f"not valid YAML ({exc})") from None
    if not isinstance(root, MappingNode):
        raise PolicyEditError("the policy must be a YAML mapping")
    found = _get(root, "rules")
    if found is None or not isinstance(found[1], SequenceNode):
        raise PolicyEditError(f"it has no `rules:` list; add a rule for the probe: rules: [{{probe: {probe}}}]")
    rules = [r for r in found[1].value if isinstance(r, MappingNode)
             and (p := _get(r, "probe")) is not None and isinstance(p[1], ScalarNode) and p[1].value == probe]
    if not rules:
        raise PolicyEditError(f"no rule under `rules:` is for probe {probe!r}; add one (- probe: {probe})")
    edits = [e for rule in rules for e in _rule_edits(text, rule, values, comment)]
    new = text
    for edit in sorted(edits, key=lambda e: (e.start, e.end), reverse=True):
        new = new[:edit.start] + edit.text + new[edit.end:]
    _check(old, yaml.safe_load(new), probe, values)
    return new, len(rules)


def _check(old: dict, new: dict, probe: str, values: dict[str, float]) -> None:
    """The edited policy must be the old one with only the asked thresholds changed, flag still <= block."""
    expected = copy.deepcopy(old)
    for rule in expected["rules"]:
        if isinstance(rule, dict) and rule.get("probe") == probe:
            prompt = rule.get("prompt") or {}
            prompt.update(values)
            rule["prompt"] = prompt
            flag, block = prompt.get("flag"), prompt.get("block")
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (flag, block)) and flag > block:
                raise PolicyEditError(f"the rule for {probe!r} would flag at {flag:.6g}, above its block threshold"
                                      f" {block:.6g}; set the block rate too (--block-rate)")
    if new != expected:
        raise PolicyEditError("the edit would change more than the thresholds (a layout this edit does not"
                              " handle); set them by hand")
