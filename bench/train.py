"""Benchmark `gptoss train`'s training step: ours vs transformers' GptOssForCausalLM, and EP=2 on 2 processes.

In one run, on the same architecture (the `tiny` preset by default), the same initial weights and
the same batch:
  * ours, single process: HybridModel + gradient buffers + finalize_model_grads + sharded AdamW
    through the plain schedule, one optimizer step per measured step;
  * transformers' GptOssForCausalLM at the settings a user would pick for speed: its default
    attention and expert implementations (printed), `torch.optim.AdamW(fused=True)`,
    `clip_grad_norm_(foreach=True)`, the same lr, betas, eps, weight decay (0) and clip as ours;
    its weights are ours, re-arranged by the test-local HF <-> Hybrid mapping
    (tests/model/conftest.py), so the first step's losses must agree (checked, printed);
  * ours at EP=2 on 2 gloo processes (each process takes half of the same global batch; wall
    clock only, so only with `--clock wall`).
Steps alternate between the two implementations and a square fp32 `torch.mm` (the GEMM peak), the
order rotating at every step (bench/harness.py), so load on a shared machine hits all alike. By
default each step is timed by this process's CPU time on one thread (`--clock cpu --threads 1`): on
a shared host that measures the work, not the waiting. Prints tokens/s from the median step time,
the ratio ours / transformers per repeat (median of that repeat's steps; the figure is the median
over repeats, the spread their min-max), and the share of the GEMM peak: model FLOPs per step
(`model_flops_per_step`: 6 x matmul parameters touched per token x tokens, plus the attention scores
and their products over the visible keys) divided by the step time and by the fp32 `torch.mm` rate
of this CPU measured in the same rotation (`gemm_peak_gflops`, the median, with its min-max). `--profile` adds one profiled step of each side
after the timings: the top operators by self CPU time, each side's GEMM share, and the ceilings of
the ratio and of the share of the GEMM peak if every non-GEMM operator of ours were free.

    python bench/train.py --batch 4 --seq 128 --steps 5 --repeats 3 [--dtype fp32] [--json out.json]
    python bench/train.py --preset wide --batch 2 --seq 512     # hidden 512, 16 experts top-4
    python bench/train.py --preset medium --batch 2 --seq 512   # the same experts, tiny's attention and vocabulary
    python bench/train.py --preset medium --batch 2 --seq 512 --allocators train keep   # + a second allocator row

Ours computes the clamped SwiGLU with the recipe's default `model.swiglu_kernel: auto` (compiled
single-pass kernels where torch.compile works, model/swiglu_kernel.py); `--swiglu-kernel eager`
measures the eager form.

`--optimizer` instead times the optimizer's part of a step, finalize_model_grads + step, of the
distributed optimizer against the one it replaced (whole-parameter shards, torch.optim.AdamW with
foreach=False, one broadcast per owner; kept below as `BaselineAdamW`) on the same model and
gradients, at W=1 and at W=2 (2 gloo processes, EP=2), and prints the ratios:

    python bench/train.py --optimizer --arch hidden_size=512,intermediate_size=512,num_local_experts=16,num_experts_per_tok=4

`--preset` is a model preset (gptoss_cli/model/config.py), `medium` (the tiny model at hidden 512,
intermediate 512, 16 experts top-4; what `--arch hidden_size=512,intermediate_size=512,
num_local_experts=16,num_experts_per_tok=4` gave before) or `wide` (medium with 8 query / 2 kv
heads of 64 and a 20480-token vocabulary, 61M parameters, where the experts, attention and LM head
have realistic shares of the step): bench/peers.py.

Both sides share the process, so they share its allocator and thread settings. The headline runs
with the allocator as `gptoss train` runs it (glibc's defaults); `--allocators train keep` adds a
second row from a second process in which glibc keeps freed memory (resources.keep_freed_memory,
which `gptoss train` used on the CPU until it fragmented the heap: bench/memory.py). The load
average during the run is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests/train/dist_helpers.py runs the 2-process measurements
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gptoss_cli.checkpoint.formats.hf.config import to_hf_config
from gptoss_cli.model.catalog import SWIGLU_KERNELS
from gptoss_cli.recipe.estimate.flops import model_flops_per_token

from bench import harness  # noqa: E402
from bench.peers import bench_arch, hf_peer, hybrid_weights  # noqa: E402


def _batch(arch, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, arch.vocab_size, (batch, seq + 1), generator=g)


# The clock steps are timed with (bench/harness.py): wall time, or (--clock cpu) this process's CPU
# time, which on a machine shared with other jobs measures the work of a single-threaded run, not its waiting.
CLOCK = "wall"
# Ours' clamped SwiGLU (model.swiglu_kernel; --swiglu-kernel): the recipe's default unless told.
SWIGLU_KERNEL = "auto"


def _recipe(dtype: str, ep_size: int = 1):
    from gptoss_cli.recipe.schema import RecipeConfig

    recipe = RecipeConfig()
    recipe.precision.params_dtype, recipe.moe.aux_loss_coeff = dtype, 0.0
    recipe.parallelism.expert_model_parallel_size = ep_size
    recipe.optimizer.weight_decay, recipe.optimizer.use_distributed_optimizer = 0.0, True
    recipe.model.swiglu_kernel = SWIGLU_KERNEL
    return recipe


def ours_step_fn(arch, tokens: torch.Tensor, dtype: str, state=None, microbatches: int = 1,
                 weights: dict[str, torch.Tensor] | None = None):
    """A closure running one full training step of ours on `tokens` (this rank's share); it returns
    the step's mean token loss. `weights`: a Hybrid state dict to start from (default: seed 0's init)."""
    from gptoss_cli.parallel.state import ParallelState
    from gptoss_cli.schedule import get_forward_backward_func
    from gptoss_cli.train.data import Microbatch
    from gptoss_cli.train.objective import forward_step
    from gptoss_cli.model.pattern import default_pattern
    from gptoss_cli.train.provider import HybridModelProvider, ModelRuntimeConfig
    from gptoss_cli.train.setup import install_training_callbacks, wrap_model_and_optimizer

    state = state or ParallelState()
    recipe = _recipe(dtype, state.ep_size)
    cfg = ModelRuntimeConfig.from_recipe(recipe, arch, default_pattern(arch))
    built = HybridModelProvider(cfg, seed=0).provide(state)
    if weights is not None:  # before the buffers and the optimizer's state are built from the parameters
        built.load_state_dict(weights, strict=True)
    model, optimizer = wrap_model_and_optimizer(built, state, recipe.optimizer, 1e-4)
    config = install_training_callbacks(model, state)
    schedule = get_forward_backward_func(config)
    mbs = [Microbatch(tokens=t[:, :-1].contiguous(), labels=t[:, 1:].contiguous())
           for t in tokens.chunk(microbatches)]

    def step() -> float:
        model.zero_grad_buffer()
        logs = schedule(forward_step_func=forward_step, data_iterator=iter(mbs), model=model,
                        num_microbatches=len(mbs))
        t0 = harness.CLOCKS[CLOCK]()
        optimizer.step(1e-4)
        step.optimizer_times.append(harness.CLOCKS[CLOCK]() - t0)
        return float(sum(log["loss_sum"] for log in logs) / sum(log["num_tokens"] for log in logs))

    step.optimizer_times = []
    return step


def hf_model(arch, dtype: str):
    """transformers' GptOssForCausalLM at its default attention and expert implementations, with
    the tests' random weights (bench/peers.py), so that the loss is far from log(vocab) and the
    first-step check below can tell two different computations apart."""
    return hf_peer(arch, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]).train()


def hf_step_fn(model, tokens: torch.Tensor):
    """One training step of transformers' model with fused AdamW at ours' optimizer settings; returns the loss."""
    opt_cfg = _recipe("fp32").optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2),
                            eps=opt_cfg.adam_eps, weight_decay=opt_cfg.weight_decay, fused=True)
    # The same S input tokens and S targets as ours (transformers would otherwise shift the labels
    # itself and score only S - 1 positions).
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step() -> float:
        out = model(input_ids=inputs, labels=targets, shift_labels=targets)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.clip_grad, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    return step


def model_flops_per_step(arch, batch: int, seq: int) -> float:
    """Training FLOPs of one step: the project's one count (gptoss_cli/recipe/estimate/flops.py, docs/flops.md)
    per token, times the step's tokens."""
    return model_flops_per_token(arch, seq) * batch * seq


GEMM_N = 1024  # the square fp32 GEMM whose rate is taken as this CPU's peak


def gemm_fn(n: int = GEMM_N):
    """One fp32 `torch.mm` (n x n by n x n) at the current thread count: timed as a side of the step
    rounds, it gives the GEMM peak of this CPU in the same machine state as the steps it prices."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)

    def mm() -> None:
        torch.mm(a, b, out=out)

    return mm


def _on_two_ranks(worker, cfg: dict) -> list:
    """worker(rank, cfg) on 2 gloo processes (tests/train/dist_helpers.run_distributed); each rank's result."""
    from tests.train.dist_helpers import run_distributed

    with tempfile.TemporaryDirectory() as out:
        return run_distributed(worker, 2, Path(out), cfg, timeout=3600)


def _ep_worker(rank: int, args: dict) -> list[float]:
    import torch.distributed as dist

    from gptoss_cli.parallel.state import init_parallel

    global SWIGLU_KERNEL
    torch.set_num_threads(args["threads"])
    SWIGLU_KERNEL = args["swiglu_kernel"]
    state = init_parallel(2, "cpu")
    arch = _arch(args["preset"], args.get("arch"))
    tokens = _batch(arch, args["batch"], args["seq"]).chunk(2)[rank]
    step = ours_step_fn(arch, tokens, args["dtype"], state)
    timed = harness.interleave({"ours": step}, args["repeats"], steps=args["steps"], warmup=2, clock="wall",
                               before=dist.barrier)
    return timed["ours"]["time_s"]


def run_ep2(args: argparse.Namespace) -> float:
    """Median global tokens/s at EP=2 on 2 processes (slowest rank's step time)."""
    cfg = {"preset": args.preset, "arch": args.arch, "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
           "steps": args.steps, "repeats": args.repeats, "threads": max(1, args.threads // 2),
           "swiglu_kernel": args.swiglu_kernel}
    per_rank = _on_two_ranks(_ep_worker, cfg)
    step_times = [max(ts) for ts in zip(*per_rank)]
    return args.batch * args.seq / statistics.median(step_times)


# --- the optimizer before issue 15, kept as the baseline of `--optimizer` ------------------------
class BaselineAdamW:
    """Today's optimizer before the distributed one: contiguous runs of WHOLE parameters balanced by
    size per group, torch.optim.AdamW(foreach=False) on fp32 masters of the owned ones, then one
    broadcast per owner; its gradients were all-reduced over the group first (`baseline_finalize`)."""

    def __init__(self, model, state, lr: float, weight_decay: float = 0.1):
        import torch.distributed as dist
        from torch import nn

        from gptoss_cli.parallel.state import group_size
        from gptoss_cli.train.optimizer import decays

        self.state, self.groups, self.master, self.param_of = state, [], {}, {}
        decay, no_decay = [], []
        for buf, pg in ((model.grad_buffers.dense, state.dp_group), (model.grad_buffers.expert, state.expert_dp_group)):
            size = group_size(pg)
            rank = dist.get_rank(pg) if pg is not None else 0
            sizes = [p.numel() for p in buf.params]
            total, acc, owners = sum(sizes), 0, []
            for n in sizes:
                owners.append(min(size - 1, int((acc + n / 2) * size / total)) if total else 0)
                acc += n
            self.groups.append((buf, pg, size, rank, owners))
            for i, o in enumerate(owners):
                if o == rank:
                    m = nn.Parameter(buf.params[i].detach().float().clone())
                    m.grad = buf.params[i].main_grad
                    self.master[buf.names[i]], self.param_of[buf.names[i]] = m, buf.params[i]
                    (decay if decays(buf.names[i]) else no_decay).append(m)
        groups = [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
                  if g["params"]]
        self.inner = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), foreach=False)

    def _owned_sq(self, buf, rank, owners) -> torch.Tensor:
        sq = torch.zeros(())
        for i, o in enumerate(owners):
            if o == rank:
                sq += buf.params[i].main_grad.float().pow(2).sum()
        return sq

    def step(self, lr: float) -> float:
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        from gptoss_cli.parallel.state import all_reduce, broadcast

        (dbuf, dpg, _, drank, downers), (ebuf, epg, _, erank, eowners) = self.groups
        dense, expert = self._owned_sq(dbuf, drank, downers), self._owned_sq(ebuf, erank, eowners)
        all_reduce(dense, dpg)
        all_reduce(expert, epg)
        all_reduce(expert, self.state.ep_group)
        norm = math.sqrt(float(dense + expert))
        coef = 1.0 / (norm + 1e-6)
        if coef < 1.0:
            for m in self.master.values():
                m.grad.mul_(coef)
        for g in self.inner.param_groups:
            g["lr"] = lr
        self.inner.step()
        with torch.no_grad():
            for name, m in self.master.items():
                self.param_of[name].copy_(m)
            for buf, pg, size, rank, owners in self.groups:
                for owner in range(size if pg is not None and size > 1 else 0):
                    params = [buf.params[i] for i, o in enumerate(owners) if o == owner]
                    if params:
                        flat = _flatten_dense_tensors([p.data for p in params])
                        broadcast(flat, owner, pg)
                        if owner != rank:
                            for p, new in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
                                p.data.copy_(new)
        return norm


def baseline_finalize(model, state, num_tokens: torch.Tensor) -> None:
    """finalize_model_grads before issue 15: all-reduce each whole buffer, then divide by the global tokens."""
    from gptoss_cli.parallel.state import all_reduce

    all_reduce(model.grad_buffers.dense.data, state.dp_group)
    all_reduce(model.grad_buffers.expert.data, state.expert_dp_group)
    total = num_tokens.clone()
    all_reduce(total, state.dp_group)
    if total.item() > 0:
        for buf in model.grad_buffers.buffers():
            buf.data.div_(total)


def optimizer_step_fns(arch, dtype: str, state):
    """(new, baseline): closures running finalize + optimizer step on two copies of the same model
    whose gradient buffers hold the same random gradients before every step."""
    from gptoss_cli.model.dtypes import torch_dtype
    from gptoss_cli.model.hybrid import HybridModel
    from gptoss_cli.parallel.grads import GradAccumulatingModel, GradBufferConfig, finalize_model_grads
    from gptoss_cli.recipe.schema import OptimizerConfig
    from gptoss_cli.train.optimizer import DistributedAdamW

    offset, n_local = state.local_expert_range(arch.num_local_experts)

    def model(distributed: bool):
        torch.manual_seed(0)
        m = HybridModel(arch, expert_offset=offset, num_local_experts=n_local, dtype=torch_dtype(dtype))
        return GradAccumulatingModel(m, state, GradBufferConfig(use_distributed_optimizer=distributed))

    new, old = model(True), model(False)
    new_opt = DistributedAdamW(new, state, OptimizerConfig(use_distributed_optimizer=True), lr=1e-4)
    old_opt = BaselineAdamW(old, state, lr=1e-4)
    g = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(p.shape, generator=g) for n, p in new.module.named_parameters()}
    tokens = torch.tensor(1000.0)

    def fill(m) -> None:
        m.zero_grad_buffer()
        for n, p in m.module.named_parameters():
            p.main_grad.copy_(grads[n])

    def new_step() -> dict:  # its own time: the gradient fill is not timed
        fill(new)
        _, timed = harness.measure(lambda: (finalize_model_grads([new], tokens, parallel_state=state),
                                            new_opt.step(1e-4)), "wall")
        return timed

    def old_step() -> dict:
        fill(old)
        _, timed = harness.measure(lambda: (baseline_finalize(old, state, tokens), old_opt.step(1e-4)), "wall")
        return timed

    return new_step, old_step


def optimizer_times(arch, dtype: str, state, steps: int, repeats: int, barrier=None) -> tuple[list, list]:
    """Per repeat, the median seconds of each optimizer's finalize + step (interleaved step by step)."""
    new_step, old_step = optimizer_step_fns(arch, dtype, state)
    timed = harness.interleave({"new": new_step, "baseline": old_step}, repeats, steps=steps, warmup=2,
                               clock="wall", before=barrier)
    return timed["new"]["time_s"], timed["baseline"]["time_s"]


def _optimizer_worker(rank: int, args: dict) -> tuple[list[float], list[float]]:
    import torch.distributed as dist

    from gptoss_cli.parallel.state import init_parallel

    torch.set_num_threads(args["threads"])
    state = init_parallel(2, "cpu")
    return optimizer_times(_arch(args["preset"], args["arch"]), args["dtype"], state, args["steps"], args["repeats"],
                           barrier=dist.barrier)


def _arch(name: str, overrides: str | None):
    return bench_arch(name, overrides)


def run_optimizer_bench(run: harness.Run, args: argparse.Namespace) -> dict:
    from gptoss_cli.model.pattern import default_pattern
    from gptoss_cli.parallel.state import ParallelState
    from gptoss_cli.recipe.estimate.parameters import parameter_layout

    arch = _arch(args.preset, args.arch)
    new1, old1 = optimizer_times(arch, args.dtype, ParallelState(), args.steps, args.repeats)
    cfg = {"preset": args.preset, "arch": args.arch, "dtype": args.dtype, "steps": args.steps,
           "repeats": args.repeats, "threads": max(1, args.threads // 2)}
    per_rank = _on_two_ranks(_optimizer_worker, cfg)
    new2 = [max(ts) for ts in zip(*(r[0] for r in per_rank))]  # the slowest rank sets the step
    old2 = [max(ts) for ts in zip(*(r[1] for r in per_rank))]
    result = {"params": sum(p.numel for p in parameter_layout(arch, default_pattern(arch)))}
    for w, new, old in (("w1", new1, old1), ("w2", new2, old2)):
        case = f"finalize + optimizer step, W={w[1]}"
        run.add(case, "new", "time_s", new)
        run.add(case, "baseline", "time_s", old)
        ratio = run.ratio(case, "baseline", "new", name="new / baseline speed")
        result.update({f"{w}_new_s": statistics.median(new), f"{w}_baseline_s": statistics.median(old),
                       f"{w}_ratio_baseline_over_new": ratio["median"]})
    return result


# The explicit GEMM operators of a step (the inner GEMMs of _grouped_mm appear as `mm`); attention's
# fused kernel, elementwise ops, reductions, copies and the optimizer are the rest.
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm")


def profile_step(name: str, step, top: int = 25) -> dict:
    """torch.profiler's operators of one `step` by self CPU time: prints the `top` ones with their
    share, returns the step's total and GEMM self time (seconds) and the non-GEMM operators."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS) / 1e6
    print(f"\n{name}: one step, {total:.3f} s of operator self time, GEMMs {100 * gemm / total:.1f}%; "
          f"the top {top} operators:")
    for e in events[:top]:
        print(f"  {e.key[:52]:<52} {e.count:>6} calls {e.self_cpu_time_total / 1e3:>9.1f} ms "
              f"{100 * e.self_cpu_time_total / 1e6 / total:5.1f}%{'  GEMM' if e.key in GEMM_OPS else ''}")
    rest = [(e.key, e.self_cpu_time_total / 1e6) for e in events if e.key not in GEMM_OPS][:top]
    return {"total_s": total, "gemm_s": gemm, "top_non_gemm": rest}


def run_step_bench(run: harness.Run, args: argparse.Namespace) -> dict:
    """Ours vs transformers, steps alternating, from the same weights on the same batch."""
    from gptoss_cli.resources import keep_freed_memory

    if args.allocators == ["keep"]:
        # One process: transformers' steps get it too, so the ratio does not count it.
        keep_freed_memory()
    arch = _arch(args.preset, args.arch)
    tokens = _batch(arch, args.batch, args.seq)
    n_tokens = args.batch * args.seq
    peer = hf_model(arch, args.dtype)
    ours = ours_step_fn(arch, tokens, args.dtype, weights=hybrid_weights(arch, peer))
    hf = hf_step_fn(peer, tokens)
    # The first step of each starts from the same weights on the same tokens: the losses agree to
    # fp32 reordering (per-token terms of size log(vocab) summed in another order; 1e-5 relative is
    # far above that and far below any real difference, e.g. a shifted or dropped target).
    first_ours, first_hf = ours(), hf()
    loss_rel = abs(first_ours - first_hf) / abs(first_hf)
    if loss_rel > 1e-5:
        raise SystemExit(f"bench: first-step losses differ: ours {first_ours:.7g}, transformers {first_hf:.7g} "
                         f"(relative {loss_rel:.2g}); the two sides do not compute the same step")
    # Steps alternate (the order rotating step by step), with the GEMM peak's square mm as a third
    # side, so the same machine state prices all three.
    sides = {"ours": ours, "transformers": hf, "fp32 GEMM peak": gemm_fn()}
    timed = harness.interleave(sides, args.repeats, steps=args.steps, warmup=1, clock=CLOCK)
    timed["fp32 GEMM peak"]["gflops"] = [2 * GEMM_N**3 / s / 1e9 for s in timed["fp32 GEMM peak"]["time_s"]]
    case = f"{args.preset}{' ' + args.arch if args.arch else ''} batch {args.batch} x {args.seq}"
    run.add_rounds(case, timed)
    ratio = run.ratio(case, "transformers", "ours", name="ours / transformers speed")
    ours_s, hf_s = timed.median("ours"), timed.median("transformers")
    flops = model_flops_per_step(arch, args.batch, args.seq)
    rates = timed["fp32 GEMM peak"]["gflops"]
    peak = statistics.median(rates)
    ceilings = {}
    if args.profile:
        # What bounds the goals: with every non-GEMM operator free, our step would be its GEMM share
        # of the measured median (GEMMs as fast as they ran).
        prof, peer_prof = profile_step("ours", ours), profile_step("transformers", hf)
        gemm_share = prof["gemm_s"] / prof["total_s"]
        ceilings = {"ours_gemm_share_of_step": gemm_share,
                    "transformers_gemm_share_of_step": peer_prof["gemm_s"] / peer_prof["total_s"],
                    "ratio_ceiling_non_gemm_free": hf_s / (ours_s * gemm_share),
                    "share_of_gemm_peak_ceiling_non_gemm_free": flops / (ours_s * gemm_share) / 1e9 / peak}
    return {
        "allocator": harness.allocator_text(args.allocators == ["keep"]),
        "tokens_per_step": n_tokens,
        "first_loss_ours": first_ours, "first_loss_transformers": first_hf, "first_loss_rel_diff": loss_rel,
        "ours_step_s": ours_s, "transformers_step_s": hf_s,
        "ours_tokens_per_s": n_tokens / ours_s, "transformers_tokens_per_s": n_tokens / hf_s,
        # the median over repeats of transformers' median step / ours in that repeat; min and max their spread
        "ratio_ours_vs_transformers": ratio["median"], "ratio_per_repeat": ratio["values"],
        "ratio_min": ratio["min"], "ratio_max": ratio["max"],
        "ours_optimizer_share": statistics.median(ours.optimizer_times) / ours_s,
        "model_flops_per_step": flops, "gemm_peak_gflops": peak, "gemm_peak_gflops_min_max": [min(rates), max(rates)],
        "ours_share_of_gemm_peak": flops / ours_s / 1e9 / peak,
        "transformers_share_of_gemm_peak": flops / hf_s / 1e9 / peak,
        "transformers_attn_implementation": peer.config._attn_implementation,
        "transformers_experts_implementation": getattr(peer.config, "_experts_implementation", None),
        "transformers_optimizer": "torch.optim.AdamW(fused=True)",
        **ceilings,
    }


def run_per_allocator(run: harness.Run, args: argparse.Namespace) -> None:
    """The step bench once per allocator, each in a fresh process (an allocator setting cannot be
    undone in a process); one case each (named by the allocator), the first the headline."""
    import subprocess

    rest, skip = [], False
    for a in sys.argv[1:]:  # this command line without --allocators and --json and their values
        if a.startswith("--"):
            skip = a in ("--allocators", "--json")
        if not skip:
            rest.append(a)
    rows = []
    for allocator in args.allocators:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, __file__, *rest, "--allocators", allocator, "--json", out.name], check=True)
            child = json.loads(Path(out.name).read_text())
        rows.append(child["extra"])
        for case, body in child["cases"].items():
            run.cases[f"{child['extra']['allocator']}: {case}"] = body
    run.extra["per_allocator"] = rows
    print("\nper allocator (both sides in one process each; the first row is the headline):")
    for i, r in enumerate(rows):
        print(f"  {'headline' if i == 0 else 'second  '} {r['allocator']}: ours / transformers "
              f"{r['ratio_ours_vs_transformers']:.2f}x [{r['ratio_min']:.2f}, {r['ratio_max']:.2f}], ours "
              f"{r['ours_step_s']:.3f} s, transformers {r['transformers_step_s']:.3f} s per step, ours "
              f"{100 * r['ours_share_of_gemm_peak']:.0f}% of the GEMM peak")


def print_result(result: dict) -> None:
    width = max(len(k) for k in result)
    for k, v in result.items():
        shown = f"{v:.4g}" if isinstance(v, float) else ", ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else v
        print(f"{k:<{width}}  {shown}")


def main() -> int | None:
    p = harness.parser(__doc__)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="measured steps of each side per repeat (after warm-up)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", default="cpu", choices=tuple(harness.CLOCKS),
                   help="time steps by this process's CPU time (default; one thread) or by wall clock")
    p.add_argument("--allocators", nargs="+", default=["train"], choices=("train", "keep"),
                   help="train: glibc's defaults, as gptoss train runs (the headline); keep: glibc keeping freed "
                        "memory. Several: one process each, one row each, the first the headline")
    p.add_argument("--no-ep", action="store_true", help="skip the 2-process EP=2 measurement (wall clock only)")
    p.add_argument("--swiglu-kernel", default="auto", choices=SWIGLU_KERNELS,
                   help="ours' clamped SwiGLU: compiled where it works (the recipe default) or eager")
    p.add_argument("--optimizer", action="store_true",
                   help="time finalize + optimizer step, new vs the optimizer it replaced, at W=1 and W=2")
    p.add_argument("--arch", default=None, help="architecture overrides, e.g. hidden_size=512,num_local_experts=16")
    p.add_argument("--profile", action="store_true",
                   help="also profile one step of each side (torch.profiler, self CPU time per operator) and "
                        "print the GEMM shares and the ceilings with every non-GEMM operator free")
    args = p.parse_args()
    global CLOCK, SWIGLU_KERNEL
    CLOCK = args.clock
    SWIGLU_KERNEL = args.swiglu_kernel
    harness.check_clock(p, args.clock, args.threads)
    torch.set_num_threads(args.threads)
    if args.optimizer:
        with harness.Run("train --optimizer", args, clock="wall") as run:
            result = run_optimizer_bench(run, args)
        print_result(result)
        run.extra.update(result)
        run.finish()
        return
    if len(args.allocators) > 1:
        with harness.Run("train", args) as run:
            run_per_allocator(run, args)
        run.finish()
        return 0
    with harness.Run("train", args) as run:
        result = run_step_bench(run, args)
        if args.clock == "wall" and not args.no_ep:
            ep_tps = run_ep2(args)
            result.update(ep2_tokens_per_s=ep_tps, ratio_ep2_vs_ours_single=ep_tps / result["ours_tokens_per_s"])
    print_result(result)
    run.extra.update(result)
    run.finish()


if __name__ == "__main__":
    sys.exit(main())
