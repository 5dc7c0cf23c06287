"""Whether reading tensor values back to the host is free: the one switch for the model's data-dependent branches.

On the CPU a branch may read what the data says (the expert counts of grouped GEMM's bias paths, the label
mask that lets the LM head skip unlabelled rows, whether the loss's ignored-row fill is needed) at no cost;
on an accelerator that read would make the device wait for the host, so those branches take the sync-free
path instead. The host-sync budget tests (tests/schedule/workers.py, test_step_syncs.py) switch this off to
count what the device path does on a CPU.
"""

from __future__ import annotations

import torch


def free(device: torch.device) -> bool:
    """Whether reading values of tensors on `device` back costs no device sync (the CPU)."""
    return device.type == "cpu"


__all__ = ["free"]
