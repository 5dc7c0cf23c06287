"""The model's named choices and constants that torch-free code (recipes, validate-config) reads too.

This module imports nothing, so `recipe/` and the rules can name these facts without torch; the
model imports them from here, as `fp8/catalog.py` is for the FP8 recipes. One source for each:
- how the clamped SwiGLU is computed (`model.swiglu_kernel`; model/mlp.py, model/swiglu_kernel.py);
- which kernel computes attention with sinks (`model.attention_backend`; model/attention/backends.py);
- the query block of a sliding-window layer (model/attention/masks.py; the memory estimate's score blocks);
- the layers LoRA can target (model/lora.py; the lora.* rules).
"""

from __future__ import annotations

# model.swiglu_kernel: "auto" = the compiled single-pass kernels where they work, "eager" = torch ops.
SWIGLU_KERNELS = ("auto", "eager")
# A training recipe's default (recipe/schema.py, train/provider.py's ModelRuntimeConfig).
SWIGLU_KERNEL_DEFAULT = "auto"
# A model no recipe configures (generate, parity-check, eval, a HybridModel built in code): eager, since
# compiling costs seconds that a few forwards do not repay. HybridModel.set_swiglu_kernel changes it.
SWIGLU_KERNEL_UNCONFIGURED = "eager"

# model.attention_backend (docs/architecture.md, "Attention and sinks"; model/attention/backends.py):
#   auto  - per device and layer: the flash kernel where it takes the layer, FlexAttention where not, else sdpa
#   flash - a flash kernel's output and log-sum-exp, rescaled by the sink (CPU: every layer; CUDA: full layers)
#   flex  - FlexAttention with a block mask (window, documents), the sink from its log-sum-exp
#   sdpa  - scaled_dot_product_attention with the sink as one more key (head dim padded to a multiple of 8)
ATTENTION_BACKENDS = ("auto", "flash", "flex", "sdpa")
ATTENTION_BACKEND_DEFAULT = "auto"

# Query block of a sliding-window layer: at least this many queries, and at least the window.
SLIDING_QUERY_BLOCK = 64

# Megatron's names of the layers LoRA can target.
ATTENTION_TARGETS = ("linear_qkv", "linear_proj")
MLP_TARGETS = ("linear_fc1", "linear_fc2")
TARGET_MODULES = ATTENTION_TARGETS + MLP_TARGETS

__all__ = ["SWIGLU_KERNELS", "SWIGLU_KERNEL_DEFAULT", "SWIGLU_KERNEL_UNCONFIGURED", "ATTENTION_BACKENDS",
           "ATTENTION_BACKEND_DEFAULT", "SLIDING_QUERY_BLOCK", "ATTENTION_TARGETS", "MLP_TARGETS", "TARGET_MODULES"]
