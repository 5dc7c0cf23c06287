"""Names of floating-point dtypes as recipes (fp32, bf16, fp16) and command options (float32, bfloat16) write them."""

from __future__ import annotations

import torch

from gptoss_cli.errors import UsageError

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def torch_dtype(name: str, what: str = "dtype", allowed: tuple[str, ...] | None = None) -> torch.dtype:
    """The torch dtype for `name`; a UsageError naming `what` (e.g. "--dtype") and the choices otherwise."""
    choices = allowed or tuple(DTYPES)
    if name not in choices:
        raise UsageError(f"{what} {name!r} is not supported; use {' or '.join(choices)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The long name (float32, bfloat16, float16) used in checkpoint configs and reports."""
    return str(dtype).removeprefix("torch.")


def short_dtype_name(dtype: torch.dtype) -> str:
    """The short name (fp32, bf16, fp16) recipes and expert forms use; str(dtype) for any other dtype."""
    return next((k for k, v in DTYPES.items() if v == dtype and k != dtype_name(v)), str(dtype))


__all__ = ["DTYPES", "torch_dtype", "dtype_name", "short_dtype_name"]
