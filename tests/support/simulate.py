"""One rank of a recipe's DP x EP layout in one process: what it holds and which collectives one
training step makes, without the cluster (bench/scale.py prints it; tests/train/test_scale_simulation.py
checks it). Test and bench scaffolding, not part of the package: it uses torch's internal fake process group.

Runs for real: the model of this rank (its slice of the experts, built on the meta device, so 120B
costs no memory), the bucketed gradient and parameter buffers, the distributed optimizer's shards,
`finalize_model_grads`, `DistributedAdamW.step`, and the MoE token dispatcher's dispatch and
combine, forward and backward, on CPU tensors of the real size.

With pipeline parallelism the rank builds the model of its pipeline stages (the provider's
`stage_parts`: its layers, the embedding or the head when it holds them) over the (pp, dp, ep)
groups of gptoss_cli/parallel/state.py; the activations and gradients its stages send to and receive
from their neighbours (torch's point-to-point sends, not collectives) are added by hand per
microbatch, from the stage boundaries of the layout.

Simulated: the process group is torch's fake one (`torch.testing._internal.distributed.fake_pg`)
at the recipe's world size and EP size, so no rank talks to another. `CollectiveRecorder` notes
every collective the code issues (operation, group, bytes) and stands in for it: an all-to-all
returns what this rank sent, which is exactly what it receives when routing is balanced (every
expert gets the same number of tokens from every rank), the assumption of this simulation. Under
it every MoE layer and microbatch moves the same, so the dispatcher runs once, for one layer and
one microbatch, and counts for all of them. Reading a scalar of a meta tensor (the gradient norm)
gives 1.0. The training loop's own two small collectives (the loss all-reduce and the metrics
all-gather, gptoss_cli/train/loop.py and metrics.py) are added by hand.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import torch
import torch.distributed as dist

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.dtypes import torch_dtype
from gptoss_cli.model.pattern import MOE, HybridPattern
from gptoss_cli.recipe.schema import RecipeConfig

# ring algorithms: how much of a collective's buffer each rank sends
_WIRE = {"all_reduce": lambda g: 2 * (g - 1) / g, "reduce_scatter": lambda g: (g - 1) / g,
         "all_gather": lambda g: (g - 1) / g, "broadcast": lambda g: 1.0 if g > 1 else 0.0}


@dataclass(frozen=True)
class Collective:
    """One collective call: `payload_bytes` is the buffer it works on (the full bucket for a
    reduce-scatter or all-gather, the input for an all-to-all), `wire_bytes` what this rank sends
    (ring algorithms; for an all-to-all, the rows for the other ranks)."""

    op: str
    group: str
    group_size: int
    payload_bytes: int
    wire_bytes: float


@dataclass
class Phase:
    """The collectives of one part of the step, and how often that part runs per step."""

    name: str
    calls: list[Collective]
    per_step: int = 1


class _Done:
    """The work handle of a recorded collective: already complete."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class CollectiveRecorder:
    """Patches torch.distributed's collectives while active: each call is recorded (group named by
    `names`, id(group) -> name) and simulated as described in the module docstring."""

    OPS = ("all_reduce", "all_to_all_single", "reduce_scatter_single", "reduce_scatter_tensor",
           "all_gather_single", "all_gather_into_tensor", "broadcast")

    def __init__(self, names: dict[int, str]):
        self.names = names
        self.calls: list[Collective] = []
        self._saved: dict[str, Any] = {}

    def _group(self, group: Any) -> tuple[str, int]:
        group = group if group is not None else dist.group.WORLD
        return self.names.get(id(group), "world"), dist.get_world_size(group)

    def _note(self, op: str, group: Any, payload: int, wire: float | None = None) -> _Done:
        name, size = self._group(group)
        self.calls.append(Collective(op, name, size, payload, _WIRE[op](size) * payload if wire is None else wire))
        return _Done()

    def __enter__(self) -> "CollectiveRecorder":
        self._saved = {op: getattr(dist, op) for op in self.OPS if hasattr(dist, op)}

        def all_reduce(tensor, op=None, group=None, async_op=False):
            return self._note("all_reduce", group, _nbytes(tensor))

        def broadcast(tensor, src=0, group=None, async_op=False):
            return self._note("broadcast", group, _nbytes(tensor))

        def reduce_scatter(output, input, op=None, group=None, async_op=False):
            return self._note("reduce_scatter", group, _nbytes(input))

        def all_gather(output, input, group=None, async_op=False):
            return self._note("all_gather", group, _nbytes(output))

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                              async_op=False):
            name, size = self._group(group)
            row = _nbytes(input) // max(input.shape[0], 1) if input.dim() else _nbytes(input)
            sizes = input_split_sizes or [input.shape[0] // size] * size
            rank = dist.get_rank(group)
            if output.device.type != "meta" and output.shape == input.shape:
                with torch.no_grad():
                    output.copy_(input)  # balanced routing: every peer sends me what I send it
            self.calls.append(Collective("all_to_all", name, size, _nbytes(input),
                                         float(row * (sum(sizes) - sizes[rank]))))
            return _Done()

        patched = {"all_reduce": all_reduce, "broadcast": broadcast, "all_to_all_single": all_to_all_single,
                   "reduce_scatter_single": reduce_scatter, "reduce_scatter_tensor": reduce_scatter,
                   "all_gather_single": all_gather, "all_gather_into_tensor": all_gather}
        for op in self._saved:
            setattr(dist, op, patched[op])
        return self

    def __exit__(self, *exc: Any) -> None:
        for op, fn in self._saved.items():
            setattr(dist, op, fn)

    def take(self) -> list[Collective]:
        calls, self.calls = self.calls, []
        return calls


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _MetaScalars:
    """Reading a scalar from a meta tensor (the gradient norm) gives 1.0 instead of an error."""

    def __enter__(self) -> Any:
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
                    return 1.0
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        return self.mode.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """torch's fake process group as the default group of this process, for the duration."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise ConfigError("a process group is already initialised; simulate in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass
class RankSimulation:
    """What one rank holds and the collectives of one training step."""

    rank: int
    world_size: int
    ep_size: int
    expert_dp_size: int
    microbatches: int
    tokens_per_microbatch: int
    moe_layers: int
    memory: dict[str, int]  # params, grads, optimizer.master, optimizer.exp_avg, optimizer.exp_avg_sq (bytes)
    buckets: dict[str, int]  # dense / expert buckets
    bucket_numel: dict[str, list[int]]
    phases: list[Phase] = field(default_factory=list)
    pp_size: int = 1
    pp_rank: int = 0

    def collectives(self) -> list[tuple[str, Collective, int]]:
        """(phase, call, times per step) for every call."""
        return [(p.name, c, p.per_step) for p in self.phases for c in p.calls]

    def count(self, op: str | None = None, phase: str | None = None) -> int:
        """Collectives per step (of one op and/or phase)."""
        return sum(n for ph, c, n in self.collectives() if (op is None or c.op == op) and (phase is None or ph == phase))

    def wire_bytes(self, phase: str | None = None) -> float:
        return sum(c.wire_bytes * n for ph, c, n in self.collectives() if phase is None or ph == phase)


def balanced_routing(tokens: int, top_k: int, num_experts: int) -> torch.Tensor:
    """[tokens, top_k] expert ids: choice j of token t goes to expert (t*k + j) mod E, so every
    expert gets the same number of (token, choice) pairs when tokens*k is a multiple of E."""
    return (torch.arange(tokens * top_k) % num_experts).view(tokens, top_k)


def simulate_rank(cfg: RecipeConfig, arch: GptOssArch, pattern: HybridPattern, world_size: int,
                  rank: int = 0, *, device: str = "meta", lr: float | None = None) -> RankSimulation:
    """Rank `rank` of `cfg` at `world_size` (DP x EP): its state and one step's collectives."""
    from gptoss_cli.model.hybrid import HybridModel
    from gptoss_cli.parallel.grads import finalize_model_grads
    from gptoss_cli.parallel.state import all_gather, state_from_world
    from gptoss_cli.train.provider import ModelRuntimeConfig, dispatcher_factory, stage_parts
    from gptoss_cli.train.setup import wrap_model_and_optimizer

    ep, pp = cfg.parallelism.expert_model_parallel_size, cfg.parallelism.pipeline_model_parallel_size
    t = cfg.training
    dp = world_size // pp if world_size % pp == 0 else 0
    if not dp or dp % ep or (t.global_batch_size % (t.micro_batch_size * dp)):
        raise ConfigError(f"world size {world_size} does not fit PP={pp}, EP={ep} and global batch "
                          f"{t.global_batch_size} of microbatches of {t.micro_batch_size}")
    dtype = torch_dtype(cfg.precision.params_dtype)
    runtime = ModelRuntimeConfig.from_recipe(cfg, arch, pattern)
    with fake_world(world_size, rank):
        state = replace(state_from_world(ep, torch.device("cpu"), pp_size=pp), device=torch.device(device))
        names: dict[int, str] = {}
        groups = [("dp", state.dp_group), ("ep", state.ep_group), ("expert_dp", state.expert_dp_group)]
        if pp > 1:  # at PP = 1 the world is the dense data-parallel group
            groups += [("pp", state.pp_group), ("world", state.world_group)]
        for name, group in groups:
            names[id(group)] = f"{names[id(group)]}={name}" if id(group) in names else name  # one group, two roles
        offset, n_local = state.local_expert_range(arch.num_local_experts)
        dispatcher = dispatcher_factory(arch.num_local_experts, state)  # None when EP = 1
        layout = runtime.pipeline_layout()
        model = HybridModel(arch, pattern, expert_offset=offset, num_local_experts=n_local,
                            token_dispatcher_factory=dispatcher, device=device, dtype=dtype,
                            **stage_parts(layout, state.pp_rank))
        wrapped, optimizer = wrap_model_and_optimizer(model, state, cfg.optimizer, t.lr if lr is None else lr,
                                                      overlap_grad_reduce=cfg.overlap.overlap_grad_reduce)
        buffers = wrapped.grad_buffers
        memory = {
            "params": sum(_nbytes(b.param_data) for b in buffers.buffers()),
            "grads": sum(_nbytes(b.data) for b in buffers.buffers()),
            # fp32 parameters are their own master weights (train/optimizer.py, `_Shard`)
            "optimizer.master": sum(_nbytes(s.master) for s in optimizer.shards if s.owns_master),
            "optimizer.exp_avg": sum(_nbytes(s.exp_avg) for s in optimizer.shards),
            "optimizer.exp_avg_sq": sum(_nbytes(s.exp_avg_sq) for s in optimizer.shards),
        }
        microbatches = t.global_batch_size // (t.micro_batch_size * dp)
        tokens = t.micro_batch_size * t.seq_length
        moe_layers = sum(1 for j in model.held_layers() if pattern.layers[j] == MOE)
        sim = RankSimulation(
            rank=rank, world_size=world_size, ep_size=ep, expert_dp_size=dp // ep, pp_size=pp, pp_rank=state.pp_rank,
            microbatches=microbatches, tokens_per_microbatch=tokens, moe_layers=moe_layers, memory=memory,
            buckets={"dense": len(buffers.dense.buckets), "expert": len(buffers.expert.buckets)},
            bucket_numel={"dense": [b.numel for b in buffers.dense.buckets],
                          "expert": [b.numel for b in buffers.expert.buckets]},
        )
        with CollectiveRecorder(names) as rec:
            if dispatcher is not None and moe_layers:
                d = dispatcher(0, None)
                g = torch.Generator().manual_seed(0)
                hidden = torch.randn(tokens, arch.hidden_size, generator=g).to(dtype).requires_grad_()
                probs = torch.full((tokens, arch.num_experts_per_tok), 1.0 / arch.num_experts_per_tok, dtype=dtype)
                indices = balanced_routing(tokens, arch.num_experts_per_tok, arch.num_local_experts)
                expert_input, _, ctx = d.dispatch(hidden, probs, indices)
                d.combine(expert_input, ctx).sum().backward()
                sim.phases.append(Phase("dispatcher (per MoE layer and microbatch)", rec.take(),
                                        moe_layers * microbatches))
            if layout is not None:
                sim.phases.append(_pipeline_sends(layout, state.pp_rank, tokens * arch.hidden_size * dtype.itemsize,
                                                  microbatches))
            finalize_model_grads([wrapped], torch.tensor(float(tokens * microbatches)), parallel_state=state)
            sim.phases.append(Phase("finalize_model_grads", rec.take()))
            with _MetaScalars() if device == "meta" else contextlib.nullcontext():
                optimizer.step(optimizer.lr)
            sim.phases.append(Phase("optimizer step", rec.take()))
            # gptoss_cli/train/loop.py and metrics.py: the global loss (2 float64) and the metrics rows (3 float64 per rank)
            dist.all_reduce(torch.zeros(2, dtype=torch.float64), group=state.global_group)
            all_gather(torch.zeros(3 * world_size, dtype=torch.float64),
                       torch.zeros(3, dtype=torch.float64), state.global_group)
            sim.phases.append(Phase("training loop", rec.take()))
        return sim


def _pipeline_sends(layout: Any, pp_rank: int, activation_bytes: int, microbatches: int) -> Phase:
    """Per microbatch, what this rank's stages send to the next stage (activations) and to the previous
    one (their gradients), when that stage is on another rank; the router accumulator (2 E + 2 floats)
    is negligible and not counted."""
    calls = []
    for stage in layout.rank_stages(pp_rank):
        nxt = stage.index + 1 < layout.num_stages and layout.stages[stage.index + 1].rank != pp_rank
        prv = stage.index > 0 and layout.stages[stage.index - 1].rank != pp_rank
        calls += [Collective("send", "pp", 2, activation_bytes, float(activation_bytes))] * (int(nxt) + int(prv))
    return Phase("pipeline sends (per microbatch)", calls, microbatches)


__all__ = ["Collective", "CollectiveRecorder", "Phase", "RankSimulation", "balanced_routing", "fake_world",
           "simulate_rank"]
