"""Property: random overrides (wrong types, unknown keys, extreme values) never produce a traceback.

Loading either succeeds or raises one of our error types; validation always returns a report whose
findings come from registered rules (a rule that crashed would show up as "rule crashed").
"""

from __future__ import annotations

import dataclasses
import json

from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gptoss_cli.cli import app
from gptoss_cli.errors import GptossError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.recipe import available_recipes, load_recipe, validate_recipe
from gptoss_cli.recipe.rules import RULES
from gptoss_cli.recipe.schema import iter_fields

SCHEMA_KEYS = [name for name, _ in iter_fields()]
ARCH_KEYS = [f"model.architecture.{f.name}" for f in dataclasses.fields(GptOssArch)]
GROUPS = sorted({k.split(".")[0] for k in SCHEMA_KEYS})

# Real field names dominate so that most examples get past loading and exercise the rules.
keys = st.one_of(
    st.sampled_from(SCHEMA_KEYS),
    st.sampled_from(SCHEMA_KEYS),
    st.sampled_from(SCHEMA_KEYS),
    st.sampled_from(ARCH_KEYS),
    st.sampled_from(GROUPS),
    st.from_regex(r"[a-z_]{1,12}(\.[a-z_]{1,12}){0,2}", fullmatch=True),
)
values = st.one_of(
    st.integers(min_value=-(10**20), max_value=10**20).map(str),
    st.sampled_from(["0", "-1", "1", "2", "3", "64", "4097", "131073", "1e30", "-1e-30", ".nan", ".inf", "-.inf"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.booleans().map(lambda b: str(b).lower()),
    st.just("null"),
    st.text(max_size=16),
    st.sampled_from(["[]", "[1, 2]", "[attn, moe]", "{a: 1}", "${nope}", "${oc.env:HOME}", "*E*E", "[*E]",
                     "'", "[", "tiny", "gpt_oss_120b", "mxfp8", "full_iteration", "full", "flex", "cpu", "\x00"]),
)
overrides = st.lists(st.tuples(keys, values).map(lambda kv: f"{kv[0]}={kv[1]}"), max_size=4)
recipes = st.sampled_from(available_recipes())


@settings(max_examples=200)  # the rest comes from the profile in tests/conftest.py (derandomised)
@given(recipe=recipes, items=overrides, target=st.sampled_from(["gptoss", "megatron"]),
       world=st.one_of(st.none(), st.integers(min_value=1, max_value=10**6)))
def test_random_overrides_give_a_report_or_our_error(recipe, items, target, world):
    try:
        loaded = load_recipe(recipe, items)
    except GptossError as exc:
        assert exc.exit_code == 2 and exc.message
        return
    report = validate_recipe(loaded, world_size=world, target=target)
    for f in report.findings:
        assert f.rule in RULES and "rule crashed" not in f.message, f
    json.dumps(report.to_dict(), default=str)
    assert report.verdict


runner = CliRunner()


@settings(max_examples=40)
@given(recipe=recipes, items=overrides)
def test_cli_never_shows_a_traceback(recipe, items):
    result = runner.invoke(app, ["validate-config", recipe, *items])
    assert result.exit_code in (0, 1, 2), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
