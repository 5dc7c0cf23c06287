"""LoRA adapters in PEFT's own layout: what `peft.PeftModel.from_pretrained` applies to transformers' GptOssForCausalLM.

A PEFT adapter folder holds `adapter_config.json` and `adapter_model.safetensors`. Attention goes
through `target_modules` (`q_proj`, `k_proj`, `v_proj`, `o_proj`: one nn.Linear LoRA each); the
experts through `target_parameters` (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), which
PEFT (>= 0.17, `lora.ParamWrapper`) wraps as one LoRA over the 3-D parameter `[E, in, out]`:

    lora_A.weight [rank * E, in]    rows expert-major: expert e's A is rows e*rank .. e*rank+rank-1
    lora_B.weight [out, rank * E]   columns rank-major: expert e's B is columns e, E + e, 2E + e, ...
    delta[e] = scaling * (B_e @ A_e)^T   (added to the `[in, out]` stored parameter)

Two wrapped parameters of one module nest: the first of `target_parameters` (gate_up_proj) is the
inner one, so its keys carry `base_layer.` (`...mlp.experts.base_layer.lora_A.weight`), the second
(down_proj) does not. `gate_up_proj`'s output columns interleave gate and up (gate j = column 2j);
ours are `[gate; up]` rows, so B's rows are interleaved on export.

Our fused linear_qkv has one A for q, k and v: the PEFT adapters of q_proj, k_proj and v_proj share
that A and take their rows of B (rank unchanged, the deltas exactly the same).

Torch-free at import (the PEFT row, formats/peft/__init__.py, reads the file names here); `convert --to
peft`'s plan is formats/peft/plan.py.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable

from gptoss_cli.model.config import GptOssArch

if TYPE_CHECKING:
    import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

PEFT_PREFIX = "base_model.model."
ATTENTION_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",)}
EXPERT_PARAMETERS = {"linear_fc1": "mlp.experts.gate_up_proj", "linear_fc2": "mlp.experts.down_proj"}


def peft_tensors(arch: GptOssArch, adapters: dict[str, torch.Tensor], target_modules: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """PEFT's tensors from ours. `adapters`: every adapter tensor under its Hybrid checkpoint name
    (per expert for the experts, all experts present), from a model in the default `*E` pattern
    (HF block i = layers 2i, 2i+1)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(arch.num_hidden_layers):
        out.update(peft_block_tensors(arch, i, adapters.__getitem__, target_modules))
    return out


def peft_block_tensors(arch: GptOssArch, i: int, read: Callable[[str], torch.Tensor],
                       target_modules: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """PEFT's tensors of HF block i, in file order, from our adapter tensors as `read(name)` gives them."""
    import torch  # noqa: PLC0415 (this module is torch-free at import)

    from gptoss_cli.checkpoint.mapping import interleave_experts, split_qkv  # noqa: PLC0415
    from gptoss_cli.model.expert_names import expert_name  # noqa: PLC0415

    out: dict[str, torch.Tensor] = {}
    nested = all(t in target_modules for t in EXPERT_PARAMETERS)  # both expert parameters wrapped
    num_experts = arch.num_local_experts
    attn = f"decoder.layers.{2 * i}.self_attention"
    hf = f"{PEFT_PREFIX}model.layers.{i}"
    for ours, theirs in ATTENTION_MODULES.items():
        if ours not in target_modules:
            continue
        a = read(f"{attn}.{ours}.adapter.linear_in.weight")
        b = read(f"{attn}.{ours}.adapter.linear_out.weight")
        parts = split_qkv(arch, b) if ours == "linear_qkv" else (b,)
        for name, part in zip(theirs, parts):
            out[f"{hf}.self_attn.{name}.lora_A.weight"] = a.clone()
            out[f"{hf}.self_attn.{name}.lora_B.weight"] = part.contiguous()
    experts = f"decoder.layers.{2 * i + 1}.mlp.experts"
    for ours in EXPERT_PARAMETERS:
        if ours not in target_modules:
            continue
        a = torch.stack([read(expert_name(f"{experts}.{ours}.adapter.linear_in.weight", e)) for e in range(num_experts)])
        b = torch.stack([read(expert_name(f"{experts}.{ours}.adapter.linear_out.weight", e)) for e in range(num_experts)])
        if ours == "linear_fc1":  # [gate; up] rows -> alternating, as HF's gate_up_proj columns
            b = interleave_experts(arch, b.unbind(0))
        e, rank, fan_in = a.shape
        key = f"{hf}.mlp.experts." + ("base_layer." if nested and ours == "linear_fc1" else "")
        out[key + "lora_A.weight"] = a.reshape(e * rank, fan_in).contiguous()
        # [E, out, rank] -> [out, rank, E] -> [out, rank * E]: expert index fastest
        out[key + "lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], rank * e).contiguous()
    return out


def adapter_config(*, rank: int, alpha: float, dropout: float, target_modules: tuple[str, ...],
                   base_model: str | None) -> dict[str, Any]:
    """adapter_config.json for PEFT's LoraConfig. PEFT refuses dropout on wrapped parameters, and
    dropout does not change inference, so it is recorded as 0 when the experts are adapted."""
    modules = [m for t in target_modules for m in ATTENTION_MODULES.get(t, ())]
    parameters = [EXPERT_PARAMETERS[t] for t in EXPERT_PARAMETERS if t in target_modules]
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0 if parameters else dropout,
        "target_modules": modules,
        "target_parameters": parameters,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "init_lora_weights": True,
    }
    return config


def adapter_config_text(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2, default=str) + "\n"


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "peft_tensors", "peft_block_tensors", "adapter_config",
           "adapter_config_text"]
