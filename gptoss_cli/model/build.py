"""`build_model`: the one place a HybridModel is created on the meta device and materialised (uninitialised)."""

from __future__ import annotations

import torch

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.mxfp4.experts import BASE_EXPERTS, pack_experts_
from gptoss_cli.model.pattern import HybridPattern


def build_model(arch: GptOssArch, pattern: HybridPattern | None = None, *, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, base_experts: str = "bf16", **kwargs) -> HybridModel:
    """A HybridModel built on the meta device and materialised (uninitialised) on `device`.

    `base_experts="mxfp4"`: the experts' weights are frozen MXFP4 blocks/scales (model/mxfp4/experts.py),
    chosen on the meta device so their `dtype` stacks are never allocated. kwargs go to HybridModel
    (expert_offset, num_local_experts, token_dispatcher_factory)."""
    if base_experts not in BASE_EXPERTS:
        raise ConfigError(f"base_experts={base_experts!r} is not one of {', '.join(BASE_EXPERTS)}")
    model = HybridModel(arch, pattern, device="meta", dtype=dtype, **kwargs)
    if base_experts == "mxfp4":
        pack_experts_(model)
    model.to_empty(device=device)
    model.reset_buffers()
    return model


__all__ = ["build_model"]
