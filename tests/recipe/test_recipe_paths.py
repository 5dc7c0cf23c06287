"""Recipes as users write them (issue 53): checkpoint.dir=null turns checkpoints off whatever else the
checkpoint section says; a recipe inherits a shipped recipe by name, as --recipe finds it; a missing tiny
model names make-tiny."""

from __future__ import annotations

import pytest

from gptoss_cli.errors import ConfigError
from gptoss_cli.recipe.load import RECIPES_DIR, available_recipes, load_recipe
from gptoss_cli.recipe.validate import validate_recipe
from tests.recipe.recipe_helpers import run_rule


@pytest.mark.parametrize("name", available_recipes())
def test_checkpoint_dir_null_turns_checkpoints_off_in_every_shipped_recipe(name):
    findings = run_rule("checkpoint.settings", ["checkpoint.dir=null"], recipe=name)
    assert all(f.severity == "warning" for f in findings), [f.message for f in findings]


def test_settings_without_a_checkpoint_dir_are_a_warning_naming_them():
    findings = run_rule("checkpoint.settings", ["checkpoint.dir=null", "checkpoint.keep_last=2",
                                                "checkpoint.save_interval=5"])
    assert [f.severity for f in findings] == ["warning"]
    assert "no checkpoint" in findings[0].message and "checkpoint.keep_last" in findings[0].message
    assert findings[0].fields["checkpoint.dir"] is None


def test_a_recipe_inherits_a_shipped_recipe_by_name(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("base: tiny_cpu_sft\ntraining: {train_iters: 30}\n")
    recipe = load_recipe(mine)
    shipped = load_recipe("tiny_cpu_sft")
    assert recipe.config.training.train_iters == 30
    assert recipe.config.training.seq_length == shipped.config.training.seq_length
    assert recipe.sources[0] == (RECIPES_DIR / "bases" / "gpt_oss_common.yaml").resolve()
    assert (RECIPES_DIR / "tiny_cpu_sft.yaml").resolve() in recipe.sources


def test_a_copied_recipe_finds_its_shipped_bases(tmp_path):
    """A shipped recipe copied out of recipes/ names `bases/tiny_cpu.yaml`, relative to recipes/."""
    mine = tmp_path / "mine.yaml"
    mine.write_text((RECIPES_DIR / "tiny_cpu_sft.yaml").read_text())
    assert load_recipe(mine).config.training == load_recipe("tiny_cpu_sft").config.training


def test_a_local_base_comes_before_a_shipped_one_and_a_missing_name_says_where_it_looked(tmp_path):
    (tmp_path / "tiny_cpu_sft.yaml").write_text("model: {preset: tiny}\ntraining: {seed: 77}\n")
    mine = tmp_path / "mine.yaml"
    mine.write_text("base: tiny_cpu_sft.yaml\n")
    assert load_recipe(mine).config.training.seed == 77
    mine.write_text("base: no_such_recipe\n")
    with pytest.raises(ConfigError, match="base recipe 'no_such_recipe' not found") as err:
        load_recipe(mine)
    assert "shipped recipe" in str(err.value)


def test_a_missing_tiny_model_names_make_tiny(tmp_path):
    tiny = run_rule("checkpoint.settings", [f"checkpoint.pretrained={tmp_path / 'tiny-hf'}"], check_paths=True)
    assert [f.severity for f in tiny] == ["error"] and f"gptoss make-tiny {tmp_path / 'tiny-hf'}" in tiny[0].hint
    big = validate_recipe(load_recipe("gpt_oss_20b_sft", [f"checkpoint.pretrained={tmp_path / 'm'}"]),
                          target="gptoss", check_paths=True)
    hints = [f.hint for f in big.findings if f.rule == "checkpoint.settings"]
    assert hints and "gptoss convert" in hints[0] and "make-tiny" not in hints[0]
