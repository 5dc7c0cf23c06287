"""A Hugging Face GPT-OSS folder (config.json with model_type gpt_oss; bf16 or MXFP4 experts): its registry row.
Torch-free at import.

Beside the row:
- config.py    HF and OpenAI config.json <-> the architecture; the tokenizer files copied with the weights
- layouts.py   how the canonical HF tensors are stored: bf16 experts, MXFP4 experts, OpenAI's original/ names
               (the original row reads through it too)
- plan.py      `ToHf`, the plan of `convert --to hf`
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptoss_cli import outputs
from gptoss_cli.checkpoint.formats.hf.config import EXTRA_FILES, from_hf_config
from gptoss_cli.checkpoint.formats.registry import Format, OpenOptions, json_field_is
from gptoss_cli.errors import CheckpointError, ConfigError
from gptoss_cli.json_input import parse_json
from gptoss_cli.model.config import GptOssArch

if TYPE_CHECKING:
    from gptoss_cli.checkpoint.formats.hf.layouts import Layout
    from gptoss_cli.checkpoint.formats.registry import Source

CONFIG = "config.json"


def load_json(path: Path) -> dict:
    """A JSON object from `path`; CheckpointError naming the file otherwise (an OSError names it itself)."""
    try:
        data = parse_json(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def is_openai_config(path: Path) -> bool:
    """config.json of OpenAI's original/ layout: no model_type, but experts_per_token and num_experts."""
    try:
        data = parse_json(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "model_type" not in data and "experts_per_token" in data and "num_experts" in data


def detect(root: Path) -> bool:
    """A config.json that is not OpenAI's (whatever else is wrong with it, the read says in one line)."""
    return (root / CONFIG).exists() and not is_openai_config(root / CONFIG)


def architecture(root: Path, options: OpenOptions | None = None) -> tuple[GptOssArch, str | None]:
    config = root / CONFIG
    data = load_json(config)
    if "model_type" not in data:
        raise CheckpointError(f"{config}: has no model_type; is this a GPT-OSS checkpoint?")
    try:
        return from_hf_config(data, source=str(config)), None
    except ConfigError as exc:
        raise CheckpointError(exc.message, exc.hint) from None


def open_hf(src: str, root: Path, revision: str | None, options: OpenOptions) -> Source:
    from gptoss_cli.checkpoint.formats.registry import Source  # noqa: PLC0415
    from gptoss_cli.checkpoint.storage.safetensors_io import CheckpointReader  # noqa: PLC0415 (imports torch)

    arch, _ = architecture(root)
    reader = CheckpointReader(root)
    try:
        layout = stored_layout(reader, load_json(root / CONFIG), root / CONFIG)
    except BaseException:
        reader.close()
        raise
    return Source(HF, src, revision, root, root, arch, reader, layout=layout, experts_form=layout.experts_form)


def stored_layout(reader: Any, config: dict, config_path: Path) -> Layout:
    """The expert form, from the tensors present (never from shapes), cross-checked with quantization_config."""
    from gptoss_cli.checkpoint.formats.hf.layouts import HF_LAYOUTS  # noqa: PLC0415

    names = set(reader.names())
    has_mx = any(n.endswith("mlp.experts.gate_up_proj_blocks") for n in names)
    has_bf16 = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    if has_mx and has_bf16:
        raise CheckpointError(f"{reader.folder}: holds both MXFP4 (*_blocks) and bf16 (gate_up_proj) experts")
    form = "mxfp4" if has_mx else "bf16"
    quant = (config.get("quantization_config") or {}).get("quant_method")
    if quant == "mxfp4" and form != "mxfp4" and has_bf16:
        raise CheckpointError(
            f"{config_path}: quantization_config says mxfp4 but the shards hold bf16 gate_up_proj experts",
            hint="remove quantization_config from config.json or restore the MXFP4 shards",
        )
    if quant not in (None, "mxfp4"):
        raise CheckpointError(f"{config_path}: quantization method {quant!r} is not supported (mxfp4 or none)")
    return HF_LAYOUTS[form]


def plan(source: Source, *, experts: str | None, dtype: Any, vocab_multiple: int | None = None):
    from gptoss_cli.checkpoint.formats.hf.plan import to_hf_plan  # noqa: PLC0415 (imports torch)

    return to_hf_plan(source, experts=experts, dtype=dtype)


def replaceable(dst: Path) -> None:
    outputs.check_replaceable(dst, CONFIG, json_field_is("model_type", "gpt_oss"), "Hugging Face", EXTRA_FILES)


HF = Format(
    name="hf", title="an HF", detect=detect, architecture=architecture, open=open_hf, plan=plan,
    replaceable=replaceable, writer_options=frozenset({"experts"}), default_target="hybrid", same_layout="hf",
    arch_file=CONFIG, lora_base=True,
)

__all__ = ["HF", "EXTRA_FILES", "load_json", "is_openai_config", "stored_layout"]
