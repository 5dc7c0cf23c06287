"""GRPO's training objective: group-relative advantages, the clipped surrogate, its three normalisations,
the KL to the reference policy, and the trainer/rollout mismatch with its importance-sampling correction.

Per completion token t (TRL's GRPOTrainer, whose loss this equals; tests/rl/test_trl_parity.py):

    ratio_t = exp(logp_t - old_t)                 old: the trainer's log-prob at the rollout's weights
    l_t     = -min(ratio_t A, clip(ratio_t, 1 - clip_low, 1 + clip_high) A)
    l_t    *= w_t                                 rl.is_correction's weight of rho_t = exp(old_t - engine_t)
    l_t    += kl_coeff * k3_t * (ratio_t if rl.kl_unbiased)              when kl_coeff > 0
    k3_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1

(w_t: rl/importance.py, TRL's vLLM importance-sampling modes, e.g. min(rho_t, rl.is_max) for tis or 0 outside
the bounds for the masks; the ratio on the KL term makes its gradient the unbiased reverse-KL gradient,
DeepSeek-V3.2: TRL's use_bias_correction_kl, on by default there and here) with A the completion's advantage:
(reward - group mean) / (group std + 1e-4) (the std unbiased, as
torch.std; without rl.scale_rewards the difference only). A completion whose reward failed has
advantage 0 and its group's statistics are over the others (TRL's unscorable completions). The
step's loss is
- grpo:    the mean over completions of each completion's token mean,
- dapo:    the sum over every completion token of the step / those tokens,
- dr_grpo: the sum over every completion token / (completions x rl.max_new_tokens),
which is `loss_sum / normaliser` of the objective seam (train/objective.py) summed over the step's
microbatches and data-parallel ranks. When a rollout is trained in one step, old_t is the current
log-prob itself (detached), as in TRL; otherwise the rollout scored it before the first update.

`mismatch_kl` is the per-token estimate exp(d) - 1 - d, d = old_t - engine_t, of KL(engine || trainer)
over the completion tokens: the trainer's recomputation against the log-probs the engine reported
for the tokens it sampled. `routing_flip_rate` (when the engine reported its experts) is the share of
token-layer pairs whose live top-k set in the trainer's forward at the rollout's weights (where old_t
is computed) differs from the engine's, counted by each router before any replay (model/routes.py;
docs/rl.md, "Routing replay"); tokens of the whole row count, the prompt's too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import torch

from gptoss_cli.model.loss import IGNORE_INDEX, HybridOutput
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.rl.importance import MASKING, ImportanceCorrection, masked_sequences
from gptoss_cli.rl.logprobs import policy_log_probs
from gptoss_cli.train.data import Microbatch
from gptoss_cli.train.objective import TrainingObjective, router_losses
from gptoss_cli.train.progress import MetricDisplay

if TYPE_CHECKING:
    from gptoss_cli.train.provider import ModelRuntimeConfig

ADVANTAGE_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


def group_advantages(rewards: Sequence[float | None], group_size: int, scale: bool) -> list[float]:
    """Each completion's advantage relative to its group (consecutive runs of `group_size`); a completion
    without a reward (None: it failed) gets 0 and the group's statistics are over the others."""
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        have = torch.tensor([r for r in group if r is not None], dtype=torch.float32)
        mean = have.mean() if have.numel() else torch.tensor(0.0)
        std = have.std() if have.numel() > 1 else torch.tensor(0.0)
        for r in group:
            if r is None:
                out.append(0.0)
                continue
            a = torch.tensor(r, dtype=torch.float32) - mean
            out.append(float(a / (std + ADVANTAGE_EPS)) if scale else float(a))
    return out


@dataclass
class GRPOObjective(TrainingObjective):
    """GRPO on rollout microbatches (see the module docstring). A microbatch's `extras` hold, per
    position of the labels: `advantages`, `rollout_logp` (the engine's), and when computed at rollout
    time `old_logp` and `ref_logp`."""

    loss_type: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coeff: float = 0.0
    kl_unbiased: bool = True  # the KL term times the ratio (DeepSeek-V3.2; TRL's use_bias_correction_kl)
    temperature: float = 1.0
    max_new_tokens: int = 1
    # rl.is_correction (rl/importance.py); none here, the recipe's from the recipe
    correction: ImportanceCorrection = field(default_factory=lambda: ImportanceCorrection("none"))
    # leave each microbatch's trainer log-probs at the rollout's weights in extras["old_logp"] after its loss
    # when the rollout did not score them (rl.save_rollouts writes them; each microbatch is trained once then)
    keep_old_logp: bool = False
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    name: ClassVar[str] = "grpo"
    sums: ClassVar[tuple[str, ...]] = (
        "loss_sum", "num_tokens", "pg_loss_sum", "completion_tokens", "completions", "kl_ref_sum", "clipped_sum",
        "entropy_sum", "mismatch_sum", "mismatch_abs_sum", "is_weight_sum", "is_capped_sum", "is_masked_sum",
        "is_masked_rows", "aux_loss_sum", "z_loss_sum", "route_flip_sum", "route_pairs")
    # reward_mean is the rollout's (RLTrainer adds it to the step's metrics, rl/rollouts.py)
    shown_metrics: ClassVar[tuple[MetricDisplay, ...]] = (
        MetricDisplay("reward_mean", label="mean reward", console="reward", format=".3f"),
        MetricDisplay("mismatch_kl", label="mismatch KL (engine || trainer)", console="mismatch", format=".1e"),
        MetricDisplay("mismatch_logp_abs", label="mean |logprob engine - trainer|", console="|dlogp|", format=".1e"),
        MetricDisplay("routing_flip_rate", label="routing flip rate (trainer vs engine top-k)", console="flips",
                      format=".1e"),
        MetricDisplay("is_masked_fraction", label="tokens masked by the importance-sampling correction",
                      console="masked", format=".1e"))

    @classmethod
    def from_recipe(cls, config: RecipeConfig) -> "GRPOObjective":
        """GRPO at the recipe's rl section, its importance-sampling correction whatever the engine."""
        rl = config.rl
        return cls(loss_type=rl.loss, clip_low=rl.clip_low, clip_high=rl.clip_high, kl_coeff=rl.kl_coeff,
                   kl_unbiased=rl.kl_unbiased, temperature=rl.temperature, max_new_tokens=rl.max_new_tokens,
                   correction=ImportanceCorrection(rl.is_correction, rl.is_min, rl.is_max, rl.is_sequence_ratio),
                   keep_old_logp=rl.save_rollouts,
                   aux_loss_coeff=config.moe.aux_loss_coeff, z_loss_coeff=config.moe.z_loss_coeff)

    def advantages(self, microbatch: Microbatch, old: torch.Tensor, mask: torch.Tensor,
                   logs: dict[str, Any]) -> torch.Tensor:
        """Each position's advantage: the completion's, from the rollout (rl/batch.py). An objective built on
        this surrogate may derive them per token instead (on-policy distillation: teacher minus `old`, the
        trainer's log-prob at the rollout's weights), adding its own device logs to `logs`."""
        return microbatch.extras["advantages"]

    def loss(self, microbatch: Microbatch, config: ModelRuntimeConfig, output: HybridOutput
             ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        ex = microbatch.extras
        mask = (microbatch.labels != IGNORE_INDEX).float()
        logp, entropy = policy_log_probs(output, microbatch.labels, self.temperature)
        old = ex["old_logp"] if "old_logp" in ex else logp.detach()
        logs: dict[str, Any] = {}
        adv = self.advantages(microbatch, old, mask, logs)
        ratio = torch.exp(logp - old)
        clipped = torch.clamp(ratio, 1 - self.clip_low, 1 + self.clip_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        d = (old - ex["rollout_logp"]) * mask
        if self.correction.active:
            per_token = per_token * self.importance_weights(d, mask, logs)
        if self.keep_old_logp and "old_logp" not in ex:
            ex["old_logp"] = old
        if "ref_logp" in ex:
            diff = ex["ref_logp"] - logp
            kl = torch.exp(diff) - diff - 1
            logs["kl_ref_sum"] = (kl.detach() * mask).sum()
            if self.kl_coeff > 0:
                per_token = per_token + self.kl_coeff * (kl * ratio if self.kl_unbiased else kl)
        rows_tokens = mask.sum(-1)
        rows = torch.tensor(float(mask.shape[0]), device=mask.device)
        summed = (per_token * mask).sum()
        if self.loss_type == "grpo":
            objective, normaliser = ((per_token * mask).sum(-1) / rows_tokens.clamp(min=1.0)).sum(), rows.sum()
        elif self.loss_type == "dapo":
            objective, normaliser = summed, mask.sum()
        else:  # dr_grpo
            objective, normaliser = summed, rows.sum() * self.max_new_tokens
        low = (ratio < 1 - self.clip_low) & (adv < 0)
        high = (ratio > 1 + self.clip_high) & (adv > 0)
        logs.update(pg_loss_sum=objective.detach(), completion_tokens=mask.sum(), completions=rows.sum(),
                    clipped_sum=((low | high).float() * mask).sum(), entropy_sum=(entropy * mask).sum(),
                    # in float64, expm1: exp(d) - 1 - d >= 0 without rounding's negatives at |d| ~ 1e-7
                    mismatch_sum=((torch.expm1(d.double()) - d.double()) * mask).sum().detach().to(d.dtype),
                    mismatch_abs_sum=d.abs().sum().detach())
        flips, pairs = ex.get("route_flips"), ex.get("route_pairs")  # counted at the rollout's weights when scored
        if pairs is None and getattr(output, "route_pairs", None) is not None:
            flips, pairs = output.route_flips, output.route_pairs
        if pairs is not None:  # the engine's routes came with the microbatch
            logs.update(route_flip_sum=flips.sum().float(), route_pairs=pairs.sum().float())
        loss_sum = objective + router_losses(output, normaliser, self.aux_loss_coeff, self.z_loss_coeff, logs)
        return loss_sum, normaliser, logs

    def importance_weights(self, d: torch.Tensor, mask: torch.Tensor, logs: dict[str, Any]) -> torch.Tensor:
        """rl.is_correction's weight of each token (rl/importance.py), `d` = old - engine; logs the weights' sum and
        the tokens (and, masking, the completions) outside the bounds."""
        weight, outside = self.correction.weights(d, mask)
        logs["is_weight_sum"] = (weight * mask).sum().detach()
        if self.correction.mode in MASKING:
            logs["is_masked_sum"] = outside.sum()
            logs["is_masked_rows"] = masked_sequences(outside, mask).float().sum()
        else:
            logs["is_capped_sum"] = outside.sum()
        return weight

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        norm, tokens, rows = sums["num_tokens"], sums["completion_tokens"], sums["completions"]

        def per(name: str, by: float) -> float:
            return sums[name] / by if by else float("nan")

        out = {"loss": per("pg_loss_sum", norm) if norm else 0.0, "tokens": tokens,
               "completion_length": per("completion_tokens", rows), "entropy": per("entropy_sum", tokens),
               "clip_fraction": per("clipped_sum", tokens), "mismatch_kl": per("mismatch_sum", tokens),
               "mismatch_logp_abs": per("mismatch_abs_sum", tokens)}
        if self.kl_coeff > 0:  # the reference is scored only when its KL is in the loss
            out["kl_ref"] = per("kl_ref_sum", tokens)
        if self.correction.active:
            out["is_weight"] = per("is_weight_sum", tokens)
            if self.correction.mode in MASKING:
                out["is_masked_fraction"] = per("is_masked_sum", tokens)
                out["is_masked_sequences"] = per("is_masked_rows", rows)
            else:
                out["is_capped_fraction"] = per("is_capped_sum", tokens)
        for name, coeff in (("aux_loss", self.aux_loss_coeff), ("z_loss", self.z_loss_coeff)):
            if coeff > 0:
                out[name] = per(f"{name}_sum", norm)
        if sums.get("route_pairs"):
            out["routing_flip_rate"] = sums["route_flip_sum"] / sums["route_pairs"]
        return out


__all__ = ["GRPOObjective", "group_advantages", "ADVANTAGE_EPS"]
