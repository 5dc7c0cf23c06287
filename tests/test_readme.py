"""The documentation: generated tables say what the registry and the schema say; every local link resolves.

The rule table lives in docs/rules.md and the recipe-field table in docs/recipes.md (HOMES in
gptoss_cli/recipe/rules/docs.py); regenerate both with `python -m gptoss_cli.recipe.rules --write`.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from gptoss_cli.recipe.rules import RULES
from gptoss_cli.recipe.rules import docs as rules_docs
from gptoss_cli.recipe.rules.__main__ import main as rules_main
from gptoss_cli.recipe.rules.docs import BLOCKS, HOMES, fields_markdown, generated_block, rules_markdown, update_blocks
from gptoss_cli.recipe.schema import iter_fields

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RULES_DOC = ROOT / HOMES["rules"]
FIELDS_DOC = ROOT / HOMES["fields"]
REGENERATE = "run `python -m gptoss_cli.recipe.rules --write`"
# Every markdown file a reader reaches from the README: their relative links must resolve.
DOCUMENTS = [README, ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200  # issue 21: the README is a front door; the manual lives in docs/


def rows_by_first_cell(table: str) -> dict[str, str]:
    """{`first cell` without backticks: the whole row} of a generated markdown table."""
    return {m.group(1): line for line in table.splitlines() if (m := re.match(r"\| `([^`]+)` \|", line))}


def test_rule_table_is_the_generators_output():
    assert generated_block(RULES_DOC.read_text(), "rules") == rules_markdown(), REGENERATE


def test_field_table_is_the_generators_output():
    assert generated_block(FIELDS_DOC.read_text(), "fields") == fields_markdown(), REGENERATE


def test_every_generated_table_lives_in_its_home_only():
    """One source of truth: no stale copy of a generated table in the README or another doc."""
    for name in BLOCKS:
        holders = [p.relative_to(ROOT) for p in DOCUMENTS if generated_block(p.read_text(), name) is not None]
        assert holders == [HOMES[name]], f"the {name} table is in {holders}, expected only {HOMES[name]}"


def test_every_registered_rule_has_a_row_with_its_fix():
    rows = rows_by_first_cell(generated_block(RULES_DOC.read_text(), "rules"))
    assert list(rows) == list(RULES)  # every rule, once, in the order they run
    for rule_id, r in RULES.items():
        assert r.fix, f"{rule_id} has no fix"
        assert r.fix.split()[0].replace("*", "\\*") in rows[rule_id], rows[rule_id]


def test_every_recipe_field_has_a_row():
    rows = rows_by_first_cell(generated_block(FIELDS_DOC.read_text(), "fields"))
    assert list(rows) == [name for name, _ in iter_fields()]


def test_a_new_rule_changes_the_generated_table(monkeypatch):
    """Adding a rule without regenerating the docs makes the table test fail."""
    before = rules_markdown()
    some = next(iter(RULES.values()))
    monkeypatch.setitem(RULES, "zz.new_rule", replace(some, id="zz.new_rule", fix="set zz=1", gate=False))
    after = rules_markdown()
    assert after != before and "| `zz.new_rule` |" in after and "set zz=1" in after


def test_table_cells_escape_markdown_that_would_break_the_row():
    """'|' ends a cell and '*' starts emphasis: the pipeline rule's '|' and the '*E' patterns."""
    rows = rows_by_first_cell(rules_markdown())
    pipeline = rows["parallel.pipeline_layout"]
    assert "'\\|'" in pipeline and pipeline.count(" | ") == 3  # four cells, three separators
    assert "'\\*E'" in rows["model.pattern_matches_architecture"]


def _stale_copies(tmp_path: Path) -> dict[Path, str]:
    """Copies of the home files under tmp_path (same relative paths) with both tables replaced by junk."""
    stale = {}
    for home in {HOMES[name] for name in BLOCKS}:
        fresh = (ROOT / home).read_text()
        text = fresh.replace(rules_markdown(), "| stale |\n").replace(fields_markdown(), "| old |\n")
        assert text != fresh
        (tmp_path / home).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / home).write_text(text)
        stale[tmp_path / home] = text
    return stale


def test_write_with_no_file_regenerates_every_table_in_its_home(tmp_path, monkeypatch, capsys):
    stale = _stale_copies(tmp_path)
    monkeypatch.setattr(rules_docs, "REPO_ROOT", tmp_path)
    assert rules_main(["--write"]) == 0
    for copy in stale:
        assert copy.read_text() == (ROOT / copy.relative_to(tmp_path)).read_text()
    out = capsys.readouterr().out
    assert out.count("updated") == len(stale), out


def test_write_regenerates_a_named_stale_file_in_place(tmp_path, capsys):
    copy, text = next(iter(_stale_copies(tmp_path).items()))
    assert rules_main(["--write", str(copy)]) == 0
    assert copy.read_text() == (ROOT / copy.relative_to(tmp_path)).read_text() == update_blocks(text)
    assert "updated" in capsys.readouterr().out


def test_write_refuses_a_file_without_the_markers(tmp_path, capsys):
    other = tmp_path / "OTHER.md"
    other.write_text("# no markers\n")
    assert rules_main(["--write", str(other)]) == 2
    err = capsys.readouterr().err
    assert "rules:begin" in err and str(HOMES["rules"]) in err and len(err.strip().splitlines()) == 1
    assert other.read_text() == "# no markers\n"


@pytest.mark.parametrize("bad", [dict(fix=""), dict(severities=()), dict(severities=("fatal",))])
def test_the_registry_refuses_a_rule_without_its_documentation(bad):
    from gptoss_cli.recipe.rules.core import register_rule

    some = next(iter(RULES.values()))
    with pytest.raises(ValueError, match="zz.undocumented"):
        register_rule(replace(some, id="zz.undocumented", **bad))
    assert "zz.undocumented" not in RULES


# --- the README is a front door, and every relative link in the documentation resolves ----------------------
_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
# [text](target): the text may hold one level of brackets (`[key=value ...]` in a command's name)
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^()\s]+)\)")


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The ids of a markdown file's headings (repeats get -1, -2, ... as on GitHub); code blocks skipped."""
    seen: dict[str, int] = {}
    found = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", _FENCE.sub("", text), re.M):
        slug = github_anchor(m.group(1))
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(doc: Path) -> list[str]:
    """Relative links of `doc` whose file, or whose #anchor in that file, does not exist."""
    broken = []
    for target in _LINK.findall(_FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not local
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and (dest.is_dir() or dest.suffix != ".md" or anchor not in anchors(dest.read_text())):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    return broken


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move the manual to docs/"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    assert broken_links(doc) == [], f"{doc.relative_to(ROOT)}: broken links"


def test_the_link_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## `gptoss train --recipe RECIPE [key=value ...]`\n"
                                       "```bash\n# not a heading\n```\n## Title\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](other.md) [ok](other.md#gptoss-train---recipe-recipe-keyvalue-) [ok](other.md#title-1)\n"
                   "[`x [y]`](#here) [web](https://example.com/nowhere.md)\n## Here\n"
                   "[gone](missing.md) [bad](other.md#not-a-heading) [bad](#nowhere) [bad](other.md#title-2)\n"
                   "```\n[inside code](also-missing.md)\n```\n")
    assert broken_links(doc) == [
        "missing.md (no such file)",
        "other.md#not-a-heading (no heading #not-a-heading in other.md)",
        "#nowhere (no heading #nowhere in doc.md)",
        "other.md#title-2 (no heading #title-2 in other.md)",
    ]



# Folders the code map describes as a whole (each file's job is the folder's, or named by kind).
MAPPED_AS_A_WHOLE = {"cli", "parity", "schedule", "fp8", "recipe/rules"}


def code_map(doc: Path) -> str:
    text = doc.read_text()
    return text[text.index("## Layout of the code"):]


def unnamed_modules(package: Path, text: str) -> list[str]:
    """Modules of `package` whose file name the code map does not mention (`plan.py` is not named
    by `recompute_plan.py`)."""
    missing = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if path.name in ("__init__.py", "__main__.py") or rel.parent.as_posix() in MAPPED_AS_A_WHOLE:
            continue
        if not re.search(rf"(?<![\w.]){re.escape(path.name)}", text):
            missing.append(rel.as_posix())
    return missing


def test_the_code_map_names_every_module():
    """docs/architecture.md's layout is how a newcomer finds a file: a module it does not name is
    a module nobody will find (issue 21 moved a dozen; the map must follow the next move too)."""
    missing = unnamed_modules(ROOT / "gptoss_cli", code_map(ROOT / "docs" / "architecture.md"))
    assert not missing, f"docs/architecture.md's code layout does not name: {missing}"


def test_the_code_map_check_finds_an_unnamed_module(tmp_path):
    for rel in ("model/plan.py", "model/recompute_plan.py", "cli/new_command.py", "model/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert unnamed_modules(tmp_path, "model/  recompute_plan.py  the plan") == ["model/plan.py"]
    assert unnamed_modules(tmp_path, "recompute_plan.py, plan.py") == []
