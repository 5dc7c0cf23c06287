"""The names in a Megatron torch_dist checkpoint: its files, its sharded keys, its vocabulary padding. Torch-free.

Keys are the sharded keys of Megatron's layer specs, which equal our Hybrid names except for the
experts: Megatron stores one `[E, ...]` tensor per layer and weight
(`...mlp.experts.experts.linear_fc1.weight`, the MoE layer's `experts` module adding its own
`experts.`), each expert a chunk at offset e of axis 0, with the gate and up halves of fc1 as two
chunks (the swiglu split), the same for SequentialMLP and TEGroupedMLP; or, with
`singleton_local_shards`, one key per expert (`...mlp.experts.experts.<e>.linear_fc1.weight_w` /
`_v`, `...linear_fc2.weight`). Modules also carry `_extra_state` objects, which a strict load
expects; we write empty ones and never unpickle the ones we read. The embedding and output rows
are padded to a multiple of `make_vocab_size_divisible_by`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gptoss_cli.model.config import GptOssArch

if TYPE_CHECKING:
    from gptoss_cli.model.expert_names import ExpertName

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
METADATA_JSON = "metadata.json"
COMMON = "common.pt"
DCP_METADATA = ".metadata"  # DCP's own file (storage/dcp_io.py reads it)
RUN_CONFIG = "run_config.yaml"  # Megatron-Bridge's record of the model provider, beside the weights
BACKEND = "torch_dist"
CHECKPOINT_VERSION = 3.0
DEFAULT_VOCAB_MULTIPLE = 128  # Megatron-LM's --make-vocab-size-divisible-by default
ITER_FOLDER = re.compile(r"^iter_(\d{7,})$")
SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")


def iter_folder_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def padded_vocab(vocab: int, multiple: int) -> int:
    """Megatron's `_vocab_size_with_padding` at TP=1: the next multiple of `multiple`."""
    return -(-vocab // multiple) * multiple


@dataclass(frozen=True)
class ExpertSlot:
    """Where one Hybrid per-expert tensor lives in the stacked Megatron layout."""

    key: str  # the stacked key, e.g. decoder.layers.1.mlp.experts.experts.linear_fc1.weight
    expert: int
    num_experts: int
    glu: bool  # fc1: stored as two chunks (gate half, up half) along the first per-expert axis


def _hybrid_expert(name: str) -> ExpertName | None:
    """A Hybrid per-expert name of the experts' fc1 / fc2 (model/expert_names.py), else None."""
    from gptoss_cli.model.expert_names import parse_expert_name  # noqa: PLC0415 (imports torch)

    per_expert = parse_expert_name(name)
    return per_expert if per_expert is not None and per_expert.is_base else None


def expert_slot(name: str, arch: GptOssArch) -> ExpertSlot | None:
    m = _hybrid_expert(name)
    if m is None:
        return None
    return ExpertSlot(f"{m.experts}.experts.{m.module}.{m.kind}", m.expert, arch.num_local_experts,
                      m.module == "linear_fc1")


def singleton_keys(name: str) -> list[str] | None:
    """The `singleton_local_shards` keys of a Hybrid per-expert name: fc1 as `_w` (gate) and `_v` (up)."""
    m = _hybrid_expert(name)
    if m is None:
        return None
    base = f"{m.experts}.experts.{m.expert}.{m.module}.{m.kind}"
    return [f"{base}_w", f"{base}_v"] if m.module == "linear_fc1" else [base]


def extra_state_keys(arch: GptOssArch) -> list[str]:
    """The ShardedObject keys (`<key>/shard_<offset>_<shape>`) of the modules' `_extra_state`.

    Per attention layer: linear_qkv, core_attention, linear_proj; per MoE layer: pre_mlp_layernorm
    and, per expert, linear_fc1 and linear_fc2 (offset e of E); the final norm; the output layer."""
    keys = []
    for b in range(arch.num_hidden_layers):
        a, m = 2 * b, 2 * b + 1
        for mod in ("linear_qkv", "core_attention", "linear_proj"):
            keys.append(f"decoder.layers.{a}.self_attention.{mod}._extra_state/shard_0_1")
        keys.append(f"decoder.layers.{m}.pre_mlp_layernorm._extra_state/shard_0_1")
        for mod in ("linear_fc1", "linear_fc2"):
            keys.extend(f"decoder.layers.{m}.mlp.experts.experts.{mod}._extra_state/shard_{e}_{arch.num_local_experts}"
                        for e in range(arch.num_local_experts))
    keys.append("decoder.final_norm._extra_state/shard_0_1")
    keys.append("output_layer._extra_state/shard_0_1")  # a ColumnParallelLinear in both specs: it has one too
    return keys


__all__ = ["TRACKER", "RELEASE", "METADATA_JSON", "COMMON", "DCP_METADATA", "RUN_CONFIG", "BACKEND",
           "CHECKPOINT_VERSION", "DEFAULT_VOCAB_MULTIPLE", "ITER_FOLDER", "SHARD_FILE", "iter_folder_name",
           "padded_vocab", "ExpertSlot", "expert_slot", "singleton_keys", "extra_state_keys"]
