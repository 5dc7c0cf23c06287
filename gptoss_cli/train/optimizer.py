"""AdamW with fp32 master weights sharded the way Megatron's distributed optimizer shards them,
global-norm clipping, and the warmup + cosine learning-rate schedule.

Sharding follows the gradient buffers (gptoss_cli/parallel/grads.py): every bucket is cut into
equal, contiguous shards, one per rank of its group (dense parameters: DP = world; experts:
expert-DP), that may cut through parameters. `finalize_model_grads` reduce-scatters a bucket, so
the rank holds the reduced gradient of its own shard; it keeps the fp32 master weights (with fp32
parameters, the parameter shard itself) and both Adam moments of exactly that shard as flat tensors, steps them with torch's fused AdamW kernel, writes
the updated shard into the parameter buffer and all-gathers the bucket: one collective per bucket
to share the update, whatever the world size. With `use_distributed_optimizer=false` each bucket
is one shard that every rank holds (gradients all-reduced, state replicated, nothing to gather).

Weight decay follows what each element's parameter is, read from its name (`decays`), never its
shape (docs/megatron-rules.md, "Weight decay"), also where a shard cuts a parameter: a shard is
stepped as runs of whole or partial parameters, one fused call for the decayed runs and one for
the others. `torch._fused_adamw_` on flat views rather than torch.optim.AdamW: the optimizer class
steps whole parameters, and constructing any torch.optim.Optimizer imports torch._dynamo (about
2 s in every training process).

The gradient norm is the true global norm: every dense parameter and every expert counted exactly
once, whether the state is sharded (one all-reduce of the shards' squares over the world: dense
shards partition the dense parameters, expert shards the experts) or replicated (dense locally,
experts summed over EP only), and with pipeline parallelism over every stage, never per stage.

The saved state is layout-free: `state_dict()` is keyed by parameter name (stacked experts split
per GLOBAL expert id), so a checkpoint written at one DP/EP layout and bucket size loads at
another. A rank that holds a whole parameter's state saves a plain tensor; a rank holding part of
one saves a torch ShardedTensor whose local shards are the boxes of that flat range (DCP writes
and reads them by their offsets, so any other cut of the same tensor can be loaded from them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from gptoss_cli import torch_private
from gptoss_cli.errors import ConfigError, TrainingError
from gptoss_cli.model.expert_names import PerExpertParams, parse_expert_name
from gptoss_cli.parallel.grads import Bucket, GradAccumulatingModel, GradBuffer
from gptoss_cli.parallel.state import ParallelState, all_gather, all_reduce, group_size
from gptoss_cli.recipe.schema import OptimizerConfig

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")


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
    per_expert = parse_expert_name(name)  # a checkpoint name `...bias{e}` decays as its stack `...bias`
    owner, _, leaf = (name if per_expert is None else per_expert.stack).rpartition(".")
    if leaf in ("bias", "layer_norm_weight", "softmax_offset"):
        return False
    return not (leaf == "weight" and owner.rpartition(".")[2].endswith("norm"))


def flat_range_boxes(lo: int, hi: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
    """The elements [lo, hi) of a row-major tensor of `shape` as boxes: (offsets, sizes, flat_lo,
    flat_hi) each, in order, covering the range exactly (at most 2 per dimension beyond the first)."""
    if hi <= lo:
        return []
    if len(shape) <= 1:
        return [((lo,) if shape else (), (hi - lo,) if shape else (), lo, hi)]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(lo, inner)
    r1, c1 = divmod(hi, inner)

    def rows(r: int, a: int, b: int) -> list:
        return [((r,) + o, (1,) + s, r * inner + fa, r * inner + fb) for o, s, fa, fb in flat_range_boxes(a, b, shape[1:])]

    if r0 == r1:
        return rows(r0, c0, c1)
    out = []
    if c0:
        out += rows(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:]), r0 * inner, r1 * inner))
    if c1:
        out += rows(r1, 0, c1)
    return out


@dataclass
class _DecayRun:
    """Elements [lo, hi) of the buffer (inside one shard) that belong to one parameter, or to
    neighbouring parameters that share the same weight-decay rule."""

    lo: int
    hi: int
    decays: bool


def _sum_of_squares(flat: torch.Tensor, row: int = 4096, divisor: torch.Tensor | None = None) -> torch.Tensor:
    """sum((flat / divisor)**2) in fp32 in one pass over the tensor, as accurate as `pow(2).sum()`.

    `pow(2).sum()` writes a temporary as large as the buffer (8% of a CPU step on 61M parameters);
    one `vector_norm` over tens of millions of elements accumulates with about 0.5% error on CPU.
    Norms of `row`-element rows, squared and summed pairwise, avoid both. The divisor (a token
    count finalize left pending) divides the row norms, so undivided sums never get squared."""
    n = flat.numel() // row * row
    norms = [torch.linalg.vector_norm(flat[:n].view(-1, row), dim=1)]
    if n < flat.numel():
        norms.append(torch.linalg.vector_norm(flat[n:]).view(1))
    norms = torch.cat(norms) if len(norms) > 1 else norms[0]
    if divisor is not None:
        norms = norms / divisor
    return norms.square().sum()


class _Shard:
    """This rank's shard of one bucket: fp32 master weights, both Adam moments, and its runs.

    With fp32 parameters the master IS the parameter buffer's shard (a view, no copy): a separate
    copy would hold the same values, cost a pass over the shard at every step to write it back, and
    the memory of a second set of weights. With bf16 parameters it is an fp32 copy."""

    def __init__(self, bucket: Bucket):
        self.bucket = bucket
        self.buffer: GradBuffer = bucket.buffer
        self.lo, self.hi = bucket.shard_bounds()
        shard = bucket.param_shard.detach()
        self.owns_master = shard.dtype != torch.float32
        self.master = shard.to(torch.float32, copy=True) if self.owns_master else shard
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.params: list[int] = []  # buffer indices of the parameters with elements in the shard
        runs: list[_DecayRun] = []
        for i in bucket.params:
            a, b = self.buffer.offsets[i]
            a, b = max(a, self.lo), min(b, self.hi)
            if a >= b:
                continue
            self.params.append(i)
            d = decays(self.buffer.names[i])
            if runs and runs[-1].hi == a and runs[-1].decays == d:
                runs[-1].hi = b
            else:
                runs.append(_DecayRun(a, b, d))
        self.runs = runs

    @property
    def grad(self) -> torch.Tensor:
        return self.bucket.grad_shard

    def local(self, flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Buffer elements [lo, hi) (inside the shard) of a shard-sized flat tensor."""
        return flat[lo - self.lo : hi - self.lo]


class DistributedAdamW:
    """AdamW over the model's gradient buffers; state sharded over each bucket's group when `distributed`."""

    def __init__(
        self,
        model: GradAccumulatingModel,
        state: ParallelState,
        config: OptimizerConfig,
        *,
        lr: float,
    ):
        """`config`: the recipe's optimizer section (weight decay, betas, eps, clip, sharding); `lr`:
        the initial learning rate (each `step(lr)` sets the current one). The shards are the gradient
        buffers' (`GradBufferConfig.use_distributed_optimizer`), which must agree with `config`."""
        self.state = state
        self.clip_grad = config.clip_grad
        self.distributed = config.use_distributed_optimizer
        self.lr = lr
        self.weight_decay, self.eps = config.weight_decay, config.adam_eps
        self.betas = (config.adam_beta1, config.adam_beta2)
        self._module = model.module
        buffers = model.grad_buffers
        for buf in buffers.buffers():
            if group_size(buf.group) > 1 and buf.sharded != self.distributed:
                raise ConfigError(
                    f"optimizer.use_distributed_optimizer={self.distributed} but the gradient buffers are "
                    f"{'sharded' if buf.sharded else 'replicated'}",
                    hint="build the model wrapper and the optimizer from the same optimizer config "
                         "(gptoss_cli.train.setup.setup_model_and_optimizer)",
                )
        self.shards = [_Shard(b) for b in buffers.dense.buckets] + [_Shard(b) for b in buffers.expert.buckets]
        # The fused step divides each gradient by the global token count as it reads it and writes
        # the divided gradient back, so finalize leaves that division to it instead of a pass of
        # its own over the buffers (parallel/grads.py). bf16 gradient buffers are stepped from an
        # fp32 copy: their division stays in finalize.
        self._buffers = list(buffers.buffers())
        if all(buf.data.dtype == torch.float32 for buf in self._buffers):
            for buf in self._buffers:
                buf.defer_division = True
        self._dense_shards = len(buffers.dense.buckets)
        # One step count for every element (all are stepped together), on the parameters' device
        # as the fused kernel requires.
        self._step = torch.zeros((), dtype=torch.float32, device=buffers.dense.data.device)

    # --- gradient norm and clipping ------------------------------------------------------
    def _pending_divisor(self) -> torch.Tensor | None:
        """The token count finalize left for the step to divide by (the same for every buffer), or
        None; buffers in any other state are divided here, at once."""
        pending = [buf.pending_divisor for buf in self._buffers]
        if pending and all(d is pending[0] for d in pending):
            return pending[0]
        for buf in self._buffers:
            buf.divide_pending()
        return None

    def grad_norm(self) -> float:
        """sqrt(sum of squares) with every dense parameter and every expert counted exactly once, of
        the per-token mean gradient (a division finalize left pending applies to the row norms)."""
        divisor = self._pending_divisor()
        dense = torch.zeros((), dtype=torch.float32, device=self._step.device)
        expert = torch.zeros_like(dense)
        for k, s in enumerate(self.shards):
            sq = _sum_of_squares(s.grad.float(), divisor=divisor)  # padding is zero; bf16 grads summed in fp32
            (dense if k < self._dense_shards else expert).add_(sq)
        if self.distributed:
            # Dense shards partition each stage's dense parameters over its ranks; expert shards
            # partition each EP rank's experts over its expert-DP group: one sum over every rank
            # (every pipeline stage) counts each once.
            dense.add_(expert)
            all_reduce(dense, self.state.global_group)
        else:
            all_reduce(expert, self.state.ep_group)  # replicas hold the same values; EP ranks other experts
            dense.add_(expert)
            all_reduce(dense, self.state.pp_group)  # the other pipeline stages' parameters (None: PP = 1)
        return math.sqrt(float(dense))

    def step(self, lr: float) -> float:
        """Clip, step the owned master shards, write them into the parameters and all-gather every
        bucket; returns the gradient norm before clipping."""
        norm = self.grad_norm()
        if not math.isfinite(norm):
            raise TrainingError(
                f"gradient norm is {norm}; stopping before the optimizer step (no checkpoint of this state)",
                hint="lower lr, enable clip_grad, or check the data for bad tokens",
            )
        # The fused kernel divides each gradient by `unscale` as it reads it and writes the divided
        # gradient back: the token division finalize left pending and the clip, without a pass of
        # their own over the buffers.
        unscale = self._pending_divisor()
        if self.clip_grad and self.clip_grad > 0:
            coef = self.clip_grad / (norm + 1e-6)
            if coef < 1.0:
                clip = torch.full((), 1.0 / coef, dtype=torch.float32, device=self._step.device)
                unscale = clip if unscale is None else unscale * clip
        self.lr = lr
        self._adamw(lr, unscale)
        for buf in self._buffers:
            buf.pending_divisor = None  # main_grad now holds the per-token mean (clipped)
        self._share()
        return norm

    def _adamw(self, lr: float, unscale: torch.Tensor | None = None) -> None:
        """One fused AdamW update of every run; gradients are divided by `unscale` first (the token
        count and the clip)."""
        self._step.add_(1)  # torch's AdamW counts the step before its update, too
        groups: dict[bool, list[list[torch.Tensor]]] = {True: [[], [], [], []], False: [[], [], [], []]}
        for s in self.shards:
            # bf16 gradient buffers (optimizer.grad_reduce_in_fp32=false): the fused step takes fp32
            flats = (s.master, s.grad if s.grad.dtype == torch.float32 else s.grad.float(), s.exp_avg, s.exp_avg_sq)
            for run in s.runs:
                for out, flat in zip(groups[run.decays and self.weight_decay != 0.0], flats):
                    out.append(s.local(flat, run.lo, run.hi))
        for decayed, (params, grads, exp_avgs, exp_avg_sqs) in groups.items():
            if params:
                torch_private.fused_adamw_(
                    params, grads, exp_avgs, exp_avg_sqs, [], [self._step] * len(params), lr=lr,
                    beta1=self.betas[0], beta2=self.betas[1], weight_decay=self.weight_decay if decayed else 0.0,
                    eps=self.eps, amsgrad=False, maximize=False, grad_scale=unscale,
                )

    def _share(self) -> None:
        """Masters -> this rank's shard of the parameter buffer -> one all-gather per sharded bucket."""
        with torch.no_grad():
            for s in self.shards:
                if s.owns_master:  # else the master is the parameter shard itself
                    s.bucket.param_shard.copy_(s.master)
            works = [all_gather(s.bucket.param_data, s.bucket.param_shard, s.buffer.group, async_op=True)
                     for s in self.shards if s.buffer.sharded]
            for w in works:
                w.wait()

    # --- inspection -----------------------------------------------------------------------
    def owned(self) -> dict[str, tuple[int, int]]:
        """Checkpoint name (experts per global id) -> [lo, hi) of its flattened elements this rank steps."""
        return {key: (lo - base, hi - base) for key, _, _, base, lo, hi in self._entries()}

    # --- checkpoint state (per parameter name, layout-free) ---------------------------------
    def _checkpoint_views(self, name: str, param: torch.Tensor) -> list[tuple[str, tuple[int, ...], int]]:
        """(checkpoint name, shape, first element in the flattened parameter): stacked local experts
        split into one entry per GLOBAL expert id (as the model's state_dict names them), so the
        state does not depend on the EP layout."""
        owner_name = name.rpartition(".")[0]
        owner = self._module.get_submodule(owner_name) if owner_name else self._module
        shape = tuple(param.shape)
        if not isinstance(owner, PerExpertParams):
            return [(name, shape, 0)]
        per = math.prod(shape[1:])
        return [(key, shape[1:], i * per) for i, key in enumerate(owner.expert_names(name))]

    def _entries(self) -> Iterator[tuple[str, _Shard, tuple[int, ...], int, int, int]]:
        """(checkpoint name, shard, shape, buffer offset of the entry, held [lo, hi) in buffer coordinates)."""
        for s in self.shards:
            for i in s.params:
                start = s.buffer.offsets[i][0]
                for key, shape, first in self._checkpoint_views(s.buffer.names[i], s.buffer.params[i]):
                    base = start + first
                    lo, hi = max(base, s.lo), min(base + math.prod(shape), s.hi)
                    if lo < hi:
                        yield key, s, shape, base, lo, hi

    def state_dict(self) -> dict[str, Any]:
        """fp32 master and AdamW state of the elements this rank steps, keyed by checkpoint name
        (experts per global id); views into the optimizer's own tensors, so DCP loads in place."""
        out: dict[str, Any] = {}
        for key, s, shape, base, lo, hi in self._entries():
            whole = lo == base and hi == base + math.prod(shape)
            for kind, flat in zip(STATE_KINDS, (s.master, s.exp_avg, s.exp_avg_sq)):
                local = s.local(flat, lo, hi)
                out[f"{key}.{kind}"] = local.view(shape) if whole else self._sharded(s, local, shape, base, lo)
            out[f"{key}.step"] = self._step
        return out

    def _sharded(self, s: _Shard, local: torch.Tensor, shape: tuple[int, ...], base: int, lo: int) -> Any:
        """A ShardedTensor of `shape` whose local shards are this rank's boxes of `local` (elements
        [lo, lo + local.numel()) of the buffer); the global metadata lists every rank's boxes."""
        st = torch_private.sharded_tensor_api()
        numel = math.prod(shape)
        metadata, shards = [], []
        for r in range(s.buffer.shards):
            r_lo, r_hi = s.bucket.shard_bounds(r)
            a, b = max(r_lo, base) - base, min(r_hi, base + numel) - base
            placement = f"rank:{dist.get_global_rank(s.buffer.group, r)}/{local.device}"
            for offsets, sizes, fa, fb in flat_range_boxes(a, b, shape):
                md = st.ShardMetadata(shard_offsets=list(offsets), shard_sizes=list(sizes), placement=placement)
                metadata.append(md)
                if r == s.buffer.shard_rank:
                    start = base + fa - lo
                    shards.append(st.Shard(local[start : start + fb - fa].view(sizes), md))
        props = st.TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                                    memory_format=torch.contiguous_format, pin_memory=False)
        return st.from_local_shards(shards, st.ShardedTensorMetadata(metadata, torch.Size(shape), props))

    def after_load(self) -> None:
        """Parameters follow the loaded masters: every rank writes its shard, every bucket is gathered."""
        self._share()


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

    @classmethod
    def from_training(cls, t: Any) -> "WarmupCosineLR":
        """The schedule of a recipe's `training` section (lr_decay_iters null: decay over train_iters)."""
        return cls(t.lr, t.min_lr, t.warmup_iters, t.lr_decay_iters or t.train_iters, t.lr_decay_style)

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

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "WarmupCosineLR":
        return cls(state["max_lr"], state["min_lr"], state["warmup_iters"], state["decay_iters"], state["style"])


__all__ = ["DistributedAdamW", "WarmupCosineLR", "decays", "flat_range_boxes", "STATE_KINDS"]
