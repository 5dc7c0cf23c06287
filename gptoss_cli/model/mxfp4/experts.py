"""Frozen expert layers kept in MXFP4 (lora.base_experts=mxfp4): blocks/scales per local expert, decoded per GEMM.

A LoRA run never changes the base's expert weights, so it can keep them as the release stores them:
per local expert `blocks uint8 [E_local, out, in/32, 16]` and `scales uint8 [E_local, out, in/32]`
(4.25 bits per weight: 4 for the E2M1 code, 8 per group of 32 for the E8M0 scale; the layout is
model/mxfp4/codec.py's, the export's and HF's, in `[expert, out, in]` orientation with the contraction
axis `in` blocked). `Mxfp4ExpertLinear` holds them as buffers (no gradient, no optimizer state, not in
a LoRA checkpoint, which names its base instead) and the biases as frozen parameters in the params
dtype. Each GEMM decodes the layer's local stack to the params dtype right before it runs, fprop in
forward and dgrad in backward, and drops it after (model/gemm/grouped.py, `frozen_grouped_linear`):
the bf16 copy of one layer's experts exists at a time, never of the whole model. Decoding is exact
(every MXFP4 value is a bf16 value), so the GEMMs see bit for bit the weights a bf16 base holding
the decoded values would: same logits, same adapter gradients. Whatever gemm the layer has (FP8,
MXFP4 QAT) gets the decoded weight, as it would get a bf16 parameter; under QAT with adapters that
gemm rounds the decoded weight with the adapters merged in, Q(W_dec + scaling * B @ A) (model/lora.py).

Checkpoint names do not change: the layer offers `weight{e}` slots (`Mxfp4WeightSlot`) that take an
expert's weight in the params dtype and encode it as they store it (OCP floor rule; a bf16 base is
quantised one expert tensor at a time as it is read), or an expert's blocks and scales as stored
(`copy_mxfp4_`, bit-exact: an HF MXFP4 base is never decoded or re-quantised). Merging adapters into
such a layer (`merge_lora_`) is refused: `gptoss convert --to hf|hybrid` merges from the checkpoint.

`pack_experts_(model)` swaps every ExpertLinear of a model still on the meta device for this storage,
so the bf16 stacks are never allocated (model/build.py's `build_model(..., base_experts="mxfp4")`).
"""

from __future__ import annotations

import torch
from torch import nn

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.expert_names import PerExpertParams
from gptoss_cli.model.gemm.grouped import GroupedGemm, WgradQueue, frozen_grouped_linear
from gptoss_cli.model.mxfp4.codec import GROUP, decode, encode
from gptoss_cli.model.moe import ExpertLinear

BASE_EXPERTS = ("bf16", "mxfp4")  # lora.base_experts


class Mxfp4ExpertLinear(ExpertLinear):
    """A frozen `ExpertLinear` whose weight is MXFP4 `blocks`/`scales` buffers (see the module docstring)."""

    stacked = ("blocks", "scales", "bias")

    def __init__(self, num_local_experts: int, expert_offset: int, out_features: int, in_features: int,
                 device=None, dtype=None):
        PerExpertParams.__init__(self, num_local_experts, expert_offset)
        if in_features % GROUP:
            raise ConfigError(f"MXFP4 experts need an input width divisible by {GROUP}, got {in_features}",
                              hint="set lora.base_experts=bf16")
        self.params_dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.register_buffer("blocks", torch.empty(num_local_experts, out_features, in_features // GROUP, GROUP // 2,
                                                   device=device, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(num_local_experts, out_features, in_features // GROUP,
                                                   device=device, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.zeros(num_local_experts, out_features, device=device, dtype=dtype),
                                 requires_grad=False)

    def __getattr__(self, name: str):
        if name == "weight":  # every reader of ExpertLinear.weight is told why there is none
            raise AttributeError("this expert layer keeps its frozen weight as MXFP4 blocks/scales "
                                 "(lora.base_experts=mxfp4): it has no `weight`; `decoded_weight()` decodes it")
        return super().__getattr__(name)

    @property
    def weight_shape(self) -> tuple[int, int, int]:
        e, out, groups, _ = self.blocks.shape
        return e, out, groups * GROUP

    def decoded_weight(self) -> torch.Tensor:
        """The weight `[E_local, out, in]` in the params dtype (exact: a fresh tensor each call)."""
        return decode(self.blocks, self.scales, self.params_dtype)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, wgrad_queue: WgradQueue | None = None,
                name: str = "expert linear", gemm: GroupedGemm | None = None) -> torch.Tensor:
        # A frozen weight has no wgrad to delay: `wgrad_queue` gets nothing from the base. `gemm` as in
        # ExpertLinear.forward (LoRA under QAT: it rounds the decoded weight with the adapters merged in).
        return frozen_grouped_linear(x, self.decoded_weight, self.bias, tokens_per_expert, gemm=gemm or self.gemm)

    def packed_slots(self):
        """The `weight` stack's checkpoint slots, one per local expert (expert_names.checkpoint_slots)."""
        return {"weight": lambda local: Mxfp4WeightSlot(self, local)}

    def stored_bytes(self) -> int:
        """Bytes of the MXFP4 weight storage (blocks + scales) of the local experts."""
        return self.blocks.numel() * self.blocks.element_size() + self.scales.numel() * self.scales.element_size()

    def extra_repr(self) -> str:
        e, o, i = self.weight_shape
        return f"experts [{self.expert_offset}, {self.expert_offset + e}), out={o}, in={i}, MXFP4 (frozen)"


class Mxfp4WeightSlot:
    """Local expert `local`'s weight `[out, in]` of an `Mxfp4ExpertLinear` as a load destination."""

    def __init__(self, layer: Mxfp4ExpertLinear, local: int):
        self.layer, self.local = layer, local
        _, out, inp = layer.weight_shape
        self.shape = torch.Size((out, inp))
        self.dtype = layer.params_dtype
        self.device = layer.blocks.device

    def copy_(self, values: torch.Tensor) -> "Mxfp4WeightSlot":
        """Store `values [out, in]` encoded (OCP floor rule; model/mxfp4/codec.py). NaN/Inf: NonFiniteError."""
        if tuple(values.shape) != tuple(self.shape):
            raise ValueError(f"expert weight of shape {list(values.shape)} does not fit {list(self.shape)}")
        blocks, scales = encode(values.to(self.device))
        return self.copy_mxfp4_(blocks, scales)

    def copy_mxfp4_(self, blocks: torch.Tensor, scales: torch.Tensor) -> "Mxfp4WeightSlot":
        """Store an expert's blocks `[out, in/32, 16]` and scales `[out, in/32]` as they are (bit-exact)."""
        dest_b, dest_s = self.layer.blocks[self.local], self.layer.scales[self.local]
        if (blocks.dtype, scales.dtype) != (torch.uint8, torch.uint8) or \
                tuple(blocks.shape) != tuple(dest_b.shape) or tuple(scales.shape) != tuple(dest_s.shape):
            raise ValueError(f"MXFP4 blocks {list(blocks.shape)} {blocks.dtype} / scales {list(scales.shape)} "
                             f"{scales.dtype} do not fit {list(dest_b.shape)} / {list(dest_s.shape)} uint8")
        dest_b.copy_(blocks)
        dest_s.copy_(scales)
        return self


def pack_experts_(model: nn.Module) -> int:
    """Replace every `ExpertLinear` of `model` (on the meta device: nothing is allocated) with an
    `Mxfp4ExpertLinear` of the same experts; returns how many. Adapters are attached afterwards."""
    swapped = 0
    for name, m in list(model.named_modules()):
        if type(m) is not ExpertLinear:
            continue
        if m.weight.device.type != "meta":
            raise ConfigError(f"{name}: MXFP4 expert storage is chosen before the weights exist (build_model's "
                              "base_experts), not for a materialised model")
        e, out, inp = m.weight_shape
        packed = Mxfp4ExpertLinear(e, m.expert_offset, out, inp, device="meta", dtype=m.weight.dtype)
        packed.gemm = m.gemm
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, packed)
        swapped += 1
    return swapped


def expert_storage_bytes(model: nn.Module) -> dict[str, int]:
    """Resident bytes of the experts' weights by storage: {"mxfp4": blocks + scales, "dense": weight
    parameters} (biases and adapters not counted)."""
    out = {"mxfp4": 0, "dense": 0}
    for m in model.modules():
        if isinstance(m, Mxfp4ExpertLinear):
            out["mxfp4"] += m.stored_bytes()
        elif type(m) is ExpertLinear:
            out["dense"] += m.weight.numel() * m.weight.element_size()
    return out


__all__ = ["BASE_EXPERTS", "Mxfp4ExpertLinear", "Mxfp4WeightSlot", "pack_experts_",
           "expert_storage_bytes"]
