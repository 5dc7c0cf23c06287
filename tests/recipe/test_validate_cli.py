"""`gptoss validate-config` through typer's CliRunner: exit codes, table, verdict, --json, --list-rules."""

from __future__ import annotations

import json
from functools import partial

import pytest

from gptoss_cli.recipe.rules import RULES
from tests.support.cli import run_cli


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """A wide console (it reads COLUMNS when it prints), so rule ids are never folded."""
    monkeypatch.setenv("COLUMNS", "200")


invoke = partial(run_cli, "validate-config")


def test_valid_recipe_exits_0_with_a_valid_verdict():
    result = invoke("tiny_cpu_ep2")
    assert result.exit_code == 0, result.output
    assert "tiny_cpu_ep2: VALID" in result.output


def test_invalid_recipe_exits_1_with_a_table_of_findings():
    result = invoke("gb200_fp8mx")
    assert result.exit_code == 1
    for text in ("overlap.cuda_graphs", "unsupported.cuda_graphs", "cuda_graphs.cuda_graph_impl=full_iteration", "fix:",
                 "gb200_fp8mx: INVALID"):
        assert text in result.output


def test_warnings_alone_exit_0():
    result = invoke("tiny_cpu_ep2", "cuda_graphs.cuda_graph_scope=[attn]")
    assert result.exit_code == 0 and "cuda_graphs.scope" in result.output and "1 warning" in result.output


def test_overrides_can_fix_a_recipe():
    assert invoke("tiny_cpu_ep2", "overlap.delay_wgrad_compute=true").exit_code == 1
    assert invoke("tiny_cpu_ep2_overlap", "overlap.overlap_moe_expert_parallel_comm=false",
                  "overlap.delay_wgrad_compute=false").exit_code == 0


def test_world_size_option_is_used():
    result = invoke("tiny_cpu_ep2", "--world-size", "3")
    assert result.exit_code == 1 and "parallel.expert_world_divisible" in result.output


def test_target_megatron_turns_unsupported_options_into_notes():
    result = invoke("tiny_cpu_ep2", "parallelism.tensor_model_parallel_size=2", "parallelism.sequence_parallel=true",
                    "parallelism.world_size=4", "--target", "megatron")
    assert result.exit_code == 0, result.output
    assert "note" in result.output and "unsupported.tensor_parallel" in result.output
    gptoss = invoke("tiny_cpu_ep2", "parallelism.tensor_model_parallel_size=2", "parallelism.sequence_parallel=true",
                    "parallelism.world_size=4")
    assert gptoss.exit_code == 1


def test_json_report(tmp_path):
    out = tmp_path / "report.json"
    result = invoke("gb200_fp8mx", "--json", str(out))
    assert result.exit_code == 1
    data = json.loads(out.read_text())
    assert data["valid"] is False and data["recipe"] == "gb200_fp8mx" and data["target"] == "gptoss"
    assert [p.rsplit("/", 1)[-1] for p in data["sources"]] == [
        "gpt_oss_common.yaml", "production_120b_64gpu.yaml", "gb200_fp8mx.yaml"]
    assert {"rule", "severity", "fields", "message", "hint", "kind", "counted_as"} <= set(data["findings"][0])


def test_missing_file_exits_2():
    result = invoke("/nonexistent/recipe.yaml")
    assert result.exit_code == 2 and "not found" in result.output


def test_not_yaml_exits_2(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: {preset: tiny\n")
    result = invoke(str(path))
    assert result.exit_code == 2 and "not valid YAML" in result.output


def test_bad_override_syntax_exits_2():
    result = invoke("tiny_cpu_ep2", "training.train_iters")
    assert result.exit_code == 2 and "key=value" in result.output


def test_unknown_key_exits_2_with_a_suggestion():
    result = invoke("tiny_cpu_ep2", "overlap.delay_wgrad=true")
    assert result.exit_code == 2 and "did you mean 'overlap.delay_wgrad_compute'" in result.output


def test_type_error_exits_2_naming_the_field():
    result = invoke("tiny_cpu_ep2", "training.train_iters=many")
    assert result.exit_code == 2 and "training.train_iters='many'" in result.output


def test_bad_target_exits_2():
    assert invoke("tiny_cpu_ep2", "--target", "nemo").exit_code == 2


def test_missing_recipe_argument_exits_2_listing_recipes():
    result = invoke()
    assert result.exit_code == 2 and "tiny_cpu_ep2" in result.output


def test_list_rules_shows_every_rule():
    result = invoke("--list-rules")
    assert result.exit_code == 0
    for rule_id in RULES:
        assert rule_id in result.output


def test_list_fields_shows_every_schema_field():
    from gptoss_cli.recipe.schema import iter_fields

    result = invoke("--list-fields")
    assert result.exit_code == 0
    for name, _ in iter_fields():
        assert name in result.output


def test_help_has_an_example():
    result = invoke("--help")
    assert result.exit_code == 0 and "Example: gptoss validate-config" in result.output
