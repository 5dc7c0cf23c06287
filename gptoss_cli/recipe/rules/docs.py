"""The documentation's rule table and recipe-field table, rendered from the registry and the schema.

Each table lives between marker comments (`<!-- rules:begin -->` ... `<!-- rules:end -->`, likewise
`fields`) in its home file, HOMES: docs/rules.md and docs/recipes.md. `python -m gptoss_cli.recipe.rules
--write` regenerates every table in its home, and tests/test_readme.py fails when a home and the
registry disagree, so a new rule cannot be added without its documentation.
"""

from __future__ import annotations

import re
from pathlib import Path

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
REPO_ROOT = Path(__file__).resolve().parents[3]
HOMES = {"rules": Path("docs/rules.md"), "fields": Path("docs/recipes.md")}  # relative to REPO_ROOT


def _block_re(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- {name}:begin -->\n)(.*?)(<!-- {name}:end -->)", re.S)


def generated_block(text: str, name: str) -> str | None:
    """What `text` holds between the `name` markers, or None when the markers are missing."""
    m = _block_re(name).search(text)
    return m.group(2) if m else None


def update_blocks(text: str) -> str:
    """`text` with every generated block it holds replaced by fresh output; a text with none is an error."""
    present = [name for name in BLOCKS if _block_re(name).search(text)]
    if not present:
        markers = " or ".join(f"<!-- {name}:begin --> ... <!-- {name}:end -->" for name in BLOCKS)
        homes = " and ".join(str(HOMES[name]) for name in BLOCKS)
        raise ValueError(f"no generated block ({markers}) to regenerate; the tables live in {homes}")
    for name in present:
        fresh = RENDERERS[name]()
        text = _block_re(name).sub(lambda m: m.group(1) + fresh + m.group(3), text, count=1)
    return text


def home_files() -> list[Path]:
    """The files that hold the generated blocks, each once, in BLOCKS order."""
    return list(dict.fromkeys(REPO_ROOT / HOMES[name] for name in BLOCKS))
