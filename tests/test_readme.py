"""The README's generated tables say what the rule registry and the recipe schema say.

Regenerate with `python -m gptoss_cli.recipe.rules --write README.md`.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from gptoss_cli.recipe.rules import RULES
from gptoss_cli.recipe.rules.__main__ import main as rules_main
from gptoss_cli.recipe.rules.docs import fields_markdown, readme_block, rules_markdown, update_readme
from gptoss_cli.recipe.schema import iter_fields

README = Path(__file__).resolve().parent.parent / "README.md"
REGENERATE = "run `python -m gptoss_cli.recipe.rules --write README.md`"


def rows_by_first_cell(table: str) -> dict[str, str]:
    """{`first cell` without backticks: the whole row} of a generated markdown table."""
    return {m.group(1): line for line in table.splitlines() if (m := re.match(r"\| `([^`]+)` \|", line))}


def test_readme_rule_table_is_the_generators_output():
    assert readme_block(README.read_text(), "rules") == rules_markdown(), REGENERATE


def test_readme_field_table_is_the_generators_output():
    assert readme_block(README.read_text(), "fields") == fields_markdown(), REGENERATE


def test_every_registered_rule_has_a_readme_row_with_its_fix():
    rows = rows_by_first_cell(readme_block(README.read_text(), "rules"))
    assert list(rows) == list(RULES)  # every rule, once, in the order they run
    for rule_id, r in RULES.items():
        assert r.fix, f"{rule_id} has no fix"
        assert r.fix.split()[0].replace("*", "\\*") in rows[rule_id], rows[rule_id]


def test_every_recipe_field_has_a_readme_row():
    rows = rows_by_first_cell(readme_block(README.read_text(), "fields"))
    assert list(rows) == [name for name, _ in iter_fields()]


def test_a_new_rule_changes_the_generated_table(monkeypatch):
    """Adding a rule without regenerating the README makes the README test fail."""
    before = rules_markdown()
    some = next(iter(RULES.values()))
    monkeypatch.setitem(RULES, "zz.new_rule", replace(some, id="zz.new_rule", fix="set zz=1", gate=False))
    after = rules_markdown()
    assert after != before and "| `zz.new_rule` |" in after and "set zz=1" in after


def test_table_cells_escape_markdown_that_would_break_the_row():
    """'|' ends a cell and '*' starts emphasis: the pipeline rule's '|' and the '*E' patterns."""
    rows = rows_by_first_cell(rules_markdown())
    pipeline = rows["parallel.pipeline_layers"]
    assert "'\\|'" in pipeline and pipeline.count(" | ") == 3  # four cells, three separators
    assert "'\\*E'" in rows["model.pattern_matches_architecture"]


def test_write_regenerates_a_stale_readme_in_place(tmp_path, capsys):
    stale = README.read_text().replace(rules_markdown(), "| stale |\n")
    assert stale != README.read_text()
    copy = tmp_path / "README.md"
    copy.write_text(stale)
    assert rules_main(["--write", str(copy)]) == 0
    assert copy.read_text() == README.read_text() == update_readme(stale)
    assert "updated" in capsys.readouterr().out


def test_write_refuses_a_file_without_the_markers(tmp_path, capsys):
    other = tmp_path / "OTHER.md"
    other.write_text("# no markers\n")
    assert rules_main(["--write", str(other)]) == 2
    assert "rules:begin" in capsys.readouterr().err
    assert other.read_text() == "# no markers\n"


@pytest.mark.parametrize("bad", [dict(fix=""), dict(severities=()), dict(severities=("fatal",))])
def test_the_registry_refuses_a_rule_without_its_documentation(bad):
    from gptoss_cli.recipe.rules.core import register_rule

    some = next(iter(RULES.values()))
    with pytest.raises(ValueError, match="zz.undocumented"):
        register_rule(replace(some, id="zz.undocumented", **bad))
    assert "zz.undocumented" not in RULES
