"""LoRA on an FP8 base: the frozen base's GEMMs run in FP8 (forward and input gradient, no weight
gradient), the adapters' low-rank path stays in the params dtype."""

from __future__ import annotations

import torch

from gptoss_cli.fp8.selection import Fp8Settings, select_gemms
from gptoss_cli.model.lora import LoraSettings, adapter_tensors, attach_lora
from tests.model.hybrid_helpers import tiny_batch, tiny_model

ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def test_frozen_base_gemms_in_fp8_adapters_in_params_dtype():
    ids, labels = tiny_batch()
    model = tiny_model()
    attach_lora(model, LoraSettings(rank=4, alpha=8.0, target_modules=ALL), seed=1)
    gemms = select_gemms(Fp8Settings("tensorwise", "hybrid", emulation=True), "cpu")
    names = model.set_gemms(dense=gemms.dense, grouped=gemms.grouped)
    assert len(names) == 12 and not any("adapter" in n for n in names)  # the base layers only
    used = []
    for _, layer in model.moe_layers():
        layer.mlp.router.register_forward_hook(lambda m, args, out: used.append(out.indices.unique().numel()))
    model(ids, labels=labels).loss.backward()
    # 3 attention layers x 2 projections, and each MoE layer's fc1 and fc2 once per expert that got
    # tokens: every one forward in FP8; input gradients for all but layer 0's linear_qkv, whose input
    # (the normalised embeddings, all frozen) needs none; no weight gradient for a frozen base. The
    # adapters' GEMMs are not among them (they would add to every count).
    fprop = 6 + 2 * sum(used)
    assert gemms.stats.gemms == {"fprop": fprop, "dgrad": fprop - 1, "wgrad": 0}
    grads = adapter_tensors(model, grads=True)
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert all(g.abs().sum() > 0 for n, g in grads.items() if ".linear_out." in n)  # B trains from step 0
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
