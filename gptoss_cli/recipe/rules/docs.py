"""The README's rule table and recipe-field table, rendered from the registry and the schema.

README.md holds the output between marker comments (`<!-- rules:begin -->` ... `<!-- rules:end -->`,
likewise `fields`); `python -m gptoss_cli.recipe.rules --write README.md` regenerates them and
tests/test_readme.py fails when the README and the registry disagree, so a new rule cannot be
added without its documentation.
"""

from __future__ import annotations

import re

from gptoss_cli.recipe.rules.core import RULES, UNSUPPORTED, WARNING, Rule
from gptoss_cli.recipe.schema import describe_schema

BLOCKS = ("rules", "fields")


def _cell(text: str) -> str:
    """Text safe in a GitHub markdown table cell: `|` would end the cell, `*` would start emphasis."""
    return " ".join(text.split()).replace("|", "\\|").replace("*", "\\*")


def _severity(r: Rule) -> str:
    if r.kind == UNSUPPORTED:
        return "error (note with `--target megatron`)"
    text = " / ".join(r.severities)
    if r.gate:
        text += " (gate: runs first; its errors skip the other rules)"
    return text


def rules_markdown() -> str:
    """A markdown table of every registered rule, in the order they run: id, severity, what it checks, the fix."""
    lines = ["| rule | severity | checks | fix |", "|---|---|---|---|"]
    for r in RULES.values():
        lines.append(f"| `{r.id}` | {_severity(r)} | {_cell(r.description)} | {_cell(r.fix)} |")
    warnings = sum(1 for r in RULES.values() if WARNING in r.severities)
    lines.append("")
    lines.append(f"{len(RULES)} rules, {sum(r.kind == UNSUPPORTED for r in RULES.values())} of them `unsupported.*`; "
                 f"{warnings} can warn.")
    return "\n".join(lines) + "\n"


def fields_markdown() -> str:
    """A markdown table of every recipe field: dotted name, default as written in YAML, meaning."""
    lines = ["| field | default | meaning |", "|---|---|---|"]
    for name, default, help_text in describe_schema():
        lines.append(f"| `{name}` | `{default}` | {_cell(help_text)} |")
    return "\n".join(lines) + "\n"


RENDERERS = {"rules": rules_markdown, "fields": fields_markdown}


def _block_re(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- {name}:begin -->\n)(.*?)(<!-- {name}:end -->)", re.S)


def readme_block(text: str, name: str) -> str | None:
    """What the README holds between the `name` markers, or None when the markers are missing."""
    m = _block_re(name).search(text)
    return m.group(2) if m else None


def update_readme(text: str) -> str:
    """`text` with every generated block replaced by fresh output (markers must already be there)."""
    for name in BLOCKS:
        pattern = _block_re(name)
        if not pattern.search(text):
            raise ValueError(f"README has no <!-- {name}:begin --> ... <!-- {name}:end --> block")
        fresh = RENDERERS[name]()
        text = pattern.sub(lambda m: m.group(1) + fresh + m.group(3), text, count=1)
    return text
