"""`gptoss generate`: decoding with a KV cache, sampling, prompts and tokenizers for talking to a checkpoint."""
