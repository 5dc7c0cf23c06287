"""gptoss's Hybrid checkpoint (hybrid_config.json + safetensors shards under Hybrid names): its registry row.
Torch-free at import. Beside it: config.py (hybrid_config.json, written and read) and plan.py (`ToHybrid`,
the plan of `convert --to hybrid`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptoss_cli import outputs
from gptoss_cli.checkpoint.formats.hf import load_json
from gptoss_cli.checkpoint.formats.hf.config import EXTRA_FILES
from gptoss_cli.checkpoint.formats.hybrid.config import (
    FORMAT_NAME, HYBRID_CONFIG, check_stored_pattern, read_hybrid_config,
)
from gptoss_cli.checkpoint.formats.registry import Format, OpenOptions, json_field_is
from gptoss_cli.errors import CheckpointError, ConfigError
from gptoss_cli.model.config import GptOssArch

if TYPE_CHECKING:
    from gptoss_cli.checkpoint.formats.registry import Source


def detect(root: Path) -> bool:
    return (root / HYBRID_CONFIG).exists()


def architecture(root: Path, options: OpenOptions | None = None) -> tuple[GptOssArch, str | None]:
    """The architecture and pattern of hybrid_config.json. A hand-written one (a recipe's model.checkpoint)
    may hold just those two; opening the folder for its weights (`read_hybrid_config`) wants the rest too."""
    path = root / HYBRID_CONFIG
    data = load_json(path)
    if any(key in data for key in ("format", "format_version")):
        cfg = read_hybrid_config(root)
        return cfg.arch, cfg.hybrid_layer_pattern
    if not isinstance(data.get("architecture"), dict):
        raise CheckpointError(f"{path}: 'architecture' is missing or not a JSON object")
    try:
        arch = GptOssArch.from_dict(data["architecture"], source=str(path))
    except ConfigError as exc:
        raise CheckpointError(exc.message, exc.hint) from None
    pattern = data.get("hybrid_layer_pattern")
    if pattern is not None:
        check_stored_pattern(pattern, arch, path)
    return arch, pattern


def open_hybrid(src: str, root: Path, revision: str | None, options: OpenOptions) -> Source:
    from gptoss_cli.checkpoint.formats.registry import Source  # noqa: PLC0415
    from gptoss_cli.checkpoint.storage.safetensors_io import CheckpointReader  # noqa: PLC0415 (imports torch)

    cfg = read_hybrid_config(root)
    return Source(HYBRID, src, revision, root, root, cfg.arch, CheckpointReader(root),
                  hybrid_layer_pattern=cfg.hybrid_layer_pattern)


def plan(source: Source, *, experts: str | None, dtype: Any, vocab_multiple: int | None = None):
    from gptoss_cli.checkpoint.formats.hybrid.plan import ToHybrid  # noqa: PLC0415 (imports torch)

    return ToHybrid.for_source(source, dtype)


def replaceable(dst: Path) -> None:
    outputs.check_replaceable(dst, HYBRID_CONFIG, json_field_is("format", FORMAT_NAME), "Hybrid", EXTRA_FILES)


HYBRID = Format(
    name="hybrid", title="a Hybrid", detect=detect, architecture=architecture, open=open_hybrid, plan=plan,
    replaceable=replaceable, hybrid_named=True, default_target="hf", same_layout="hybrid", arch_file=HYBRID_CONFIG,
    lora_base=True,
)

__all__ = ["HYBRID"]
