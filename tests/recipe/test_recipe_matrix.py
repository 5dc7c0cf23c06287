"""Every recipe in recipes/ validates to the verdict docs/recipes.md states; the production matrix (docs/megatron-rules.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gptoss_cli.errors import ValidationFailed
from gptoss_cli.recipe import available_recipes, load_recipe, preflight, validate_recipe
from gptoss_cli.recipe.load import RECIPES_DIR

RECIPES_DOC = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"
GRAPHS_POLICY = "overlap.cuda_graphs"
GRAPHS_UNSUPPORTED = {"unsupported.cuda_graphs"}  # FP8 itself is implemented (gptoss_cli/fp8/)

# recipe -> (error rules for --target megatron, error rules for --target gptoss), written out by
# hand from docs/recipes.md's recipe table (which the next test parses and compares with this).
VERDICTS = {
    "gpt_oss_20b_pretrain": (set(), set()),
    "gpt_oss_20b_finetune": (set(), set()),
    "gpt_oss_120b_pretrain": (set(), set()),
    "gpt_oss_120b_finetune": (set(), set()),
    "gpt_oss_20b_sft": (set(), set()),
    "gpt_oss_120b_sft": (set(), set()),
    "gpt_oss_20b_sft_32k": (set(), set()),  # context parallel 8
    "h100_pp4_ep8": (set(), set()),  # pipeline parallel 4 x EP 8 (docs/pipeline-parallel.md)
    "tiny_cpu_pp2_ep2": (set(), set()),
    "h100_bf16": (set(), set()),  # fits 80 GB with selective recompute and bf16 gradient buffers
    "tiny_cpu_ep2": (set(), set()),
    "tiny_cpu_ep2_overlap": (set(), set()),
    "tiny_cpu_ep2_mxfp8": (set(), set()),
    "tiny_cpu_sft": (set(), set()),
    "tiny_cpu_grpo": (set(), set()),
    "gpt_oss_20b_grpo_lora": (set(), set()),
    "gpt_oss_120b_grpo_lora": (set(), set()),
    "tiny_cpu_dpo": (set(), set()),
    "gpt_oss_20b_dpo_lora": (set(), set()),
    "gpt_oss_120b_dpo_lora": (set(), set()),
    "tiny_cpu_distill": (set(), set()),
    "gpt_oss_20b_distill_from_120b": (set(), set()),  # 120B's stored top-64
    "gpt_oss_20b_distill_from_120b_on_policy": (set(), set()),  # an MXFP4 120B beside a LoRA 20B
    "gpt_oss_20b_lora": (set(), set()),
    "gpt_oss_120b_lora": (set(), set()),
    "gb200_bf16": (set(), set()),
    "gb200_fp8mx": ({"overlap.cuda_graphs"}, {"overlap.cuda_graphs", "unsupported.cuda_graphs"}),
    "gb300_fp8mx": ({"overlap.cuda_graphs"}, {"overlap.cuda_graphs", "unsupported.cuda_graphs"}),
}


def documented_verdicts() -> dict[str, tuple[set[str], set[str]]]:
    """docs/recipes.md's `| recipe | verdict |` table as {recipe: (megatron errors, gptoss errors)}.

    A recipe cell lists names separated by commas, with `a_b_c / _d` meaning a_b_c and a_b_d and
    parentheses as comments. A verdict cell is `valid`, or `invalid ...` naming the rule ids in
    backticks, then `the gptoss target adds` and the ids only the gptoss target reports."""
    lines = RECIPES_DOC.read_text().splitlines()
    start = lines.index("| recipe | verdict |") + 2  # skip the header and the |---| line
    table = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        recipes_cell, verdict = (c.strip() for c in line.strip("|").split("|"))
        names = []
        for item in re.sub(r"\([^)]*\)", "", recipes_cell).split(","):
            first, *suffixes = (part.strip() for part in item.split("/"))
            names += [first] + [first.rsplit("_", 1)[0] + suffix for suffix in suffixes]
        if verdict == "valid":
            megatron, extra = set(), set()
        else:
            assert verdict.startswith("invalid"), verdict
            common, _, added = verdict.partition("the gptoss target adds")
            megatron, extra = set(re.findall(r"`([^`]+)`", common)), set(re.findall(r"`([^`]+)`", added))
        for name in names:
            assert name not in table, f"{name} appears twice in docs/recipes.md's table"
            table[name] = (megatron, megatron | extra)
    return table


def test_documented_table_gives_every_recipe_the_verdict_the_tests_assert():
    assert documented_verdicts() == VERDICTS
    assert set(available_recipes()) == set(VERDICTS)


def test_every_recipe_file_states_its_verdict_in_a_comment():
    for name, (megatron, _) in VERDICTS.items():
        text = (RECIPES_DIR / f"{name}.yaml").read_text()
        (comment,) = re.findall(r"Verdict: (.*)", text)
        assert comment.startswith("valid" if not megatron else "invalid"), f"{name}.yaml: {comment}"
        assert all(rule in text for rule in megatron), f"{name}.yaml does not name {megatron}"


@pytest.mark.parametrize("target", ["megatron", "gptoss"])
@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_recipe_validates_to_its_verdict(name, target):
    report = validate_recipe(load_recipe(name), target=target)
    assert set(report.error_rules()) == VERDICTS[name][target == "gptoss"], report.verdict


# --- the production matrix (docs/megatron-rules.md, "CUDA graphs policy") -----------------------
@pytest.mark.parametrize("target", ["gptoss", "megatron"])
def test_gb200_bf16_is_valid(target):
    report = validate_recipe(load_recipe("gb200_bf16"), target=target)
    assert report.ok, report.verdict


def test_gb200_bf16_is_the_section_6_workload():
    cfg = load_recipe("gb200_bf16").config
    assert (cfg.parallelism.world_size, cfg.model.preset) == (64, "gpt_oss_120b")
    assert cfg.overlap.overlap_moe_expert_parallel_comm and cfg.overlap.delay_wgrad_compute
    assert (cfg.cuda_graphs.cuda_graph_impl, cfg.cuda_graphs.paged_stash) == ("none", False)
    assert not cfg.parallelism.use_megatron_fsdp and cfg.model.mtp_num_layers in (None, 0)


@pytest.mark.parametrize("name", ["gb200_fp8mx", "gb300_fp8mx"])
def test_fp8mx_full_iteration_graphs_with_overlap_are_rejected_by_policy(name):
    cfg = load_recipe(name).config
    assert (cfg.cuda_graphs.cuda_graph_impl, cfg.cuda_graphs.paged_stash) == ("full_iteration", True)
    report = validate_recipe(load_recipe(name), target="megatron")
    (policy,) = [f for f in report.errors if f.rule == GRAPHS_POLICY]
    assert "cuda_graphs.cuda_graph_impl=none cuda_graphs.paged_stash=false" in policy.hint
    assert "overlap.overlap_moe_expert_parallel_comm=false overlap.delay_wgrad_compute=false" in policy.hint


@pytest.mark.parametrize("name", ["gb200_fp8mx", "gb300_fp8mx"])
def test_fp8mx_way_out_keep_graphs_drop_overlap_is_valid_for_megatron(name):
    recipe = load_recipe(name, ["overlap.overlap_moe_expert_parallel_comm=false", "overlap.delay_wgrad_compute=false"])
    report = validate_recipe(recipe, target="megatron")
    assert report.ok, report.verdict
    assert {f.rule for f in report.notes} == GRAPHS_UNSUPPORTED


@pytest.mark.parametrize("name", ["gb200_fp8mx", "gb300_fp8mx"])
def test_fp8mx_way_out_keep_overlap_drop_graphs_is_valid_for_megatron(name):
    # HybridModel builds a schedule plan for *E, so the capability rule overlap.schedule_plan passes
    recipe = load_recipe(name, ["cuda_graphs.cuda_graph_impl=none", "cuda_graphs.paged_stash=false"])
    report = validate_recipe(recipe, target="megatron")
    assert report.ok, report.verdict
    assert {f.rule for f in report.notes} == set()  # MXFP8 is implemented (gptoss_cli/fp8/)


@pytest.mark.parametrize("name", ["gb200_fp8mx", "gb300_fp8mx"])
def test_fp8mx_with_graphs_off_is_runnable_by_gptoss(name):
    # MXFP8 is implemented: only the CUDA-graph policy stood between gptoss train and these recipes.
    recipe = load_recipe(name, ["cuda_graphs.cuda_graph_impl=none", "cuda_graphs.paged_stash=false"])
    report = validate_recipe(recipe, target="gptoss")
    assert report.ok, report.verdict
    assert {f.rule for f in report.warnings} == {"fp8.mxfp8_expert_bias"}  # native on Blackwell: no emulation


@pytest.mark.parametrize(
    "overrides, rule",
    [
        (["overlap.overlap_moe_expert_parallel_comm=false"], "delay_wgrad.requires_overlap"),
        (["parallelism.expert_model_parallel_size=1"], "overlap.requires_expert_parallel"),
        (["recompute.recompute_granularity=full", "recompute.recompute_method=uniform",
          "recompute.recompute_num_layers=1"], "overlap.recompute"),
        (["model.mtp_num_layers=2"], "overlap.mtp_num_layers"),
    ],
    ids=["delayed-wgrad-without-overlap", "overlap-with-ep1", "overlap-with-full-recompute", "mtp-2"],
)
def test_matrix_misconfigurations_are_errors_naming_the_rule(overrides, rule):
    report = validate_recipe(load_recipe("gb200_bf16", overrides), target="megatron")
    assert rule in report.error_rules()


def test_mtp_2_is_also_rejected_because_gpt_oss_has_no_mtp_layers():
    report = validate_recipe(load_recipe("gb200_bf16", ["model.mtp_num_layers=2"]), target="megatron")
    assert "model.mtp_layers" in report.error_rules()


# --- the API train calls -------------------------------------------------------------------------
def test_preflight_passes_a_runnable_recipe():
    report = preflight(load_recipe("tiny_cpu_ep2"), world_size=2)
    assert report.ok and report.data_parallel_size == 2


def test_preflight_raises_validation_failed_naming_the_rules():
    recipe = load_recipe("tiny_cpu_ep2", ["overlap.delay_wgrad_compute=true"])
    with pytest.raises(ValidationFailed) as exc:
        preflight(recipe, world_size=2)
    assert exc.value.exit_code == 1
    assert "delay_wgrad.requires_overlap" in str(exc.value)


def test_preflight_checks_the_launched_world_size():
    with pytest.raises(ValidationFailed, match="parallel.expert_world_divisible"):
        preflight(load_recipe("tiny_cpu_ep2"), world_size=3)


def test_out_of_range_values_are_reported_before_the_arithmetic():
    report = validate_recipe(load_recipe("tiny_cpu_ep2", ["parallelism.tensor_model_parallel_size=0"]))
    assert report.error_rules() == ["field.range"] and report.skipped


def test_report_json_lists_findings_with_their_counted_severity():
    report = validate_recipe(load_recipe("gb200_fp8mx"), target="megatron")
    data = report.to_dict()
    assert data["valid"] is False and data["world_size"] == 64
    counted = {f["rule"]: f["counted_as"] for f in data["findings"]}
    assert counted["unsupported.cuda_graphs"] == "note" and counted[GRAPHS_POLICY] == "error"
