"""The generate tests reuse the model tests' tiny transformers GPT-OSS."""

from tests.model.conftest import hf_tiny  # noqa: F401  (a fixture)
