"""A tiny GPT-OSS with the real vocabulary (o200k_base + harmony's special tokens, 201088 ids) and head_dim 64, in
the HF layout with MXFP4 experts, its tokenizer files as the released model has them: what llama.cpp's converter
and serve-check's llama.cpp tests need (the tokenizer is built offline: tests/data/harmony_tokenizer.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gptoss_cli.checkpoint.make_tiny import make_tiny
from gptoss_cli.model.config import preset

REAL_VOCAB = 201088


def real_vocab_arch(**changes):
    return preset("tiny").replace(vocab_size=REAL_VOCAB, head_dim=64, eos_token_id=200002, pad_token_id=199999,
                                  **changes)


def chat_template() -> str:
    """The gpt-oss chat template TRL's wheel carries (the released tokenizer_config.json's)."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "gptoss.jinja").read_text()


def real_vocab_tiny(dst: Path, *, experts: str = "mxfp4", seed: int = 5, **changes) -> Path:
    from tests.data.harmony_tokenizer import cache_folder, gpt_oss_tokenizer_json

    make_tiny(dst, experts=experts, seed=seed, arch=real_vocab_arch(**changes))
    shutil.copyfile(gpt_oss_tokenizer_json(cache_folder()), dst / "tokenizer.json")
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": chat_template(), "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
        "bos_token": "<|startoftext|>", "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return dst
