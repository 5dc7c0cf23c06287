"""The GPT-OSS architecture and the Hybrid model in pure PyTorch (no process groups)."""
