"""The policy's weights as a rollout engine serves them: an HF folder written from the live model.

What the engine must compute is what the trainer computes: LoRA adapters merged into their base
weights (`merged_weight`, as the merged export does), and under MXFP4 QAT each expert weight rounded
to MXFP4 (`rounded_weight`, the forward's own rounding; an engine without an MXFP4 kernel then computes
with the rounded weights in its dtype, which is what QAT's forward does). The Hybrid -> HF
re-arrangement is the checkpoint mapping's (checkpoint/mapping.py) and the experts are stored in the
HF bf16 layout (checkpoint/formats/hf/layouts.py; the dtype is the engine's). The folder holds
`model.safetensors` and `config.json`, written under a temporary name and renamed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from gptoss_cli.checkpoint.formats.hf.config import to_hf_config
from gptoss_cli.checkpoint.formats.hf.layouts import HF_BF16
from gptoss_cli.checkpoint.mapping import units
from gptoss_cli.model.lora import is_adapter_name, lora_deltas
from gptoss_cli.model.mxfp4.qat import rounded_weight

EXPERT_WEIGHTS = ("mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight")
ENGINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@torch.no_grad()
def served_state(model: torch.nn.Module, *, qat: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{Hybrid checkpoint name: tensor in `dtype`} of what the model computes (see the module docstring).
    The model must hold every expert (expert parallel size 1)."""
    deltas = lora_deltas(model)
    out: dict[str, torch.Tensor] = {}
    for name, t in model.named_checkpoint_slots(all_experts=True):
        if is_adapter_name(name):
            continue
        if t is None:
            raise ValueError(f"{name}: this rank does not hold the tensor (the engine push needs every expert)")
        w = t.detach().float()
        if name in deltas:
            w = w + deltas[name].to(w.device)
        if qat and name.rstrip("0123456789").endswith(EXPERT_WEIGHTS):
            w = rounded_weight(w[None])[0]  # along `in`, the blocks the MXFP4 export writes
        out[name] = w.to(dtype).cpu()
    return out


def hf_tensors(state: dict[str, torch.Tensor], arch) -> dict[str, torch.Tensor]:
    """The HF (bf16-layout) tensors of a full Hybrid state."""
    out: dict[str, torch.Tensor] = {}
    for unit in units(arch):
        for canonical, t in zip(unit.hf, unit.to_hf(arch, [state[n] for n in unit.hybrid])):
            for stored, s in HF_BF16.store(canonical, t):
                out[stored] = s.contiguous()
    return out


def write_hf_folder(model: torch.nn.Module, arch, folder: str | Path, *, qat: bool, dtype: str) -> Path:
    """`folder` (replaced) holding the model's served weights in the engine's `dtype` ("float32" | "bfloat16")."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(served_state(model, qat=qat, dtype=ENGINE_DTYPES[dtype]), arch)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(to_hf_config(arch, torch_dtype=dtype), indent=2) + "\n")
    if folder.exists():
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    os.replace(tmp, folder)
    return folder


__all__ = ["served_state", "hf_tensors", "write_hf_folder", "ENGINE_DTYPES"]
