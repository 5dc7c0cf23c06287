"""Training jobs and configs for tests, built from the recipe schema (the one table of defaults).

Tests name settings with short keywords (`ep_size=2, lr=1e-3`); `FIELDS` maps each onto its recipe
field. `BASE` are the small-test values every job starts from (fp32, mock data, one process).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptoss_cli.model.config import GptOssArch, preset
from gptoss_cli.model.pattern import HybridPattern, default_pattern, parse_pattern
from gptoss_cli.recipe.schema import OptimizerConfig, RecipeConfig
from gptoss_cli.train.job import TrainJob
from gptoss_cli.train.provider import ModelRuntimeConfig

TINY = preset("tiny")

FIELDS = {
    "ep_size": "parallelism.expert_model_parallel_size", "backend": "parallelism.backend",
    "cp_size": "parallelism.context_parallel_size", "pp_size": "parallelism.pipeline_model_parallel_size",
    "vpp_size": "parallelism.virtual_pipeline_model_parallel_size", "pipeline_schedule": "parallelism.pipeline_schedule",
    "pipeline_layout": "parallelism.pipeline_model_parallel_layout", "z_loss_coeff": "moe.z_loss_coeff",
    "device": "system.device", "heartbeat_timeout_s": "system.heartbeat_timeout_s",
    "params_dtype": "precision.params_dtype", "fp8_recipe": "precision.fp8_recipe",
    "fp8_format": "precision.fp8_format", "fp8_emulation": "precision.fp8_emulation", "qat": "precision.qat",
    "aux_loss_coeff": "moe.aux_loss_coeff",
    "overlap_moe_expert_parallel_comm": "overlap.overlap_moe_expert_parallel_comm",
    "delay_wgrad_compute": "overlap.delay_wgrad_compute",
    "seq_length": "training.seq_length", "micro_batch_size": "training.micro_batch_size",
    "global_batch_size": "training.global_batch_size", "train_iters": "training.train_iters", "lr": "training.lr",
    "min_lr": "training.min_lr", "warmup_iters": "training.warmup_iters", "lr_decay_style": "training.lr_decay_style",
    "lr_decay_iters": "training.lr_decay_iters", "seed": "training.seed",
    "weight_decay": "optimizer.weight_decay", "adam_beta1": "optimizer.adam_beta1", "adam_beta2": "optimizer.adam_beta2",
    "adam_eps": "optimizer.adam_eps", "clip_grad": "optimizer.clip_grad",
    "use_distributed_optimizer": "optimizer.use_distributed_optimizer", "bucket_size": "optimizer.bucket_size",
    "overlap_grad_reduce": "overlap.overlap_grad_reduce",
    "recompute_granularity": "recompute.recompute_granularity", "recompute_modules": "recompute.recompute_modules",
    "recompute_method": "recompute.recompute_method", "recompute_num_layers": "recompute.recompute_num_layers",
    "data_kind": "data.kind", "data_path": "data.path",
    "checkpoint_dir": "checkpoint.dir", "save_interval": "checkpoint.save_interval", "resume": "checkpoint.resume",
    "pretrained": "checkpoint.pretrained", "log_interval": "logging.log_interval",
    "keep_last": "checkpoint.keep_last", "keep_every": "checkpoint.keep_every",
    "override_lr_schedule": "checkpoint.override_lr_schedule", "data_blend": "data.blend",
    "override_data": "checkpoint.override_data", "async_save": "checkpoint.async_save",
    "save_on_signal": "checkpoint.save_on_signal",
    "validation_data": "validation.data", "validation_interval": "validation.interval",
    "validation_iters": "validation.iters",
    "lora_rank": "lora.rank", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout",
    "lora_targets": "lora.target_modules", "lora_base_experts": "lora.base_experts",
    "objective": "objective.kind", "rl_prompts": "rl.prompts", "rl_tokenizer": "rl.tokenizer", "rl_reward": "rl.reward",
    "group_size": "rl.group_size", "steps_per_rollout": "rl.steps_per_rollout", "max_new_tokens": "rl.max_new_tokens",
    "temperature": "rl.temperature", "top_p": "rl.top_p", "rl_seed": "rl.seed", "rl_loss": "rl.loss",
    "scale_rewards": "rl.scale_rewards", "clip_low": "rl.clip_low", "clip_high": "rl.clip_high",
    "kl_coeff": "rl.kl_coeff", "kl_unbiased": "rl.kl_unbiased", "rollout_engine": "rl.rollout.engine",
    "engine_python": "rl.rollout.engine_python", "rollout_batch_size": "rl.rollout.batch_size",
    "is_correction": "rl.is_correction", "is_max": "rl.is_max", "is_min": "rl.is_min",
    "is_sequence_ratio": "rl.is_sequence_ratio", "save_rollouts": "rl.save_rollouts", "mismatch_warn": "rl.rollout.mismatch_warn", "stage_dir": "rl.rollout.stage_dir",
    "routing_replay": "rl.routing_replay",
}

BASE: dict[str, Any] = dict(
    ep_size=1, device="cpu", params_dtype="fp32", aux_loss_coeff=0.0, seq_length=64, micro_batch_size=1,
    global_batch_size=8, train_iters=10, lr=3e-4, min_lr=3e-5, warmup_iters=0, weight_decay=0.0, clip_grad=1.0,
    use_distributed_optimizer=True, data_kind="mock", log_interval=1,
)


def recipe_config(**changes: Any) -> RecipeConfig:
    """RecipeConfig with BASE and `changes` (short keywords, see FIELDS) applied."""
    cfg = RecipeConfig()
    for key, value in {**BASE, **changes}.items():
        *path, attr = FIELDS[key].split(".")
        owner = cfg
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, attr, value)
    return cfg


def train_job(run_dir: str | Path, *, arch: GptOssArch = TINY, pattern: str | None = None, name: str = "test",
              **changes: Any) -> TrainJob:
    """What `gptoss train` hands a worker, for the tiny model unless `arch` says otherwise (`pattern`: the
    layer pattern as a recipe spells it; default the architecture's `*E` per block)."""
    return TrainJob(config=recipe_config(**changes), arch=arch, pattern=_parsed(arch, pattern), name=name,
                    run_dir=str(run_dir))


def runtime_config(arch: GptOssArch = TINY, pattern: str | None = None, **changes: Any) -> ModelRuntimeConfig:
    return ModelRuntimeConfig.from_recipe(recipe_config(**changes), arch, _parsed(arch, pattern))


def _parsed(arch: GptOssArch, pattern: str | None) -> HybridPattern:
    return parse_pattern(pattern) if pattern is not None else default_pattern(arch)


def optimizer_config(**changes: Any) -> OptimizerConfig:
    return recipe_config(**changes).optimizer
