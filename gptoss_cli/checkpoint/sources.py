"""Opening a checkpoint: SRC (a local folder or a Hugging Face repo id) resolved, its format detected by the
registry (checkpoint/formats/), and the format's opener giving a `Source`: the architecture, the
stored layout and a reader over its tensors. `check_tensors` checks a source against what its
record says it holds.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gptoss_cli.checkpoint import formats
from gptoss_cli.checkpoint.formats.hf import EXTRA_FILES
from gptoss_cli.checkpoint.formats.registry import Format, OpenOptions
from gptoss_cli.checkpoint.layouts import UINT8
from gptoss_cli.checkpoint.mapping import check_vocab_padding, units
from gptoss_cli.checkpoint.storage.readers import TensorReader
from gptoss_cli.errors import CheckpointError, UsageError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.dtypes import short_dtype_name

if TYPE_CHECKING:
    from gptoss_cli.checkpoint.layouts import Layout

HUB_PATTERNS = ["config.json", "model*.safetensors", "model.safetensors.index.json", *EXTRA_FILES]
HUB_ORIGINAL_PATTERNS = ["original/config.json", "original/*.safetensors", "original/*.json"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# The kinds, as Source.kind names them (the registry rows' names)
HF, ORIGINAL, HYBRID, TRAINING, MEGATRON = (f.name for f in (formats.HF, formats.ORIGINAL, formats.HYBRID,
                                                               formats.TRAINING, formats.MEGATRON))


@dataclass
class Source:
    """An opened checkpoint: its format, architecture, stored layout and a reader over its shards."""

    format: Format
    origin: str  # what the user passed
    revision: str | None
    folder: Path  # the folder holding the weights
    extras_folder: Path  # where tokenizer files are looked up
    arch: GptOssArch
    reader: TensorReader  # CheckpointReader, DcpReader, MegatronReader or LoraMergedReader (or a wrapper of one)
    layout: Layout | None = None  # for HF and original sources
    hybrid_layer_pattern: str | None = None  # for Hybrid and training sources
    provenance: dict = field(default_factory=dict)  # what an output records besides SRC (training: run, iteration)
    protected: tuple[Path, ...] = ()  # more folders an output may not be in (a training run's checkpoint.dir)
    lora: dict | None = None  # a LoRA training checkpoint: its run's LoRA record (training_format.run_record)
    experts_form: str = "bf16"  # how the experts are stored: bf16, mxfp4, or a training checkpoint's dtype

    @property
    def kind(self) -> str:
        """The format's name (hf, openai-original, hybrid, training, megatron)."""
        return self.format.name

    def close(self) -> None:
        self.reader.close()


def resolve(src: str, revision: str | None = None) -> tuple[Path, str | None]:
    """A local folder as is; otherwise a Hugging Face repo id fetched (only the needed files) into the cache."""
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"{src}: SRC must be a checkpoint folder or a Hugging Face repo id, not a file")
        return path, revision
    if not _REPO_ID.match(src):
        raise UsageError(f"{src}: no such folder, and not a Hugging Face repo id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:  # pragma: no cover - a runtime dependency
        raise UsageError("huggingface_hub is not installed; pass a local folder") from None
    try:
        folder = Path(snapshot_download(src, revision=revision, allow_patterns=HUB_PATTERNS))
        if not (folder / "config.json").exists() and not list(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(src, revision=revision, allow_patterns=HUB_ORIGINAL_PATTERNS))
    except LocalEntryNotFoundError:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        raise UsageError(
            f"{src}: not found in the Hugging Face cache"
            + (" and HF_HUB_OFFLINE is set" if offline else " and the Hub could not be reached"),
            hint="download it once with network access, or pass a local folder",
        ) from None
    except RepositoryNotFoundError:
        raise UsageError(f"{src}: no such Hugging Face repository (or it is private and you are not logged in)") from None
    except HfHubHTTPError as exc:
        raise UsageError(f"{src}: Hugging Face Hub error ({exc})") from None
    except ValueError as exc:  # bad revision strings and the like
        raise UsageError(f"{src}: {exc}") from None
    return folder, revision


def open_source(src: str, revision: str | None = None, *, weights: str | None = None,
                adapters_only: bool = False, arch_from: GptOssArch | None = None) -> Source:
    """Resolve SRC, detect its format (the registry's first row that recognises it) and open it.

    `weights` picks what a training checkpoint's tensors are read from (`model` or `master`). A LoRA
    training checkpoint reads as its base with the adapters merged in (checkpoint/lora_merge.py), or,
    with `adapters_only`, as its adapters alone (`Source.lora` says which run made them). `arch_from`:
    the architecture of a Megatron checkpoint whose args cannot say it."""
    root, revision = resolve(src, revision)
    options = OpenOptions(weights=weights, adapters_only=adapters_only, arch_from=arch_from)
    fmt = formats.detect_or_fail(root)
    for name in options.given():
        if name not in fmt.options:
            flag = "--" + name.replace("_", "-")
            takes = [f.name for f in formats.FORMATS if name in f.options]
            raise UsageError(f"{flag} applies to {' and '.join(takes)} checkpoints only; {src} is {fmt.title} checkpoint")
    return fmt.open(src, root, revision, options)


def expert_dtype_form(reader: TensorReader, arch: GptOssArch) -> str:
    """The dtype a Hybrid-named checkpoint stores its experts in, as expert forms are named (bf16, fp32)."""
    return short_dtype_name(reader.dtype(next(u.hybrid[0] for u in units(arch) if u.per_expert)))


def check_tensors(source: Source, expected: dict[str, tuple[tuple[int, ...], str]], *, padded_rows: tuple = ()) -> None:
    """Every expected tensor present with the right shape and dtype kind; nothing unexpected."""
    present = set(source.reader.names())
    missing = [n for n in expected if n not in present]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{source.folder}: tensor {missing[0]!r} is missing{more} (the config expects it)")
    unexpected = sorted(n for n in present - set(expected) if not n.endswith("._extra_state"))
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise CheckpointError(
            f"{source.reader.file_of(unexpected[0])}: unexpected tensor {unexpected[0]!r}{more} "
            f"(not part of a GPT-OSS {source.kind} checkpoint with this config)"
        )
    for name, (shape, kind) in expected.items():
        spec = source.reader.spec(name)
        padded = name in padded_rows and spec.shape[1:] == shape[1:] and len(shape) >= 1
        if padded and spec.shape[0] > shape[0]:
            check_vocab_padding(spec.shape[0], source.arch, source.reader.file_of(name), name)
        ok_shape = spec.shape == shape or (padded and spec.shape[0] > shape[0])
        if not ok_shape:
            raise CheckpointError(
                f"{source.reader.file_of(name)}: tensor {name!r} has shape {list(spec.shape)}, "
                f"expected {list(shape)} for this config"
            )
        is_float = spec.dtype.is_floating_point
        if (kind == UINT8 and spec.dtype != torch.uint8) or (kind != UINT8 and not is_float):
            raise CheckpointError(
                f"{source.reader.file_of(name)}: tensor {name!r} has dtype {spec.dtype}, expected "
                + ("uint8 (MXFP4)" if kind == UINT8 else "a floating-point dtype")
            )


__all__ = ["Source", "open_source", "resolve", "check_tensors", "expert_dtype_form", "EXTRA_FILES", "HF", "ORIGINAL",
           "HYBRID", "TRAINING", "MEGATRON"]
