"""Kernel selection: `precision.fp8_*` -> the numerics, the kernel path (native or emulated), and the model's gemm objects.

  fp8_recipe   scaling                                     native kernel (device)
  tensorwise   one scale per operand                       torch._scaled_mm, CUDA sm90+
  rowwise      one scale per row along the outer dim       torch._scaled_mm, CUDA sm90+
  mxfp8        UE8M0 scale per 32 values along K           block-scaled torch._scaled_mm, CUDA sm100+
  fp8_format   e4m3: every operand e4m3; hybrid: output gradients e5m2, inputs and weights e4m3.

The path is decided once, when the gemms are built for a device (docs/megatron-rules.md, "FP8
and MXFP8"):
  native    the device has the kernel;
  emulated  it does not and `precision.fp8_emulation=true` allows the same numerics without the
            speed-up: tensorwise/rowwise through torch._scaled_mm's CPU kernel on CPU (else
            dequantise + fp32 matmul), mxfp8 by dequantise + fp32 matmul;
  otherwise a ConfigError. A run never falls back silently: `Fp8Gemms.summary()` goes into the
  run's summary and metrics, and the gemms count what they ran.
FP8 applies to the attention projections and the expert GEMMs (`HybridModel.set_gemms`); the
router, embeddings, output layer, norms and sinks stay in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gptoss_cli.errors import ConfigError
from gptoss_cli.fp8.catalog import FORMATS, RECIPES
from gptoss_cli.fp8.grouped import Fp8GroupedGemm
from gptoss_cli.fp8.guard import NonFiniteGuard
from gptoss_cli.fp8.linear import Fp8LinearGemm, Fp8Stats
from gptoss_cli.fp8.matmul import BLOCK_SCALED_MM, DEQUANTIZE, SCALED_MM, Fp8Numerics
from gptoss_cli.fp8.scaling import E4M3, E5M2

NATIVE, EMULATED = "native", "emulated"


@dataclass(frozen=True)
class Fp8Settings:
    """The recipe's `precision.fp8_recipe`, `fp8_format` and `fp8_emulation` (plain, picklable)."""

    recipe: str = "none"
    fp8_format: str = "e4m3"
    emulation: bool = False

    @classmethod
    def from_precision(cls, precision: Any) -> "Fp8Settings":
        return cls(recipe=precision.fp8_recipe, fp8_format=precision.fp8_format, emulation=precision.fp8_emulation)

    @property
    def enabled(self) -> bool:
        return self.recipe != "none"


@dataclass
class Fp8Gemms:
    """The gemm objects of one model for one recipe and device, and what path they take."""

    settings: Fp8Settings
    numerics: Fp8Numerics
    path: str  # "native" | "emulated"
    device: str
    stats: Fp8Stats = field(default_factory=Fp8Stats)
    # The NaN/inf checks of every gemm below: at once by default; the training loop sets
    # `guard.deferred` and reads one flag per step (fp8/guard.py).
    guard: NonFiniteGuard = field(default_factory=NonFiniteGuard)

    def dense(self, layer: str) -> Fp8LinearGemm:
        return Fp8LinearGemm(self.numerics, layer, self.stats, self.guard)

    def grouped(self, layer: str) -> Fp8GroupedGemm:
        return Fp8GroupedGemm(self.numerics, layer, self.stats, self.guard)

    def describe(self) -> str:
        """One line for the run's summary, e.g. 'mxfp8 e4m3, emulated (dequantize) on cpu'."""
        s = self.settings
        return f"{s.recipe} {s.fp8_format}, {self.path} ({self.numerics.kernel}) on {self.device}"

    def summary(self) -> dict[str, Any]:
        return {"recipe": self.settings.recipe, "format": self.settings.fp8_format, "path": self.path,
                "kernel": self.numerics.kernel, "device": self.device, "gemms": self.stats.total}


def native_kernel(recipe: str, device: torch.device) -> str | None:
    """The native kernel for `recipe` on `device`, or None when the device has none."""
    spec = RECIPES[recipe]
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if torch.cuda.get_device_capability(device) < spec.native_capability:
        return None
    return BLOCK_SCALED_MM if spec.scaling == "mx" else SCALED_MM


def emulated_kernel(recipe: str, device: torch.device) -> str:
    """Same numerics without FP8 hardware: torch._scaled_mm's CPU kernel (tensor or row scales), else
    dequantise + matmul."""
    if RECIPES[recipe].scaling != "mx" and device.type == "cpu":
        return SCALED_MM
    return DEQUANTIZE


def _native_needs(recipe: str) -> str:
    """e.g. 'a CUDA GPU of compute capability 9.0+ (Hopper)'."""
    spec = RECIPES[recipe]
    major, minor = spec.native_capability
    return f"a CUDA GPU of compute capability {major}.{minor}+ ({spec.generation})"


def select_gemms(settings: Fp8Settings, device: torch.device | str) -> Fp8Gemms | None:
    """The FP8 gemms of `settings` on `device`; None for fp8_recipe=none. Raises ConfigError when
    the device has no native kernel and emulation is not allowed."""
    if not settings.enabled:
        return None
    if settings.recipe not in RECIPES:
        raise ConfigError(f"precision.fp8_recipe={settings.recipe!r} is not one of none, {', '.join(RECIPES)}")
    if settings.fp8_format not in FORMATS:
        raise ConfigError(f"precision.fp8_format={settings.fp8_format!r} is not one of {', '.join(FORMATS)}")
    device = torch.device(device)
    kernel = native_kernel(settings.recipe, device)
    path = NATIVE
    if kernel is None:
        if not settings.emulation:
            need = _native_needs(settings.recipe)
            raise ConfigError(
                f"precision.fp8_recipe={settings.recipe} has no native kernel on {_device_name(device)} "
                f"(it needs {need})",
                hint="run on such a GPU, or set precision.fp8_emulation=true for the same numerics without the speed-up",
            )
        kernel, path = emulated_kernel(settings.recipe, device), EMULATED
    numerics = Fp8Numerics(
        scaling=RECIPES[settings.recipe].scaling, forward=E4M3,
        gradient=E5M2 if settings.fp8_format == "hybrid" else E4M3, kernel=kernel,
    )
    return Fp8Gemms(settings=settings, numerics=numerics, path=path, device=_device_name(device))


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm{major}{minor})"
    return device.type


__all__ = ["Fp8Settings", "Fp8Gemms", "select_gemms", "native_kernel", "emulated_kernel"]
