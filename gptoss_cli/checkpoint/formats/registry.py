"""What every checkpoint format's row is (`Format`), what its opener takes (`OpenOptions`) and gives (`Source`).
Torch-free at import.

A row answers, for one kind of checkpoint folder: is this folder one (`detect`, file checks only),
what model does it hold (`architecture`, without torch: validate-config reads it), how is it
opened as a `Source` (`open`), how `convert --to <name>` writes one (`plan`), and what `--force`
may replace (`replaceable`). Each row is the `__init__` of its format's package. `open_source`,
`convert`, the model loader and recipe loading ask the table (checkpoint/formats/__init__.py); nothing
else branches on what kind a checkpoint is.
`check_tensors` checks an opened source against what its record says it holds.

At import this module loads no row and nothing that loads one, so that the rows, their openers and plans,
and the table above them form no import circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from gptoss_cli.errors import CheckpointError
from gptoss_cli.json_input import parse_json
from gptoss_cli.model.config import GptOssArch

if TYPE_CHECKING:
    from gptoss_cli.checkpoint.formats.hf.layouts import Layout
    from gptoss_cli.checkpoint.storage.readers import TensorReader

@dataclass(frozen=True)
class OpenOptions:
    """What the caller asked of an opened checkpoint; a row refuses the options it does not take."""

    weights: str | None = None  # training checkpoints: `model` or `master`
    adapters_only: bool = False  # a LoRA training checkpoint read as its adapters alone (`--to peft`)
    arch_from: GptOssArch | None = None  # Megatron checkpoints whose args cannot say the architecture
    open_source: Callable[..., Any] | None = None  # opens another folder (a LoRA run's base): sources.open_source

    def given(self) -> dict[str, Any]:
        return {k: v for k, v in (("weights", self.weights), ("arch_from", self.arch_from)) if v is not None}


@dataclass(frozen=True)
class Format:
    """One kind of checkpoint folder and everything gptoss does with it."""

    name: str  # the kind a Source reports, and the `--to` value of a writable format
    title: str  # how messages name it ("an HF checkpoint")
    detect: Callable[[Path], bool]  # file checks only, no torch
    architecture: Callable[..., tuple[GptOssArch, str | None]]  # (root, options) -> arch, pattern; no torch
    open: Callable[..., Any] | None = None  # (src, root, revision, options) -> Source
    plan: Callable[..., Any] | None = None  # (source, *, experts, dtype, vocab_multiple) -> a ConvertPlan
    replaceable: Callable[[Path], None] | None = None  # --force: raise unless DST is empty or a previous output of ours
    options: frozenset[str] = frozenset()  # the OpenOptions it takes
    writer_options: frozenset[str] = frozenset()  # the convert options its plan takes (experts, vocab_multiple)
    hybrid_named: bool = False  # its tensors carry Hybrid names (no HF layout to go through)
    default_target: str = "hybrid"  # what `convert` writes from it without --to
    same_layout: str | None = None  # the --to that would write its own layout again (refused)
    arch_file: str = "config.json"  # where it records the architecture, for messages
    lora_base: bool = False  # a LoRA run may adapt it (safetensors weights with a fingerprint)
    reads_adapters: bool = False  # `convert --to <name>` reads the source's adapters only
    training_run: bool = False  # a `gptoss train` checkpoint (it may hold a LoRA run's adapters)
    file_suffix: str | None = None  # it is one file DST ending so (GGUF), not a folder
    dtypes: tuple[str, ...] = ()  # the --dtype values its plan takes, as given, when not convert's own
    expert_forms: tuple[str, ...] = ()  # the --experts values its plan takes, when not convert's own

    @property
    def writable(self) -> bool:
        return self.plan is not None

    def __repr__(self) -> str:
        return f"<format {self.name}>"


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
    lora: dict | None = None  # a LoRA training checkpoint: its run's LoRA record (training/record.py run_record)
    experts_form: str = "bf16"  # how the experts are stored: bf16, mxfp4, or a training checkpoint's dtype

    @property
    def kind(self) -> str:
        """The format's name (hf, openai-original, hybrid, training, megatron)."""
        return self.format.name

    def close(self) -> None:
        self.reader.close()


def expert_dtype_form(reader: TensorReader, arch: GptOssArch) -> str:
    """The dtype a Hybrid-named checkpoint stores its experts in, as expert forms are named (bf16, fp32)."""
    from gptoss_cli.checkpoint.mapping import units  # noqa: PLC0415 (imports torch)
    from gptoss_cli.model.dtypes import short_dtype_name  # noqa: PLC0415

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
    import torch  # noqa: PLC0415 (the registry imports no torch)

    from gptoss_cli.checkpoint.formats.hf.layouts import UINT8  # noqa: PLC0415
    from gptoss_cli.checkpoint.mapping import check_vocab_padding  # noqa: PLC0415

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


def json_field_is(key: str, value: str) -> Callable[[Path], bool]:
    """A `--force` ownership test for outputs.check_replaceable: the folder's JSON config holds key == value
    (an unreadable or non-object file is not ours)."""
    def ours(config: Path) -> bool:
        try:
            return parse_json(config.read_text()).get(key) == value
        except (OSError, ValueError, AttributeError):
            return False
    return ours


__all__ = ["Format", "OpenOptions", "Source", "check_tensors", "expert_dtype_form", "json_field_is"]
