"""Megatron-LM's `torch_dist` checkpoint of a GPT-OSS hybrid model: its registry row (detection, the
architecture, the opener, the writer plan, the `--force` policy), and the format itself beside it, one
concern per module. Torch-free at import, as every row.

A Megatron checkpoint folder (docs/megatron-checkpoints.md), given as its dir (read through the tracker
file) or one iteration folder:

    <dir>/latest_checkpointed_iteration.txt   "release" or an iteration number
    <dir>/release/ or <dir>/iter_0000100/
        metadata.json      {"sharded_backend": "torch_dist", ...}: how the rest is stored
        common.pt          torch.save of the non-sharded state: `args` (an argparse.Namespace with the
                           architecture), `iteration`, `checkpoint_version`
        .metadata          DCP's pickled Metadata: every key, its global shape and its chunks
        __<rank>_<n>.distcp  the chunks, each a torch.save'd tensor (or raw bytes for objects)
    <dir>/run_config.yaml  (Megatron-Bridge) the model provider's settings, read when `args` lack a field

- names.py   file names, the sharded keys (experts stacked or `singleton_local_shards`, `_extra_state`), vocabulary padding
- args.py    the architecture as Megatron-LM's `args` (and Megatron-Bridge's run_config.yaml) record it
- common.py  common.pt through a restricted unpickler (nothing from the file is imported or run); the folder's checks
- reader.py  `MegatronReader`: the weights under Hybrid names, chunk by chunk
- writer.py  `MegatronWriter` and the folder files: what `convert --to megatron` writes
- plan.py    `ToMegatron`: the conversion plan
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptoss_cli.checkpoint.formats.megatron.common import is_megatron_checkpoint, read_megatron_checkpoint
from gptoss_cli.checkpoint.formats.megatron.names import (
    COMMON, DCP_METADATA, ITER_FOLDER, METADATA_JSON, RELEASE, SHARD_FILE, TRACKER,
)
from gptoss_cli.checkpoint.formats.registry import Format, OpenOptions
from gptoss_cli.errors import UsageError
from gptoss_cli.model.config import GptOssArch

if TYPE_CHECKING:
    from gptoss_cli.checkpoint.formats.registry import Source


def architecture(root: Path, options: OpenOptions | None = None) -> tuple[GptOssArch, str | None]:
    arch = read_megatron_checkpoint(root, options.arch_from if options else None).arch
    return arch, arch.hybrid_layer_pattern


def open_megatron(src: str, root: Path, revision: str | None, options: OpenOptions) -> Source:
    """The architecture from common.pt's args (or run_config.yaml, or --arch-from), the model weights
    under Hybrid names."""
    from gptoss_cli.checkpoint.formats.megatron.reader import MegatronReader  # noqa: PLC0415 (imports torch)
    from gptoss_cli.checkpoint.formats.registry import Source, expert_dtype_form  # noqa: PLC0415

    ckpt = read_megatron_checkpoint(root, options.arch_from)
    reader = MegatronReader(ckpt.folder, ckpt.arch)
    provenance = {"megatron_iteration": ckpt.iteration, "checkpoint": str(ckpt.folder.resolve()),
                  "expert_layout": reader.layout}
    return Source(MEGATRON, src, None, ckpt.folder, ckpt.folder, ckpt.arch, reader,
                  hybrid_layer_pattern=ckpt.arch.hybrid_layer_pattern, provenance=provenance,
                  protected=(root,) if root != ckpt.folder else (), experts_form=expert_dtype_form(reader, ckpt.arch))


def plan(source: Source, *, experts: str | None, dtype: Any, vocab_multiple: int | None = None):
    from gptoss_cli.checkpoint.formats.megatron.plan import ToMegatron  # noqa: PLC0415

    return ToMegatron.for_source(source, dtype, vocab_multiple)


def check_megatron_output(dst: Path) -> None:
    """--force replaces only an empty folder or a previous `convert --to megatron` output: the tracker
    file and iteration folders holding only what the writer writes."""
    if not dst.is_dir() or not any(dst.iterdir()):
        return
    refuse = f"{dst}: --force replaces only an empty folder or a previous gptoss Megatron output"
    ours = {METADATA_JSON, COMMON, DCP_METADATA}
    for entry in sorted(dst.iterdir()):
        if entry.name == TRACKER and entry.is_file():
            continue
        if entry.is_dir() and (entry.name == RELEASE or ITER_FOLDER.match(entry.name)) and all(
                f.is_file() and (f.name in ours or re.fullmatch(SHARD_FILE, f.name)) for f in entry.iterdir()):
            continue
        raise UsageError(f"{refuse}; it also holds {entry.name!r}, which gptoss does not write",
                         hint="choose another DST, or move that out first")
    if not (dst / TRACKER).is_file():
        raise UsageError(f"{refuse}, and it has no {TRACKER}", hint="choose another DST, or empty it yourself")


MEGATRON = Format(
    name="megatron", title="a Megatron torch_dist", detect=is_megatron_checkpoint, architecture=architecture,
    open=open_megatron, plan=plan, replaceable=check_megatron_output, options=frozenset({"arch_from"}),
    writer_options=frozenset({"vocab_multiple"}), hybrid_named=True, default_target="hybrid", arch_file=COMMON,
)

__all__ = ["MEGATRON", "check_megatron_output"]
