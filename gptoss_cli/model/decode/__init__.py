"""The model's forward for a decoding step: the key/value cache and the cached forward (kv_cache.py),
the MoE layer over only the experts a step's few tokens chose (moe.py), and the few-row products on
the CPU (skinny_gemm.py)."""
