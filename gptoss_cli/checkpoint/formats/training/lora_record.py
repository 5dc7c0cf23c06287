"""A LoRA training checkpoint's run record (`run.lora`: rank, target_modules) checked against its adapter tensors.

The tensors are the truth: an export scales the merge by alpha / rank and writes PEFT's `r` and targets
from the record, so a record that disagrees with them would export a wrong model with exit 0. Every
adapter tensor must have a place in the record (its module among `target_modules`, its rank axis the
record's rank: A `[rank, in]`, B `[out, rank]`), and every target must have its adapter pair on every
layer that holds the module (attention `*` layers: linear_qkv, linear_proj; MoE `E` layers: linear_fc1,
linear_fc2, one pair per expert). Alpha is not in the tensors; resuming checks it against the recipe
(train/resume.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptoss_cli.errors import CheckpointError
from gptoss_cli.model.catalog import ATTENTION_TARGETS, MLP_TARGETS
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.lora import ADAPTER, LINEAR_IN, LINEAR_OUT
from gptoss_cli.model.pattern import ATTENTION, MOE, parse_pattern

ADAPTER_MARK = f".{ADAPTER}."


def _expected(arch: GptOssArch, pattern: str, targets: list[str]) -> list[tuple[str, str]]:
    """(target, adapter tensor name) for every adapter the record's targets call for."""
    out: list[tuple[str, str]] = []
    for i, symbol in enumerate(parse_pattern(pattern).layers):
        for t in targets:
            if symbol == ATTENTION and t in ATTENTION_TARGETS:
                out += [(t, f"decoder.layers.{i}.self_attention.{t}.{ADAPTER}.{f}.weight") for f in (LINEAR_IN, LINEAR_OUT)]
            elif symbol == MOE and t in MLP_TARGETS:
                out += [(t, f"decoder.layers.{i}.mlp.experts.{t}.{ADAPTER}.{f}.weight{e}")
                        for e in range(arch.num_local_experts) for f in (LINEAR_IN, LINEAR_OUT)]
    return out


def check_lora_record(lora: dict[str, Any], reader: Any, arch: GptOssArch, pattern: str, folder: Path) -> None:
    """Refuse, in one line naming the tensor, a `run.lora` record of `folder` that `reader`'s adapter
    tensors (Hybrid names) contradict."""
    rank, targets = int(lora["rank"]), [str(t) for t in lora["target_modules"]]
    where = f"{folder}/train_state.json"
    for name in sorted(reader.names()):
        if ADAPTER_MARK not in name:
            continue
        module = name.split(ADAPTER_MARK)[0].rsplit(".", 1)[-1]
        if module not in targets:
            raise CheckpointError(f"{folder}: tensor {name} adapts {module}, which {where} run.lora.target_modules "
                                  f"{targets} does not name", hint="the record does not belong to these adapters")
        shape = tuple(reader.shape(name))
        factor = name.split(ADAPTER_MARK)[1].split(".")[0]
        has = shape[0] if factor == LINEAR_IN else shape[-1]
        if len(shape) != 2 or has != rank:
            raise CheckpointError(f"{folder}: tensor {name} has shape {list(shape)} (rank {has}), but {where} "
                                  f"run.lora.rank is {rank}", hint="the record does not belong to these adapters")
    present = set(reader.names())
    for target, name in _expected(arch, pattern, targets):
        if name not in present:
            raise CheckpointError(f"{folder}: {where} run.lora.target_modules names {target}, but tensor {name} is "
                                  "not in the checkpoint", hint="the record does not belong to these adapters")


__all__ = ["check_lora_record"]
