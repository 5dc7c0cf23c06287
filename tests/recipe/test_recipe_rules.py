"""Each rule of the registry, triggered and not triggered (on the tiny CPU recipe with overrides)."""

from __future__ import annotations

import json

import pytest

from gptoss_cli.recipe.rules import RULES, SEMANTIC, UNSUPPORTED, list_rules
from gptoss_cli.recipe.rules.overlap import schedule_plan_capability
from tests.recipe.recipe_helpers import OVERLAP, make_ctx, run_rule

W4 = ["parallelism.world_size=4"]
MX = ["precision.fp8_recipe=mxfp8"]
LORA = ["lora.rank=4", "lora.target_modules=[linear_qkv, linear_fc1]"]

# rule id -> (overrides that trigger it, expected severity, overrides that keep it quiet).
# The quiet case differs from the trigger only in what the rule is about.
GRPO = ["objective.kind=grpo", "rl.prompts=builtin:arithmetic", "rl.tokenizer=TOK", "rl.max_new_tokens=8",
        "rl.group_size=2"]
DISTILL = ["objective.kind=distill", "distill.teacher_checkpoint=checkpoints/teacher"]
CASES = {
    "field.range": (["training.micro_batch_size=0"], "error", ["training.micro_batch_size=1"]),
    "model.pattern_matches_architecture": (
        ["model.hybrid_layer_pattern=*E*E"], "error", ["model.hybrid_layer_pattern=[*E][*E][*E]"]),
    "model.mtp_layers": (["model.mtp_num_layers=2"], "error", ["model.mtp_num_layers=0"]),
    "model.attention_backend": (
        ["model.attention_backend=flash", "system.device=cuda"], "error", ["model.attention_backend=auto", "system.device=cuda"]),
    "model.seq_within_positions": (
        ["model.architecture.max_position_embeddings=16"], "error", ["model.architecture.max_position_embeddings=32"]),
    "parallel.world_size_consistent": (
        ["parallelism.nodes=1", "parallelism.gpus_per_node=4"], "error",
        ["parallelism.nodes=1", "parallelism.gpus_per_node=2"]),
    "parallel.world_divisible": (["parallelism.tensor_model_parallel_size=3"], "error", []),
    "parallel.expert_world_divisible": (["parallelism.expert_model_parallel_size=4"], "error", []),
    "parallel.data_parallel_consistent": (
        ["parallelism.data_parallel_size=4"], "error", ["parallelism.data_parallel_size=2"]),
    "parallel.experts_divisible": (
        ["parallelism.expert_model_parallel_size=3", "parallelism.world_size=6"], "error",
        ["parallelism.expert_model_parallel_size=4", "parallelism.world_size=4"]),
    "parallel.heads_divisible": (
        ["parallelism.tensor_model_parallel_size=4", *W4], "error", ["parallelism.tensor_model_parallel_size=2"]),
    "parallel.batch_divisible": (["training.global_batch_size=6"], "error", ["training.global_batch_size=12"]),
    "parallel.pipeline_layout": (
        ["parallelism.pipeline_model_parallel_size=2", *W4], "error",
        ["parallelism.pipeline_model_parallel_size=2", *W4, "parallelism.pipeline_model_parallel_layout=Et*2|tL"]),
    "parallel.pipeline_schedule": (
        ["parallelism.pipeline_model_parallel_size=2", *W4, "parallelism.pipeline_schedule=dualpipev"], "error",
        ["parallelism.pipeline_model_parallel_size=2", *W4, "parallelism.pipeline_schedule=zbv_zero_bubble",
         "parallelism.virtual_pipeline_model_parallel_size=2"]),
    "parallel.context_parallel_heads": (
        ["parallelism.context_parallel_size=4", *W4], "error", ["parallelism.context_parallel_size=2", *W4]),
    "parallel.context_parallel_combinations": (
        ["parallelism.context_parallel_size=2", *W4, "moe.aux_loss_coeff=0.01"], "error",
        ["parallelism.context_parallel_size=2", *W4, "moe.aux_loss_coeff=0"]),
    "parallel.context_parallel_seq": (
        ["parallelism.context_parallel_size=2", *W4, "training.seq_length=31"], "error",
        ["parallelism.context_parallel_size=2", *W4, "training.seq_length=32"]),
    "parallel.sequence_parallel": (["parallelism.sequence_parallel=true"], "warning", []),
    "moe.sequence_parallel_with_tp": (
        ["parallelism.tensor_model_parallel_size=2", *W4], "error",
        ["parallelism.tensor_model_parallel_size=2", *W4, "parallelism.sequence_parallel=true"]),
    "moe.capacity_factor": (["moe.capacity_factor=0"], "error", ["moe.capacity_factor=1.25"]),
    "moe.shared_expert_overlap": (["moe.shared_expert_overlap=true"], "error", []),
    "moe.router_loss_scale": (["moe.aux_loss_coeff=0.9"], "warning", ["moe.aux_loss_coeff=0.01", "moe.z_loss_coeff=1e-3"]),
    "overlap.requires_expert_parallel": (
        [*OVERLAP, "parallelism.expert_model_parallel_size=1"], "error", OVERLAP),
    "overlap.requires_multiple_experts": (
        [*OVERLAP, "model.architecture.num_local_experts=1", "model.architecture.num_experts_per_tok=1"], "error",
        OVERLAP),
    "overlap.dispatcher": ([*OVERLAP, "moe.token_dispatcher_type=allgather"], "error",
                           [*OVERLAP, "moe.token_dispatcher_type=flex"]),
    "overlap.precision": ([*OVERLAP, "precision.params_dtype=fp32"], "error", [*OVERLAP, "precision.params_dtype=fp16"]),
    "overlap.recompute": (
        [*OVERLAP, "recompute.recompute_granularity=full", "recompute.recompute_method=uniform",
         "recompute.recompute_num_layers=1"], "error",
        [*OVERLAP, "recompute.recompute_granularity=selective", "recompute.recompute_modules=[core_attn]"]),
    "overlap.shared_expert_overlap": ([*OVERLAP, "moe.shared_expert_overlap=true"], "error", OVERLAP),
    "overlap.mtp_num_layers": ([*OVERLAP, "model.mtp_num_layers=2"], "error", [*OVERLAP, "model.mtp_num_layers=1"]),
    "overlap.pipeline_requires_virtual": (
        [*OVERLAP, "parallelism.pipeline_model_parallel_size=2", *W4], "error",
        [*OVERLAP, "parallelism.pipeline_model_parallel_size=2", *W4,
         "parallelism.virtual_pipeline_model_parallel_size=3"]),
    "overlap.cuda_graphs": ([*OVERLAP, "cuda_graphs.cuda_graph_impl=full_iteration"], "error", OVERLAP),
    "delay_wgrad.requires_overlap": (
        ["overlap.delay_wgrad_compute=true"], "error", [*OVERLAP, "overlap.delay_wgrad_compute=true"]),
    "cuda_graphs.paged_stash_requires_full_iteration": (
        ["cuda_graphs.paged_stash=true"], "error",
        ["cuda_graphs.paged_stash=true", "cuda_graphs.cuda_graph_impl=full_iteration", "system.device=cuda"]),
    "cuda_graphs.requires_cuda": (
        ["cuda_graphs.cuda_graph_impl=local"], "error", ["cuda_graphs.cuda_graph_impl=local", "system.device=cuda"]),
    "cuda_graphs.scope": (
        ["cuda_graphs.cuda_graph_scope=[attn]"], "warning",
        ["cuda_graphs.cuda_graph_scope=[attn]", "cuda_graphs.cuda_graph_impl=local"]),
    "recompute.settings": (
        ["recompute.recompute_granularity=full"], "error",
        ["recompute.recompute_granularity=full", "recompute.recompute_method=block", "recompute.recompute_num_layers=2"]),
    "recompute.layers": (
        ["recompute.recompute_granularity=full", "recompute.recompute_method=block", "recompute.recompute_num_layers=7"],
        "error",
        ["recompute.recompute_granularity=full", "recompute.recompute_method=block", "recompute.recompute_num_layers=6"]),
    "fp8.mxfp8_dims": ([*MX, "model.architecture.hidden_size=48"], "error", MX),
    "fp8.native_gpu": ([*MX, "system.device=cuda", "system.gpu=h100"], "error",
                       [*MX, "system.device=cuda", "system.gpu=gb200"]),
    "fp8.mxfp8_expert_bias": (MX, "warning", ["precision.fp8_recipe=tensorwise"]),
    "qat.mxfp4_dims": (["precision.qat=mxfp4", "model.architecture.intermediate_size=48"], "error",
                       ["precision.qat=mxfp4"]),
    "qat.fp8_recipe": (["precision.qat=mxfp4", "precision.fp8_recipe=rowwise", "precision.fp8_emulation=true"], "error",
                       ["precision.qat=mxfp4", *MX, "precision.fp8_emulation=true"]),
    "training.lr_schedule": (["training.min_lr=0.01"], "error", ["training.min_lr=0.001"]),
    "optimizer.betas": (["optimizer.adam_beta2=1.0"], "error", ["optimizer.adam_beta2=0.999"]),
    "optimizer.param_gather": (
        ["overlap.overlap_param_gather=true"], "error",
        ["overlap.overlap_param_gather=true", "overlap.overlap_grad_reduce=true"]),
    "data.source": (["data.kind=tokens"], "error", ["data.kind=tokens", "data.path=data/tokens"]),
    "checkpoint.settings": (["checkpoint.dir=null"], "warning", ["checkpoint.dir=null", "checkpoint.save_interval=null"]),
    "checkpoint.retention": (["checkpoint.keep_every=5"], "warning", ["checkpoint.keep_every=5", "checkpoint.keep_last=2"]),
    "checkpoint.async_save": (["checkpoint.async_save=true", "checkpoint.dir=null", "checkpoint.save_interval=null"],
                              "warning", ["checkpoint.async_save=true"]),
    "checkpoint.save_on_signal": ([*GRPO, "checkpoint.save_on_signal=true", "rl.steps_per_rollout=2",
                                   "training.train_iters=4", "checkpoint.save_interval=2"], "warning",
                                  [*GRPO, "checkpoint.save_on_signal=true", "rl.steps_per_rollout=1"]),
    "validation.source": (["validation.interval=10"], "warning", ["validation.interval=10", "validation.data=data/val"]),
    # ~130 GB per GPU: 4M tokens per microbatch of the tiny model's activations and logits
    "memory.fits": (["system.gpu=h100", "training.seq_length=65536", "training.micro_batch_size=128"], "error",
                    ["system.gpu=gb300", "training.seq_length=65536", "training.micro_batch_size=128"]),
    "system.backend": (["parallelism.backend=nccl"], "error", ["parallelism.backend=auto"]),
    "lora.targets": (["lora.rank=4", "lora.target_modules=[linear_qkv, linear_qkv]"], "error",
                     ["lora.rank=4", "lora.target_modules=[linear_qkv]"]),
    "lora.rank": ([*LORA, "lora.rank=65"], "error", [*LORA, "lora.rank=48"]),
    "lora.base": (LORA, "error", [*LORA, "checkpoint.pretrained=checkpoints/base"]),
    "lora.base_experts": (["lora.base_experts=mxfp4"], "error", [*LORA, "lora.base_experts=mxfp4"]),
    "rl.inputs": (["objective.kind=grpo"], "error", [*GRPO]),
    "rl.sampling": ([*GRPO, "rl.temperature=0"], "error", [*GRPO, "rl.temperature=0.7"]),
    "rl.batch": ([*GRPO, "rl.group_size=5"], "error", [*GRPO]),
    "rl.checkpoints": ([*GRPO, "rl.steps_per_rollout=2", "training.train_iters=3"], "error",
                       [*GRPO, "rl.steps_per_rollout=2", "training.train_iters=4", "checkpoint.save_interval=2"]),
    "rl.layout": ([*GRPO, "parallelism.pipeline_model_parallel_size=2", "parallelism.world_size=4"], "error",
                  [*GRPO, "parallelism.world_size=4"]),
    "rl.routing_replay": ([*GRPO, "rl.routing_replay=rollout", "rl.rollout.engine=vllm", "system.gpu=none"], "error",
                         [*GRPO, "rl.routing_replay=rollout", "rl.rollout.engine=vllm", "system.gpu=h100"]),
    "dpo.inputs": (["objective.kind=dpo"], "error", ["objective.kind=dpo", "data.kind=tokens", "data.path=data/pairs"]),
    "dpo.loss": (["objective.kind=dpo", "dpo.label_smoothing=0.1"], "error",
                 ["objective.kind=dpo", "dpo.loss=robust", "dpo.label_smoothing=0.1"]),
    "dpo.reference": (["objective.kind=dpo", "dpo.reference=precomputed"], "error",
                      ["objective.kind=dpo", "dpo.reference=precomputed", "checkpoint.pretrained=checkpoints/base"]),
    "distill.inputs": (["objective.kind=distill"], "error", [*DISTILL]),
    "distill.teacher": ([*DISTILL, "distill.teacher_preset=gpt_oss_20b"], "error", [*DISTILL, "distill.teacher_preset=tiny"]),
    "distill.loss": ([*DISTILL, "distill.loss=jsd", "distill.jsd_beta=0"], "error", [*DISTILL, "distill.loss=jsd"]),
    "distill.layout": ([*DISTILL, "parallelism.pipeline_model_parallel_size=2", "parallelism.world_size=4"], "error",
                       [*DISTILL, "parallelism.world_size=4"]),
    "rl.is_correction": ([*GRPO, "rl.is_correction=icepop"], "error", [*GRPO, "rl.is_correction=icepop", "rl.is_min=0.5"]),
    "rl.save_rollouts": (["rl.save_rollouts=true"], "warning", [*GRPO, "rl.save_rollouts=true"]),
    "serve_check.engine": (["serve_check.engine=vllm", "checkpoint.dir=null", "checkpoint.save_interval=null"], "error",
                           ["serve_check.engine=vllm"]),
    "lora.combinations": ([*LORA, "parallelism.context_parallel_size=2", "parallelism.world_size=2"], "error",
                          [*LORA, "parallelism.world_size=2"]),
    "unsupported.tensor_parallel": (["parallelism.tensor_model_parallel_size=2"], "error", []),
    "unsupported.pipeline_ep_overlap": (
        [*OVERLAP, "parallelism.pipeline_model_parallel_size=2", *W4, "parallelism.virtual_pipeline_model_parallel_size=2",
         "parallelism.pipeline_schedule=interleaved_1f1b"], "error", [*OVERLAP, W4[0]]),
    "unsupported.expert_tensor_parallel": (["parallelism.expert_tensor_parallel_size=2", *W4], "error", W4),
    "unsupported.megatron_fsdp": (["parallelism.use_megatron_fsdp=true"], "error", []),
    "unsupported.token_dispatcher": (["moe.token_dispatcher_type=flex"], "error", []),
    "unsupported.token_dropping": (["moe.capacity_factor=1.0"], "error", []),
    "unsupported.router_dtype": (["moe.router_dtype=fp32"], "error", ["moe.router_dtype=null"]),
    "unsupported.fp16": (["precision.params_dtype=fp16"], "error", ["precision.params_dtype=bf16"]),
    "unsupported.cuda_graphs": (["cuda_graphs.cuda_graph_impl=local", "system.device=cuda"], "error", []),
    # overlap_grad_reduce is implemented: only overlapping the parameter gather is not
    "unsupported.param_gather_overlap": (
        ["overlap.overlap_param_gather=true"], "error", ["overlap.overlap_grad_reduce=true"]),
    "unsupported.checkpoint_format": (["checkpoint.format=torch_dist"], "error", []),
}
# Tested with their own context below (the pattern, a torch version, what is implemented).
SPECIAL = {"overlap.schedule_plan", "overlap.torch_version", "unsupported.fp8",
           "data.documents_fit",
           "rl.engine"}  # at launch only: tests/rl/test_grpo_vllm.py and test_rl_engine_names_the_interpreter below  # with a token file: tests/train/test_sft_training.py


def test_every_registered_rule_has_a_test_case():
    assert set(RULES) == set(CASES) | SPECIAL


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_triggered(rule_id):
    trigger, severity, _ = CASES[rule_id]
    findings = run_rule(rule_id, trigger)
    assert findings, f"{rule_id} did not fire for {trigger}"
    f = findings[0]
    assert (f.rule, f.severity) == (rule_id, severity)
    assert severity in RULES[rule_id].severities, "the README's rule table states the wrong severity"
    assert f.message and f.fields
    assert isinstance(f.hint, str), "the registry fills a missing hint with the rule's fix"
    if severity == "error":
        assert f.hint, "an error must say how to fix it"


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_not_triggered(rule_id):
    _, _, quiet = CASES[rule_id]
    assert run_rule(rule_id, quiet) == []


def test_unsupported_rules_are_their_own_kind():
    kinds = {rule_id: kind for rule_id, kind, _ in list_rules()}
    assert all((kinds[r] == UNSUPPORTED) == r.startswith("unsupported.") for r in kinds)
    assert kinds["overlap.schedule_plan"] == SEMANTIC


def test_list_rules_describes_every_rule_once():
    rows = list_rules()
    assert [r[0] for r in rows] == list(RULES)
    assert all(description for _, _, description in rows)


# --- the capability rule ---------------------------------------------------------------------
# overlap.schedule_plan asks model/pattern.schedule_plan_support about the recipe's own pattern; the
# schedule plan builder refuses the same patterns (tests/schedule/test_schedule_plan.py).
def test_capability_passes_for_the_patterns_the_plan_splits():
    for pattern in ("*E*E*E", "[*E][*E][*E]", "[*E][*-][*E]"):
        cfg, ctx = make_ctx(overrides=[*OVERLAP, f"model.hybrid_layer_pattern={pattern}"])
        assert schedule_plan_capability(cfg, ctx) == [], pattern


@pytest.mark.parametrize(
    "pattern, reason",
    [
        ("*E|*E*E", "does not split pipeline stages ('|' in the pattern)"),
        ("*E*M*E", "has no nodes for layer symbol 'M' (mamba)"),
    ],
)
def test_capability_without_plan_is_an_error_with_both_flags_as_the_fix(pattern, reason):
    cfg, ctx = make_ctx(overrides=[*OVERLAP, "overlap.delay_wgrad_compute=true", f"model.hybrid_layer_pattern={pattern}"])
    (finding,) = schedule_plan_capability(cfg, ctx)
    assert finding.severity == "error" and reason in finding.message
    assert finding.fields["model.hybrid_layer_pattern"] == pattern
    assert finding.fields["overlap.delay_wgrad_compute"] is True
    assert "overlap.overlap_moe_expert_parallel_comm=false" in finding.hint
    assert "overlap.delay_wgrad_compute=false" in finding.hint


def test_capability_not_asked_without_overlap():
    cfg, ctx = make_ctx(overrides=["model.hybrid_layer_pattern=*E*M*E"])
    assert schedule_plan_capability(cfg, ctx) == []


def test_capability_rule_reads_the_recipe_pattern():
    assert run_rule("overlap.schedule_plan", [*OVERLAP, "model.hybrid_layer_pattern=[*E][*E][*E]"]) == []
    (finding,) = run_rule("overlap.schedule_plan", [*OVERLAP, "model.hybrid_layer_pattern=[*E][*M][*E]"])
    assert "'M' (mamba)" in finding.message


def test_capability_rule_needs_no_model_import(monkeypatch):
    """validate-config judges the pattern without importing the model (torch): a broken or absent
    model module changes nothing in its verdict."""
    import sys

    monkeypatch.setitem(sys.modules, "gptoss_cli.model.hybrid", None)  # importing it would raise
    monkeypatch.setitem(sys.modules, "gptoss_cli.model.schedule_plan", None)
    assert run_rule("overlap.schedule_plan", OVERLAP) == []
    (finding,) = run_rule("overlap.schedule_plan", [*OVERLAP, "model.hybrid_layer_pattern=*E|*E*E"])
    assert "does not split pipeline stages" in finding.message


# --- torch version -----------------------------------------------------------------------------
def test_overlap_needs_torch_2_6():
    rule = RULES["overlap.torch_version"]
    cfg, ctx = make_ctx(overrides=OVERLAP, torch_version="2.5.1+cu121")
    assert [f.rule for f in rule(cfg, ctx)] == ["overlap.torch_version"]
    cfg, ctx = make_ctx(overrides=OVERLAP, torch_version="2.6.0")
    assert rule(cfg, ctx) == []


def test_flex_attention_needs_torch_2_5_and_flash_on_an_unknown_device_is_a_warning():
    rule = RULES["model.attention_backend"]
    cfg, ctx = make_ctx(overrides=["model.attention_backend=flex"], torch_version="2.4.1")
    assert [f.severity for f in rule(cfg, ctx)] == ["error"]
    cfg, ctx = make_ctx(overrides=["model.attention_backend=flex"], torch_version="2.11.0+cu128")
    assert rule(cfg, ctx) == []
    assert [f.severity for f in run_rule("model.attention_backend", ["model.attention_backend=flash", "system.device=auto"])] \
        == ["warning"]
    assert run_rule("model.attention_backend", ["model.attention_backend=flash", "system.device=cpu"]) == []
    # a window no shorter than the sequence masks nothing: the CUDA flash kernel takes those layers
    assert run_rule("model.attention_backend", ["model.attention_backend=flash", "system.device=cuda",
                                                "model.architecture.sliding_window=32"]) == []


# --- rules with a second trigger worth pinning -------------------------------------------------
def test_explicit_world_size_differing_from_the_recipe_is_a_warning():
    findings = run_rule("parallel.world_size_consistent", [], world_size=4)
    assert [f.severity for f in findings] == ["warning"]


def test_overlap_forbids_recomputing_moe():
    findings = run_rule("overlap.recompute", [*OVERLAP, "recompute.recompute_granularity=selective",
                                               "recompute.recompute_modules=[core_attn,moe]"])
    assert findings and "moe" in findings[0].message


def test_selective_modules_without_a_layer_warn():
    # tiny is *E*E*E: no dense `-` layer for `mlp` to recompute
    (finding,) = run_rule("recompute.layers", ["recompute.recompute_granularity=selective",
                                               "recompute.recompute_modules=[mlp,moe_act]"])
    assert finding.severity == "warning" and "['mlp']" in finding.message
    assert run_rule("recompute.layers", ["recompute.recompute_granularity=selective",
                                         "recompute.recompute_modules=[mlp]", "model.hybrid_layer_pattern=*E*-*E"]) == []


def test_overlap_accepts_mtp_null_and_zero():
    assert run_rule("overlap.mtp_num_layers", [*OVERLAP, "model.mtp_num_layers=null"]) == []
    assert run_rule("overlap.mtp_num_layers", [*OVERLAP, "model.mtp_num_layers=0"]) == []


def test_overlap_with_local_graphs_is_also_rejected():
    findings = run_rule("overlap.cuda_graphs", [*OVERLAP, "cuda_graphs.cuda_graph_impl=local", "system.device=cuda"])
    assert findings and "cuda_graphs.cuda_graph_impl=none" in findings[0].hint


def test_pattern_splits_must_match_pipeline_size():
    findings = run_rule("parallel.pipeline_layout", ["model.hybrid_layer_pattern=*E*E|*E"])
    assert findings and "PP > 1" in findings[0].message
    findings = run_rule("parallel.pipeline_layout", ["model.hybrid_layer_pattern=*E*E|*E", *W4,
                                                     "parallelism.pipeline_model_parallel_size=4"])
    assert findings and "make 2 stages but PP x VPP = 4" in findings[0].message


def test_virtual_pipeline_needs_pipeline():
    findings = run_rule("parallel.pipeline_layout", ["parallelism.virtual_pipeline_model_parallel_size=2"])
    assert findings and "PP > 1" in findings[0].message


def test_fp8_emulation_turns_the_gpu_error_into_a_warning():
    findings = run_rule("fp8.native_gpu", [*MX, "precision.fp8_emulation=true"])
    assert [f.severity for f in findings] == ["warning"]


def test_a_finding_without_its_own_hint_shows_the_rules_fix():
    (finding,) = run_rule("moe.capacity_factor", ["moe.capacity_factor=0"])
    assert finding.hint == RULES["moe.capacity_factor"].fix
    assert finding.hint == "set moe.capacity_factor=null for dropless routing, or a value > 0"


def test_an_explicitly_empty_hint_stays_empty():
    # fp8 emulation is a choice the user made: the warning has nothing to fix
    (finding,) = run_rule("fp8.native_gpu", [*MX, "precision.fp8_emulation=true"])
    assert finding.hint == ""


def test_fp8_unknown_gpu_is_a_warning_until_launch():
    findings = run_rule("fp8.native_gpu", [*MX, "system.device=cuda", "system.gpu=auto"])
    assert [f.severity for f in findings] == ["warning"]
    assert run_rule("fp8.native_gpu", [*MX, "system.device=cuda", "system.gpu=auto"], gpu="gb300") == []


def test_tensorwise_fp8_runs_natively_on_hopper():
    assert run_rule("fp8.native_gpu", ["precision.fp8_recipe=tensorwise", "system.device=cuda", "system.gpu=h100"]) == []


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
def test_every_fp8_recipe_of_the_schema_is_implemented(recipe):
    assert run_rule("unsupported.fp8", [f"precision.fp8_recipe={recipe}"]) == []


def test_an_fp8_recipe_missing_from_implemented_is_unsupported(monkeypatch):
    from gptoss_cli.recipe import rules

    monkeypatch.setitem(rules.IMPLEMENTED, "fp8_recipes", frozenset({"none", "tensorwise"}))
    (finding,) = run_rule("unsupported.fp8", MX)
    assert (finding.severity, finding.kind, finding.fields) == ("error", UNSUPPORTED, {"precision.fp8_recipe": "mxfp8"})
    assert finding.hint == "set precision.fp8_recipe=none"


def test_cuda_with_gloo_is_a_warning():
    findings = run_rule("system.backend", ["system.device=cuda", "parallelism.backend=gloo"])
    assert [f.severity for f in findings] == ["warning"]


def _token_files(tmp_path, vocab):
    prefix = tmp_path / "tokens"
    prefix.with_suffix(".bin").write_bytes(b"\0" * 64)
    prefix.with_suffix(".json").write_text(json.dumps(
        {"format": "gptoss-tokens", "version": 1, "dtype": "uint16", "num_tokens": 32, "num_documents": 1,
         "vocab_size": vocab, "eos_token_id": 1002}))
    return prefix


def test_token_files_are_checked_at_launch_only(tmp_path):
    over = ["data.kind=tokens", f"data.path={tmp_path / 'missing'}"]
    assert run_rule("data.source", over) == []
    findings = run_rule("data.source", over, check_paths=True)
    assert findings and "not found" in findings[0].message


def test_token_files_present_and_fitting_the_vocabulary_pass(tmp_path):
    prefix = _token_files(tmp_path, 1003)
    assert run_rule("data.source", ["data.kind=tokens", f"data.path={prefix}"], check_paths=True) == []


def test_token_file_with_a_larger_vocabulary_fails(tmp_path):
    prefix = _token_files(tmp_path, 201088)
    findings = run_rule("data.source", ["data.kind=tokens", f"data.path={prefix}"], check_paths=True)
    assert findings and "201088" in findings[0].message


def test_token_file_with_an_eos_id_past_the_model_vocabulary_fails(tmp_path):
    prefix = _token_files(tmp_path, 1003)
    header = json.loads(prefix.with_suffix(".json").read_text())
    prefix.with_suffix(".json").write_text(json.dumps({**header, "eos_token_id": 1003}))
    findings = run_rule("data.source", ["data.kind=tokens", f"data.path={prefix}"], check_paths=True)
    assert findings and "eos_token_id 1003 is outside the model's vocabulary" in findings[0].message


def test_token_file_shorter_than_its_header_announces_fails(tmp_path):
    prefix = _token_files(tmp_path, 1003)
    prefix.with_suffix(".bin").write_bytes(b"\0" * 62)  # 31 uint16 tokens, the header says 32
    findings = run_rule("data.source", ["data.kind=tokens", f"data.path={prefix}"], check_paths=True)
    assert findings and "62 bytes do not hold the 32 uint16 tokens" in findings[0].message


def test_missing_token_bin_fails_at_launch(tmp_path):
    prefix = _token_files(tmp_path, 1003)
    prefix.with_suffix(".bin").unlink()
    findings = run_rule("data.source", ["data.kind=tokens", f"data.path={prefix}"], check_paths=True)
    assert findings and f"token file {prefix.with_suffix('.bin')} not found" in findings[0].message


def test_missing_pretrained_weights_fail_at_launch(tmp_path):
    over = [f"checkpoint.pretrained={tmp_path / 'nope'}"]
    assert run_rule("checkpoint.settings", over) == []
    assert [f.rule for f in run_rule("checkpoint.settings", over, check_paths=True)] == ["checkpoint.settings"]


@pytest.mark.parametrize("name, gpu", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA GB200", "gb200"), ("NVIDIA B200", "b200"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("Tesla T4", "auto"), (None, "none"),
])
def test_gpu_generation_from_device_name(name, gpu):
    from gptoss_cli.recipe.environment import gpu_from_device_name

    assert gpu_from_device_name(name) == gpu


def test_router_loss_scale_names_the_threshold_and_the_frozen_router():
    """0.1 warns (just above the threshold), 0.1 itself does not; a frozen router with a router loss warns."""
    assert run_rule("moe.router_loss_scale", ["moe.aux_loss_coeff=0.1"]) == []
    (f,) = run_rule("moe.router_loss_scale", ["moe.aux_loss_coeff=0.11"])
    assert f.fields == {"moe.aux_loss_coeff": 0.11} and "top_k=2" in f.message
    (f,) = run_rule("moe.router_loss_scale", ["moe.freeze_router=true", "moe.aux_loss_coeff=0", "moe.z_loss_coeff=1e-3"])
    assert f.fields["moe.freeze_router"] is True and "frozen" in f.message
    assert run_rule("moe.router_loss_scale", ["moe.freeze_router=true", "moe.aux_loss_coeff=0"]) == []


def test_rl_engine_names_the_interpreter():
    findings = run_rule("rl.engine", [*GRPO, "rl.rollout.engine=vllm", "rl.rollout.engine_python=/nonexistent/python",
                                      "parallelism.expert_model_parallel_size=1"], check_paths=True)
    assert findings and findings[0].rule == "rl.engine" and "/nonexistent/python" in findings[0].message


def test_old_policy_replay_with_one_step_per_rollout_is_a_warning():
    """old_policy replays the trainer's routes at the rollout's weights: with one step per rollout that step's own."""
    findings = run_rule("rl.routing_replay", [*GRPO, "rl.routing_replay=old_policy"])
    assert [(f.severity, f.fields["rl.steps_per_rollout"]) for f in findings] == [("warning", 1)]
    assert run_rule("rl.routing_replay", [*GRPO, "rl.routing_replay=old_policy", "rl.steps_per_rollout=2",
                                          "training.train_iters=4"]) == []


def test_is_correction_refuses_a_lower_bound_mis_ignores_and_warns_on_none_with_vllm():
    (f,) = run_rule("rl.is_correction", [*GRPO, "rl.is_correction=mis", "rl.is_min=0.5"])
    assert f.severity == "error" and f.fields == {"rl.is_correction": "mis", "rl.is_min": 0.5} and "icepop" in f.hint
    assert run_rule("rl.is_correction", [*GRPO, "rl.is_correction=mis"]) == []
    (f,) = run_rule("rl.is_correction", [*GRPO, "rl.is_correction=none", "rl.rollout.engine=vllm"])
    assert f.severity == "warning" and f.fields["rl.rollout.engine"] == "vllm"
    assert run_rule("rl.is_correction", [*GRPO, "rl.is_correction=none"]) == []  # gptoss's engine is the trainer


def test_save_rollouts_needs_pyarrow_at_launch(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a))
    (f,) = run_rule("rl.save_rollouts", [*GRPO, "rl.save_rollouts=true"], check_paths=True)
    assert f.severity == "error" and "pyarrow" in f.message and "datasets" in f.hint
    assert run_rule("rl.save_rollouts", [*GRPO, "rl.save_rollouts=true"]) == []  # validate-config elsewhere: not asked


def test_rollout_replay_with_vllms_cpu_build_is_refused_at_launch(monkeypatch):
    """At launch the engine's interpreter is asked which vLLM it has; its CPU build returns no routes."""
    import gptoss_cli.generate.engines.vllm_offline as offline

    monkeypatch.setattr(offline, "vllm_build", lambda python: "cpu")
    replay = [*GRPO, "rl.routing_replay=rollout", "rl.rollout.engine=vllm", "system.gpu=h100"]
    findings = run_rule("rl.routing_replay", replay, check_paths=True)
    assert len(findings) == 1 and "CPU build" in findings[0].message and "\n" not in findings[0].message
    monkeypatch.setattr(offline, "vllm_build", lambda python: "gpu")
    assert run_rule("rl.routing_replay", replay, check_paths=True) == []


VLLM = [*GRPO, "parallelism.world_size=1", "parallelism.expert_model_parallel_size=1", "rl.rollout.engine=vllm"]


def test_grpo_with_vllm_on_the_cpu_refuses_a_head_size_its_attention_refuses_naming_the_fix():
    findings = run_rule("rl.layout", VLLM)  # the tiny preset: head size 16, system.device cpu
    assert len(findings) == 1 and "head_dim 16" in findings[0].message, findings
    assert "make-tiny DST --head-dim 64" in findings[0].hint
    assert run_rule("rl.layout", [*VLLM, "model.architecture={head_dim: 64}"]) == []
    assert run_rule("rl.layout", [*VLLM, "system.device=cuda", "system.gpu=h100"]) == []  # vLLM's GPU kernels differ


def test_the_pushes_stage_folder_must_be_writable_at_launch(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTOSS_ENGINE_PYTHON", "/bin/sh")  # an executable: the interpreter check passes
    blocker = tmp_path / "file"
    blocker.write_text("")
    ok = run_rule("rl.engine", [*VLLM, f"rl.rollout.stage_dir={tmp_path / 'stage'}"], check_paths=True)
    bad = run_rule("rl.engine", [*VLLM, f"rl.rollout.stage_dir={blocker / 'stage'}"], check_paths=True)
    assert ok == [] and len(bad) == 1 and "is a file, not a folder" in bad[0].message, bad
