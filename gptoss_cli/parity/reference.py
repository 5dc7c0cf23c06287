"""Loading an HF GPT-OSS folder into transformers' own `GptOssForCausalLM`, the independent reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gptoss_cli.json_input import parse_json


def load_transformers_model(folder: str | Path, dtype: torch.dtype = torch.float32,
                            attn_implementation: str | None = None) -> Any:
    """transformers' `GptOssForCausalLM` from `folder` in eval mode, quietly (no progress bar or info logs).

    MXFP4 experts (a `quantization_config` in config.json) are dequantised by transformers' own code,
    which runs on CPU; `attn_implementation` None keeps transformers' default."""
    import transformers
    from transformers.utils import logging as hf_logging

    kw: dict[str, Any] = {}
    if "quantization_config" in parse_json((Path(folder) / "config.json").read_text()):
        kw["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        return transformers.GptOssForCausalLM.from_pretrained(folder, dtype=dtype, **kw).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


__all__ = ["load_transformers_model"]
