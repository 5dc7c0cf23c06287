"""GRPO's items in the per-GPU memory estimate (recipe/estimate/memory.py): the rollout's KV cache and a vLLM engine
sharing the training GPUs.

- The gptoss engine decodes with `generate`'s preallocated cache (gptoss_cli/model/decode/kv_cache.py): per
  attention layer, keys and values [rows, kv_heads, slots, head_dim] in the parameters' dtype, where
  rows = rl.rollout.batch_size (at most the rank's completions of a rollout, training.global_batch_size x
  rl.steps_per_rollout / data-parallel size; all of them when null) and slots = the columns of a row
  (the longest prompt + rl.max_new_tokens, at most training.seq_length, which the estimate takes) on a
  full-attention layer, min(window, columns) on a sliding-window layer (a ring of the last W columns).
  The rollout runs before the step's forward, but the allocator keeps the cache's blocks for the
  activations that follow, so the estimate adds it to them (an upper bound when they reuse the blocks).
- The vLLM engine on the training GPUs (rl.rollout.gpu_memory_utilization > 0) takes that share of each
  GPU's memory (vLLM's own setting: weights, its KV cache and activations inside it); it is counted
  when the GPU's capacity is known. Rollouts then decode in the engine, so there is no gptoss cache.
- The rollout's expert routes (routing replay, docs/rl.md "Routing replay"), kept on the device with the
  rollout's microbatches from the rollout to its last update: int16 ids [rows, training.seq_length, MoE
  layers, k] for every completion of the rank's rollout (training.global_batch_size x rl.steps_per_rollout /
  data-parallel size), recorded whenever the engine is gptoss (the flip rate is logged in every mode) or
  rl.routing_replay=rollout; twice that under old_policy, whose scoring forward records the trainer's own ids
  beside the engine's.
- The trainer's log-probabilities rl.save_rollouts writes: with one step per rollout the step's own forward
  computes them, and the objective keeps them ([rows, training.seq_length] fp32 for the rank's completions of
  the rollout) until the rollout's file is written after the step; with several steps the rollout scores
  them anyway. Rank 0 gathers the rollout's rows in host memory to write them, which the per-GPU estimate
  does not count.
- The KL term's reference (rl.kl_coeff > 0) under full fine-tuning is a second, frozen model
  (rl/reference.py): the rank's parameters once more in the parameters' dtype. Under LoRA it is the base
  with the adapters off, which costs nothing.

Pure Python, like the rest of the estimate.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.pattern import HybridPattern, layer_windows
from gptoss_cli.recipe.schema import RecipeConfig

# memory.MemoryItem, handed in by memory.py (which imports this module): (key, label, bytes, formula, knobs)
Item = TypeVar("Item")
ItemType = Callable[[str, str, float, str, str], Item]


def kv_cache_bytes(arch: GptOssArch, pattern: HybridPattern, rows: int, columns: int, dtype_bytes: int) -> int:
    """Bytes of the keys and values of a KVCache of `rows` x `columns` on every attention layer of `pattern`."""
    per_slot = 2 * rows * arch.num_key_value_heads * arch.head_dim * dtype_bytes
    return sum(per_slot * (columns if w is None or w >= columns else w) for w in layer_windows(arch, pattern).values())


def rollout_rows(cfg: RecipeConfig, dp: int) -> int:
    """Completions one rank decodes at once: rl.rollout.batch_size, at most the rank's share of a rollout."""
    per_rank = max(1, cfg.training.global_batch_size * cfg.rl.steps_per_rollout // max(dp, 1))
    size = cfg.rl.rollout.batch_size
    return min(size, per_rank) if size else per_rank


def rl_items(cfg: RecipeConfig, arch: GptOssArch, pattern: HybridPattern, dp: int, b: int, capacity_bytes: float | None,
             item_type: ItemType[Item], notes: list[str], rank_params: int = 0) -> list[Item]:
    """The GRPO items (`item_type` is memory.MemoryItem) of one rank holding `rank_params` model parameters;
    [] unless the run samples rollouts (objective.kind=grpo, or distill with distill.on_policy)."""
    if cfg.objective.kind != "grpo" and not (cfg.objective.kind == "distill" and cfg.distill.on_policy):
        return []  # on-policy distillation samples with GRPO's rollouts
    return (_reference_items(cfg, b, rank_params, item_type) + _routes_items(cfg, pattern, arch, dp, item_type)
            + _saved_items(cfg, dp, item_type) + _rollout_items(cfg, arch, pattern, dp, b, capacity_bytes, item_type,
                                                                  notes))


ROUTE_ID_BYTES = 2  # int16 on the device (rl/routes.py, `rows_routes`)


def routes_bytes(cfg, arch: GptOssArch, pattern: HybridPattern, dp: int) -> int:
    """Bytes of the expert routes a rank keeps for one rollout (see the module docstring); 0 when none are kept."""
    rl = cfg.rl
    if rl.rollout.engine != "gptoss" and rl.routing_replay != "rollout":
        return 0
    copies = 2 if rl.routing_replay == "old_policy" and rl.steps_per_rollout > 1 else 1
    rows = max(1, cfg.training.global_batch_size * rl.steps_per_rollout // max(dp, 1))
    layers = pattern.layers.count("E")
    return copies * rows * cfg.training.seq_length * layers * arch.num_experts_per_tok * ROUTE_ID_BYTES


def _routes_items(cfg, pattern: HybridPattern, arch: GptOssArch, dp: int, item_type) -> list:
    size = routes_bytes(cfg, arch, pattern, dp)
    if not size:
        return []
    rows = max(1, cfg.training.global_batch_size * cfg.rl.steps_per_rollout // max(dp, 1))
    return [item_type("rl.routes", "rollout expert routes (routing replay, routing_flip_rate)", size,
                      f"{size // (rows * cfg.training.seq_length)} B x {rows} rows x {cfg.training.seq_length}",
                      "rl.routing_replay=none with rl.rollout.engine=vllm keeps none")]


LOGPROB_BYTES = 4  # fp32, as the rollout's other per-position tensors (rl/batch.py)


def _saved_items(cfg: RecipeConfig, dp: int, item_type: ItemType[Item]) -> list[Item]:
    rl = cfg.rl
    if not rl.save_rollouts or rl.steps_per_rollout > 1:
        return []
    rows = max(1, cfg.training.global_batch_size // max(dp, 1))
    size = rows * cfg.training.seq_length * LOGPROB_BYTES
    return [item_type("rl.saved_logprobs", "trainer log-probs kept for the rollout file (rl.save_rollouts)", size,
                      f"{LOGPROB_BYTES} B x {rows} rows x {cfg.training.seq_length}", "rl.save_rollouts=false")]


def _reference_items(cfg: RecipeConfig, b: int, rank_params: int, item_type: ItemType[Item]) -> list[Item]:
    if cfg.rl.kl_coeff <= 0 or cfg.lora.rank > 0:
        return []
    return [item_type("rl.reference", "KL reference model (frozen copy)", b * rank_params, f"{b} B x {rank_params:,}",
                      "rl.kl_coeff=0, or LoRA (the reference is then the base with the adapters off)")]


def _rollout_items(cfg: RecipeConfig, arch: GptOssArch, pattern: HybridPattern, dp: int, b: int,
                   capacity_bytes: float | None, item_type: ItemType[Item], notes: list[str]) -> list[Item]:
    rollout = cfg.rl.rollout
    if rollout.engine == "vllm":
        share = rollout.gpu_memory_utilization
        if share <= 0:
            return []
        if capacity_bytes is None:
            notes.append(f"the vLLM engine's share (rl.rollout.gpu_memory_utilization={share}) is not counted: "
                         "the GPU is unknown (set system.gpu)")
            return []
        return [item_type("rl.engine", "vLLM engine on the same GPU", share * capacity_bytes,
                          f"{share} x {capacity_bytes / 1e9:.0f} GB",
                          "rl.rollout.gpu_memory_utilization (or run the engine on other GPUs: 0)")]
    rows, columns = rollout_rows(cfg, dp), cfg.training.seq_length
    windows = list(layer_windows(arch, pattern).values())
    sliding = sum(1 for w in windows if w is not None and w < columns)
    kv = kv_cache_bytes(arch, pattern, rows, columns, b)
    return [item_type("rl.kv_cache", "rollout KV cache (gptoss engine)", kv,
                      f"2 x {rows} rows x {arch.num_key_value_heads} kv heads x {arch.head_dim} x {b} B x "
                      f"({len(windows) - sliding} full layers x {columns} + {sliding} sliding x "
                      f"{arch.sliding_window})", "rl.rollout.batch_size; training.seq_length; rl.max_new_tokens")]


__all__ = ["kv_cache_bytes", "rollout_rows", "rl_items", "routes_bytes"]
