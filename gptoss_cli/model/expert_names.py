"""The expert naming rule: stacked `[E_local, ...]` expert parameters, named per GLOBAL expert id on disk.

Every expert tensor lives under a layer's `mlp.experts` module. In the model an expert parameter
is one stack over the experts this rank holds, `[E_local, ...]`, experts
[expert_offset, expert_offset + E_local) under expert parallelism (EP); in a checkpoint, in the
optimizer's state and in DCP it is one tensor per expert, named by the stack's name followed by
the global expert id: `decoder.layers.1.mlp.experts.linear_fc1.weight3`, `...linear_fc2.bias3`,
a LoRA factor `...linear_fc1.adapter.linear_in.weight3` (docs/checkpoint-layouts.md, "Hybrid
layout"). So any EP layout writes and reads the same names.

`expert_name` writes such a name and `parse_expert_name` reads one back; `PerExpertParams` (the
module that holds stacks) and `checkpoint_slots` (a module's parameters under their checkpoint
names; a stack kept in another form, MXFP4, offers load slots through `packed_slots`) are built on them, and `is_expert_name` says which parameters are the experts' (split over
EP, reduced over the expert data-parallel group).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

EXPERTS = "mlp.experts"  # the module path, inside a layer, of every expert tensor

# <layer>.mlp.experts.<module>.<weight|bias><e>
_PER_EXPERT = re.compile(
    rf"^(?P<stack>(?P<experts>(?:.*\.)?{re.escape(EXPERTS)})\.(?P<module>.+)\.(?P<kind>weight|bias))(?P<expert>\d+)$"
)
BASE_MODULES = ("linear_fc1", "linear_fc2")  # the experts' own linear layers (not their LoRA factors)


@dataclass(frozen=True)
class ExpertName:
    """A per-expert name taken apart: `<experts>.<module>.<kind><expert>`, `stack` = all but the id."""

    stack: str  # the stacked parameter's name, e.g. decoder.layers.1.mlp.experts.linear_fc1.weight
    expert: int  # the global expert id
    experts: str  # the experts module, e.g. decoder.layers.1.mlp.experts
    module: str  # linear_fc1 / linear_fc2, or a LoRA factor such as linear_fc1.adapter.linear_in
    kind: str  # "weight" or "bias"

    @property
    def is_base(self) -> bool:
        """A weight or bias of the experts' own fc1 / fc2 (not a LoRA factor)."""
        return self.module in BASE_MODULES


def expert_name(stack: str, expert: int) -> str:
    """The checkpoint name of global expert `expert` of the stacked parameter named `stack`."""
    return f"{stack}{expert}"


def parse_expert_name(name: str) -> ExpertName | None:
    """The parts of a per-expert checkpoint name (see `expert_name`); None for any other name."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    return ExpertName(m["stack"], int(m["expert"]), m["experts"], m["module"], m["kind"])


def ep_slice(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The global ids of the experts that EP rank `ep_rank` of `ep_size` holds: the contiguous block
    [ep_rank * n, (ep_rank + 1) * n), n = num_experts / ep_size (the callers check it divides)."""
    n = num_experts // ep_size
    return range(ep_rank * n, (ep_rank + 1) * n)


def is_expert_name(name: str) -> bool:
    """Whether a parameter or checkpoint name (stacked or per expert, LoRA factors included) is the
    experts': split over EP and reduced over expert-DP; every other parameter is dense."""
    return f".{EXPERTS}." in f".{name}"


class PerExpertParams(nn.Module):
    """Parameters stacked over the local experts, `[E_local, ...]`, named per expert on disk.

    state_dict() and load_state_dict() speak the checkpoint's per-expert names with GLOBAL expert
    ids (`weight{e}`, `bias{e}` for e in [expert_offset, expert_offset + E_local)), so a layer that
    holds a slice of the experts under expert parallelism saves and loads its own slice. `stacked`
    lists the parameter names that are stacked this way."""

    stacked: tuple[str, ...] = ("weight", "bias")

    def __init__(self, num_local_experts: int, expert_offset: int):
        super().__init__()
        self.expert_offset = expert_offset
        self.num_local_experts = num_local_experts
        self.register_state_dict_post_hook(PerExpertParams._split_state_dict)
        self.register_load_state_dict_pre_hook(PerExpertParams._join_state_dict)
        self.register_load_state_dict_post_hook(PerExpertParams._drop_stacked_missing)

    def packed_slots(self) -> dict[str, Any]:
        """Stacks held in another form than a parameter: {stack name: local expert -> its load
        destination} (model/mxfp4/experts.py's MXFP4 weights); none here."""
        return {}

    def global_ids(self) -> range:
        """The global ids of the experts this module holds, in stack order."""
        return range(self.expert_offset, self.expert_offset + self.num_local_experts)

    def expert_names(self, stack: str) -> list[str]:
        """The checkpoint names of the rows of the stack named `stack` (a parameter of this module)."""
        return [expert_name(stack, e) for e in self.global_ids()]

    @staticmethod
    def _split_state_dict(module: "PerExpertParams", state_dict, prefix, local_metadata) -> None:
        for name in module.stacked:
            stacked = state_dict.pop(prefix + name)
            for local, key in enumerate(module.expert_names(prefix + name)):
                state_dict[key] = stacked[local]

    @staticmethod
    def _join_state_dict(module: "PerExpertParams", state_dict, prefix, local_metadata, strict,
                         missing_keys, unexpected_keys, error_msgs) -> None:
        module._load_prefix = prefix
        for name in module.stacked:
            keys = module.expert_names(prefix + name)
            absent = [k for k in keys if k not in state_dict]
            if absent:
                missing_keys.extend(absent)
                for k in keys:
                    state_dict.pop(k, None)
                continue
            state_dict[prefix + name] = torch.stack([state_dict.pop(k) for k in keys])

    @staticmethod
    def _drop_stacked_missing(module: "PerExpertParams", incompatible_keys) -> None:
        # The stacked names are internal; the per-expert names were already reported missing.
        prefix = getattr(module, "_load_prefix", None)
        for name in module.stacked:
            if prefix is not None and prefix + name in incompatible_keys.missing_keys:
                incompatible_keys.missing_keys.remove(prefix + name)

    def extra_repr(self) -> str:
        e, o, i = self.weight.shape
        return f"experts [{self.expert_offset}, {self.expert_offset + e}), out={o}, in={i}"


def checkpoint_slots(
    module: nn.Module, prefix: str = "", *, all_experts: bool = False, num_experts: int | None = None
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(checkpoint name, destination tensor) for every parameter of `module` (a model or one layer,
    names prefixed by `prefix`). Expert names map to a row of their stacked parameter; with
    all_experts, names of experts this module does not hold come with None."""
    owners = {name: m for name, m in module.named_modules() if isinstance(m, PerExpertParams)}
    seen: set[str] = set()
    for name, param in module.named_parameters():
        owner_name = name.rpartition(".")[0]
        owner = owners.get(owner_name)
        if owner is None:
            yield prefix + name, param
            continue
        if owner_name not in seen:  # stacks held in another form (MXFP4 weights) come before the parameters
            seen.add(owner_name)
            for stack, slot in owner.packed_slots().items():
                yield from _per_expert(owner, prefix + (f"{owner_name}." if owner_name else "") + stack, slot,
                                       all_experts, num_experts)
        yield from _per_expert(owner, prefix + name, lambda local, p=param: p[local], all_experts, num_experts)


def _per_expert(owner: PerExpertParams, stack: str, slot, all_experts: bool, num_experts: int | None):
    ids = range(num_experts) if all_experts and num_experts is not None else owner.global_ids()
    for e in ids:
        local = e - owner.expert_offset
        held = 0 <= local < owner.num_local_experts
        yield expert_name(stack, e), (slot(local) if held else None)


__all__ = ["EXPERTS", "BASE_MODULES", "ExpertName", "expert_name", "parse_expert_name", "ep_slice", "is_expert_name",
           "PerExpertParams", "checkpoint_slots"]
