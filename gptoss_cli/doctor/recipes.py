"""What each shipped recipe would get on this machine: its precision, its FP8 recipe natively, emulated or
refused, the attention kernel of each layer kind, and the rules it would fail here.

Each recipe is validated as `gptoss train` would on this machine: system.device set to the device the
checks run on, system.gpu the detected generation (recipe/environment.py), the installed torch; so the
rule registry says what is refused (e.g. MXFP8 on Hopper: fp8.native_gpu). The FP8 path and the
attention kernels come from the same functions a training run calls (fp8's `native_kernel`,
model/attention/backends.py's `layer_kernels`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gptoss_cli.errors import GptossError
from gptoss_cli.fp8.selection import native_kernel
from gptoss_cli.model.attention.backends import layer_kernels
from gptoss_cli.model.dtypes import torch_dtype
from gptoss_cli.recipe.load import available_recipes, load_recipe
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.recipe.validate import validate_recipe


@dataclass
class RecipeVerdict:
    recipe: str
    params_dtype: str
    fp8: str  # "none", or "<recipe>: native (<kernel>)" / "emulated" / "refused"
    attention: dict[str, str] = field(default_factory=dict)  # layer kind -> kernel, or "refused: ..."
    refused: list[str] = field(default_factory=list)  # "[rule] message" of every error here

    @property
    def ok(self) -> bool:
        return not self.refused

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def recipe_verdicts(device: str, generation: str) -> list[RecipeVerdict]:
    """One verdict per shipped recipe (recipes/*.yaml), validated for `device` and GPU `generation`."""
    return [recipe_verdict(name, device, generation) for name in available_recipes()]


def recipe_verdict(name: str, device: str, generation: str) -> RecipeVerdict:
    try:
        recipe = load_recipe(name, [f"system.device={device}", f"system.gpu={generation}"])
    except GptossError as exc:
        return RecipeVerdict(name, "?", "?", refused=[f"[load] {exc.message}"])
    cfg = recipe.config
    report = validate_recipe(recipe, gpu=generation)
    verdict = RecipeVerdict(name, cfg.precision.params_dtype, _fp8_path(cfg, device),
                            refused=[f"[{f.rule}] {f.message}" for f in report.errors])
    a = recipe.arch
    window = a.sliding_window if any(a.is_sliding(i) for i in range(a.num_hidden_layers)) else None
    try:
        kernels = layer_kernels(cfg.model.attention_backend, device, torch_dtype(cfg.precision.params_dtype),
                                a.head_dim, cfg.training.seq_length, window)
        verdict.attention = {kind: kernel for kind, kernel in kernels.items() if kind == "full" or window}
    except GptossError as exc:
        verdict.attention = {"all": f"refused: {exc.message}"}
    return verdict


def _fp8_path(cfg: RecipeConfig, device: str) -> str:
    recipe = cfg.precision.fp8_recipe
    if recipe == "none":
        return "none"
    kernel = native_kernel(recipe, torch.device(device))
    if kernel is not None:
        return f"{recipe}: native ({kernel})"
    return f"{recipe}: emulated" if cfg.precision.fp8_emulation else f"{recipe}: refused (no native kernel here)"


__all__ = ["RecipeVerdict", "recipe_verdicts", "recipe_verdict"]
