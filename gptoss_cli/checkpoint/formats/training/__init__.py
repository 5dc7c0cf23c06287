"""A `gptoss train` checkpoint (a checkpoint.dir read through `latest`, or one iter_* folder; DCP under
Hybrid names, the run recorded in train_state.json): its registry row and its opener. Torch-free at import.

It is read, never written by convert. The architecture and layer pattern come from the run record;
the tensors are the model state (`--weights model`) or the optimizer's fp32 master copies
(`master`). A LoRA run reads as its base with the adapters merged in, or, for `--to peft`, as its
adapters alone; a QAT run (and a LoRA base kept in MXFP4) reads its experts rounded to MXFP4, as its
forward computed.

Beside the row:
- record.py       the on-disk form `gptoss train` writes: file and tensor names, the run record, `latest`,
                  a LoRA base's fingerprint
- lora_record.py  a LoRA run's record (rank, targets) checked against its adapter tensors
- readers.py      the readers it is read through: LoRA merged into its base, an HF base under Hybrid names,
                  QAT's experts rounded to MXFP4
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gptoss_cli.checkpoint.formats.registry import Format, OpenOptions
from gptoss_cli.checkpoint.formats.training.record import (
    MASTER, MODEL, OPTIMIZER, TRAIN_STATE, WEIGHT_SOURCES, find_checkpoint_folder, looks_like_training_checkpoint,
    model_key, optimizer_key, read_training_run,
)
from gptoss_cli.errors import UsageError
from gptoss_cli.model.config import GptOssArch

if TYPE_CHECKING:
    from gptoss_cli.checkpoint.formats.registry import Source


def architecture(root: Path, options: OpenOptions | None = None) -> tuple[GptOssArch, str | None]:
    run = read_training_run(find_checkpoint_folder(root)[0])
    return run.arch, run.hybrid_layer_pattern


def open_training(src: str, root: Path, revision: str | None, options: OpenOptions) -> Source:
    """The iter_* folder `root` is or `latest` names, read as the options say. Nothing is written into it."""
    from gptoss_cli.checkpoint.formats.registry import Source, expert_dtype_form  # noqa: PLC0415
    from gptoss_cli.checkpoint.formats.training.readers import Mxfp4QatReader, check_group, merged_with_base  # noqa: PLC0415
    from gptoss_cli.checkpoint.storage.dcp_io import DcpReader  # noqa: PLC0415 (imports torch)

    weights = options.weights or MODEL
    if weights not in WEIGHT_SOURCES:
        raise UsageError(f"--weights {weights!r} is not one of {' | '.join(WEIGHT_SOURCES)}")
    folder, ckpt_dir = find_checkpoint_folder(root)
    run = read_training_run(folder)
    if weights == MODEL:
        prefix = f"{MODEL}."
        reader = DcpReader(folder, model_key, lambda k: k[len(prefix):] if k.startswith(prefix) else None)
    else:
        prefix, suffix = f"{OPTIMIZER}.", f".{MASTER}"
        reader = DcpReader(folder, lambda n: optimizer_key(n, MASTER),
                           lambda k: k[len(prefix):-len(suffix)] if k.startswith(prefix) and k.endswith(suffix) else None)
    if run.lora is None:  # a LoRA run's group holds its adapters: check_lora_record below checks those
        check_group(reader, run, folder, weights)
    # Tokenizer files come from the weights the run started from, when that folder is still there.
    extras = Path(run.pretrained) if run.pretrained and Path(run.pretrained).is_dir() else folder
    if run.lora is not None:
        from gptoss_cli.checkpoint.formats.training.lora_record import check_lora_record  # noqa: PLC0415 (imports torch)

        try:  # the adapter tensors are the truth: the record must agree with them
            check_lora_record(run.lora, reader, run.arch, run.hybrid_layer_pattern, folder)
        except BaseException:
            reader.close()
            raise
        # A LoRA run's state is its adapters, merged into the base as the forward computed: the base's
        # experts rounded when it kept them in MXFP4 (lora.base_experts=mxfp4), and under QAT the merged
        # expert weights (base + adapters) rounded.
        if not options.adapters_only:
            reader = merged_with_base(run, folder, reader, options.open_source)
    elif run.qat == "mxfp4":
        reader = Mxfp4QatReader(reader)
    form = "-" if options.adapters_only and run.lora is not None else expert_dtype_form(reader, run.arch)
    return Source(TRAINING, src, None, folder, extras, run.arch, reader, hybrid_layer_pattern=run.hybrid_layer_pattern,
                  provenance={**run.provenance(), "weights": weights}, protected=(ckpt_dir,) if ckpt_dir else (),
                  lora=run.lora, experts_form=form)


TRAINING = Format(
    name="training", title="a training", detect=looks_like_training_checkpoint, architecture=architecture,
    open=open_training, options=frozenset({"weights"}), hybrid_named=True, default_target="hybrid",
    arch_file=TRAIN_STATE, training_run=True,
)

__all__ = ["TRAINING", "open_training"]
