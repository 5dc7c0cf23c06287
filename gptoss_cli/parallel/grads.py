"""Gradient buffers that accumulate over microbatches, and `finalize_model_grads`.

Each parameter gets an fp32 `main_grad` view into one flat buffer per reduction group (dense
parameters: the data-parallel group = world; experts: the expert-data-parallel group). A
post-accumulate-grad hook adds every backward's `.grad` into `main_grad` and frees `.grad`, so the
buffers hold the sum over all microbatches of the step whatever the parameter dtype.

`finalize_model_grads` runs once per step after the last microbatch (the schedule calls it through
the model's own config, see `get_model_config`): it all-reduces the dense buffer over DP and the
expert buffer over expert-DP, then divides by the number of tokens in the global batch, the
per-token normalisation of `gpt-oss-reference.md` section 5.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from gptoss_cli.parallel.state import ParallelState, all_reduce


def is_expert_param(name: str, param: nn.Parameter | None = None) -> bool:
    """Expert weights are split over EP and reduced over expert-DP; everything else is dense."""
    if param is not None and getattr(param, "is_expert", None) is not None:
        return bool(param.is_expert)
    return ".mlp.experts." in f".{name}"


class GradBuffer:
    """One flat fp32 buffer whose slices are the `main_grad` of a list of parameters."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], device: torch.device):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        total = sum(p.numel() for p in self.params)
        self.data = torch.zeros(total, dtype=torch.float32, device=device)
        self.offsets: list[tuple[int, int]] = []
        start = 0
        for p in self.params:
            self.offsets.append((start, start + p.numel()))
            p.main_grad = self.data[start : start + p.numel()].view(p.shape)
            start += p.numel()

    def zero(self) -> None:
        self.data.zero_()


class GradBuffers:
    """The dense and expert gradient buffers of one model, with accumulation hooks installed."""

    def __init__(self, module: nn.Module, device: torch.device):
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.dense = GradBuffer([(n, p) for n, p in named if not is_expert_param(n, p)], device)
        self.expert = GradBuffer([(n, p) for n, p in named if is_expert_param(n, p)], device)
        self._hooks = [p.register_post_accumulate_grad_hook(_accumulate) for _, p in named]

    def zero(self) -> None:
        self.dense.zero()
        self.expert.zero()

    def buffers(self) -> Iterable[GradBuffer]:
        return (self.dense, self.expert)


def _accumulate(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


class GradAccumulatingModel(nn.Module):
    """Wrapper (like Megatron's DDP) that owns the gradient buffers of the model it wraps.

    It has no `config` attribute of its own: `get_model_config` unwraps it to the model's.
    """

    def __init__(self, module: nn.Module, state: ParallelState):
        super().__init__()
        self.module = module
        self.parallel_state = state
        self.grad_buffers = GradBuffers(module, state.device)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self) -> None:
        self.grad_buffers.zero()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Microbatches inside accumulate locally; here every reduction waits for finalize_model_grads
        anyway, so this only marks the scope (the seam for overlapped bucket reduction)."""
        yield


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
    """Reduce dense grads over DP and expert grads over expert-DP; divide by the global token count."""
    ps = parallel_state
    for chunk in model_chunks:
        buffers: GradBuffers = chunk.grad_buffers
        all_reduce(buffers.dense.data, ps.dp_group)
        all_reduce(buffers.expert.data, ps.expert_dp_group)
    if num_tokens is not None:
        total = num_tokens.detach().to(device=ps.device, dtype=torch.float32).clone()
        all_reduce(total, ps.dp_group)
        if total.item() > 0:
            for chunk in model_chunks:
                for buf in chunk.grad_buffers.buffers():
                    buf.data.div_(total)


__all__ = [
    "GradBuffer", "GradBuffers", "GradAccumulatingModel", "finalize_model_grads", "get_model_config",
    "get_attr_wrapped_model", "unwrap_model", "is_expert_param",
]
