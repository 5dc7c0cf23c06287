"""GRPO's items in the memory estimate: the rollout KV cache against a closed-form count from the published
architectures and against the bytes gptoss's KVCache allocates; the vLLM engine's share of the GPU."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.model.config import preset
from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.decode.kv_cache import KVCache
from gptoss_cli.model.pattern import parse_pattern
from gptoss_cli.recipe import load_recipe
from gptoss_cli.recipe.estimate import memory as M
from gptoss_cli.recipe.estimate.memory_rl import kv_cache_bytes

# openai/gpt-oss-20b and -120b config.json: num_hidden_layers 24 / 36, layer_types alternating
# sliding_attention (even blocks) and full_attention, sliding_window 128, num_key_value_heads 8, head_dim 64.
PUBLISHED = {"gpt_oss_20b_grpo_lora": (24, 1), "gpt_oss_120b_grpo_lora": (36, 8)}


def _estimate(name: str, overrides=()):
    recipe = load_recipe(name, list(overrides))
    return recipe.config, M.estimate_memory(recipe.config, recipe.arch, recipe.pattern,
                                            recipe.config.parallelism.world_size)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_kv_cache_term_is_the_closed_form_of_the_published_architecture(name):
    layers, world = PUBLISHED[name]
    cfg, est = _estimate(name)
    per_rank = cfg.training.global_batch_size * cfg.rl.steps_per_rollout // world
    rows = min(cfg.rl.rollout.batch_size or per_rank, per_rank)
    columns = cfg.training.seq_length  # the longest prompt + max_new_tokens is at most this
    full, sliding = layers // 2, layers // 2
    expect = 2 * rows * 8 * 64 * 2 * (full * columns + sliding * min(128, columns))  # K and V, bf16
    assert est.bytes_of("rl.kv_cache") == expect
    assert est.bytes_of("rl.engine") == 0
    # a rank decoding every completion of its rollout at once holds proportionally more
    _, whole = _estimate(name, ["rl.rollout.batch_size=null"])
    assert whole.bytes_of("rl.kv_cache") == expect * per_rank // rows


@pytest.mark.parametrize("rows,columns", [(3, 5), (2, 8), (4, 21)])  # window 8: below, at and above it
def test_kv_cache_term_is_what_gptoss_kv_cache_allocates(rows, columns):
    arch = preset("tiny")
    model = HybridModel(arch, device="meta", dtype=torch.bfloat16)
    cache = KVCache(model, batch=rows, capacity=columns)
    allocated = sum(c.keys.nbytes + c.values.nbytes for c in cache.layers.values())
    assert kv_cache_bytes(arch, parse_pattern(arch.hybrid_layer_pattern), rows, columns, 2) == allocated


def test_vllm_on_the_training_gpu_counts_its_share_and_no_gptoss_cache():
    share = ["rl.rollout.engine=vllm", "rl.rollout.gpu_memory_utilization=0.3", "lora.base_experts=bf16"]
    cfg, est = _estimate("gpt_oss_20b_grpo_lora", share)
    assert est.bytes_of("rl.engine") == pytest.approx(0.3 * 80e9) and est.bytes_of("rl.kv_cache") == 0
    _, elsewhere = _estimate("gpt_oss_20b_grpo_lora", ["rl.rollout.engine=vllm", "lora.base_experts=bf16"])
    assert elsewhere.bytes_of("rl.engine") == 0 and elsewhere.bytes_of("rl.kv_cache") == 0
    _, unknown = _estimate("gpt_oss_20b_grpo_lora", [*share, "system.gpu=auto"])
    assert unknown.bytes_of("rl.engine") == 0 and any("gpu_memory_utilization" in n for n in unknown.notes)


def test_cross_entropy_recipes_have_no_rl_items():
    _, est = _estimate("gpt_oss_20b_lora")
    assert not [it for it in est.items if it.key.startswith("rl.")]


def test_the_kl_reference_is_a_second_model_under_full_fine_tuning_and_free_under_lora():
    cfg, off = _estimate("tiny_cpu_grpo")
    _, full = _estimate("tiny_cpu_grpo", ["rl.kl_coeff=0.1"])
    arch = preset("tiny")
    params = sum(p.numel() for p in HybridModel(arch, device="meta").parameters())
    assert off.bytes_of("rl.reference") == 0 and full.bytes_of("rl.reference") == 4 * params  # fp32
    assert full.total_bytes - off.total_bytes == 4 * params
    _, lora = _estimate("gpt_oss_20b_grpo_lora", ["rl.kl_coeff=0.1"])
    assert lora.bytes_of("rl.reference") == 0


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_routes_term_is_what_the_rollouts_microbatches_hold(name):
    """The rollout's expert routes: rl/routes.py's rows for every completion of the rank's rollout, once per
    MoE layer of the published architecture (one per block) and per expert chosen (4); twice under
    old_policy replay; none for vLLM without replay."""
    from types import SimpleNamespace

    from gptoss_cli.rl.routes import rows_routes

    layers, world = PUBLISHED[name]
    cfg, est = _estimate(name)
    per_rank = cfg.training.global_batch_size * cfg.rl.steps_per_rollout // world
    one_row = rows_routes([SimpleNamespace(routes=torch.zeros(3, layers, 4, dtype=torch.uint8))],
                          cfg.training.seq_length)
    assert est.bytes_of("rl.routes") == per_rank * one_row.nbytes
    _, old = _estimate(name, ["rl.routing_replay=old_policy", "rl.steps_per_rollout=2", "training.train_iters=2",
                              "checkpoint.save_interval=2"])
    assert old.bytes_of("rl.routes") == 2 * 2 * per_rank * one_row.nbytes  # two steps' rows, two copies
    _, vllm = _estimate(name, ["rl.rollout.engine=vllm", "lora.base_experts=bf16"])
    assert vllm.bytes_of("rl.routes") == 0


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_saved_rollouts_count_the_trainer_logprobs_kept_with_one_step_per_rollout(name):
    """rl.save_rollouts keeps each microbatch's trainer log-probs (the loss's own, fp32 per position of its rows, as
    the rollout's engine log-probs: rl/batch.py) until the file is written; with several steps per rollout the
    rollout scores them anyway."""
    from gptoss_cli.rl.batch import SampledCompletion, completion_rows

    _, world = PUBLISHED[name]
    cfg, est = _estimate(name, ["rl.save_rollouts=true"])
    per_rank = cfg.training.global_batch_size // world
    row = completion_rows([SampledCompletion(0, [1, 2], [3], [-1.0])], [0.0], cfg.training.seq_length,
                          torch.device("cpu")).extras["rollout_logp"]
    assert est.bytes_of("rl.saved_logprobs") == per_rank * row.nbytes
    _, off = _estimate(name)
    assert off.bytes_of("rl.saved_logprobs") == 0
    _, several = _estimate(name, ["rl.save_rollouts=true", "rl.steps_per_rollout=2", "training.train_iters=2",
                                  "checkpoint.save_interval=2"])
    assert several.bytes_of("rl.saved_logprobs") == 0
