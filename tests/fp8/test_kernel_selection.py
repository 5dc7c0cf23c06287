"""precision.fp8_* -> numerics, native or emulated path, and what the run says about it."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.errors import ConfigError
from gptoss_cli.fp8.selection import Fp8Settings, select_gemms
from gptoss_cli.fp8.selection import emulated_kernel, native_kernel
from gptoss_cli.recipe.load import load_recipe
from gptoss_cli.train.provider import ModelRuntimeConfig


def test_recipe_none_selects_nothing():
    assert select_gemms(Fp8Settings("none"), "cpu") is None


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
def test_without_native_kernels_emulation_must_be_allowed(recipe):
    with pytest.raises(ConfigError, match=f"fp8_recipe={recipe} has no native kernel on cpu") as exc:
        select_gemms(Fp8Settings(recipe, "e4m3", emulation=False), "cpu")
    assert "precision.fp8_emulation=true" in exc.value.hint


@pytest.mark.parametrize("recipe, scaling, kernel", [
    ("tensorwise", "tensor", "scaled_mm"), ("rowwise", "row", "scaled_mm"), ("mxfp8", "mx", "dequantize")])
def test_emulation_on_cpu_picks_torchs_cpu_kernel_or_dequantize(recipe, scaling, kernel):
    gemms = select_gemms(Fp8Settings(recipe, "hybrid", emulation=True), "cpu")
    assert (gemms.path, gemms.numerics.kernel, gemms.numerics.scaling) == ("emulated", kernel, scaling)
    assert (gemms.numerics.forward.name, gemms.numerics.gradient.name) == ("e4m3", "e5m2")
    assert gemms.describe() == f"{recipe} hybrid, emulated ({kernel}) on cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the choice on a machine without CUDA")
def test_a_cuda_device_without_fp8_hardware_emulates_by_dequantizing():
    assert native_kernel("mxfp8", torch.device("cuda")) is None
    assert emulated_kernel("tensorwise", torch.device("cuda")) == "dequantize"


def test_the_recipe_reaches_the_models_runtime_config():
    recipe = load_recipe("tiny_cpu_ep2_mxfp8")
    runtime = ModelRuntimeConfig.from_recipe(recipe.config, recipe.arch, recipe.pattern)
    assert runtime.fp8 == Fp8Settings("mxfp8", "hybrid", emulation=True)
    assert runtime.overlap_moe_expert_parallel_comm and runtime.delay_wgrad_compute


def test_the_summary_table_names_the_fp8_path():
    from gptoss_cli.cli.app import console
    from gptoss_cli.cli.train import render_result
    from gptoss_cli.train.progress import TrainResult

    result = TrainResult(steps=2, final_step=2, losses=[7.0, 6.5], grad_norms=[1.0, 1.0], tokens_per_s=10.0,
                         run_dir="runs/x", checkpoint=None, resumed_from=None, world_size=2, ep_size=2,
                         fp8={"recipe": "mxfp8", "format": "hybrid", "path": "emulated", "kernel": "dequantize",
                              "device": "cpu", "gemms": 1234})
    with console.capture() as cap:
        render_result(result)
    text = " ".join(cap.get().replace("│", " ").split())  # the cell may wrap on a narrow terminal
    assert "mxfp8 hybrid: emulated (dequantize) on cpu, 1234 FP8 GEMMs" in text
