"""A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors): its registry row.
Torch-free at import.

gptoss writes one from a LoRA training run (`convert --to peft`) and recognises one, but does not
read it as a model: it holds deltas for a base, not weights (nor an architecture). Beside the row:
adapter.py (the folder's files, adapter_config.json, our adapter tensors in PEFT's layout) and
plan.py (`ToPeft`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptoss_cli import outputs
from gptoss_cli.checkpoint.formats.peft.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from gptoss_cli.checkpoint.formats.registry import Format, OpenOptions, json_field_is
from gptoss_cli.errors import CheckpointError, UsageError
from gptoss_cli.model.config import GptOssArch

if TYPE_CHECKING:
    from gptoss_cli.checkpoint.formats.registry import Source


def detect(root: Path) -> bool:
    return (root / ADAPTER_CONFIG).is_file()


def architecture(root: Path, options: OpenOptions | None = None) -> tuple[GptOssArch, str | None]:
    raise CheckpointError(f"{root / ADAPTER_CONFIG}: a PEFT adapter holds no architecture (its base does)",
                          hint="point at the base checkpoint instead")


def open_peft(src: str, root: Path, revision: str | None, options: OpenOptions) -> Source:
    raise UsageError(f"{root}: is a PEFT adapter ({ADAPTER_CONFIG}): LoRA deltas for a base model, not a model "
                     "gptoss reads", hint="use the training checkpoint it was exported from (--to hf merges the "
                     "adapters), or its base")


def plan(source: Source, *, experts: str | None, dtype: Any, vocab_multiple: int | None = None):
    from gptoss_cli.checkpoint.formats.peft.plan import ToPeft  # noqa: PLC0415 (imports torch)

    return ToPeft.for_source(source, source.origin)


def replaceable(dst: Path) -> None:
    outputs.check_replaceable(dst, ADAPTER_CONFIG, json_field_is("peft_type", "LORA"), "PEFT adapter",
                              (ADAPTER_WEIGHTS,))


PEFT = Format(
    name="peft", title="a PEFT adapter", detect=detect, architecture=architecture, open=open_peft, plan=plan,
    replaceable=replaceable, default_target="hybrid", arch_file=ADAPTER_CONFIG, reads_adapters=True,
)

__all__ = ["PEFT"]
