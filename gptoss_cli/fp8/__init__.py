"""Low-precision GEMMs: FP8 (tensorwise, rowwise) and MXFP8 for the attention projections and experts.

scaling.py (formats, scale rules, casting, NaN/inf guard) -> matmul.py (one FP8 GEMM and its
kernels) -> linear.py / grouped.py (the gemm objects behind the model's dense and grouped linear
layers) -> recipe.py (`precision.fp8_*` -> numerics, native or emulated path, gemms).
"""

from gptoss_cli.fp8.recipe import Fp8Gemms, Fp8Settings, select_gemms

__all__ = ["Fp8Gemms", "Fp8Settings", "select_gemms"]
