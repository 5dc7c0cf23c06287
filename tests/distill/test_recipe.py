"""objective.kind=distill as a recipe: its rules beyond tests/recipe/test_recipe_rules.py's one case each, the
shipped recipes' verdicts, and the teacher in the per-GPU estimate against the bytes a built teacher holds."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.model.build import build_model
from gptoss_cli.model.config import preset
from gptoss_cli.model.pattern import parse_pattern
from gptoss_cli.recipe.estimate import memory as M
from gptoss_cli.recipe.load import load_recipe
from gptoss_cli.recipe.validate import validate_recipe
from tests.recipe.recipe_helpers import run_rule

ON_POLICY = ["distill.teacher=model", "distill.top_k=0", "distill.teacher_checkpoint=t", "distill.on_policy=true", "distill.loss=reverse_kl",
             "rl.prompts=builtin:arithmetic", "rl.tokenizer=TOK", "rl.max_new_tokens=8", "rl.group_size=2"]


def _errors(rule_id, overrides, recipe="tiny_cpu_distill"):
    return [f for f in run_rule(rule_id, overrides, recipe) if f.severity == "error"]


@pytest.mark.parametrize("name", ["gpt_oss_20b_distill_from_120b", "gpt_oss_20b_distill_from_120b_on_policy",
                                  "tiny_cpu_distill"])
def test_the_shipped_distillation_recipes_are_valid_and_fit(name):
    report = validate_recipe(load_recipe(name))
    assert [f for f in report.findings if f.severity == "error"] == []
    est = report.memory
    if est.capacity_bytes:  # the H100 recipes: below the 90% the memory rule warns at
        assert est.total_bytes < 0.9 * est.capacity_bytes


def test_on_policy_needs_a_model_teacher_prompts_and_the_rollout_temperature():
    assert _errors("distill.inputs", [*ON_POLICY, "distill.teacher=precomputed", "distill.scores=s", "distill.top_k=4"])
    assert _errors("rl.inputs", [o for o in ON_POLICY if not o.startswith("rl.prompts")])
    found = _errors("distill.loss", [*ON_POLICY, "distill.temperature=0.5"])
    assert found and found[0].fields["rl.temperature"] == 1.0 and found[0].fields["distill.temperature"] == 0.5
    assert _errors("distill.loss", [*ON_POLICY, "distill.loss=forward_kl"])
    assert not _errors("distill.loss", ON_POLICY) and not _errors("rl.inputs", ON_POLICY)
    # the rl section's layout rules hold on-policy, validation excepted (it scores the student's cross-entropy)
    assert _errors("rl.layout", [*ON_POLICY, "parallelism.context_parallel_size=2", "parallelism.world_size=2"])
    assert not _errors("rl.layout", [*ON_POLICY, "validation.data=data/val"])


def test_a_precomputed_teacher_needs_one_token_file_and_a_k():
    assert _errors("distill.inputs", ["distill.top_k=0"])
    assert _errors("distill.inputs", ["data.kind=mock"])
    assert not _errors("distill.inputs", [])


def test_the_teacher_and_student_vocabularies_must_agree_naming_both():
    found = _errors("distill.teacher", ["distill.teacher_preset=gpt_oss_120b"])
    assert found and found[0].fields == {"teacher vocab_size": 201088, "student vocab_size": 1003}
    assert not _errors("distill.teacher", ["distill.teacher_preset=tiny"])


def test_the_model_teacher_in_the_estimate_is_what_a_built_teacher_holds():
    """The tiny teacher with MXFP4 experts, built as distill/teacher.py builds it (its experts as blocks and
    scales): its parameters' and buffers' bytes are the estimate's teacher item."""
    overrides = ["distill.teacher=model", "distill.teacher_preset=tiny", "distill.teacher_experts=mxfp4",
                 "distill.top_k=0"]
    recipe = load_recipe("tiny_cpu_distill", overrides)
    est = M.estimate_memory(recipe.config, recipe.arch, recipe.pattern, 1)
    tiny = preset("tiny")
    model = build_model(tiny, parse_pattern(tiny.hybrid_layer_pattern), dtype=torch.float32, base_experts="mxfp4")
    held = sum(t.numel() * t.element_size() for name, t in [*model.named_parameters(), *model.named_buffers()]
               if not name.endswith("inv_freq"))  # RoPE's 8 frequencies: not weights
    assert est.bytes_of("distill.teacher") == held
    seq = recipe.config.training.seq_length
    assert est.bytes_of("distill.teacher_hidden") == seq * tiny.hidden_size * 4  # fp32, one row of seq_length
    precomputed = M.estimate_memory(load_recipe("tiny_cpu_distill").config, recipe.arch, recipe.pattern, 1)
    assert precomputed.bytes_of("distill.teacher") == 0 and precomputed.bytes_of("distill.topk") == seq * (12 * 16 + 4)
