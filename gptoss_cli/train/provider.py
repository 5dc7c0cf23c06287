"""The model provider: builds this rank's HybridModel (its slice of experts, the EP dispatcher, weights).

The provider holds a `ModelRuntimeConfig`; like Megatron-Bridge's canonical providers, the model
it builds keeps its own deep copy as `model.config`, which is the object the schedule reads
(`get_model_config(model)`). Training callbacks must therefore be installed on that copy, never on
`provider.config` (see `gptoss_cli.train.setup.install_training_callbacks`).

Weights come from one of: a seed (every tensor drawn from a generator seeded by the seed and the
tensor's checkpoint name, so any EP layout gets the same initial model), a Hybrid checkpoint
(each rank reads only its own experts' tensors) or a Hugging Face checkpoint (mapped on the fly).
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from gptoss_cli.errors import CheckpointError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.dispatcher import AllToAllTokenDispatcher
from gptoss_cli.parallel.state import ParallelState

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ModelRuntimeConfig:
    """What the built model and the schedule read at run time (Megatron's TransformerConfig role)."""

    arch: GptOssArch
    hybrid_layer_pattern: str
    params_dtype: str = "fp32"
    aux_loss_coeff: float = 0.0
    expert_model_parallel_size: int = 1
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    # Training callbacks, installed by setup on the model's own copy of this config.
    finalize_model_grads_func: Callable[..., Any] | None = None
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None
    no_sync_func: Callable[[], Any] | None = None
    grad_sync_func: Callable[..., Any] | None = None
    param_sync_func: Callable[..., Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.params_dtype]


def seeded_init_(model: nn.Module, seed: int, std: float) -> None:
    """Initialise every checkpoint tensor from its own generator (seed, crc32(name)).

    The value of a tensor depends only on the seed and its checkpoint name, not on which rank
    holds it, so EP=1 and EP=2 start from the same model. Norm weights 1, biases 0, the rest
    normal(0, std) (the model's own init rule, `init_weights_`).
    """
    with torch.no_grad():
        for name, dest in model.named_checkpoint_slots():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name and leaf.startswith("weight") or leaf == "layer_norm_weight":
                dest.fill_(1.0)
            elif leaf.startswith("bias"):
                dest.zero_()
            else:
                g = torch.Generator().manual_seed((seed * 2_654_435_761 + zlib.crc32(name.encode())) % (1 << 63))
                dest.copy_(torch.randn(dest.shape, generator=g, dtype=torch.float32).mul_(std))


class HybridModelProvider:
    """Builds the HybridModel slice of one rank. `provide(state)` returns the model with `.config` set."""

    def __init__(self, config: ModelRuntimeConfig, *, seed: int = 1234, weights: str | None = None):
        self.config = config
        self.seed = seed
        self.weights = weights

    def provide(self, state: ParallelState) -> nn.Module:
        from gptoss_cli.model.hybrid import HybridModel

        cfg = self.config
        arch = cfg.arch
        offset, n_local = state.local_expert_range(arch.num_local_experts)
        factory = None
        if state.ep_size > 1:
            def factory(_j: int, _layer: Any) -> AllToAllTokenDispatcher:
                return AllToAllTokenDispatcher(arch.num_local_experts, state.ep_size, state.ep_rank, state.ep_group)
        model = HybridModel(
            arch, cfg.hybrid_layer_pattern, expert_offset=offset, num_local_experts=n_local,
            token_dispatcher_factory=factory, device="meta", dtype=cfg.torch_dtype,
        )
        model.to_empty(device=state.device)
        model.reset_buffers()
        # The aux loss follows the recipe (moe.aux_loss_coeff), not the checkpoint's config.json.
        model.aux_loss_coef = cfg.aux_loss_coeff
        if self.weights is None:
            seeded_init_(model, self.seed, arch.initializer_range)
        else:
            load_weights(model, self.weights)
        # The model keeps its own copy of the config (as canonical providers do).
        model.config = copy.deepcopy(cfg)
        return model


def load_weights(model: nn.Module, folder: str | Path) -> None:
    """Fill `model` from a Hybrid checkpoint or an HF / OpenAI-original checkpoint (mapped on the fly).

    Either way tensors are read one at a time by name, and only this rank's experts are read.
    """
    from gptoss_cli.checkpoint.sources import HYBRID, open_source

    source = open_source(str(folder))
    try:
        difference = _first_difference(source.arch, model.arch)
        if difference:
            raise CheckpointError(
                f"{folder}: its architecture differs from the recipe's model ({difference})",
                hint="set model.checkpoint to the same folder so the recipe takes its architecture",
            )
    finally:
        source.close()
    if source.kind == HYBRID:
        model.load_hybrid_tensors(Path(folder))
    else:
        model.load_hf_tensors(Path(folder))


# The fields that decide tensor shapes; token ids, init std and the like may differ freely.
SHAPE_FIELDS = ("num_hidden_layers", "num_local_experts", "hidden_size", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")


def _first_difference(a: GptOssArch, b: GptOssArch) -> str:
    for k in SHAPE_FIELDS:
        if getattr(a, k) != getattr(b, k):
            return f"{k}: checkpoint {getattr(a, k)!r} vs recipe {getattr(b, k)!r}"
    return ""


__all__ = ["ModelRuntimeConfig", "HybridModelProvider", "seeded_init_", "load_weights", "DTYPES"]
