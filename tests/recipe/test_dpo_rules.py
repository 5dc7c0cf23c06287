"""The dpo section's rules and its memory item: what validate-config and train's pre-flight say about a DPO recipe,
and whether the per-GPU estimate counts a frozen reference model (full fine-tuning with dpo.reference=model) or
not (LoRA: the base with the adapters off; precomputed: scored before the policy is built; simpo: none)."""

from __future__ import annotations

import json

import pytest

from gptoss_cli.recipe import load_recipe
from gptoss_cli.recipe.estimate import memory as M
from gptoss_cli.recipe.estimate.parameters import parameter_layout
from tests.preference.pairs import write_pair_file
from tests.recipe.recipe_helpers import run_rule
from tests.train.sft_files import sft_documents, write_sft_file

DPO = "tiny_cpu_dpo"


def _ids(findings):
    return [(f.rule, f.severity) for f in findings]


@pytest.mark.parametrize("overrides,message", [
    (["data.kind=mock"], "one token file: data.kind=tokens with data.path"),
    (["data.path=null"], "one token file"),
])
def test_dpo_needs_one_token_file_of_pairs(overrides, message):
    (finding,) = run_rule("dpo.inputs", overrides, recipe=DPO)
    assert finding.severity == "error" and message in finding.message


def test_a_dpo_section_without_the_kind_is_ignored_with_a_warning():
    (finding,) = run_rule("dpo.inputs", ["objective.kind=cross_entropy", "dpo.beta=0.3"], recipe=DPO)
    assert finding.severity == "warning" and finding.fields["dpo.beta"] == 0.3
    assert run_rule("dpo.inputs", ["objective.kind=cross_entropy"], recipe=DPO) == []


def test_at_launch_the_files_are_pairs_that_fit_a_row(tmp_path):
    docs, masks = sft_documents([6, 7], 1003)
    write_sft_file(tmp_path / "sft", docs, masks, 1003)
    write_pair_file(tmp_path / "pairs", [([1] * 60, [2] * 30, [3] * 40), ([1] * 5, [2], [3])], 1003)
    (bad,) = run_rule("dpo.inputs", [f"data.path={tmp_path / 'sft'}", "validation.data=null"], recipe=DPO,
                      check_paths=True)
    assert "not preference pairs" in bad.message and bad.bad_input
    (long,) = run_rule("dpo.inputs", [f"data.path={tmp_path / 'pairs'}", "validation.data=null"], recipe=DPO,
                       check_paths=True)
    assert "pair 0 has 190 tokens (both sides), more than a row of training.seq_length=128" in long.message
    assert run_rule("dpo.inputs", [f"data.path={tmp_path / 'pairs'}", "validation.data=null",
                                   "training.seq_length=190"], recipe=DPO, check_paths=True) == []


@pytest.mark.parametrize("overrides,severity,needle", [
    (["dpo.beta=0"], "error", "dpo.beta=0"),
    (["dpo.label_smoothing=0.1"], "error", "dpo.loss=sigmoid takes no label smoothing"),
    (["dpo.loss=simpo", "dpo.reference=precomputed"], "warning", "simpo is reference-free"),
])
def test_loss_settings(overrides, severity, needle):
    (finding,) = run_rule("dpo.loss", overrides, recipe=DPO)
    assert finding.severity == severity and needle in finding.message
    assert run_rule("dpo.loss", ["dpo.loss=robust", "dpo.label_smoothing=0.1"], recipe=DPO) == []


def test_where_the_reference_comes_from(tmp_path):
    (finding,) = run_rule("dpo.reference", ["dpo.reference=precomputed", "checkpoint.pretrained=null"], recipe=DPO)
    assert "checkpoint.pretrained scored once; there is none" in finding.message
    pp = ["parallelism.world_size=2", "parallelism.pipeline_model_parallel_size=2", "validation.data=null"]
    (frozen,) = run_rule("dpo.reference", pp, recipe=DPO)
    assert "frozen reference model of full fine-tuning is called outside the pipeline schedule" in frozen.message
    assert run_rule("dpo.reference", [*pp, "lora.rank=4", "lora.alpha=8", "lora.target_modules=[linear_qkv]"],
                    recipe=DPO) == []
    write_pair_file(tmp_path / "pairs", [([1] * 5, [2], [3])], 1003)
    (missing,) = run_rule("dpo.reference", [*pp, "dpo.reference=precomputed", f"data.path={tmp_path / 'pairs'}"],
                          recipe=DPO, check_paths=True)
    assert f"{tmp_path / 'pairs.reference'}: no reference scores" in missing.message and "gptoss score" in missing.hint


def _reference_bytes(overrides):
    recipe = load_recipe("gpt_oss_20b_dpo_lora", overrides)
    est = M.estimate_memory(recipe.config, recipe.arch, recipe.pattern, recipe.config.parallelism.world_size)
    return est, recipe


def test_the_frozen_reference_is_counted_only_when_it_is_in_memory():
    full = ["lora.rank=0", "lora.target_modules=[]"]
    est, recipe = _reference_bytes(full)
    params = sum(p.numel for p in parameter_layout(recipe.arch, recipe.pattern))  # EP=1: every expert
    assert est.bytes_of("dpo.reference") == 2 * params  # bf16, every parameter of the one rank
    for other in (["dpo.reference=precomputed"], ["dpo.loss=simpo"]):
        assert _reference_bytes([*full, *other])[0].bytes_of("dpo.reference") == 0
    assert _reference_bytes([])[0].bytes_of("dpo.reference") == 0  # LoRA: the base with the adapters off
    assert json.dumps(est.bytes_of("dpo.reference"))  # a plain number in --json
