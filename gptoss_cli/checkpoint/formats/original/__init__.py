"""OpenAI's `original/` layout (its own config.json and tensor names; MXFP4 experts): its registry row.

SRC may be the repository folder holding `original/`, or the `original/` folder itself. It is read,
never written: convert makes Hybrid (or Megatron) checkpoints of it. Torch-free at import. Its config
and tensor names are variants of HF's, so the HF row's package holds them (formats/hf/config.py:
`from_openai_config`; formats/hf/layouts.py: `OPENAI_ORIGINAL`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gptoss_cli.checkpoint.formats.hf import CONFIG, is_openai_config, load_json
from gptoss_cli.checkpoint.formats.hf.config import from_openai_config
from gptoss_cli.checkpoint.formats.registry import Format, OpenOptions
from gptoss_cli.errors import CheckpointError, ConfigError
from gptoss_cli.model.config import GptOssArch

if TYPE_CHECKING:
    from gptoss_cli.checkpoint.formats.registry import Source

ORIGINAL_DIR = "original"


def weights_folder(root: Path) -> Path:
    """The folder holding the original/ weights and config: `root` itself, or root/original."""
    return root if is_openai_config(root / CONFIG) else root / ORIGINAL_DIR


def detect(root: Path) -> bool:
    if (root / CONFIG).is_file():
        return is_openai_config(root / CONFIG)
    return (root / ORIGINAL_DIR / CONFIG).is_file()


def architecture(root: Path, options: OpenOptions | None = None) -> tuple[GptOssArch, str | None]:
    config = weights_folder(root) / CONFIG
    try:
        return from_openai_config(load_json(config), source=str(config)), None
    except ConfigError as exc:
        raise CheckpointError(exc.message, exc.hint) from None


def open_original(src: str, root: Path, revision: str | None, options: OpenOptions) -> Source:
    from gptoss_cli.checkpoint.formats.hf.layouts import OPENAI_ORIGINAL  # noqa: PLC0415 (imports torch)
    from gptoss_cli.checkpoint.formats.registry import Source  # noqa: PLC0415
    from gptoss_cli.checkpoint.storage.safetensors_io import CheckpointReader  # noqa: PLC0415

    folder = weights_folder(root)
    arch, _ = architecture(root)
    extras = root.parent if folder == root else root
    return Source(ORIGINAL, src, revision, folder, extras, arch, CheckpointReader(folder), layout=OPENAI_ORIGINAL,
                  experts_form=OPENAI_ORIGINAL.experts_form)


ORIGINAL = Format(
    name="openai-original", title="an OpenAI original/", detect=detect, architecture=architecture,
    open=open_original, default_target="hybrid", same_layout="hf", arch_file=CONFIG, lora_base=True,
)

__all__ = ["ORIGINAL"]
