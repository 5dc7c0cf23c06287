"""DPO's item in the per-GPU memory estimate (recipe/memory.py): the frozen reference model, or nothing.

dpo.reference=model under full fine-tuning keeps a second, frozen model (gptoss_cli/preference/reference.py):
the rank's parameters once more in the parameters' dtype, with no gradients and no optimizer state. Under
LoRA the reference is the base with the adapters off, which costs nothing; with dpo.reference=precomputed
the reference's log-probs are read per microbatch from the scores file (4 bytes a trained token, a few
microbatches' worth), and the scoring pass before training frees its model before the policy is built; the
reference-free simpo needs none. Pure Python, like the rest of the estimate.
"""

from __future__ import annotations

from gptoss_cli.recipe.schema import RecipeConfig


def dpo_items(cfg: RecipeConfig, b: int, rank_params: int, item_type) -> list:
    """The DPO items (`item_type` is memory.MemoryItem) of one rank holding `rank_params` model parameters."""
    d = cfg.objective.kind == "dpo" and cfg.dpo
    if not d or d.loss == "simpo" or d.reference != "model" or cfg.lora.rank > 0:
        return []
    return [item_type("dpo.reference", "DPO reference model (frozen copy)", b * rank_params, f"{b} B x {rank_params:,}",
                      "dpo.reference=precomputed (scored once before training), or LoRA (the base with the adapters "
                      "off)")]


__all__ = ["dpo_items"]
