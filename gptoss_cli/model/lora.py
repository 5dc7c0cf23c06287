"""LoRA adapters on a frozen HybridModel: attention's linear_qkv / linear_proj and one adapter pair per expert.

An adapter adds `scaling * B @ A @ dropout(x)` to its layer's output, with `A [rank, in]`,
`B [out, rank]` and PEFT's scaling `alpha / rank`; B starts at zero, so a freshly attached model
computes exactly the base model. `A` starts as PEFT's (kaiming-uniform, bound 1/sqrt(in)), drawn
from a generator seeded by (seed, checkpoint name) like `init_weights_`, so any expert-parallel
layout starts from the same adapters.

Names follow Megatron-Bridge's LoRA: `<layer>.adapter.linear_in.weight` (A) and
`<layer>.adapter.linear_out.weight` (B). On the experts, `linear_fc1` / `linear_fc2` get one pair
per expert, stacked `[E_local, rank, in]` / `[E_local, out, rank]` and named per global expert id
(`...linear_fc1.adapter.linear_in.weight{e}`), so expert adapters live with their experts under
expert parallelism and their names contain `.mlp.experts.` (reduced over the expert data-parallel
group like the experts). The low-rank path runs in the params dtype with the default GEMMs,
whatever gemm (FP8) the frozen base layer uses. Under delayed wgrad the expert adapters' weight
gradients wait in the schedule's queue (model/gemm/grouped.py); the frozen base queues none.
Under MXFP4 QAT (model/mxfp4/qat.py) an expert layer computes with its merged weight rounded,
Q(W + scaling * B @ A) (`merged_weight`, the formula the merged export uses too; W decoded from
the blocks/scales when lora.base_experts=mxfp4), with the straight-through estimator's gradients
(`ExpertLoraAdapter.adapted`; docs/lora.md).

`attach_lora` freezes every base parameter (no gradient, hence no gradient buffer and no optimizer
state: both are built for trainable parameters only) and adds the adapters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.attention.layer import LayerNormLinear
from gptoss_cli.model.catalog import ATTENTION_TARGETS, MLP_TARGETS, TARGET_MODULES
from gptoss_cli.model.gemm.dense import ADAPTER, Linear
from gptoss_cli.model.expert_names import PerExpertParams, checkpoint_slots
from gptoss_cli.model.gemm.grouped import WgradQueue, grouped_linear
from gptoss_cli.model.init import name_generator
from gptoss_cli.model.moe import ExpertLinear
from gptoss_cli.model.mxfp4.experts import Mxfp4ExpertLinear
from gptoss_cli.model.mxfp4.qat import Mxfp4QatGemm

LINEAR_IN, LINEAR_OUT = "linear_in", "linear_out"  # A and B


@dataclass(frozen=True)
class LoraSettings:
    """rank > 0, alpha, dropout in [0, 1), targets from TARGET_MODULES."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = TARGET_MODULES

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def check(self) -> "LoraSettings":
        unknown = [t for t in self.target_modules if t not in TARGET_MODULES]
        if unknown:
            raise ConfigError(f"lora.target_modules: {unknown[0]!r} is not a LoRA target",
                              hint=f"choose from {', '.join(TARGET_MODULES)}")
        if self.rank < 1 or not self.target_modules:
            raise ConfigError(f"LoRA needs rank >= 1 and at least one target (rank={self.rank}, "
                              f"target_modules={list(self.target_modules)})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout={self.dropout} must be in [0, 1)")
        return self


class LoraAdapter(nn.Module):
    """The low-rank path of a dense layer: `linear_in.weight` A [rank, in], `linear_out.weight` B [out, rank]."""

    def __init__(self, in_features: int, out_features: int, settings: LoraSettings, device=None, dtype=None):
        super().__init__()
        self.scaling = settings.scaling
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else nn.Identity()
        self.linear_in = nn.Linear(in_features, settings.rank, bias=False, device=device, dtype=dtype)
        self.linear_out = nn.Linear(settings.rank, out_features, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(self.dropout(x), self.linear_in.weight), self.linear_out.weight) * self.scaling

    def delta(self) -> torch.Tensor:
        """scaling * B @ A [out, in] in fp32: what merging adds to the base weight."""
        return (self.linear_out.weight.float() @ self.linear_in.weight.float()) * self.scaling


class _ExpertFactor(PerExpertParams):
    """One LoRA factor of every local expert, `weight [E_local, out, in]`, saved per global expert id."""

    stacked = ("weight",)

    def __init__(self, num_local_experts: int, expert_offset: int, out_features: int, in_features: int,
                 device=None, dtype=None):
        super().__init__(num_local_experts, expert_offset)
        self.weight = nn.Parameter(torch.zeros(num_local_experts, out_features, in_features, device=device, dtype=dtype))


class ExpertLoraAdapter(nn.Module):
    """One adapter pair per local expert: A_e [rank, in], B_e [out, rank] (grouped GEMMs over the experts)."""

    def __init__(self, base: ExpertLinear, settings: LoraSettings, device=None, dtype=None):
        super().__init__()
        e, out_features, in_features = base.weight_shape  # whatever the base's storage (bf16 or MXFP4)
        self.scaling = settings.scaling
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else nn.Identity()
        self.linear_in = _ExpertFactor(e, base.expert_offset, settings.rank, in_features, device, dtype)
        self.linear_out = _ExpertFactor(e, base.expert_offset, out_features, settings.rank, device, dtype)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, wgrad_queue: WgradQueue | None = None,
                name: str = "expert adapter") -> torch.Tensor:
        """The low-rank path `scaling * B_e @ A_e @ dropout(x)`. With `wgrad_queue` (delayed wgrad) the
        adapters' weight gradients wait in the queue like their base layer's would; `name` is the base
        layer's (errors name it)."""
        return self._low_rank(self.dropout(x), tokens_per_expert, wgrad_queue, name)

    def _low_rank(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, wgrad_queue: WgradQueue | None,
                  name: str) -> torch.Tensor:
        a, b = self.linear_in.weight, self.linear_out.weight
        no_bias = a.new_zeros(a.shape[0], a.shape[1])
        h = grouped_linear(x, a, no_bias, tokens_per_expert, wgrad_queue=wgrad_queue,
                           name=f"{name}.{ADAPTER}.{LINEAR_IN}")
        return grouped_linear(h, b, a.new_zeros(b.shape[0], b.shape[1]), tokens_per_expert, wgrad_queue=wgrad_queue,
                              name=f"{name}.{ADAPTER}.{LINEAR_OUT}") * self.scaling

    def adapted(self, base: ExpertLinear, x: torch.Tensor, tokens_per_expert: torch.Tensor,
                wgrad_queue: WgradQueue | None = None, name: str = "expert adapter") -> torch.Tensor:
        """The adapted layer's output: base(x) + the low-rank path, or, when the base's gemm rounds its
        weight to MXFP4 (QAT), x @ Q(W + scaling * B @ A)^T + b per expert: the merged weight is what
        is rounded, so the forward is what the merged MXFP4 export computes. An MXFP4-stored base
        (lora.base_experts=mxfp4) gives W as its decoded blocks/scales, decoded for each GEMM.

        QAT's gradients are the straight-through estimator's (dQ/dM = identity): dx = dy @ Q(M) (the
        base gemm's dgrad, with the same rounded merged weight), and the adapters get the ordinary
        low-rank gradients, from the low-rank path run on a detached input whose value is subtracted
        again (it adds exactly zero). With dropout the adapters' input is dropout(x) in training as
        without QAT: the forward adds the low-rank path's dropout perturbation
        scaling * B @ A @ (dropout(x) - x) to the rounded merged layer, so the adapters' gradients are
        the ordinary dropout-LoRA ones and the input gradient gains that perturbation's term."""
        gemm = base.gemm
        if not isinstance(gemm, Mxfp4QatGemm):
            return base(x, tokens_per_expert, wgrad_queue, name) + self(x, tokens_per_expert, wgrad_queue, name)
        # the base layer's own GEMM (a bf16 parameter, or MXFP4 blocks decoded per GEMM: never `.weight`)
        y = base(x, tokens_per_expert, wgrad_queue, name, gemm=gemm.merged_with(self.merged_expert))
        if not torch.is_grad_enabled() or not self.linear_in.weight.requires_grad:
            return y  # the low-rank path would only carry gradients
        xd = x.detach()
        if isinstance(self.dropout, nn.Identity):
            low = self._low_rank(xd, tokens_per_expert, wgrad_queue, name)
            return y + (low - low.detach())
        # value dropout(x), gradient to x that of dropout(x) - x (the rounded merged layer has the rest)
        low = self._low_rank(xd + (self.dropout(x) - x), tokens_per_expert, wgrad_queue, name)
        with torch.no_grad():
            undropped = self._low_rank(xd, tokens_per_expert, None, name)
        return y + (low - undropped)

    def merged_expert(self, e: int, weight: torch.Tensor) -> torch.Tensor:
        """Local expert e's base weight with its adapter merged in (`merged_weight`, fp32)."""
        return merged_weight(weight, self.linear_in.weight[e].detach(), self.linear_out.weight[e].detach(),
                             self.scaling)

    def delta(self) -> torch.Tensor:
        """scaling * B_e @ A_e for every local expert, [E_local, out, in] in fp32."""
        return torch.bmm(self.linear_out.weight.float(), self.linear_in.weight.float()) * self.scaling


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`weight + scaling * b @ a` in fp32, computed in float64 and rounded once: the one formula of a
    merged adapted weight (QAT's forward rounds it to MXFP4; the merged export recomputes it from the
    checkpoint). Products of fp32 factors are exact in float64, so the fp32 result does not depend on
    how a GEMM orders the rank-long sums (bmm in training, one expert's rows in the export) unless the
    exact value lies within float64 rounding of an fp32 rounding boundary."""
    return (weight.double() + (b.double() @ a.double()) * scaling).float()


def _targets(model: nn.Module, targets: tuple[str, ...]) -> Iterator[tuple[str, nn.Module]]:
    """(name, layer) of every layer of `model` that LoRA targets: Megatron's layer name is the last part."""
    for name, m in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf in targets and isinstance(m, (LayerNormLinear, Linear, ExpertLinear)):
            yield name, m


def attach_lora(model: nn.Module, settings: LoraSettings, seed: int = 0) -> list[str]:
    """Freeze every parameter of `model` and add adapters to the targeted layers; returns their names.

    A targeted layer must exist: `linear_fc1` / `linear_fc2` on a model without MoE or MLP layers is
    a ConfigError, like any target that matches nothing."""
    settings.check()
    if any(True for _ in adapter_modules(model)):
        raise ConfigError("the model already has LoRA adapters")
    for p in model.parameters():
        p.requires_grad_(False)
    named = []
    for name, layer in list(_targets(model, settings.target_modules)):
        if isinstance(layer, ExpertLinear):  # the bias: an MXFP4-stored base has no `weight`
            b = layer.bias
            adapter = ExpertLoraAdapter(layer, settings, device=b.device, dtype=b.dtype)
        else:
            w = layer.weight
            adapter = LoraAdapter(w.shape[1], w.shape[0], settings, device=w.device, dtype=w.dtype)
        setattr(layer, ADAPTER, adapter)
        named.append(name)
    found = {n.rpartition(".")[2] for n in named}
    missing = [t for t in settings.target_modules if t not in found]
    if missing:
        raise ConfigError(f"lora.target_modules: {missing[0]!r} matches no layer of this model",
                          hint="drop it from lora.target_modules")
    init_lora_(model, seed)
    return named


def adapter_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name of the adapted layer, adapter) for every adapter of `model`."""
    for name, m in model.named_modules():
        if isinstance(m, (LoraAdapter, ExpertLoraAdapter)):
            yield name.rpartition(".")[0], m


def has_lora(model: nn.Module) -> bool:
    return any(True for _ in adapter_modules(model))


def is_adapter_name(name: str) -> bool:
    """Whether a parameter or checkpoint name is a LoRA adapter's."""
    return f".{ADAPTER}.{LINEAR_IN}." in name or f".{ADAPTER}.{LINEAR_OUT}." in name


def init_lora_(model: nn.Module, seed: int) -> None:
    """A as PEFT initialises it (uniform, bound 1/sqrt(in)), B zero; each tensor (each expert's) from a
    generator seeded by (seed, its checkpoint name)."""
    with torch.no_grad():
        for name, dest in checkpoint_slots(model):
            if dest is None or not is_adapter_name(name):
                continue
            if f".{LINEAR_OUT}." in name:
                dest.zero_()
                continue
            bound = 1.0 / math.sqrt(dest.shape[-1])
            g = name_generator(seed, name)
            dest.copy_(torch.rand(dest.shape, generator=g, dtype=torch.float32).mul_(2 * bound).sub_(bound))


def adapter_tensors(model: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """{checkpoint name: tensor} of every adapter factor this model holds (per global expert id for the
    experts); with `grads`, their gradients instead (None where there is none)."""
    out: dict[str, torch.Tensor] = {}
    for layer_name, adapter in adapter_modules(model):
        for part_name in (LINEAR_IN, LINEAR_OUT):
            part = getattr(adapter, part_name)
            t = part.weight.grad if grads else part.weight.detach()
            prefix = f"{layer_name}.{ADAPTER}.{part_name}.weight"
            if isinstance(part, _ExpertFactor):
                for local, key in enumerate(part.expert_names(prefix)):
                    out[key] = None if t is None else t[local]
            else:
                out[prefix] = t
    return out


def lora_deltas(model: nn.Module) -> dict[str, torch.Tensor]:
    """{checkpoint name of a base weight: the fp32 delta that merging adds to it}, per expert for the
    experts (`...linear_fc1.weight{e}`, global ids)."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for layer_name, adapter in adapter_modules(model):
            delta = adapter.delta()
            if isinstance(adapter, ExpertLoraAdapter):
                for local, key in enumerate(adapter.linear_in.expert_names(f"{layer_name}.weight")):
                    out[key] = delta[local]
            else:
                out[f"{layer_name}.weight"] = delta
    return out


def merge_lora_(model: nn.Module) -> int:
    """Add every adapter's delta into its base weight (rounded once to the weight's dtype) and remove
    the adapters; returns how many layers were merged."""
    merged = 0
    with torch.no_grad():
        for layer_name, adapter in list(adapter_modules(model)):
            layer = model.get_submodule(layer_name)
            if isinstance(layer, Mxfp4ExpertLinear):
                raise ConfigError(f"{layer_name}: the base keeps these experts in MXFP4 (lora.base_experts=mxfp4); "
                                  "merging the adapters into it would re-quantise the fine-tune away",
                                  hint="merge from the training checkpoint: gptoss convert CKPT OUT --to hf (or hybrid)")
            a, b = adapter.linear_in.weight, adapter.linear_out.weight
            layer.weight.copy_(merged_weight(layer.weight, a, b, adapter.scaling).to(layer.weight.dtype))
            delattr(layer, ADAPTER)
            merged += 1
    return merged


__all__ = [
    "TARGET_MODULES", "ATTENTION_TARGETS", "MLP_TARGETS", "LoraSettings", "LoraAdapter", "ExpertLoraAdapter",
    "attach_lora", "adapter_modules", "adapter_tensors", "has_lora", "is_adapter_name", "init_lora_", "lora_deltas", "merge_lora_",
    "merged_weight",
]
