"""The model provider: builds this rank's HybridModel (its slice of experts, the EP dispatcher, weights).

The provider holds a `ModelRuntimeConfig`; like Megatron-Bridge's canonical providers, the model
it builds keeps its own deep copy as `model.config`, which is the object the schedule reads
(`get_model_config(model)`). Training callbacks must therefore be installed on that copy, never on
`provider.config` (see `gptoss_cli.train.setup.install_training_callbacks`).

With `precision.fp8_recipe` set, the attention projections and expert GEMMs get FP8 gemms
(gptoss_cli/fp8/selection.py, `select_gemms`) for this rank's device; with `precision.qat=mxfp4` the
expert GEMMs compute with MXFP4-rounded weights (gptoss_cli/model/mxfp4/qat.py), wrapping the FP8 gemm if any.

With a `lora` section the base is frozen and adapters are added after the weights are loaded
(gptoss_cli/model/lora.py); with `lora.base_experts=mxfp4` the frozen experts are built as MXFP4
blocks/scales (gptoss_cli/model/mxfp4/experts.py) and each rank loads its own experts into them. Weights come from one of: a seed (every tensor drawn from a generator seeded by the seed and the
tensor's checkpoint name, so any EP layout gets the same initial model), a Hybrid checkpoint
(each rank reads only its own experts' tensors) or a Hugging Face checkpoint (mapped on the fly).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from gptoss_cli.errors import ConfigError
from gptoss_cli.fp8.selection import Fp8Gemms, Fp8Settings, select_gemms
from gptoss_cli.model.catalog import ATTENTION_BACKEND_DEFAULT, SWIGLU_KERNEL_DEFAULT
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.lora import LoraSettings, attach_lora
from gptoss_cli.model.dtypes import torch_dtype
from gptoss_cli.model.pattern import HybridPattern
from gptoss_cli.schedule.pipeline.layout import PipelineLayout, pipeline_layout
from gptoss_cli.model.recompute_plan import RecomputePlan
from gptoss_cli.recipe.estimate.memory import recompute_plan
from gptoss_cli.model.mxfp4.qat import qat_gemms
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.model.dispatcher import AllToAllTokenDispatcher
from gptoss_cli.parallel.state import ParallelState

@dataclass
class ModelRuntimeConfig:
    """What the built model and the schedule read at run time (Megatron's TransformerConfig role).

    Built from a recipe by `from_recipe`: the recipe's schema is the only table of defaults."""

    arch: GptOssArch
    pattern: HybridPattern
    params_dtype: str
    fp8: Fp8Settings  # the provider gives the model its FP8 gemms when enabled
    aux_loss_coeff: float
    expert_model_parallel_size: int
    overlap_moe_expert_parallel_comm: bool
    delay_wgrad_compute: bool
    z_loss_coeff: float = 0.0
    freeze_router: bool = False
    recompute: RecomputePlan = RecomputePlan()  # what backward recomputes (model/recompute.py)
    qat: str = "none"  # precision.qat: "mxfp4" gives the experts Mxfp4QatGemm (gptoss_cli/model/mxfp4/qat.py)
    lora: LoraSettings | None = None  # LoRA: the provider freezes the base and adds adapters (model/lora.py)
    base_experts: str = "bf16"  # lora.base_experts with LoRA on: "mxfp4" keeps the frozen experts in MXFP4
    swiglu_kernel: str = SWIGLU_KERNEL_DEFAULT  # model.swiglu_kernel (model/swiglu_kernel.py), the recipe's default
    attention_backend: str = ATTENTION_BACKEND_DEFAULT  # model.attention_backend (model/attention/backends.py)
    # pipeline parallelism (gptoss_cli/schedule/pipeline/): the provider builds the layers of this rank's stages
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    pipeline_schedule: str = "1f1b"
    pipeline_model_parallel_layout: str | None = None
    # Set at run time: the FP8 gemms the provider selected (which path runs, GEMM counts), and the
    # training callbacks, installed by setup on the model's own copy of this config.
    fp8_gemms: Fp8Gemms | None = None
    finalize_model_grads_func: Callable[..., Any] | None = None
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None
    no_sync_func: Callable[[], Any] | None = None

    @classmethod
    def from_recipe(cls, cfg: RecipeConfig, arch: GptOssArch, pattern: HybridPattern) -> "ModelRuntimeConfig":
        return cls(
            arch=arch, pattern=pattern, params_dtype=cfg.precision.params_dtype,
            fp8=Fp8Settings.from_precision(cfg.precision), aux_loss_coeff=cfg.moe.aux_loss_coeff,
            expert_model_parallel_size=cfg.parallelism.expert_model_parallel_size,
            overlap_moe_expert_parallel_comm=cfg.overlap.overlap_moe_expert_parallel_comm,
            delay_wgrad_compute=cfg.overlap.delay_wgrad_compute,
            qat=cfg.precision.qat, z_loss_coeff=cfg.moe.z_loss_coeff, freeze_router=cfg.moe.freeze_router,
            recompute=recompute_plan(cfg, pattern),
            lora=lora_settings(cfg), swiglu_kernel=cfg.model.swiglu_kernel,
            attention_backend=cfg.model.attention_backend,
            base_experts=cfg.lora.base_experts if cfg.lora.rank > 0 else "bf16",
            pipeline_model_parallel_size=cfg.parallelism.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=cfg.parallelism.virtual_pipeline_model_parallel_size,
            pipeline_schedule=cfg.parallelism.pipeline_schedule,
            pipeline_model_parallel_layout=cfg.parallelism.pipeline_model_parallel_layout,
        )

    def pipeline_layout(self) -> PipelineLayout | None:
        """The stages and their ranks (gptoss_cli/schedule/pipeline/layout.py); None without pipeline parallelism."""
        if self.pipeline_model_parallel_size == 1:
            return None
        return pipeline_layout(self.pattern, self.pipeline_model_parallel_size,
                               self.virtual_pipeline_model_parallel_size, self.pipeline_schedule,
                               self.pipeline_model_parallel_layout)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.params_dtype)


def lora_settings(cfg: RecipeConfig) -> LoraSettings | None:
    """The recipe's `lora` section as the model's settings; None when lora.rank is 0 (full fine-tuning)."""
    lo = cfg.lora
    if lo.rank == 0:
        return None
    return LoraSettings(rank=lo.rank, alpha=float(lo.alpha), dropout=float(lo.dropout),
                        target_modules=tuple(lo.target_modules)).check()


def dispatcher_factory(num_experts: int, state: ParallelState) -> Callable[[int, Any], AllToAllTokenDispatcher] | None:
    """The model's `token_dispatcher_factory` for this rank: an all-to-all dispatcher over the EP group
    per MoE layer, or None without expert parallelism (every expert is local)."""
    if state.ep_size == 1:
        return None

    def factory(_j: int, _layer: Any) -> AllToAllTokenDispatcher:
        return AllToAllTokenDispatcher(num_experts, state.ep_size, state.ep_rank, state.ep_group,
                                       control_group=state.ep_control_group)

    return factory


def stage_parts(layout: PipelineLayout | None, pp_rank: int) -> dict[str, Any]:
    """The HybridModel keywords of pipeline rank `pp_rank`'s stages: the layers it holds, whether it
    holds the embedding (pre_process) and the output layer (post_process); none without PP."""
    if layout is None:
        return {}
    stages = layout.rank_stages(pp_rank)
    return {"held_layers": layout.rank_layers(pp_rank), "pre_process": any(s.embedding for s in stages),
            "post_process": any(s.loss for s in stages)}


class HybridModelProvider:
    """Builds the HybridModel slice of one rank. `provide(state)` returns the model with `.config` set."""

    def __init__(self, config: ModelRuntimeConfig, *, seed: int = 1234, weights: str | None = None):
        self.config = config
        self.seed = seed
        self.weights = weights

    def provide(self, state: ParallelState) -> nn.Module:
        from gptoss_cli.checkpoint.load import load_weights
        from gptoss_cli.model.build import build_model
        from gptoss_cli.model.init import init_weights_

        cfg = self.config
        arch = cfg.arch
        offset, n_local = state.local_expert_range(arch.num_local_experts)
        if cfg.base_experts != "bf16" and cfg.lora is None:
            raise ConfigError(f"base_experts={cfg.base_experts} keeps frozen experts; it needs LoRA (a frozen base)")
        model = build_model(arch, cfg.pattern, device=state.device, dtype=cfg.torch_dtype,
                            base_experts=cfg.base_experts, expert_offset=offset, num_local_experts=n_local,
                            token_dispatcher_factory=dispatcher_factory(arch.num_local_experts, state),
                            **stage_parts(cfg.pipeline_layout(), state.pp_rank))
        if state.cp_size > 1:
            model.set_context_parallel(state.cp_group)  # each rank holds S/CP positions of every row
        # The aux loss follows the recipe (moe.aux_loss_coeff), not the checkpoint's config.json.
        model.aux_loss_coef = cfg.aux_loss_coeff
        model.z_loss_coef = cfg.z_loss_coeff
        model.set_recompute(cfg.recompute)
        model.set_swiglu_kernel(cfg.swiglu_kernel)
        model.set_attention_backend(cfg.attention_backend)
        if self.weights is None:
            init_weights_(model, arch.initializer_range, self.seed)
        else:
            load_weights(model, self.weights)
        if cfg.freeze_router:
            # Frozen parameters get no gradient buffer and no optimizer state (parallel/grads.py
            # keeps only parameters that require grad), so AdamW and weight decay never move them.
            for _, layer in model.moe_layers():
                layer.mlp.router.requires_grad_(False)
        if cfg.lora is not None:  # after the weights: the base is frozen as loaded, adapters start at B = 0
            attach_lora(model, cfg.lora, seed=self.seed)
        gemms = None
        if cfg.fp8.enabled:
            gemms = select_gemms(cfg.fp8, state.device)  # ConfigError: no native kernel, no emulation
        if gemms is not None or cfg.qat != "none":
            # QAT wraps the experts' gemm (the FP8 one when FP8 is on): rounded weights in, STE out
            model.set_gemms(dense=gemms.dense if gemms else None,
                            grouped=qat_gemms(cfg.qat, gemms.grouped if gemms else None))
        # The model keeps its own copy of the config (as canonical providers do).
        model.config = copy.deepcopy(cfg)
        model.config.fp8_gemms = gemms  # the run reports its path and GEMM counts from here
        return model


__all__ = ["ModelRuntimeConfig", "HybridModelProvider", "dispatcher_factory", "lora_settings", "stage_parts"]
