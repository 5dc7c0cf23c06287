"""`ToPeft`, the plan of `convert --to peft`: a LoRA training checkpoint's adapters (read alone) -> a PEFT adapter
folder (adapter_config.json, adapter_model.safetensors) for transformers' GptOssForCausalLM of the base; one job
per HF block, through convert's pipeline and its finiteness check like every other output."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Iterator

import torch

from gptoss_cli import outputs
from gptoss_cli.checkpoint.formats.peft.base_id import base_model_id
from gptoss_cli.checkpoint.formats.peft.adapter import (
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, adapter_config_text, peft_block_tensors,
)
from gptoss_cli.checkpoint.formats.plan import PROVENANCE_KEY, ConvertPlan, Empty, Job, fresh
from gptoss_cli.checkpoint.formats.registry import Source
from gptoss_cli.checkpoint.formats.training.record import check_base
from gptoss_cli.checkpoint.storage.pipeline import Task
from gptoss_cli.checkpoint.storage.readers import RowReader
from gptoss_cli.checkpoint.storage.safetensors_io import ShardedWriter, TensorSpec
from gptoss_cli.errors import UsageError


# --to peft of a LoRA run whose experts computed in MXFP4. PEFT adds the adapters, unrounded, to whatever base
# it is given: what a run on MXFP4-stored experts computed, when that base has them; not what a QAT run
# computed, whose forward rounded the merged expert weights.
MXFP4_PEFT_NOTE = ("these adapters were trained against the base's experts rounded to MXFP4 (lora.base_experts=mxfp4): "
                   "apply them to a base with MXFP4 experts (as released), or merge them with --to hf, which adds "
                   "them to the rounded base")
QAT_PEFT_NOTE = ("these adapters were trained with the merged expert weights (base + adapters) rounded to MXFP4 "
                 "(precision.qat=mxfp4{also}); PEFT adds them unrounded, which is not quite the trained model: for that, "
                 "merge them with --to hf --experts mxfp4 (or --to hf), which rounds the merged experts as training did")


@dataclass
class ToPeft(ConvertPlan):
    """A LoRA training checkpoint's adapters (read alone) -> a PEFT adapter folder (adapter_config.json,
    adapter_model.safetensors) for transformers' GptOssForCausalLM of the base: one job per HF block."""

    target: ClassVar[str] = "peft"
    targets: tuple[str, ...] = ()

    @classmethod
    def for_source(cls, source: Source, src: str) -> "ToPeft":
        lora, arch = source.lora, source.arch
        if lora is None:
            what = ("a full fine-tune (no LoRA adapters)" if source.format.training_run
                    else f"{source.format.title} checkpoint")
            raise UsageError(f"{src}: --to peft exports the LoRA adapters of a training checkpoint, but this is {what}",
                             hint="use --to hf or --to hybrid for full weights")
        if source.hybrid_layer_pattern != arch.hybrid_layer_pattern:
            raise UsageError(f"{src}: trained with the layer pattern {source.hybrid_layer_pattern!r}; a PEFT adapter "
                             f"for transformers needs {arch.hybrid_layer_pattern!r} (one '*E' per HF block)")
        check_base(lora["base"], source.folder)  # the adapters belong to this base, byte for byte
        notes = []
        mxfp4_base = lora.get("base_experts") == "mxfp4"
        if source.provenance.get("qat") == "mxfp4":
            notes.append(QAT_PEFT_NOTE.format(also=", on lora.base_experts=mxfp4" if mxfp4_base else ""))
        elif mxfp4_base:
            notes.append(MXFP4_PEFT_NOTE)
        targets = tuple(lora["target_modules"])
        reader = source.reader

        def meta(name: str) -> torch.Tensor:  # shapes and dtypes only: the plan is fixed before any read
            return torch.empty(reader.shape(name), dtype=reader.dtype(name), device="meta")

        jobs = [Job(i, [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in peft_block_tensors(arch, i, meta, targets).items()])
                for i in range(arch.num_hidden_layers)]
        dtype = next((s.dtype for job in jobs for s in job.outputs), torch.float32)
        return cls(source, dtype, jobs, "-", "-", notes, targets=targets)

    def tasks(self, reader: RowReader, job: Job, budget: int, empty: Empty = fresh) -> Iterator[Task | object]:
        def block():
            return list(peft_block_tensors(self.source.arch, job.unit, reader.read, self.targets).items()), []
        yield block

    def open_writer(self, folder: Path, *, provenance: dict, max_shard_bytes: int,
                    on_bytes: Callable[[int], None] | None):
        return ShardedWriter(folder, self.specs, single_file=ADAPTER_WEIGHTS, on_bytes=on_bytes,
                             metadata={PROVENANCE_KEY: json.dumps(provenance, default=str)})

    def write_files(self, folder: Path, provenance: dict) -> None:
        lora = self.source.lora
        config = adapter_config(rank=int(lora["rank"]), alpha=float(lora["alpha"]), dropout=float(lora.get("dropout", 0.0)),
                                target_modules=self.targets, base_model=base_model_id(lora["base"]["path"]))
        outputs.write_text(folder / ADAPTER_CONFIG, adapter_config_text(config))


__all__ = ["ToPeft", "MXFP4_PEFT_NOTE", "QAT_PEFT_NOTE"]
