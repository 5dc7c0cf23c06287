"""The recipe's `dpo` section: preference tuning (objective.kind=dpo, docs/dpo.md; gptoss_cli/preference/)."""

from __future__ import annotations

from dataclasses import dataclass

from gptoss_cli.recipe.field_spec import spec

# the per-pair losses (gptoss_cli/preference/objective.py), TRL's names; simpo needs no reference
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust", "simpo")
DPO_REFERENCES = ("model", "precomputed")


@dataclass
class DPOConfig:
    beta: float = spec(0.1, "how far the policy may move from the reference: the rewards are beta x the log-ratio "
                       "to the reference (simpo: beta x the mean log-prob; SimPO uses 2 to 10)", min=0.0)
    loss: str = spec("sigmoid", "sigmoid (DPO), ipo (per-token log-ratios, target 1/(2 beta)), hinge (SLiC), robust "
                     "(conservative DPO with label_smoothing) or simpo (reference-free, length-normalised, margin "
                     "simpo_gamma)", choices=DPO_LOSSES)
    label_smoothing: float = spec(0.0, "robust, simpo: the assumed share of pairs whose labels are flipped",
                                  min=0.0, below=0.5)
    rpo_alpha: float = spec(0.0, "weight of the chosen side's negative log-likelihood (a token mean over the step) "
                            "added to the loss (RPO); 0 = off", min=0.0)
    simpo_gamma: float = spec(0.5, "simpo: the target reward margin gamma (the mean log-prob margin is gamma / beta)",
                              min=0.0)
    reference: str = spec("model", "where the reference log-probs come from: model (a frozen reference; under LoRA "
                          "the base with the adapters off, otherwise a second frozen model in memory) or precomputed "
                          "(scored once before training and stored next to the token files; the reference never "
                          "sits beside the policy)", choices=DPO_REFERENCES)


__all__ = ["DPOConfig", "DPO_LOSSES", "DPO_REFERENCES"]
