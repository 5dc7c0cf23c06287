"""A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors): its registry row.

gptoss writes one from a LoRA training run (`convert --to peft`, checkpoint/peft_format.py) and
recognises one, but does not read it as a model: it holds deltas for a base, not weights. Its
architecture is its base's, when `base_model_name_or_path` is a local checkpoint folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptoss_cli import outputs
from gptoss_cli.checkpoint.formats.hf import load_json
from gptoss_cli.checkpoint.formats.registry import Format, OpenOptions
from gptoss_cli.errors import CheckpointError, UsageError
from gptoss_cli.json_input import parse_json
from gptoss_cli.model.config import GptOssArch

if TYPE_CHECKING:
    from gptoss_cli.checkpoint.sources import Source

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def detect(root: Path) -> bool:
    return (root / ADAPTER_CONFIG).is_file()


def architecture(root: Path, options: OpenOptions | None = None) -> tuple[GptOssArch, str | None]:
    """The base's architecture, when the adapter names a local base folder gptoss reads."""
    from gptoss_cli.checkpoint import formats  # noqa: PLC0415 (the table holds this row)

    config = root / ADAPTER_CONFIG
    base = load_json(config).get("base_model_name_or_path")
    base_path = Path(base).expanduser() if isinstance(base, str) and base else None
    if base_path is None or not base_path.is_dir():
        raise CheckpointError(f"{config}: a PEFT adapter holds no architecture, and its base_model_name_or_path "
                              f"{base!r} is not a local folder", hint="point at the base checkpoint instead")
    fmt = formats.detect_or_fail(base_path)
    if fmt is PEFT:
        raise CheckpointError(f"{config}: its base {base_path} is another PEFT adapter")
    return fmt.architecture(base_path, options)


def open_peft(src: str, root: Path, revision: str | None, options: OpenOptions) -> Source:
    raise UsageError(f"{root}: is a PEFT adapter ({ADAPTER_CONFIG}): LoRA deltas for a base model, not a model "
                     "gptoss reads", hint="use the training checkpoint it was exported from (--to hf merges the "
                     "adapters), or its base")


def plan(source: Source, *, experts: str | None, dtype: Any, vocab_multiple: int | None = None):
    from gptoss_cli.checkpoint.peft_format import ToPeft  # noqa: PLC0415 (imports torch)

    return ToPeft.for_source(source, source.origin)


def _is_peft_adapter(config: Path) -> bool:
    try:
        return parse_json(config.read_text()).get("peft_type") == "LORA"
    except (OSError, ValueError, AttributeError):
        return False


def replaceable(dst: Path) -> None:
    outputs.check_replaceable(dst, ADAPTER_CONFIG, _is_peft_adapter, "PEFT adapter", (ADAPTER_WEIGHTS,))


PEFT = Format(
    name="peft", title="a PEFT adapter", detect=detect, architecture=architecture, open=open_peft, plan=plan,
    replaceable=replaceable, default_target="hybrid", arch_file=ADAPTER_CONFIG, reads_adapters=True,
)

__all__ = ["PEFT", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS"]
