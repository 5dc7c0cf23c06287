"""Parity: weight round trip and block-streamed forward comparison against transformers."""
