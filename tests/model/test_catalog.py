"""Facts said once: the model's catalog and dtype vocabulary load without torch, and every consumer reads
the same values (the recipe schema, the trainer's model spec, the model)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import torch

from gptoss_cli.model import catalog
from gptoss_cli.model.dtypes import CHECKPOINT_DTYPES, RECIPE_DTYPES, dtype_name, short_dtype_name, torch_dtype
from gptoss_cli.recipe.schema import RecipeConfig


def test_the_catalog_and_the_dtype_names_load_without_torch():
    code = ("import sys, gptoss_cli.model.catalog, gptoss_cli.model.dtypes, gptoss_cli.limits, "
            "gptoss_cli.recipe.validate, gptoss_cli.recipe.rules; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_dtype_name_is_torchs_dtype_of_that_name():
    # torch's own spellings, written out here
    expected = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    assert set(RECIPE_DTYPES + CHECKPOINT_DTYPES) == set(expected)
    for name, dtype in expected.items():
        assert torch_dtype(name) is dtype
        assert dtype_name(dtype) in CHECKPOINT_DTYPES and short_dtype_name(dtype) in RECIPE_DTYPES
        assert torch_dtype(short_dtype_name(dtype)) is torch_dtype(dtype_name(dtype)) is dtype


def test_the_swiglu_kernel_default_is_one_value():
    from gptoss_cli.train.provider import ModelRuntimeConfig

    spec_default = next(f.default for f in dataclasses.fields(ModelRuntimeConfig) if f.name == "swiglu_kernel")
    assert RecipeConfig().model.swiglu_kernel == spec_default == catalog.SWIGLU_KERNEL_DEFAULT
    assert catalog.SWIGLU_KERNEL_DEFAULT in catalog.SWIGLU_KERNELS
