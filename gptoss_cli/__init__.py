"""gptoss: convert, validate, train and parity-check OpenAI GPT-OSS models."""

__version__ = "0.1.0"
