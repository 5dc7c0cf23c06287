"""Low-precision kernels: scaling, casting, FP8/MXFP8 linear and grouped GEMMs."""
