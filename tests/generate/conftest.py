"""The generate tests reuse the model tests' tiny transformers GPT-OSS and the data tests' offline GPT-OSS
tokenizer and openai-harmony reference."""

from tests.data.conftest import gpt_oss_tokenizer_file, harmony, harmony_cache, harmony_tok  # noqa: F401  (fixtures)
from tests.model.conftest import hf_tiny  # noqa: F401  (a fixture)
