"""YaRN rotary position embeddings as GPT-OSS uses them (docs/architecture.md, "YaRN")."""

from __future__ import annotations

import math

import torch
from torch import nn

from gptoss_cli.model.config import GptOssArch


def yarn_inv_freq(arch: GptOssArch) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies and the cos/sin scale (`0.1*ln(factor)+1`) of YaRN.

    `arch.rope_truncate` decides whether the correction range from beta_fast/beta_slow is rounded
    outward; GPT-OSS ships `truncate: false` and rounding changes 9 of 32 frequencies.
    """
    dim = arch.head_dim
    base = arch.rope_theta
    factor = arch.rope_scaling_factor
    original = arch.rope_original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        # The dimension index whose wavelength makes `num_rotations` turns over the original context.
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(arch.rope_beta_fast)
    high = correction_dim(arch.rope_beta_slow)
    if arch.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0.0), min(high, dim - 1.0)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero

    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    # ramp = 0 keeps the original (extrapolated) frequency, 1 takes the interpolated one.
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = interpolation * ramp + extrapolation * (1 - ramp)
    scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, scale


class YarnRotaryEmbedding(nn.Module):
    """Produces (cos, sin) of shape [batch, seq, head_dim/2] for given positions; no parameters."""

    def __init__(self, arch: GptOssArch):
        super().__init__()
        inv_freq, scale = yarn_inv_freq(arch)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = scale

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[..., None].to(torch.float32) * self.inv_freq.to(position_ids.device)
        # Cast after scaling, as the reference does, so bf16 runs round the same values.
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (NeoX) rotation of x [batch, heads, seq, head_dim] by cos/sin [batch, seq, head_dim/2]."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
