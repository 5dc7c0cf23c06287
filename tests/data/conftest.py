"""Fixtures for the conversation tests: the real GPT-OSS tokenizer and openai_harmony, both offline.

The tokenizer.json is built once (about half a minute: transformers' TikTokenConverter on o200k_base) and
cached in .test-cache/gpt-oss-tokenizer at the repository root (or $GPTOSS_TEST_CACHE; never pytest's cache,
which `-p no:cacheprovider` turns off); delete that folder to rebuild it.
"""

from __future__ import annotations

import pytest

from tests.data.harmony_tokenizer import cache_folder, gpt_oss_tokenizer_json, harmony_encoding


@pytest.fixture(scope="session")
def harmony_cache():
    pytest.importorskip("openai_harmony", reason="the test extra installs openai-harmony")
    pytest.importorskip("bpe_openai", reason="the test extra installs bpe-openai")
    return cache_folder()


@pytest.fixture(scope="session")
def gpt_oss_tokenizer_file(harmony_cache):
    """Path of the GPT-OSS tokenizer.json (o200k_base + harmony's special tokens)."""
    return gpt_oss_tokenizer_json(harmony_cache)


@pytest.fixture(scope="session")
def harmony(harmony_cache):
    """openai_harmony's HARMONY_GPT_OSS encoding, the reference the renderer is compared with."""
    return harmony_encoding(harmony_cache)


@pytest.fixture(scope="session")
def harmony_tok(gpt_oss_tokenizer_file):
    """Our renderer's view of that tokenizer.json."""
    from tokenizers import Tokenizer

    from gptoss_cli.data.harmony import HarmonyTokenizer

    return HarmonyTokenizer(Tokenizer.from_file(str(gpt_oss_tokenizer_file)), str(gpt_oss_tokenizer_file))
