"""Loading a model's weights: a built HybridModel filled from a checkpoint folder of any readable format.

`load_weights` fills a model (built with model/build.py's `build_model`) from whatever the folder
holds, `model_from_checkpoint` builds and fills in one call (the architecture from the folder),
`checkpoint_architecture` reads the architecture alone; `load_hybrid` and `load_hf` insist on one
format. The source's registry row says how its tensors are named: Hybrid-named ones (Hybrid,
training, Megatron) are filled by name, HF and OpenAI-original ones through the mapping table.

Streaming and strict: tensors are read one at a time by name (for HF sources, one mapping-table
unit at a time, experts in chunks), only the experts the model holds are read, and a missing,
unexpected or misshapen tensor is a CheckpointError naming the file and the tensor. The model's
architecture must equal the checkpoint's in every field that changes the computation
(`GptOssArch.differences`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from gptoss_cli.checkpoint.formats.hf.layouts import EXPERT_CHUNK
from gptoss_cli.checkpoint.formats.hybrid.config import HYBRID_CONFIG, read_hybrid_config
from gptoss_cli.checkpoint.formats.registry import Source, check_tensors
from gptoss_cli.checkpoint.mapping import VOCAB_PADDED_HYBRID, check_vocab_padding, units
from gptoss_cli.checkpoint.sources import open_source, source_pattern
from gptoss_cli.checkpoint.storage.readers import TensorReader
from gptoss_cli.checkpoint.storage.safetensors_io import CheckpointReader
from gptoss_cli.errors import CheckpointError, ConfigError
from gptoss_cli.model.build import build_model
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.mxfp4.codec import NonFiniteError
from gptoss_cli.model.mxfp4.experts import Mxfp4WeightSlot

LoadProgress = Callable[[str], None]  # called with the name(s) of each tensor (or HF group) once filled
_HYBRID_HINT = "re-run `gptoss convert`, or check hybrid_config.json against the tensors"


def read_hybrid_tensor(reader: TensorReader, name: str, shape: tuple[int, ...],
                       arch: GptOssArch | None = None) -> torch.Tensor:
    """Read `name` from a Hybrid checkpoint, checking its shape; Megatron's vocabulary padding rows
    are dropped (docs/checkpoint-layouts.md, "Vocabulary padding"). With `arch`, extra rows must be
    that padding (`is_vocab_padding`), never real tokens cut by a too-small vocab_size."""
    stored = tuple(reader.shape(name))
    if name in VOCAB_PADDED_HYBRID and stored[1:] == tuple(shape[1:]) and stored[0] >= shape[0]:
        if arch is not None:
            check_vocab_padding(stored[0], arch, reader.file_of(name), name)
        return reader.read(name, 0, shape[0])
    if stored != tuple(shape):
        raise CheckpointError(
            f"{reader.file_of(name)}: tensor {name} has shape {list(stored)}, the model expects {list(shape)}",
            hint="hybrid_config.json does not describe these tensors",
        )
    return reader.read(name)


def _check_architecture(folder: Path, what: str, stored: GptOssArch, model: HybridModel) -> None:
    diff = stored.differences(model.arch)
    if diff:
        raise CheckpointError(
            f"{folder / what}: describes a different architecture than the model "
            f"(checkpoint vs model: {'; '.join(diff)})",
            hint="build the model from the checkpoint's own config (e.g. model.checkpoint in a recipe)",
        )


def load_hybrid(model: HybridModel, folder: str | Path, progress: LoadProgress | None = None) -> None:
    """Fill every parameter from a Hybrid checkpoint folder, strictly by name."""
    folder = Path(folder)
    if (folder / HYBRID_CONFIG).exists():
        _check_architecture(folder, HYBRID_CONFIG, read_hybrid_config(folder).arch, model)
    with CheckpointReader(folder) as reader:
        _fill_by_hybrid_names(model, reader, folder, progress, _HYBRID_HINT)


def _fill_by_hybrid_names(model: HybridModel, reader: TensorReader, folder: Path, progress: LoadProgress | None, hint: str) -> None:
    """Every slot of `model` from the tensor of the same name (only the experts it holds); exactly those names."""
    present = set(reader.names())
    expected = model.checkpoint_names()
    missing = [n for n in expected if n not in present]
    unexpected = sorted(present - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensors (first: {missing[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensors (first: {unexpected[:3]})")
        raise CheckpointError(
            f"{folder}: does not match the model for pattern {model.pattern.text!r}: " + "; ".join(parts), hint=hint,
        )
    with torch.no_grad():
        for name, dest in model.named_checkpoint_slots():
            _store(dest, read_hybrid_tensor(reader, name, tuple(dest.shape), model.arch), name, folder)
            if progress is not None:
                progress(name)


def load_hf(model: HybridModel, folder: str | Path, progress: LoadProgress | None = None) -> None:
    """Fill every parameter from an HF GPT-OSS folder (bf16 or MXFP4 experts) or OpenAI's original/
    layout through the mapping table, one unit at a time (experts in chunks, only those held)."""
    _check_hf_pattern(model)
    source = open_source(str(folder))
    try:
        if source.format.hybrid_named:
            raise CheckpointError(f"{folder}: is {source.format.title} checkpoint, not a Hugging Face one")
        _fill_from_hf(model, source, progress)
    finally:
        source.close()


def _check_hf_pattern(model: HybridModel) -> None:
    if model.pattern.layers != tuple(model.arch.hybrid_layer_pattern):
        raise ConfigError(
            f"an HF checkpoint maps onto the pattern {model.arch.hybrid_layer_pattern!r}, not {model.pattern.text!r}"
        )


def _fill_from_hf(model: HybridModel, source: Source, progress: LoadProgress | None) -> None:
    _check_hf_pattern(model)
    folder = source.folder
    _check_architecture(folder, "config.json", source.arch, model)
    check_tensors(source, source.layout.stored_specs(model.arch))
    # A pipeline stage's model names the other stages' tensors with None (and reads nothing for them).
    slots = dict(model.named_checkpoint_slots(all_experts=True))
    dtype = model.params_dtype
    with torch.no_grad():
        for unit in units(model.arch):
            if unit.per_expert:
                held = [e for e, n in enumerate(unit.hybrid) if slots[n] is not None]
                lo, hi = (held[0], held[-1] + 1) if held else (0, 0)
                for e0 in range(lo, hi, EXPERT_CHUNK):
                    e1 = min(hi, e0 + EXPERT_CHUNK)
                    if _copy_mxfp4_as_stored(source, model.arch, unit, [slots[n] for n in unit.hybrid[e0:e1]], e0, e1):
                        continue
                    stack = source.layout.read(source.reader, model.arch, unit.hf[0], dtype, e0, e1)
                    for name, t in zip(unit.hybrid[e0:e1], unit.to_hybrid(model.arch, [stack])):
                        _copy_checked(slots[name], t, name, folder)
                continue
            if all(slots[name] is None for name in unit.hybrid):
                continue
            ins = [source.layout.read(source.reader, model.arch, n, dtype) for n in unit.hf]
            for name, t in zip(unit.hybrid, unit.to_hybrid(model.arch, ins)):
                if slots[name] is not None:
                    _copy_checked(slots[name], t, name, folder)
            if progress is not None:
                progress(", ".join(unit.hf))


def _copy_checked(dest: torch.Tensor, src: torch.Tensor, name: str, folder: str | Path) -> None:
    if tuple(src.shape) != tuple(dest.shape):
        raise CheckpointError(f"{folder}: tensor {name} has shape {list(src.shape)}, the model expects {list(dest.shape)}")
    _store(dest, src, name, folder)


def _store(dest, src: torch.Tensor, name: str, where: str | Path) -> None:
    """dest.copy_(src); an MXFP4-stored expert weight (Mxfp4WeightSlot) encodes it, which NaN or Inf refuse."""
    try:
        dest.copy_(src)
    except NonFiniteError as exc:
        raise CheckpointError(f"{where}: tensor {name}: {exc}",
                              hint="lora.base_experts=mxfp4 stores finite weights only; check the base") from None


def _copy_mxfp4_as_stored(source: Source, arch: GptOssArch, unit, dests: list, e0: int, e1: int) -> bool:
    """Experts [e0, e1) of an MXFP4-stored checkpoint into MXFP4-stored experts, blocks and scales as
    released (rows moved by the table's transform, never decoded); False when either side is not MXFP4."""
    if not dests or not all(isinstance(d, Mxfp4WeightSlot) or d is None for d in dests):
        return False
    stored = source.layout.read_rowwise(source.reader, unit.hf[0], e0, e1)
    if stored is None:  # bf16 experts: read and encoded per expert by the caller
        return False
    blocks, scales = (unit.to_hybrid(arch, [t]) for t in stored)
    for dest, b, s in zip(dests, blocks, scales):
        if dest is not None:
            dest.copy_mxfp4_(b, s)
    return True


def _fill_from_source(model: HybridModel, source: Source, progress: LoadProgress | None) -> None:
    """Fill `model` from an opened source of any format: by name when its tensors carry Hybrid names,
    through the mapping table otherwise."""
    if not source.format.hybrid_named:
        _fill_from_hf(model, source, progress)
        return
    _check_architecture(source.folder, source.format.arch_file, source.arch, model)
    _fill_by_hybrid_names(model, source.reader, source.folder, progress,
                          f"build the model from the checkpoint's own {source.format.arch_file} (model_from_checkpoint)")


def load_weights(model: HybridModel, folder: str | Path, progress: LoadProgress | None = None) -> None:
    """Fill `model` from a Hybrid, HF, OpenAI-original folder, a training checkpoint or a Megatron torch_dist
    checkpoint, whichever `folder` holds."""
    source = open_source(str(folder))
    try:
        _fill_from_source(model, source, progress)
    finally:
        source.close()


def checkpoint_architecture(folder: str | Path) -> tuple[GptOssArch, str | None]:
    """(architecture, Hybrid layer pattern or None for HF/original) of a checkpoint folder (a training
    checkpoint gives the run's recorded pattern)."""
    source = open_source(str(folder))
    try:
        return source.arch, source.hybrid_layer_pattern
    finally:
        source.close()


def model_from_checkpoint(folder: str | Path, *, dtype: torch.dtype = torch.float32,
                          device: str | torch.device = "cpu", progress: LoadProgress | None = None,
                          weights: str | None = None, **kwargs) -> HybridModel:
    """Build a HybridModel from a folder's own config (hybrid_config.json, config.json, or a training
    run's record) and load it; the folder is opened once.

    `weights`: a training checkpoint's model state or master weights (open_source's option). kwargs go
    to HybridModel (expert_offset, num_local_experts, token_dispatcher_factory)."""
    source = open_source(str(folder), weights=weights)
    try:
        model = build_model(source.arch, source_pattern(source), device=device, dtype=dtype, **kwargs)
        _fill_from_source(model, source, progress)
    finally:
        source.close()
    return model


__all__ = ["load_hybrid", "load_hf", "load_weights", "model_from_checkpoint", "read_hybrid_tensor",
           "checkpoint_architecture"]
