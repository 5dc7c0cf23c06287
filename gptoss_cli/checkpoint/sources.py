"""Opening a checkpoint: SRC (a local folder or a Hugging Face repo id) resolved (`resolve`), its format
detected by the registry (checkpoint/formats/), and the format's opener giving a `Source`
(`open_source`): the architecture, the stored layout and a reader over its tensors.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gptoss_cli.checkpoint import formats
from gptoss_cli.checkpoint.formats.hf.config import EXTRA_FILES
from gptoss_cli.checkpoint.formats.registry import OpenOptions, Source
from gptoss_cli.errors import UsageError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.pattern import HybridPattern, default_pattern, parse_pattern

HUB_PATTERNS = ["config.json", "model*.safetensors", "model.safetensors.index.json", *EXTRA_FILES]
HUB_ORIGINAL_PATTERNS = ["original/config.json", "original/*.safetensors", "original/*.json"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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
    training checkpoint reads as its base with the adapters merged in (checkpoint/formats/training/readers.py), or,
    with `adapters_only`, as its adapters alone (`Source.lora` says which run made them). `arch_from`:
    the architecture of a Megatron checkpoint whose args cannot say it."""
    root, revision = resolve(src, revision)
    options = OpenOptions(weights=weights, adapters_only=adapters_only, arch_from=arch_from, open_source=open_source)
    fmt = formats.detect_or_fail(root)
    for name in options.given():
        if name not in fmt.options:
            flag = "--" + name.replace("_", "-")
            takes = [f.name for f in formats.FORMATS if name in f.options]
            raise UsageError(f"{flag} applies to {' and '.join(takes)} checkpoints only; {src} is {fmt.title} checkpoint")
    return fmt.open(src, root, revision, options)


def source_pattern(source: Source) -> HybridPattern:
    """The layer pattern a checkpoint records (a Hybrid folder's, a training run's), parsed once here where
    it is read; the architecture's `*E` per block for the formats that record none (HF, original)."""
    stored = source.hybrid_layer_pattern
    return parse_pattern(stored) if stored is not None else default_pattern(source.arch)


__all__ = ["open_source", "source_pattern", "resolve", "HUB_PATTERNS"]
