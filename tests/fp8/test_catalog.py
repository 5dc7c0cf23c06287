"""The FP8 recipe list is written once (fp8/catalog.py): the rules and the kernel choice agree on it, torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from gptoss_cli.fp8.catalog import RECIPES
from gptoss_cli.fp8.selection import native_kernel
from tests.recipe.recipe_helpers import run_rule

# NVIDIA's compute capabilities of the GPUs `system.gpu` names (CUDA programming guide, "Compute
# Capabilities"): written here independently of the rules' GPU generation sets.
CAPABILITY = {"a100": (8, 0), "h100": (9, 0), "h200": (9, 0), "b200": (10, 0), "gb200": (10, 0), "gb300": (10, 3)}


@pytest.mark.parametrize("gpu", sorted(CAPABILITY))
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_rule_and_the_kernel_choice_agree_on_which_gpus_run_a_recipe_natively(recipe, gpu, monkeypatch):
    # The kernel choice sees a CUDA device of the GPU's capability; the rule sees its system.gpu name.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: CAPABILITY[gpu])
    has_kernel = native_kernel(recipe, torch.device("cuda")) is not None
    findings = run_rule("fp8.native_gpu", [f"precision.fp8_recipe={recipe}", "system.device=cuda", f"system.gpu={gpu}"])
    assert (findings == []) == has_kernel, (recipe, gpu, findings)
    assert has_kernel == (CAPABILITY[gpu] >= ((10, 0) if recipe == "mxfp8" else (9, 0)))


def test_the_recipe_layer_and_the_catalog_load_without_torch():
    """validate-config runs without the trainer's stack: importing the FP8 list must not pull torch in."""
    code = ("import sys, gptoss_cli.fp8.catalog, gptoss_cli.recipe.validate, gptoss_cli.recipe.rules; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
