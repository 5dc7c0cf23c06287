"""What a recipe costs before it runs, from formulas (pure Python: validation must not need torch).

sizes.py (the layout's world, data-parallel and expert-data-parallel sizes), parameters.py (a rank's
parameters and gradient buffers), memory.py (the per-GPU memory estimate), memory_rl.py (GRPO's
items in it), flops.py (model FLOPs per token and MFU).
"""
