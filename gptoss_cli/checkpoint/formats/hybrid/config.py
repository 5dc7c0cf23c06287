"""The Hybrid checkpoint folder: `hybrid_config.json` (architecture, pattern, provenance) and its reading."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptoss_cli.errors import CheckpointError, ConfigError
from gptoss_cli.json_input import parse_json
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.dtypes import CHECKPOINT_DTYPES
from gptoss_cli.model.pattern import parse_pattern

HYBRID_CONFIG = "hybrid_config.json"
FORMAT_NAME = "gptoss-hybrid"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class HybridCheckpointConfig:
    arch: GptOssArch
    hybrid_layer_pattern: str
    format_version: int = FORMAT_VERSION
    dtype: str = "bfloat16"
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "hybrid_layer_pattern": self.hybrid_layer_pattern,
            "num_layers": len(self.hybrid_layer_pattern.replace("[", "").replace("]", "").replace("|", "")),
            "dtype": self.dtype,
            "architecture": self.arch.to_dict(),
            "provenance": self.provenance,
        }


def read_hybrid_config(folder: str | Path) -> HybridCheckpointConfig:
    """Read and check `hybrid_config.json` of a Hybrid checkpoint folder."""
    path = Path(folder) / HYBRID_CONFIG
    try:
        data = parse_json(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {folder} is not a gptoss Hybrid checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path}: 'format' must be {FORMAT_NAME!r}")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {version!r} is not supported (this gptoss reads {FORMAT_VERSION})"
        )
    try:
        arch = GptOssArch.from_dict(data["architecture"], source=str(path))
        pattern = data["hybrid_layer_pattern"]
    except KeyError as exc:
        raise CheckpointError(f"{path}: missing field {exc.args[0]!r}") from None
    except ConfigError as exc:
        raise CheckpointError(exc.message, exc.hint) from None
    check_stored_pattern(pattern, arch, path)
    dtype = data.get("dtype", "bfloat16")
    if dtype not in CHECKPOINT_DTYPES:
        raise CheckpointError(f"{path}: dtype {dtype!r} is not one of {', '.join(CHECKPOINT_DTYPES)}")
    provenance = data.get("provenance", {})
    if not isinstance(provenance, dict):
        raise CheckpointError(f"{path}: provenance must be a JSON object, got {provenance!r}")
    return HybridCheckpointConfig(
        arch=arch,
        hybrid_layer_pattern=pattern,
        format_version=version,
        dtype=dtype,
        provenance=provenance,
    )


def check_stored_pattern(pattern: Any, arch: GptOssArch, path: Path) -> None:
    """The stored pattern parses and is GPT-OSS's '*E' per block (grouped `[*E]` allowed), as the tensors are."""
    try:
        parsed = parse_pattern(pattern)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc.message}", exc.hint) from None
    if parsed.layers != tuple(arch.hybrid_layer_pattern):
        shown = pattern if len(pattern) <= 40 else pattern[:37] + "..."
        raise CheckpointError(
            f"{path}: hybrid_layer_pattern {shown!r} does not describe the tensors: GPT-OSS with "
            f"num_hidden_layers={arch.num_hidden_layers} stores '*E' x {arch.num_hidden_layers} "
            "(attention layer 2i, MoE layer 2i+1)",
            hint=f"set it to '{'*E' * min(arch.num_hidden_layers, 3)}...' ('*E' x {arch.num_hidden_layers})",
        )


def write_hybrid_config(folder: Path, cfg: HybridCheckpointConfig) -> None:
    from gptoss_cli.outputs import write_text

    write_text(Path(folder) / HYBRID_CONFIG, json.dumps(cfg.to_json(), indent=2) + "\n")
