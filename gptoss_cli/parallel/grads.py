"""Bucketed gradient (and parameter) buffers that accumulate over microbatches, and `finalize_model_grads`.

Megatron's layout (`_ParamAndGradBuffer`, docs/megatron-rules.md, "Gradient finalisation"): each
reduction group has one flat fp32 gradient buffer and one flat parameter buffer of the same
layout (dense parameters: the data-parallel group = world; experts: the expert-data-parallel
group). Every parameter's `.data` becomes a view into the parameter buffer and its `main_grad` a
view into the gradient buffer. A post-accumulate-grad hook adds every backward's `.grad` into
`main_grad` and frees `.grad`, so the buffers hold the sum over all microbatches of the step
whatever the parameter dtype. The experts', the output layer's and the embedding's backward add
their weight gradients into `main_grad` themselves where both are fp32
(gptoss_cli/model/gemm/main_grad.py), and the hook skips their add.

Buffers are split into *buckets* of whole parameters (in reverse order of `named_parameters`, so
buckets fill in the order backward produces gradients), each padded to a multiple of
`ALIGN x shards`. With the distributed optimizer a bucket is cut into `shards` (the group size)
contiguous, equal shards that may cut through parameters: rank r of the group owns shard r. A
bucket is reduced with one collective over its group: a reduce-scatter (sharded: after it, only
the rank's own shard of the bucket holds the reduced gradient) or an all-reduce (replicated).
With `overlap_grad_reduce` a bucket's collective starts as soon as the last microbatch's
backward has produced all its gradients (the accumulation hook counts them), and
`finalize_model_grads` waits for it. Gradients the delayed-wgrad queue adds straight into
`main_grad` fire no hook: their buckets start in `finalize_model_grads`.

`finalize_model_grads` runs once per step after the last microbatch (the schedule calls it through
the model's own config, see `get_model_config`): it finishes every bucket's reduction, then
divides the reduced gradients by the number of tokens in the global batch (docs/megatron-rules.md,
"Gradient finalisation"). The division is a pass over every gradient of its own, unless the
optimizer takes it over (`GradBuffer.defer_division`, set by DistributedAdamW on fp32 buffers):
then finalize only records the count (`pending_divisor`), the optimizer's fused step divides each
gradient as it reads it and writes the divided gradient back, so after the step main_grad holds
the per-token mean either way. Anything that reads main_grad between finalize and the optimizer
step divides by `pending_divisor` itself (or calls `divide_pending()`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from gptoss_cli.buckets import ALIGN, default_bucket_size
from gptoss_cli.errors import ConfigError, TrainingError
from gptoss_cli.model.expert_names import is_expert_name
from gptoss_cli.model.gemm.main_grad import add_cast_, take_added
from gptoss_cli.parallel.state import ParallelState, all_reduce, group_rank, group_size, reduce_scatter


@dataclass(frozen=True)
class GradBufferConfig:
    """How gradients are reduced (the part of Megatron's DistributedDataParallelConfig gptoss uses)."""

    use_distributed_optimizer: bool = False  # shard every bucket over its group (reduce-scatter)
    overlap_grad_reduce: bool = False  # start a bucket's reduction during the last backward
    bucket_size: int | None = None  # elements per bucket; None = default_bucket_size(DP)
    # main_grad (accumulation and reduction) in fp32; False: in the parameters' dtype (Megatron's
    # grad_reduce_in_fp32=False), half the buffer for bf16 at the cost of bf16 sums
    grad_reduce_in_fp32: bool = True


def pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Bucket:
    """A contiguous range `[start, end)` of a buffer holding whole parameters, split into equal shards."""

    def __init__(self, buffer: "GradBuffer", index: int, start: int, end: int, params: list[int]):
        self.buffer, self.index, self.start, self.end, self.params = buffer, index, start, end, params
        self.grad = buffer.data[start:end]
        self.param_data = buffer.param_data[start:end]
        self.shard_size = (end - start) // buffer.shards
        self.handle: Any = None  # the reduction in flight
        self.ready: set[int] = set()  # params whose last-microbatch gradient has arrived (overlap)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_bounds(self, shard: int | None = None) -> tuple[int, int]:
        """[lo, hi) of shard `shard` (default: this rank's) in buffer coordinates."""
        r = self.buffer.shard_rank if shard is None else shard
        lo = self.start + r * self.shard_size
        return lo, lo + self.shard_size

    def local(self, t: torch.Tensor, shard: int | None = None) -> torch.Tensor:
        """The slice of a buffer-shaped flat tensor (`buffer.data`, `buffer.param_data`) that is shard `shard`."""
        lo, hi = self.shard_bounds(shard)
        return t[lo:hi]

    @property
    def grad_shard(self) -> torch.Tensor:
        return self.local(self.buffer.data)

    @property
    def param_shard(self) -> torch.Tensor:
        return self.local(self.buffer.param_data)


class GradBuffer:
    """One group's flat fp32 gradient buffer and parameter buffer, in buckets.

    `group`: the process group the parameters are replicated over (None: one process).
    `shard`: the distributed optimizer's layout, each bucket cut into group-size shards.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], device: torch.device, *, group: Any = None,
                 shard: bool = False, bucket_size: int | None = None, grad_in_fp32: bool = True):
        # Reverse order: the last layers' gradients arrive first in backward, so their bucket completes first.
        named_params = list(reversed(named_params))
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.group = group
        self.shards = group_size(group) if shard else 1
        self.shard_rank = group_rank(group) if shard else 0
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ConfigError(f"parameters of one gradient buffer have different dtypes {sorted(map(str, dtypes))}",
                              hint="train with one params_dtype")
        self.param_dtype = dtypes.pop() if dtypes else torch.float32
        bucket_size = bucket_size or default_bucket_size(group_size(group))
        multiple = ALIGN * self.shards
        self.offsets: list[tuple[int, int]] = []
        spans: list[tuple[int, int, list[int]]] = []  # (start, end, param indices) per bucket
        start = bucket_start = 0
        members: list[int] = []
        for i, p in enumerate(self.params):
            self.offsets.append((start, start + p.numel()))
            start += p.numel()
            members.append(i)
            if start - bucket_start >= bucket_size or i == len(self.params) - 1:
                end = bucket_start + pad(start - bucket_start, multiple)
                spans.append((bucket_start, end, members))
                start = bucket_start = end
                members = []
        self.numel = start
        self.data = torch.zeros(self.numel, dtype=torch.float32 if grad_in_fp32 else self.param_dtype, device=device)
        self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
        with torch.no_grad():
            for p, (lo, hi) in zip(self.params, self.offsets):
                view = self.param_data[lo:hi].view(p.shape)
                view.copy_(p.data)
                p.data = view  # the old storage is freed here, one parameter at a time
                p.main_grad = self.data[lo:hi].view(p.shape)
        self.buckets = [Bucket(self, b, lo, hi, members) for b, (lo, hi, members) in enumerate(spans)]
        self.bucket_of = {i: b for b in self.buckets for i in b.params}
        # The global token count the reduced gradients are still to be divided by (see the module's
        # docstring); None once divided. finalize leaves it pending when `defer_division` is set.
        self.pending_divisor: torch.Tensor | None = None
        self.defer_division = False

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    def zero(self) -> None:
        for b in self.buckets:
            if b.handle is not None:  # a step that failed after starting it: let it land first
                b.handle.wait()
                b.handle = None
            b.ready.clear()
        self.data.zero_()
        self.pending_divisor = None

    def divide_pending(self) -> None:
        """Divide the reduced gradients by the pending token count now (nothing when none is pending)."""
        if self.pending_divisor is not None:
            for grad in self.reduced_grads():
                grad.div_(self.pending_divisor)
            self.pending_divisor = None

    # --- reduction ---------------------------------------------------------------------------
    def start_grad_sync(self, bucket: Bucket) -> None:
        """Issue the bucket's reduction over the group (asynchronous): reduce-scatter into this
        rank's shard when sharded, else all-reduce."""
        if bucket.handle is not None or group_size(self.group) == 1:
            return
        if self.sharded:
            bucket.handle = reduce_scatter(bucket.grad_shard, bucket.grad, self.group, async_op=True)
        else:
            bucket.handle = dist.all_reduce(bucket.grad, group=self.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Start every bucket not yet started, then wait for all of them."""
        for b in self.buckets:
            self.start_grad_sync(b)
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
            b.ready.clear()

    def reduced_grads(self) -> Iterator[torch.Tensor]:
        """The parts of the buffer that hold reduced gradients on this rank (one per bucket)."""
        for b in self.buckets:
            yield b.grad_shard


class GradBuffers:
    """The dense and expert buffers of one model, with accumulation hooks installed."""

    def __init__(self, module: nn.Module, state: ParallelState, config: GradBufferConfig = GradBufferConfig()):
        self.config = config
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        shard = config.use_distributed_optimizer
        self.dense = GradBuffer([(n, p) for n, p in named if not is_expert_name(n)], state.device,
                                group=state.dp_group, shard=shard, bucket_size=config.bucket_size,
                                grad_in_fp32=config.grad_reduce_in_fp32)
        self.expert = GradBuffer([(n, p) for n, p in named if is_expert_name(n)], state.device,
                                 group=state.expert_dp_group, shard=shard, bucket_size=config.bucket_size,
                                 grad_in_fp32=config.grad_reduce_in_fp32)
        self.sync_enabled = True  # False inside no_sync: the microbatch is not the step's last
        self._where = {id(p): (buf, i) for buf in self.buffers() for i, p in enumerate(buf.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for _, p in named]

    def zero(self) -> None:
        self.dense.zero()
        self.expert.zero()

    def buffers(self) -> Iterable[GradBuffer]:
        return (self.dense, self.expert)

    def _accumulate(self, param: torch.Tensor) -> None:
        # A backward that added its gradient into main_grad itself hands autograd a stand-in
        # (gptoss_cli/model/gemm/main_grad.py): nothing left to add.
        if not take_added(param, param.grad):
            add_cast_(param.main_grad, param.grad)  # a bf16 gradient in blocks (no fresh fp32 copy of it)
        param.grad = None
        self.grad_ready(param)

    def grad_ready(self, param: torch.Tensor) -> None:
        """`param`'s gradient of this backward is in main_grad; with overlap_grad_reduce, in the
        step's last microbatch, start its bucket's reduction once every parameter of it is ready."""
        if not (self.config.overlap_grad_reduce and self.sync_enabled):
            return
        buf, i = self._where[id(param)]
        bucket = buf.bucket_of[i]
        if bucket.handle is not None:
            raise TrainingError(
                f"the gradient of {buf.names[i]} arrived after its bucket's reduction started "
                "(it is accumulated twice in the last microbatch's backward)",
                hint="set overlap.overlap_grad_reduce=false",
            )
        bucket.ready.add(i)
        if len(bucket.ready) == len(bucket.params):
            buf.start_grad_sync(bucket)

    def finish_grad_sync(self) -> None:
        for buf in self.buffers():
            buf.finish_grad_sync()


class GradAccumulatingModel(nn.Module):
    """Wrapper (like Megatron's DDP) that owns the gradient buffers of the model it wraps.

    It has no `config` attribute of its own: `get_model_config` unwraps it to the model's.
    """

    def __init__(self, module: nn.Module, state: ParallelState, config: GradBufferConfig = GradBufferConfig()):
        super().__init__()
        self.module = module
        self.parallel_state = state
        self.grad_buffers = GradBuffers(module, state, config)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self) -> None:
        self.grad_buffers.zero()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Microbatches inside accumulate locally; bucket reductions start (with overlap_grad_reduce)
        only in the backward of the microbatch after it, the step's last."""
        self.grad_buffers.sync_enabled = False
        try:
            yield
        finally:
            self.grad_buffers.sync_enabled = True


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip wrappers (ours, DDP, FSDP, compile) that keep the wrapped model in `.module`/`._orig_mod`."""
    while True:
        inner = _inner(model)
        if inner is None:
            return model
        model = inner


def _inner(model: Any) -> nn.Module | None:
    for attr in ("module", "_orig_mod"):
        inner = getattr(model, attr, None)
        if isinstance(inner, nn.Module):
            return inner
    return None


def get_attr_wrapped_model(model: nn.Module, attr: str) -> Any:
    """The first `attr` found walking from the outermost wrapper inwards (Megatron's lookup)."""
    m = model[0] if isinstance(model, (list, tuple)) else model
    while not hasattr(m, attr):
        inner = _inner(m)
        if inner is None:
            raise AttributeError(f"{type(m).__name__} and the models it wraps have no attribute {attr!r}")
        m = inner
    return getattr(m, attr)


def get_model_config(model: nn.Module | list[nn.Module]) -> Any:
    """The runtime config the schedule reads: the built model's own `config`, not the provider's."""
    return get_attr_wrapped_model(model, "config")


def finalize_model_grads(
    model_chunks: list[nn.Module], num_tokens: torch.Tensor | None = None, *, parallel_state: ParallelState
) -> None:
    """Reduce dense grads over DP and expert grads over expert-DP (one collective per bucket,
    reduce-scatter with the distributed optimizer); divide the reduced grads by the global token count,
    summed over every rank (or leave the division to the optimizer's step where it takes it over:
    `GradBuffer.defer_division`)."""
    ps = parallel_state
    for chunk in model_chunks:
        chunk.grad_buffers.finish_grad_sync()
    if num_tokens is not None:
        total = num_tokens.detach().to(device=ps.device, dtype=torch.float32).clone()
        # Over every rank: with pipeline parallelism only the last stage computes the loss, and every
        # stage must divide by the same global count (parallel/state.py, `global_group`).
        all_reduce(total, ps.global_group)
        # A step without tokens has zero gradients: dividing by 1 leaves them so, without reading
        # the count back to the host.
        total.clamp_(min=1.0)
        for chunk in model_chunks:
            for buf in chunk.grad_buffers.buffers():
                buf.pending_divisor = total
                if not buf.defer_division:
                    buf.divide_pending()


__all__ = [
    "ALIGN", "Bucket", "GradBuffer", "GradBufferConfig", "GradBuffers", "GradAccumulatingModel",
    "default_bucket_size", "finalize_model_grads", "get_model_config", "get_attr_wrapped_model", "unwrap_model",
]
