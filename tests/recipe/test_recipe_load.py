"""Loading recipes: finding the file, bases and overrides, type errors, the model the recipe describes."""

from __future__ import annotations

import json

import pytest

from gptoss_cli.errors import ConfigError
from gptoss_cli.checkpoint.formats.hf.config import to_hf_config
from gptoss_cli.model.config import PRESETS
from gptoss_cli.recipe.load import RECIPES_DIR, available_recipes, load_recipe, parse_overrides
from gptoss_cli.recipe.schema import RecipeConfig, describe_schema, iter_fields


def _write(path, text):
    path.write_text(text)
    return path


def test_bare_name_finds_the_repository_recipe():
    recipe = load_recipe("tiny_cpu_ep2")
    assert recipe.path == RECIPES_DIR / "tiny_cpu_ep2.yaml"
    assert recipe.name == "tiny_cpu_ep2"


def test_name_with_yaml_suffix_and_path_both_work():
    assert load_recipe("tiny_cpu_ep2.yaml").path == load_recipe(str(RECIPES_DIR / "tiny_cpu_ep2.yaml")).path


def test_bases_merge_in_order_then_the_file_then_overrides():
    recipe = load_recipe("tiny_cpu_ep2", ["training.train_iters=5"])
    names = [p.name for p in recipe.sources]
    assert names == ["gpt_oss_common.yaml", "tiny_cpu.yaml", "tiny_cpu_ep2.yaml"]
    cfg = recipe.config
    assert cfg.optimizer.adam_beta2 == 0.95  # from gpt_oss_common
    assert cfg.training.seq_length == 32  # tiny_cpu overrides gpt_oss_common's 4096
    assert cfg.checkpoint.dir == "runs/tiny_cpu_ep2/checkpoints"  # the file itself
    assert cfg.training.train_iters == 5  # the override


def test_bases_resolve_relative_to_the_recipe_file(tmp_path):
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub" / "b.yaml", "model: {preset: tiny}\ntraining: {seed: 7}\n")
    recipe = load_recipe(_write(tmp_path / "r.yaml", "base: sub/b.yaml\ntraining: {seed: 8}\n"))
    assert recipe.config.training.seed == 8 and recipe.config.model.preset == "tiny"


def test_base_cycle_is_a_config_error(tmp_path):
    _write(tmp_path / "a.yaml", "base: b.yaml\n")
    _write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_recipe(tmp_path / "a.yaml")


def test_missing_base_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="base recipe 'nope.yaml' not found"):
        load_recipe(_write(tmp_path / "r.yaml", "base: nope.yaml\n"))


def test_missing_recipe_suggests_close_names():
    with pytest.raises(ConfigError) as exc:
        load_recipe("tiny_cpu_ep")
    assert "tiny_cpu_ep2" in str(exc.value)


def test_not_yaml_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_recipe(_write(tmp_path / "r.yaml", "model: [unclosed\n"))


def test_yaml_that_is_not_a_mapping_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not a YAML mapping"):
        load_recipe(_write(tmp_path / "r.yaml", "- a\n- b\n"))


def test_binary_file_is_a_config_error(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(b"\xff\xfe\x00\x01model")
    with pytest.raises(ConfigError):
        load_recipe(path)


def test_unquoted_pattern_in_yaml_gets_a_quoting_hint(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_recipe(_write(tmp_path / "r.yaml", "model: {preset: tiny, hybrid_layer_pattern: *E*E*E}\n"))
    assert "quote" in str(exc.value)


def test_unknown_key_gets_did_you_mean():
    with pytest.raises(ConfigError) as exc:
        load_recipe("tiny_cpu_ep2", ["overlap.overlap_moe_expert_parallel_com=true"])
    assert "did you mean 'overlap.overlap_moe_expert_parallel_comm'" in str(exc.value)


def test_field_at_top_level_is_pointed_to_its_group():
    with pytest.raises(ConfigError, match="did you mean 'training.train_iters'"):
        load_recipe("tiny_cpu_ep2", ["train_iters=3"])


def test_a_replaced_field_names_its_replacement_in_one_line(tmp_path):
    recipe = _write(tmp_path / "old.yaml", "base: tiny_cpu_ep2\nrl: {rollout: {is_cap: 2.0}}\n")
    with pytest.raises(ConfigError) as exc:
        load_recipe(recipe)
    assert "rl.rollout.is_cap was replaced by rl.is_max" in str(exc.value) and "\n" not in str(exc.value)


def test_unknown_architecture_field_gets_did_you_mean():
    with pytest.raises(ConfigError, match="model.architecture.num_hidden_layers"):
        load_recipe("tiny_cpu_ep2", ["model.architecture.num_hiden_layers=2"])


def test_type_error_names_field_and_value():
    with pytest.raises(ConfigError) as exc:
        load_recipe("tiny_cpu_ep2", ["parallelism.expert_model_parallel_size=two"])
    assert "parallelism.expert_model_parallel_size='two'" in str(exc.value)
    assert "integer" in str(exc.value)


def test_unknown_choice_gets_did_you_mean():
    with pytest.raises(ConfigError, match="did you mean 'alltoall'"):
        load_recipe("tiny_cpu_ep2", ["moe.token_dispatcher_type=alltoal"])


def test_list_items_are_checked_against_their_choices():
    with pytest.raises(ConfigError, match="recompute.recompute_modules='attn'"):
        load_recipe("tiny_cpu_ep2", ["recompute.recompute_modules=[attn]"])


@pytest.mark.parametrize("item", ["noequals", "a..b=1", "=3", "training.lr"])
def test_bad_override_syntax_is_a_config_error(item):
    with pytest.raises(ConfigError):
        parse_overrides([item])


def test_override_values_are_yaml():
    assert parse_overrides(["a.b=null", "a.c=true", "a.d=[x, y]", "e=1e-4"]) == {
        "a": {"b": None, "c": True, "d": ["x", "y"]}, "e": 1e-4}


def test_unquoted_pattern_override_is_taken_as_text():
    recipe = load_recipe("tiny_cpu_ep2", ["model.hybrid_layer_pattern=*E*E*E"])
    assert recipe.pattern.layers == ("*", "E") * 3


def test_bad_pattern_symbol_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown symbol 'X'"):
        load_recipe("tiny_cpu_ep2", ["model.hybrid_layer_pattern=*X"])


def test_preset_gives_the_architecture_and_default_pattern():
    recipe = load_recipe("gb200_bf16")
    assert recipe.arch == PRESETS["gpt_oss_120b"]
    assert recipe.pattern.text == "*E" * 36


def test_architecture_overrides_apply_and_rederive_the_pattern():
    recipe = load_recipe("tiny_cpu_ep2", ["model.architecture.num_hidden_layers=2"])
    assert recipe.arch.num_hidden_layers == 2 and recipe.pattern.text == "*E*E"


def test_invalid_architecture_override_is_a_config_error():
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        load_recipe("tiny_cpu_ep2", ["model.architecture.num_key_value_heads=4"])


def test_no_model_is_a_config_error():
    with pytest.raises(ConfigError, match="model.preset or model.checkpoint"):
        load_recipe("tiny_cpu_ep2", ["model.preset=null"])


def test_preset_and_checkpoint_together_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="both set"):
        load_recipe("tiny_cpu_ep2", [f"model.checkpoint={tmp_path}"])


def test_checkpoint_hybrid_config_gives_architecture_and_pattern(tmp_path):
    arch = PRESETS["tiny"].replace(num_hidden_layers=2)
    (tmp_path / "hybrid_config.json").write_text(json.dumps(
        {"architecture": arch.to_dict(), "hybrid_layer_pattern": "[*E][*E]"}))
    recipe = load_recipe("tiny_cpu_ep2", ["model.preset=null", f"model.checkpoint={tmp_path}"])
    assert recipe.arch == arch and recipe.pattern.text == "[*E][*E]"


def test_checkpoint_hf_config_gives_architecture(tmp_path):
    arch = PRESETS["tiny"]
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(arch)))
    recipe = load_recipe("tiny_cpu_ep2", ["model.preset=null", f"model.checkpoint={tmp_path}"])
    assert recipe.arch == arch


def test_missing_checkpoint_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe("tiny_cpu_ep2", ["model.preset=null", f"model.checkpoint={tmp_path / 'nope'}"])


def test_resolved_recipe_round_trips_through_yaml(tmp_path):
    recipe = load_recipe("gb200_fp8mx")
    again = load_recipe(_write(tmp_path / "r.yaml", recipe.to_yaml()))
    assert again.config == recipe.config


def test_every_schema_field_is_documented():
    rows = describe_schema()
    assert len(rows) == len(list(iter_fields())) > 60
    assert all(help_text for _, _, help_text in rows)


def test_defaults_build_without_a_file():
    assert RecipeConfig().parallelism.expert_model_parallel_size == 1


def test_available_recipes_excludes_bases():
    names = available_recipes()
    assert "tiny_cpu_ep2" in names and not any(n.startswith("gpt_oss_common") for n in names)
