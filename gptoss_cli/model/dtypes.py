"""The vocabulary of floating-point dtype names: recipes write fp32/bf16/fp16, checkpoint configs and command
options float32/bfloat16/float16, and both name the same three dtypes.

Torch-free at import (recipe/ and validate-config read the names); `torch_dtype` imports torch when it
is called. Other vocabularies keep their own names: safetensors' header codes (`SAFETENSORS_DTYPES`,
checkpoint/safetensors_io.py), token files' integer dtypes (data/token_format.py), and the subsets one
command accepts (convert's `OUTPUT_DTYPES`, generate's `GENERATE_DTYPES`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gptoss_cli.errors import UsageError

if TYPE_CHECKING:
    import torch

# short name (recipes: precision.params_dtype, training checkpoints' run.params_dtype) -> long name
# (torch's, checkpoint configs' `dtype`, command options)
LONG_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
RECIPE_DTYPES = tuple(LONG_NAMES)  # ("fp32", "bf16", "fp16")
CHECKPOINT_DTYPES = tuple(LONG_NAMES.values())  # ("float32", "bfloat16", "float16")
DTYPE_NAMES = RECIPE_DTYPES + CHECKPOINT_DTYPES  # every name torch_dtype takes


def torch_dtype(name: str, what: str = "dtype", allowed: tuple[str, ...] | None = None) -> "torch.dtype":
    """The torch dtype for `name`; a UsageError naming `what` (e.g. "--dtype") and the choices otherwise."""
    import torch

    choices = allowed or DTYPE_NAMES
    if name not in choices or name not in DTYPE_NAMES:
        raise UsageError(f"{what} {name!r} is not supported; use {' or '.join(choices)}")
    return getattr(torch, LONG_NAMES.get(name, name))


def dtype_name(dtype: "torch.dtype") -> str:
    """The long name (float32, bfloat16, float16) used in checkpoint configs and reports."""
    return str(dtype).removeprefix("torch.")


def short_dtype_name(dtype: "torch.dtype") -> str:
    """The short name (fp32, bf16, fp16) recipes and expert forms use; str(dtype) for any other dtype."""
    long = dtype_name(dtype)
    return next((short for short, name in LONG_NAMES.items() if name == long), str(dtype))


__all__ = ["LONG_NAMES", "RECIPE_DTYPES", "CHECKPOINT_DTYPES", "DTYPE_NAMES", "torch_dtype", "dtype_name",
           "short_dtype_name"]
