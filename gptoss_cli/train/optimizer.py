"""AdamW with fp32 master weights, optimizer state sharded over data parallel, global-norm clipping,
and the warmup + cosine learning-rate schedule.

Sharding: each reduction group (dense parameters over DP = world, experts over expert-DP) splits
its ordered parameter list into contiguous runs of whole parameters balanced by size; a rank keeps
fp32 master copies and AdamW state (torch.optim.AdamW) only for the run it owns, steps them, and
broadcasts its updated parameters to the group. Our own sharding rather than
torch's ZeroRedundancyOptimizer, because ZeRO keeps no fp32 master copy of bf16 parameters and
cannot shard expert parameters over a different group than dense ones. Whole-parameter ownership
also makes the saved state layout-free: state is saved per parameter name, so a checkpoint
written at one DP/EP layout loads at another.

The gradient norm is the true global norm: dense parameters once (they are reduced over DP) and
every expert once, not once per EP replica (`gpt-oss-reference.md` section 7).

Weight decay follows what a parameter is, read from its name (`decays`), never its shape
(docs/megatron-rules.md, "Weight decay").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gptoss_cli.errors import TrainingError
from gptoss_cli.parallel.grads import GradAccumulatingModel, GradBuffer
from gptoss_cli.recipe.schema import OptimizerConfig
from gptoss_cli.parallel.state import ParallelState, all_reduce, broadcast, group_size


_BIAS = re.compile(r"bias\d*")  # `bias`, or `bias{e}` in per-expert checkpoint names


def decays(name: str) -> bool:
    """Whether AdamW's weight decay applies to the parameter called `name` in the model
    (a `named_parameters()` name or a checkpoint name; docs/megatron-rules.md, "Weight decay").

    No decay, by meaning: every bias (`*.bias`: attention, dense MLP, the router's, and the
    stacked expert biases `[E_local, out]`, which are biases although 2-D; `bias{e}` per expert),
    every norm weight (`*.layer_norm_weight`, the `weight` of any module named `*norm`:
    `pre_mlp_layernorm`, `final_norm`) and the attention sinks (`*.softmax_offset`). Everything
    else decays: projections, expert matrices, the router weight, the embedding, the output layer.
    Megatron's rule, `name.endswith(".bias") or param.dim() == 1`, selects the same set for the
    Hybrid model's per-expert 1-D biases; deciding by shape instead would decay our stacked ones.
    """
    owner, _, leaf = name.rpartition(".")
    if _BIAS.fullmatch(leaf) or leaf in ("layer_norm_weight", "softmax_offset"):
        return False
    return not (leaf == "weight" and owner.rpartition(".")[2].endswith("norm"))


def partition_contiguous(sizes: list[int], parts: int) -> list[int]:
    """Owner index of each item: contiguous runs with balanced total size (greedy by prefix sum)."""
    total = sum(sizes)
    owners, acc = [], 0
    for s in sizes:
        # Assign by the midpoint of the item so that runs split near total*k/parts.
        mid = acc + s / 2
        owners.append(min(parts - 1, int(mid * parts / total)) if total else 0)
        acc += s
    return owners


@dataclass
class _ShardedGroup:
    buffer: GradBuffer
    group: Any  # process group the parameters are replicated over (None = not sharded)
    size: int
    rank: int
    owners: list[int]

    def owned(self) -> list[int]:
        return [i for i, o in enumerate(self.owners) if o == self.rank]


class DistributedAdamW:
    """AdamW over the model's gradient buffers; state sharded over DP when `distributed`."""

    def __init__(
        self,
        model: GradAccumulatingModel,
        state: ParallelState,
        config: OptimizerConfig,
        *,
        lr: float,
    ):
        """`config`: the recipe's optimizer section (weight decay, betas, eps, clip, sharding); `lr`:
        the initial learning rate (each `step(lr)` sets the current one)."""
        self.state = state
        self.clip_grad = config.clip_grad
        self.distributed = distributed = config.use_distributed_optimizer
        weight_decay, betas, eps = config.weight_decay, (config.adam_beta1, config.adam_beta2), config.adam_eps
        self.groups: list[_ShardedGroup] = []
        self.master: dict[str, nn.Parameter] = {}  # owned parameter name -> fp32 master
        self._param_of: dict[str, nn.Parameter] = {}
        self._module = model.module
        decay, no_decay = [], []
        for buf, pg in ((model.grad_buffers.dense, state.dp_group), (model.grad_buffers.expert, state.expert_dp_group)):
            size = group_size(pg) if distributed else 1
            rank = dist.get_rank(pg) if (distributed and pg is not None) else 0
            owners = partition_contiguous([p.numel() for p in buf.params], size)
            g = _ShardedGroup(buf, pg if distributed else None, size, rank, owners)
            self.groups.append(g)
            for i in g.owned():
                name, p = buf.names[i], buf.params[i]
                m = nn.Parameter(p.detach().to(torch.float32).clone())
                m.grad = p.main_grad  # fp32 view into the gradient buffer
                self.master[name] = m
                self._param_of[name] = p
                (decay if decays(name) else no_decay).append(m)
        param_groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        param_groups = [g for g in param_groups if g["params"]]
        self.inner = (
            torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, foreach=False) if param_groups else None
        )
        # Create AdamW's state now (it would be created lazily) so checkpoints can load into it in place.
        if self.inner is not None:
            for m in self.master.values():
                self.inner.state[m] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format),
                }

    # --- gradient norm and clipping ------------------------------------------------------
    def _owned_sq(self, g: _ShardedGroup) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float32, device=g.buffer.data.device)
        for i in g.owned():
            sq += g.buffer.params[i].main_grad.float().pow(2).sum()
        return sq

    def grad_norm(self) -> float:
        """sqrt(sum of squares) with every dense parameter and every expert counted exactly once."""
        dense_g, expert_g = self.groups
        dense = self._owned_sq(dense_g)
        if dense_g.group is not None:
            all_reduce(dense, dense_g.group)  # sharded: each rank summed its own run
        expert = self._owned_sq(expert_g)
        if expert_g.group is not None:
            all_reduce(expert, expert_g.group)
        all_reduce(expert, self.state.ep_group)  # EP ranks hold different experts
        return math.sqrt(float(dense + expert))

    def step(self, lr: float) -> float:
        """Clip, step the owned masters, write them back into the parameters and share them; returns the grad norm."""
        norm = self.grad_norm()
        if not math.isfinite(norm):
            raise TrainingError(
                f"gradient norm is {norm}; stopping before the optimizer step (no checkpoint of this state)",
                hint="lower lr, enable clip_grad, or check the data for bad tokens",
            )
        if self.clip_grad and self.clip_grad > 0:
            coef = self.clip_grad / (norm + 1e-6)
            if coef < 1.0:
                for m in self.master.values():
                    m.grad.mul_(coef)
        if self.inner is not None:
            for group in self.inner.param_groups:
                group["lr"] = lr
            self.inner.step()
        with torch.no_grad():
            for name, m in self.master.items():
                self._param_of[name].copy_(m)
            for g in self.groups:
                self._share(g)
        return norm

    def _share(self, g: _ShardedGroup) -> None:
        """Every owner broadcasts its updated parameters (one flat tensor) to the rest of the group."""
        if g.group is None or g.size == 1:
            return
        for owner in range(g.size):
            params = [g.buffer.params[i] for i, o in enumerate(g.owners) if o == owner]
            if not params:
                continue
            flat = _flatten_dense_tensors([p.data for p in params])
            broadcast(flat, owner, g.group)
            if owner != g.rank:
                for p, new in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
                    p.data.copy_(new)

    # --- checkpoint state (per parameter name, layout-free) ---------------------------------
    def _checkpoint_views(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(checkpoint name, view) pairs: stacked local experts split into one entry per GLOBAL expert
        id (as the model's state_dict names them), so the state does not depend on the EP layout."""
        owner_name, _, leaf = name.rpartition(".")
        owner = self._module.get_submodule(owner_name) if owner_name else self._module
        offset, n = getattr(owner, "expert_offset", None), getattr(owner, "num_local_experts", None)
        if offset is None or n is None or tensor.dim() == 0 or tensor.shape[0] != n:
            return [(name, tensor)]
        return [(f"{owner_name}.{leaf}{offset + i}", tensor[i]) for i in range(n)]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Owned parameters' fp32 master and AdamW state, keyed by checkpoint name (experts per global id)."""
        out: dict[str, torch.Tensor] = {}
        for name, m in self.master.items():
            st = self.inner.state[m]
            for kind, tensor in (("master", m.data), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"])):
                for key, view in self._checkpoint_views(name, tensor):
                    out[f"{key}.{kind}"] = view
            for key, _ in self._checkpoint_views(name, m.data):
                out[f"{key}.step"] = st["step"]
        return out

    def after_load(self) -> None:
        """Parameters follow the loaded masters (owners), then every group shares them."""
        with torch.no_grad():
            for name, m in self.master.items():
                self._param_of[name].copy_(m)
            for g in self.groups:
                self._share(g)


class WarmupCosineLR:
    """Megatron's schedule (docs/megatron-rules.md, "Learning-rate schedule"): linear warmup from 0
    to `lr` over `warmup_iters`, then cosine (or linear, or constant) decay to `min_lr` at `decay_iters`.

    `lr_at(s)` is the lr of the optimizer step that follows `s` completed steps, as Megatron's
    `OptimizerParamScheduler` computes it with `num_steps = s` (`lr_warmup_init` 0): the first step
    uses 0 when there is warmup (it only fills AdamW's moments), `lr` is reached at step
    `warmup_iters`, so a recipe gives the same lr column as Megatron at every iteration.
    """

    def __init__(self, lr: float, min_lr: float, warmup_iters: int, decay_iters: int, style: str = "cosine"):
        self.max_lr, self.min_lr = lr, min_lr
        self.warmup_iters, self.decay_iters = warmup_iters, max(decay_iters, 1)
        self.style = style

    def lr_at(self, step: int) -> float:
        """Learning rate for the 0-based optimizer step `step` (= steps completed before it)."""
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.max_lr * step / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        span = max(self.decay_iters - self.warmup_iters, 1)
        progress = min(max(step - self.warmup_iters, 0) / span, 1.0)
        if self.style == "linear":
            return self.min_lr + (self.max_lr - self.min_lr) * (1.0 - progress)
        return self.min_lr + (self.max_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def state_dict(self) -> dict[str, Any]:
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "warmup_iters": self.warmup_iters,
                "decay_iters": self.decay_iters, "style": self.style}


__all__ = ["DistributedAdamW", "WarmupCosineLR", "decays", "partition_contiguous"]
