"""The GEMM seams FP8 and LoRA plug into: the dense linear layer (dense.py), the experts' grouped
linear layer (grouped.py), which numerics each layer computes with (selection.py), and weight
gradients added straight into the training buffers' main_grad (main_grad.py)."""
