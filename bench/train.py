"""Benchmark `gptoss train`'s training step: ours vs transformers' GptOssForCausalLM, and EP=2 on 2 processes.

In one run, on the same architecture (the `tiny` preset by default) and the same batch:
  * ours, single process: HybridModel + gradient buffers + finalize_model_grads + sharded AdamW
    through the plain schedule, one optimizer step per measured step;
  * transformers' GptOssForCausalLM: forward with labels, backward, torch AdamW step;
  * ours at EP=2 on 2 gloo processes (each process takes half of the same global batch).
Prints tokens/s (median over --repeats of the median step time over --steps measured steps) and
the ratios ours / transformers (target >= 1) and EP=2 / ours single-process.

    python bench/train.py --batch 4 --seq 128 --steps 5 --repeats 3 [--dtype fp32] [--json out.json]
    python bench/train.py --preset wide --batch 2 --seq 512 --no-ep   # hidden 512, 16 experts top-4

`--preset` is a model preset (gptoss_cli/model/config.py) or `wide`: the tiny model widened to
hidden 512, intermediate 512, 16 experts top-4, 8 query / 2 kv heads of 64, vocabulary 20480
(61M parameters), where the experts, attention and LM head have realistic shares of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from gptoss_cli.model.config import preset


def bench_arch(name: str):
    if name == "wide":
        return preset("tiny").replace(hidden_size=512, intermediate_size=512, num_local_experts=16,
                                      num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2,
                                      head_dim=64, vocab_size=20480, eos_token_id=20479, pad_token_id=20478)
    return preset(name)


def _batch(arch, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, arch.vocab_size, (batch, seq + 1), generator=g)


# The clock steps are timed with: wall time, or (--clock cpu) this process's CPU time, which on a
# machine shared with other jobs measures the work of a single-threaded run, not its waiting.
CLOCK = time.perf_counter


def _median_step(step, steps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = CLOCK()
        step()
        times.append(CLOCK() - t0)
    return statistics.median(times)


def ours_step_fn(arch, tokens: torch.Tensor, dtype: str, state=None, microbatches: int = 1):
    """A closure running one full training step of ours on `tokens` (this rank's share)."""
    from gptoss_cli.parallel.state import ParallelState
    from gptoss_cli.schedule import get_forward_backward_func
    from gptoss_cli.train.data import Microbatch
    from gptoss_cli.train.loop import forward_step
    from gptoss_cli.recipe.schema import RecipeConfig
    from gptoss_cli.train.provider import HybridModelProvider, ModelRuntimeConfig
    from gptoss_cli.train.setup import setup_model_and_optimizer

    state = state or ParallelState()
    recipe = RecipeConfig()
    recipe.precision.params_dtype, recipe.moe.aux_loss_coeff = dtype, 0.0
    recipe.parallelism.expert_model_parallel_size = state.ep_size
    recipe.optimizer.weight_decay, recipe.optimizer.use_distributed_optimizer = 0.0, True
    cfg = ModelRuntimeConfig.from_recipe(recipe, arch, arch.hybrid_layer_pattern)
    setup = setup_model_and_optimizer(HybridModelProvider(cfg, seed=0), state, recipe.optimizer, 1e-4)
    schedule = get_forward_backward_func(setup.config)
    mbs = [Microbatch(tokens=t[:, :-1].contiguous(), labels=t[:, 1:].contiguous())
           for t in tokens.chunk(microbatches)]

    def step() -> None:
        setup.model.zero_grad_buffer()
        schedule(forward_step_func=forward_step, data_iterator=iter(mbs), model=setup.model,
                 num_microbatches=len(mbs))
        t0 = CLOCK()
        setup.optimizer.step(1e-4)
        step.optimizer_times.append(CLOCK() - t0)

    step.optimizer_times = []
    return step


def hf_step_fn(arch, tokens: torch.Tensor, dtype: str):
    from transformers import GptOssConfig, GptOssForCausalLM

    hf_cfg = arch.to_hf_config()
    hf_cfg.update(output_router_logits=False, torch_dtype=None)
    hf_cfg.pop("torch_dtype", None)
    config = GptOssConfig(**hf_cfg)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = GptOssForCausalLM(config).to(torch_dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), foreach=False)
    inputs = tokens[:, :-1].contiguous()

    def step() -> None:
        # transformers shifts the labels itself: the same S input tokens as ours go through the model.
        out = model(input_ids=inputs, labels=inputs)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, getattr(config, "_attn_implementation", None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ep_worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    import torch.distributed as dist

    from gptoss_cli.parallel.state import init_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = init_parallel(world, "cpu")
    arch = bench_arch(args["preset"])
    tokens = _batch(arch, args["batch"], args["seq"]).chunk(world)[rank]
    step = ours_step_fn(arch, tokens, args["dtype"], state)
    times = []
    for _ in range(args["repeats"]):
        dist.barrier()
        times.append(_median_step(step, args["steps"]))
    Path(out, f"rank{rank}.json").write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def run_ep2(args: argparse.Namespace) -> float:
    """Median global tokens/s at EP=2 on 2 processes (slowest rank's step time)."""
    with tempfile.TemporaryDirectory() as out:
        world = 2
        cfg = {"preset": args.preset, "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
               "steps": args.steps, "repeats": args.repeats, "threads": max(1, args.threads // world)}
        mp.start_processes(_ep_worker, args=(world, _free_port(), cfg, out), nprocs=world, start_method="spawn")
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    step_times = [max(ts) for ts in zip(*per_rank)]
    return args.batch * args.seq / statistics.median(step_times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="measured steps per repeat (after 2 warm-up steps)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                   help="time steps by wall clock or by this process's CPU time (use with --threads 1)")
    p.add_argument("--no-ep", action="store_true", help="skip the 2-process EP=2 measurement")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.clock == "cpu" and not args.no_ep:
        p.error("--clock cpu measures one process: add --no-ep")
    torch.set_num_threads(args.threads)
    arch = bench_arch(args.preset)
    tokens = _batch(arch, args.batch, args.seq)
    n_tokens = args.batch * args.seq

    ours = ours_step_fn(arch, tokens, args.dtype)
    hf, attn = hf_step_fn(arch, tokens, args.dtype)
    ours_t, hf_t = [], []
    for _ in range(args.repeats):  # interleaved so machine noise hits both alike
        ours_t.append(_median_step(ours, args.steps))
        hf_t.append(_median_step(hf, args.steps))
    ours_tps = n_tokens / statistics.median(ours_t)
    hf_tps = n_tokens / statistics.median(hf_t)
    result = {
        "preset": args.preset, "batch": args.batch, "seq": args.seq, "dtype": args.dtype, "threads": args.threads,
        "clock": args.clock, "tokens_per_step": n_tokens, "ours_tokens_per_s": ours_tps,
        "transformers_tokens_per_s": hf_tps, "ratio_ours_vs_transformers": ours_tps / hf_tps,
        # per repeat, the ratio of the two medians measured back to back
        "ratio_per_repeat": [h / o for o, h in zip(ours_t, hf_t)],
        "ours_optimizer_share": statistics.median(ours.optimizer_times) * ours_tps / n_tokens,
        "transformers_attn_implementation": attn,
    }
    if not args.no_ep:
        ep_tps = run_ep2(args)
        result.update(ep2_tokens_per_s=ep_tps, ratio_ep2_vs_ours_single=ep_tps / ours_tps)
    width = max(len(k) for k in result)
    for k, v in result.items():
        shown = f"{v:.4g}" if isinstance(v, float) else ", ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else v
        print(f"{k:<{width}}  {shown}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
