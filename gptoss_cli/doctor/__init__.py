"""`gptoss doctor`: what a user runs on a new node before launching.

machine.py (torch, CUDA, NCCL, driver, the device and its free memory), recipes.py (what each shipped
recipe would get natively here, and what would be refused), checks.py (quick checks of the local
device against a CPU reference: a tiny model's forward and backward, each attention backend, the
grouped GEMM, the FP8 GEMMs, one collective per backend), report.py (the report and `run_doctor`).
"""
