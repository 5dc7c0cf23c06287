"""DPO's training objective and its variants, on microbatches of whole preference pairs (preference/data.py).

Per pair, with c and r the policy's summed log-probabilities of the chosen and rejected side's trained
tokens, c0 and r0 the reference policy's, n_c and n_r the sides' trained tokens, and d = (c - c0) - (r - r0)
(TRL's DPOTrainer, whose loss this equals; tests/preference/test_trl_parity.py):

    sigmoid   -log sigmoid(beta d)                                         (DPO)
    hinge     max(0, 1 - beta d)                                           (SLiC)
    ipo       ((c - c0) / n_c - (r - r0) / n_r - 1 / (2 beta))^2           (IPO, per-token log-ratios as TRL)
    robust    (-(1 - e) log sigmoid(beta d) + e log sigmoid(-beta d)) / (1 - 2e)    e = dpo.label_smoothing
    simpo     -(1 - e) log sigmoid(beta m) - e log sigmoid(-beta m),  m = c / n_c - r / n_r - gamma / beta
              (SimPO as TRL's CPOTrainer computes it: no reference, per-token means, gamma = dpo.simpo_gamma)

The step's loss is the mean of these over the step's pairs (the seam's normaliser is pairs), plus, with
dpo.rpo_alpha > 0, rpo_alpha times the chosen sides' negative log-likelihood averaged over every chosen
trained token of the step (TRL's loss_type [.., "sft"] with loss_weights [1, rpo_alpha]: RPO). That
second mean has another denominator, so `prepare_step` counts the step's pairs and chosen tokens over the
data-parallel ranks (one small all-reduce) and hands each microbatch the factor pairs / chosen tokens.

The rewards are beta (c - c0) and beta (r - r0) (beta c / n_c and beta r / n_r for simpo); the metrics are
their means over the step's pairs, the mean margin and the share of pairs whose chosen reward is the larger
(accuracy), as TRL logs them. The reference log-probabilities arrive per position in
`Microbatch.extras["ref_logp"]` (preference/reference.py: a frozen reference, the base with the LoRA
adapters off, or a precomputed file); simpo needs none.

Context parallel: a pair's tokens are spread over the CP ranks of its rows, so the per-side sums are
all-reduced over the CP group (its backward all-reduces the gradients, so every rank's tokens get
d loss / d sum), and each pair's loss and logs are counted by the one rank holding its `pair_first`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gptoss_cli.model.loss import IGNORE_INDEX
from gptoss_cli.preference.data import PAIR_FIRST, PAIR_SIDE
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.train.data import Microbatch
from gptoss_cli.train.objective import StepContext, TrainingObjective, router_losses, token_log_probs
from gptoss_cli.train.progress import MetricDisplay

REF_LOGP = "ref_logp"
RPO_WEIGHT = "rpo_weight"
REFERENCE_FREE = ("simpo",)


class _SumOverGroup(torch.autograd.Function):
    """all_reduce(SUM) over a group whose backward all-reduces the gradient (each rank's part of a sum gets
    the gradient of every rank's use of it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def side_sums(values: torch.Tensor, side: torch.Tensor, sides: int) -> torch.Tensor:
    """[rows, sides] sums of `values` [rows, S] over the positions of each side id (side [rows, S], -1: none)."""
    index = torch.where(side >= 0, side, sides)
    out = values.new_zeros(values.shape[0], sides + 1)
    return out.scatter_add(1, index, values)[:, :sides]


@dataclass
class PairSums:
    """Per pair of a microbatch ([rows, pairs] each): the policy's and reference's summed log-probs of both
    sides, their trained tokens, and which pairs this rank counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    n_chosen: torch.Tensor
    n_rejected: torch.Tensor
    owned: torch.Tensor  # 1.0 where this rank counts the pair (it holds its pair_first), else 0.0


@dataclass
class DPOObjective(TrainingObjective):
    """DPO and its variants on preference-pair microbatches (module docstring)."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    rpo_alpha: float = 0.0
    simpo_gamma: float = 0.5
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    name: ClassVar[str] = "dpo"
    sums: ClassVar[tuple[str, ...]] = (
        "loss_sum", "num_tokens", "pref_loss_sum", "trained_tokens", "chosen_reward_sum", "rejected_reward_sum",
        "correct_sum", "chosen_logp_sum", "rejected_logp_sum", "nll_sum", "chosen_tokens", "aux_loss_sum",
        "z_loss_sum")
    shown_metrics: ClassVar[tuple[MetricDisplay, ...]] = (
        MetricDisplay("rewards_accuracy", label="reward accuracy (chosen > rejected)", console="acc", format=".3f"),
        MetricDisplay("rewards_margin", label="reward margin (chosen - rejected)", console="margin", format=".3g"),
        MetricDisplay("rewards_chosen", label="chosen reward", console="chosen", format=".3g"),
        MetricDisplay("rewards_rejected", label="rejected reward", console="rejected", format=".3g"),
        MetricDisplay("val_rewards_accuracy", label="held-out reward accuracy", console="val acc", format=".3f"),
        MetricDisplay("val_rewards_margin", label="held-out reward margin", console="val margin", format=".3g"))
    # set by the run (preference/trainer.py): the CP group a pair's tokens are spread over, and what
    # attaches the reference's log-probabilities to a step's microbatches
    cp_group: Any = None
    reference: Any = None

    @classmethod
    def from_recipe(cls, config: RecipeConfig) -> "DPOObjective":
        d = config.dpo
        return cls(loss_type=d.loss, beta=d.beta, label_smoothing=d.label_smoothing, rpo_alpha=d.rpo_alpha,
                   simpo_gamma=d.simpo_gamma, aux_loss_coeff=config.moe.aux_loss_coeff,
                   z_loss_coeff=config.moe.z_loss_coeff)

    @property
    def needs_reference(self) -> bool:
        return self.loss_type not in REFERENCE_FREE

    def __getstate__(self) -> dict[str, Any]:  # travels to spawned workers without its run-time parts
        return {**self.__dict__, "cp_group": None, "reference": None}

    # -- before the schedule ---------------------------------------------------------------------
    def prepare_step(self, microbatches: Iterator[Microbatch], context: StepContext) -> Iterator[Microbatch]:
        """The reference's log-probabilities (when the loss has a reference), and RPO's factor, on every
        microbatch of the step."""
        mbs = list(microbatches)
        if self.needs_reference:
            if self.reference is None:
                raise RuntimeError("DPOObjective.reference is not set: the preference Trainer binds it")
            self.reference.attach(mbs, context)
        if self.rpo_alpha > 0:
            self.attach_rpo_weight(mbs, context.state)
        return iter(mbs)

    def attach_rpo_weight(self, mbs: list[Microbatch], state: Any) -> None:
        """extras[rpo_weight]: the step's pairs / its chosen trained tokens, counted over the data-parallel ranks."""
        device = mbs[0].labels.device if mbs else torch.device("cpu")
        counts = torch.zeros(2, dtype=torch.float64, device=device)
        for mb in mbs:
            counts[0] += mb.extras[PAIR_FIRST].sum()
            counts[1] += ((mb.extras[PAIR_SIDE] >= 0) & (mb.extras[PAIR_SIDE] % 2 == 0)).sum()
        if getattr(state, "distributed", False):
            dist.all_reduce(counts, group=state.dp_group)
        factor = (counts[0] / counts[1].clamp(min=1)).float()
        for mb in mbs:
            mb.extras[RPO_WEIGHT] = factor.expand(mb.labels.shape)

    # -- one microbatch --------------------------------------------------------------------------
    def pair_sums(self, microbatch: Microbatch, logp: torch.Tensor) -> PairSums:
        """The microbatch's per-pair sums (CP-reduced), from the policy's per-position log-probs."""
        side, labels = microbatch.extras[PAIR_SIDE], microbatch.labels
        cp = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        sides = 2 * (labels.shape[1] * cp // 2 + 1)  # a side has >= 1 trained token and a document >= 2 tokens
        trained = (labels != IGNORE_INDEX).float()
        ref = microbatch.extras.get(REF_LOGP)
        policy = side_sums(logp, side, sides)
        fixed = torch.stack([side_sums(trained, side, sides),
                             side_sums(ref.float() if ref is not None else torch.zeros_like(logp), side, sides),
                             side_sums(microbatch.extras[PAIR_FIRST].float(), side, sides)])
        if cp > 1:
            policy = _SumOverGroup.apply(policy, self.cp_group)
            shared = fixed[:2].contiguous()  # token counts and reference sums: whole-pair values on every rank
            dist.all_reduce(shared, group=self.cp_group)
            counts, refs, owned = shared[0], shared[1], fixed[2]
        else:
            counts, refs, owned = fixed
        return PairSums(policy[:, 0::2], policy[:, 1::2], refs[:, 0::2], refs[:, 1::2], counts[:, 0::2],
                        counts[:, 1::2], owned[:, 0::2])

    def pair_losses(self, s: PairSums) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, chosen reward, rejected reward) of every pair slot [rows, pairs]."""
        beta, e = self.beta, self.label_smoothing
        n_c, n_r = s.n_chosen.clamp(min=1.0), s.n_rejected.clamp(min=1.0)
        if self.loss_type == "simpo":
            avg_c, avg_r = s.chosen / n_c, s.rejected / n_r
            m = avg_c - avg_r - self.simpo_gamma / beta
            loss = -(1 - e) * F.logsigmoid(beta * m) - e * F.logsigmoid(-beta * m)
            return loss, beta * avg_c.detach(), beta * avg_r.detach()
        lr_c, lr_r = s.chosen - s.ref_chosen, s.rejected - s.ref_rejected
        d = lr_c - lr_r
        if self.loss_type == "sigmoid":
            loss = -F.logsigmoid(beta * d)
        elif self.loss_type == "hinge":
            loss = torch.relu(1 - beta * d)
        elif self.loss_type == "ipo":
            loss = (lr_c / n_c - lr_r / n_r - 1 / (2 * beta)) ** 2
        else:  # robust
            loss = (-(1 - e) * F.logsigmoid(beta * d) + e * F.logsigmoid(-beta * d)) / (1 - 2 * e)
        return loss, beta * lr_c.detach(), beta * lr_r.detach()

    def loss(self, microbatch: Microbatch, config: Any, output: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        labels = microbatch.labels
        logp = token_log_probs(output, labels)
        s = self.pair_sums(microbatch, logp)
        per_pair, chosen_reward, rejected_reward = self.pair_losses(s)
        owned = s.owned
        pairs = owned.sum()
        objective = (per_pair * owned).sum()
        logs: dict[str, Any] = {
            "pref_loss_sum": objective.detach(), "trained_tokens": (labels != IGNORE_INDEX).sum(),
            "chosen_reward_sum": (chosen_reward * owned).sum(), "rejected_reward_sum": (rejected_reward * owned).sum(),
            "correct_sum": ((chosen_reward > rejected_reward).float() * owned).sum(),
            "chosen_logp_sum": (s.chosen.detach() * owned).sum(), "rejected_logp_sum": (s.rejected.detach() * owned).sum()}
        if self.rpo_alpha > 0:
            chosen_side = (microbatch.extras[PAIR_SIDE] >= 0) & (microbatch.extras[PAIR_SIDE] % 2 == 0)
            nll = -(logp * chosen_side).sum()
            logs.update(nll_sum=nll.detach(), chosen_tokens=chosen_side.sum())
            # rpo_weight = the step's pairs / its chosen tokens: divided by the pairs, a token mean
            objective = objective + self.rpo_alpha * nll * microbatch.extras[RPO_WEIGHT].reshape(-1)[0]
        cp = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        loss_sum = objective + router_losses(output, pairs.detach() / cp if cp > 1 else pairs.detach(),
                                             self.aux_loss_coeff, self.z_loss_coeff, logs)
        return loss_sum, pairs, logs

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        pairs = sums["num_tokens"]

        def per(name: str, by: float) -> float:
            return sums[name] / by if by else float("nan")

        out = {"loss": per("pref_loss_sum", pairs), "tokens": sums["trained_tokens"], "pairs": pairs,
               "rewards_chosen": per("chosen_reward_sum", pairs), "rewards_rejected": per("rejected_reward_sum", pairs),
               "rewards_accuracy": per("correct_sum", pairs),
               "rewards_margin": per("chosen_reward_sum", pairs) - per("rejected_reward_sum", pairs),
               "logps_chosen": per("chosen_logp_sum", pairs), "logps_rejected": per("rejected_logp_sum", pairs)}
        if self.rpo_alpha > 0:
            out["nll"] = per("nll_sum", sums["chosen_tokens"])
            out["loss"] = out["loss"] + self.rpo_alpha * out["nll"]
        for name, coeff in (("aux_loss", self.aux_loss_coeff), ("z_loss", self.z_loss_coeff)):
            if coeff > 0:
                out[name] = per(f"{name}_sum", pairs)
        return out


__all__ = ["DPOObjective", "PairSums", "side_sums", "REF_LOGP", "RPO_WEIGHT", "REFERENCE_FREE"]
