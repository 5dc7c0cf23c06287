"""A `gptoss train` checkpoint (a checkpoint.dir read through `latest`, or one iter_* folder; DCP under
Hybrid names, the run recorded in train_state.json): its registry row and its opener.

It is read, never written by convert. The architecture and layer pattern come from the run record;
the tensors are the model state (`--weights model`) or the optimizer's fp32 master copies
(`master`). A LoRA run reads as its base with the adapters merged in (checkpoint/lora_merge.py), or,
for `--to peft`, as its adapters alone; a QAT run (and a LoRA base kept in MXFP4) reads its experts
rounded to MXFP4, as its forward computed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gptoss_cli.checkpoint.formats.registry import Format, OpenOptions
from gptoss_cli.checkpoint.training_format import (
    MASTER, MODEL, OPTIMIZER, TRAIN_STATE, WEIGHT_SOURCES, check_base, find_checkpoint_folder,
    looks_like_training_checkpoint, model_key, optimizer_key, read_training_run,
)
from gptoss_cli.errors import CheckpointError, UsageError
from gptoss_cli.model.config import GptOssArch

if TYPE_CHECKING:
    import torch

    from gptoss_cli.checkpoint.formats.registry import Source


def architecture(root: Path, options: OpenOptions | None = None) -> tuple[GptOssArch, str | None]:
    run = read_training_run(find_checkpoint_folder(root)[0])
    return run.arch, run.hybrid_layer_pattern


def open_training(src: str, root: Path, revision: str | None, options: OpenOptions) -> Source:
    """The iter_* folder `root` is or `latest` names, read as the options say. Nothing is written into it."""
    from gptoss_cli.checkpoint.formats.registry import Source, expert_dtype_form  # noqa: PLC0415
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
        _check_group(reader, run, folder, weights)
    # Tokenizer files come from the weights the run started from, when that folder is still there.
    extras = Path(run.pretrained) if run.pretrained and Path(run.pretrained).is_dir() else folder
    if run.lora is not None:
        from gptoss_cli.checkpoint.lora_record import check_lora_record  # noqa: PLC0415 (imports torch)

        try:  # the adapter tensors are the truth: the record must agree with them
            check_lora_record(run.lora, reader, run.arch, run.hybrid_layer_pattern, folder)
        except BaseException:
            reader.close()
            raise
        # A LoRA run's state is its adapters, merged into the base as the forward computed: the base's
        # experts rounded when it kept them in MXFP4 (lora.base_experts=mxfp4), and under QAT the merged
        # expert weights (base + adapters) rounded.
        if not options.adapters_only:
            reader = _merged_with_base(run, folder, reader, options.open_source)
    elif run.qat == "mxfp4":
        reader = Mxfp4QatReader(reader)
    form = "-" if options.adapters_only and run.lora is not None else expert_dtype_form(reader, run.arch)
    return Source(TRAINING, src, None, folder, extras, run.arch, reader, hybrid_layer_pattern=run.hybrid_layer_pattern,
                  provenance={**run.provenance(), "weights": weights}, protected=(ckpt_dir,) if ckpt_dir else (),
                  lora=run.lora, experts_form=form)


def _check_group(reader, run, folder: Path, weights: str) -> None:
    """Every tensor the recorded architecture has is in the group `--weights` reads, at its shape: a
    checkpoint whose metadata lacks some (master copies a run never saved, a damaged `.metadata`) is one
    line naming the first, before anything is read or written."""
    from gptoss_cli.checkpoint.mapping import VOCAB_PADDED_HYBRID, hybrid_shapes  # noqa: PLC0415 (imports torch)

    key = model_key if weights == MODEL else (lambda n: optimizer_key(n, MASTER))
    try:
        names = set(reader.names())
        expected = hybrid_shapes(run.arch)
        missing = [n for n in expected if n not in names]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise CheckpointError(
                f"{folder}: its DCP metadata has no tensor {key(missing[0])!r}{more}, which the recorded architecture "
                f"needs (--weights {weights})",
                hint="the checkpoint is incomplete or damaged; use an earlier iter_* folder"
                + (", or --weights model" if weights == MASTER else ""))
        for name, shape in expected.items():
            stored = tuple(reader.shape(name))
            padded = name in VOCAB_PADDED_HYBRID and stored[1:] == shape[1:] and stored[0] >= shape[0]
            if stored != tuple(shape) and not padded:
                raise CheckpointError(f"{folder}: tensor {key(name)!r} has shape {list(stored)} in the DCP metadata, "
                                      f"the recorded architecture gives it {list(shape)}",
                                      hint="train_state.json's run record does not describe these tensors")
    except BaseException:
        reader.close()
        raise


def _merged_with_base(run, folder: Path, adapters, open_source):
    """The base a LoRA run names (checked byte for byte), opened by `open_source` (sources.open_source, handed
    in: the rows sit below it) and read under Hybrid names (an HF or OpenAI-original base through
    `HfHybridView`) with the run's adapters merged in."""
    from gptoss_cli.checkpoint.formats.registry import check_tensors  # noqa: PLC0415
    from gptoss_cli.checkpoint.lora_merge import HfHybridView, LoraMergedReader  # noqa: PLC0415

    base_source = None
    try:
        check_base(run.lora["base"], folder / TRAIN_STATE)
        base_source = open_source(run.lora["base"]["path"])
        if not base_source.format.lora_base:
            raise CheckpointError(f"{folder}: its LoRA base {base_source.folder} is {base_source.format.title} "
                                  "checkpoint; the adapters merge into a Hybrid, HF or OpenAI-original base")
        base = base_source.reader
        if base_source.layout is not None:  # HF or original: Hybrid names through the mapping table
            check_tensors(base_source, base_source.layout.stored_specs(base_source.arch))
            base = HfHybridView(base, base_source.layout, base_source.arch)
    except BaseException:
        if base_source is not None:
            base_source.close()
        adapters.close()
        raise
    if run.lora.get("base_experts") == "mxfp4":  # the model stored the base's experts encoded: W is Q(W)
        base = Mxfp4QatReader(base)
    merged = LoraMergedReader(base, adapters, float(run.lora["alpha"]) / int(run.lora["rank"]))
    # QAT rounded the merged expert weights, W + scaling * B @ A, in the forward: so does the reader
    return Mxfp4QatReader(merged) if run.qat == "mxfp4" else merged


def _is_expert_weight(name: str) -> bool:
    """A per-expert weight under its Hybrid name: decoder.layers.<i>.mlp.experts.linear_fc<1|2>.weight<e>."""
    from gptoss_cli.model.expert_names import parse_expert_name  # noqa: PLC0415 (imports torch)

    per_expert = parse_expert_name(name)
    return per_expert is not None and per_expert.is_base and per_expert.kind == "weight"


class Mxfp4QatReader:
    """A training checkpoint of a `precision.qat=mxfp4` run (or the base of a `lora.base_experts=mxfp4`
    run, which the model stored encoded), read as its forward computed: every expert
    weight rounded to MXFP4 along its input axis (`round_to_mxfp4`, the export's own codec), every
    other tensor as stored. Rows are rounded independently, so row-range reads round the same."""

    def __init__(self, reader):
        self._reader = reader

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        import torch  # noqa: PLC0415

        from gptoss_cli.model.mxfp4 import round_to_mxfp4  # noqa: PLC0415

        t = self._reader.read(name, start, stop)
        if not _is_expert_weight(name) or not t.is_floating_point() or not torch.isfinite(t).all():
            return t  # non-finite weights are left for the finite checks to name
        return round_to_mxfp4(t)


TRAINING = Format(
    name="training", title="a training", detect=looks_like_training_checkpoint, architecture=architecture,
    open=open_training, options=frozenset({"weights"}), hybrid_named=True, default_target="hybrid",
    arch_file=TRAIN_STATE, training_run=True,
)

__all__ = ["TRAINING", "Mxfp4QatReader", "open_training"]
