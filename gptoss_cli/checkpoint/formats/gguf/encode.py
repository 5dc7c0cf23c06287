"""Tensor values to the bytes of a GGML type: F32, F16, BF16, Q8_0 (the gguf package's quantizer, bit-exact with
ggml's), and MXFP4 repacked from GPT-OSS's blocks and scales or encoded from values (model/mxfp4/codec.py).

Every encoder works on rows (the last dimension is the one GGML's blocks run along: the `in` axis of every
[out, in] weight), so a tensor is encoded in row ranges and never held whole.

MXFP4 in GGUF is ggml's `block_mxfp4`: per 32 values one byte of scale (E8M0, the same byte as GPT-OSS's
`*_scales`) then 16 bytes whose byte j holds value j in its low nibble and value j + 16 in its high nibble;
GPT-OSS's `*_blocks` hold values 2j and 2j + 1 in byte j instead (docs/checkpoint-layouts.md, "MXFP4"). The
codes themselves are the same E2M1 codes (ggml doubles its value table and halves the scale), so repacking
moves nibbles and never changes a value: the released bytes pass through.
"""

from __future__ import annotations

import torch

from gptoss_cli.errors import CheckpointError
from gptoss_cli.model.mxfp4 import codec as mxfp4

F32, F16, BF16, Q8_0, MXFP4 = "F32", "F16", "BF16", "Q8_0", "MXFP4"
BLOCKS = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q8_0: (32, 34), MXFP4: (32, 17)}  # values, bytes per block
F16_MAX = 65504.0


def row_bytes(ggml_type: str, row_len: int) -> int:
    values, nbytes = BLOCKS[ggml_type]
    return row_len // values * nbytes


def nbytes(ggml_type: str, shape: tuple[int, ...]) -> int:
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * row_bytes(ggml_type, shape[-1])


def encode(values: torch.Tensor, ggml_type: str, name: str) -> torch.Tensor:
    """`values` [..., n] (float) as the bytes of `ggml_type`, [..., row_bytes] uint8 (a view where no copy is needed)."""
    if ggml_type == F32:
        out = values.to(torch.float32)
    elif ggml_type == BF16:
        out = values.to(torch.bfloat16)
    elif ggml_type == F16:
        peak = float(values.abs().max()) if values.numel() else 0.0
        if peak > F16_MAX:
            raise CheckpointError(f"tensor {name!r} holds {peak:.6g}, beyond float16's range (65504)",
                                  hint="export with --dtype bf16 or f32")
        out = values.to(torch.float16)
    elif ggml_type == Q8_0:
        return _q8_0(values)
    elif ggml_type == MXFP4:
        try:
            blocks, scales = mxfp4.encode(values)
        except mxfp4.NonFiniteError as exc:
            raise CheckpointError(f"tensor {name!r} holds {exc.value}; MXFP4 has no encoding for NaN or Inf") from None
        return repack_mxfp4(blocks, scales)
    else:
        raise ValueError(ggml_type)
    out = out.contiguous()
    return out.view(torch.uint8).reshape(*out.shape[:-1], -1)


def _q8_0(values: torch.Tensor) -> torch.Tensor:
    import gguf  # noqa: PLC0415 (the gguf extra)

    rows = values.to(torch.float32).contiguous().numpy()
    return torch.from_numpy(gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0))


def repack_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's MXFP4 (`blocks [..., G, 16]`: values 2j, 2j+1 in byte j; `scales [..., G]`) as ggml's
    block_mxfp4 bytes `[..., G * 17]` (scale, then values j and j + 16 in byte j)."""
    lo, hi = blocks & 0x0F, blocks >> 4
    codes = torch.stack((lo, hi), dim=-1).reshape(*blocks.shape[:-1], 32)  # value k at index k
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat((scales.unsqueeze(-1), packed), dim=-1)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 17)


def unpack_mxfp4(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `repack_mxfp4`: ggml's bytes [..., G * 17] -> (blocks [..., G, 16], scales [..., G])."""
    groups = raw.reshape(*raw.shape[:-1], raw.shape[-1] // 17, 17)
    scales, packed = groups[..., 0], groups[..., 1:]
    codes = torch.cat((packed & 0x0F, packed >> 4), dim=-1)  # value k at index k
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), scales.contiguous()


__all__ = ["F32", "F16", "BF16", "Q8_0", "MXFP4", "BLOCKS", "encode", "repack_mxfp4", "unpack_mxfp4", "row_bytes",
           "nbytes"]
