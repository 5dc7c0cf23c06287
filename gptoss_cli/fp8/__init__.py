"""Low-precision GEMMs: FP8 (tensorwise, rowwise) and MXFP8 for the attention projections and experts.

catalog.py (the recipes and formats, torch-free: the recipe schema and rules read it) ->
scaling.py (formats, scale rules, casting, NaN/inf guard) -> matmul.py (one FP8 GEMM and its
kernels) -> linear.py / grouped.py (the gemm objects behind the model's dense and grouped linear
layers) -> selection.py (`precision.fp8_*` -> numerics, native or emulated path, gemms: `select_gemms`).
Nothing is imported here, so importing fp8.catalog does not load torch.
"""
