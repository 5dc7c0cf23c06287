"""Benchmark a LoRA training step: ours vs transformers + PEFT, and vs our full fine-tune.

In one run, on the same architecture, the same tokens and the same LoRA settings (rank, alpha, all
four targets: attention q/k/v/o and every expert's gate_up / down):
  * ours, LoRA: HybridModel with a frozen base and adapters (gptoss_cli/model/lora.py), gradient
    buffers + distributed AdamW over the adapters only, plain schedule, one optimizer step per step;
  * transformers' GptOssForCausalLM + peft.get_peft_model (target_modules q/k/v/o_proj,
    target_parameters mlp.experts.gate_up_proj / down_proj), torch AdamW (fused where torch has it,
    else foreach) over the adapters: forward with labels, backward, clip, step;
  * ours, full fine-tune: every parameter trained (the same step as bench/train.py's);
  * ours, LoRA on an MXFP4 base (lora.base_experts=mxfp4): the same LoRA step with the frozen experts
    held as MXFP4 blocks/scales and decoded for each GEMM (gptoss_cli/model/mxfp4/experts.py).
Prints the median step time (median over --repeats of the median over --steps steps), the ratio
transformers+PEFT / ours-LoRA (goal >= 1.5) and the trainable state of each: parameters that
train, their gradients and the optimizer's state, counted from the tensors the run holds, with
the ratio ours-LoRA / ours-full (goal < 5%). For the MXFP4 base: its step time over the bf16 base's
(the decode's cost) and the resident bytes of the frozen base, experts and all (parameters and
buffers the model holds), MXFP4 over bf16 (the experts alone: 4.25 / 16 bits with --dtype bf16).

    python bench/lora.py --preset wide --batch 2 --seq 256 --rank 16 --steps 5 --repeats 3

`--profile N` adds, after the timings, torch.profiler's top operators (self CPU time over N steps)
of ours-LoRA and of transformers + PEFT: where each step's time goes.

`--base-hash-mb N` instead times naming the frozen base (checkpoint/formats/training/record.py's
base_fingerprint, at every LoRA start, resume and export) on a base of N MB of safetensors files:
the full sha256 read (the baseline, from the page cache: its fastest) against the cached fingerprint
(a stat of each file), medians over --repeats, and their ratio.

    python bench/lora.py --base-hash-mb 2048 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import harness  # noqa: E402
from bench.peers import bench_arch  # noqa: E402
from bench.train import GEMM_OPS, _batch  # noqa: E402

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def ours_step_fn(arch, tokens: torch.Tensor, dtype: str, rank: int, alpha: float, base_experts: str = "bf16"):
    """One training step of ours on `tokens` (LoRA with rank > 0, else the full fine-tune), and its setup."""
    from gptoss_cli.parallel.state import ParallelState
    from gptoss_cli.recipe.schema import RecipeConfig
    from gptoss_cli.schedule import get_forward_backward_func
    from gptoss_cli.train.data import Microbatch
    from gptoss_cli.train.objective import forward_step
    from gptoss_cli.model.pattern import default_pattern
    from gptoss_cli.train.provider import HybridModelProvider, ModelRuntimeConfig
    from gptoss_cli.train.setup import setup_model_and_optimizer

    recipe = RecipeConfig()
    recipe.precision.params_dtype, recipe.moe.aux_loss_coeff = dtype, 0.0
    recipe.optimizer.weight_decay, recipe.optimizer.use_distributed_optimizer = 0.0, True
    if rank:
        recipe.lora.rank, recipe.lora.alpha, recipe.lora.target_modules = rank, alpha, list(TARGETS)
        recipe.lora.base_experts = base_experts
    cfg = ModelRuntimeConfig.from_recipe(recipe, arch, default_pattern(arch))
    setup = setup_model_and_optimizer(HybridModelProvider(cfg, seed=0), ParallelState(), recipe.optimizer, 1e-4)
    schedule = get_forward_backward_func(setup.config)
    mbs = [Microbatch(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous())]

    def step() -> None:
        setup.model.zero_grad_buffer()
        schedule(forward_step_func=forward_step, data_iterator=iter(mbs), model=setup.model, num_microbatches=1)
        setup.optimizer.step(1e-4)

    return step, setup


def ours_state_bytes(setup) -> int:
    """Trainable parameters + their gradient buffers + the optimizer's shards (master, two moments)."""
    params = sum(p.numel() * p.element_size() for p in setup.model.module.parameters() if p.requires_grad)
    grads = sum(b.data.numel() * b.data.element_size() for b in setup.model.grad_buffers.buffers())
    opt = sum(t.numel() * t.element_size() for s in setup.optimizer.shards for t in (s.master, s.exp_avg, s.exp_avg_sq))
    return params + grads + opt


def frozen_base_bytes(setup) -> dict[str, int]:
    """Resident bytes of the frozen base (parameters that do not train, and buffers such as MXFP4
    blocks/scales; RoPE tables included) and of its expert weights alone."""
    from gptoss_cli.model.mxfp4.experts import expert_storage_bytes

    model = setup.model.module
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    frozen += sum(b.numel() * b.element_size() for b in model.buffers())
    return {"base": frozen, "experts": sum(expert_storage_bytes(model).values())}


def hf_peft_step_fn(arch, tokens: torch.Tensor, dtype: str, rank: int, alpha: float):
    """transformers + PEFT with the same LoRA; one step, and the model and optimizer (for their state)."""
    import peft
    from transformers import GptOssConfig, GptOssForCausalLM

    from gptoss_cli.checkpoint.formats.hf.config import to_hf_config

    hf_cfg = to_hf_config(arch)
    hf_cfg.update(output_router_logits=False)
    hf_cfg.pop("torch_dtype", None)
    model = GptOssForCausalLM(GptOssConfig(**hf_cfg)).to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    lora = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = peft.get_peft_model(model, lora)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    try:
        opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
        kind = "fused"
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
        kind = "foreach"
    inputs = tokens[:, :-1].contiguous()

    def step() -> None:
        out = model(input_ids=inputs, labels=inputs)  # transformers shifts the labels itself
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep .grad allocated, as our buffers stay allocated

    def state_bytes() -> int:
        params = sum(p.numel() * p.element_size() for p in trainable)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in trainable if p.grad is not None)
        opt_state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                        if isinstance(t, torch.Tensor))
        return params + grads + opt_state

    return step, state_bytes, kind


def bench_base_hash(run: harness.Run, megabytes: int, repeats: int) -> None:
    """The full hash and the cached fingerprint of a base of `megabytes` MB (4 files), interleaved."""
    import os
    import tempfile

    from gptoss_cli.checkpoint.formats.training.record import base_fingerprint, hash_base_files

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["GPTOSS_CACHE_DIR"] = str(Path(tmp) / "cache")
        base = Path(tmp) / "base"
        base.mkdir()
        block = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        block = block.numpy().tobytes()
        for i in range(4):
            with open(base / f"model-{i + 1:05d}-of-00004.safetensors", "wb") as fh:
                for _ in range(megabytes // 4):
                    fh.write(block)
        files = sorted(base.glob("*.safetensors"))
        digest = base_fingerprint(base)["sha256"]  # the first start: hashes in full, fills the cache

        def full() -> None:
            assert hash_base_files(files) == digest

        def cached() -> None:
            assert base_fingerprint(base)["sha256"] == digest

        timed = harness.interleave({"full sha256": full, "cached fingerprint": cached}, repeats, warmup=0,
                                   clock="wall")
    case = f"base fingerprint, {megabytes} MB"
    run.add_rounds(case, timed, ("time_s",))
    ratio = run.ratio(case, "full sha256", "cached fingerprint")
    full_s, cached_s = timed.median("full sha256"), timed.median("cached fingerprint")
    print(f"base fingerprint of {megabytes} MB in 4 safetensors files, {repeats} repeats")
    print(f"full sha256 (baseline)  {1e3 * full_s:>10.1f} ms  ({megabytes / full_s:.0f} MB/s)")
    print(f"cached fingerprint      {1e3 * cached_s:>10.3f} ms")
    print(f"full / cached: {ratio['median']:.0f}x")


def profile_steps(name: str, step, steps: int, top: int = 15) -> float:
    """torch.profiler's operators of `steps` steps of `step`, the `top` ones by self CPU time; returns
    the GEMM operators' share of the operator self time (bench/train.py's GEMM_OPS)."""
    from torch.profiler import ProfilerActivity, profile

    step()  # warm-up outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS)
    print(f"\n{name}: top {top} operators by self CPU time over {steps} steps; GEMMs {100 * gemm / total:.1f}%")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48))
    return gemm / total


SIDES = ("ours_lora", "hf_peft", "ours_full", "ours_lora_mxfp4")


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--steps", type=int, default=5, help="steps of each side per repeat, alternating")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, help="also profile this many steps of ours-LoRA and HF+PEFT")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", default="cpu", choices=tuple(harness.CLOCKS),
                    help="time steps by this process's CPU time (default; one thread) or by wall clock")
    ap.add_argument("--base-hash-mb", type=int, help="time the base fingerprint on a base of this many MB instead")
    args = ap.parse_args()
    if args.base_hash_mb:
        with harness.Run("lora --base-hash-mb", args, clock="wall") as run:
            bench_base_hash(run, args.base_hash_mb, args.repeats)
        run.finish()
        return
    harness.check_clock(ap, args.clock, args.threads)
    torch.set_num_threads(args.threads)
    run = harness.Run("lora", args).__enter__()
    torch.manual_seed(0)
    arch = bench_arch(args.preset)
    tokens = _batch(arch, args.batch, args.seq)

    ours, ours_setup = ours_step_fn(arch, tokens, args.dtype, args.rank, args.alpha)
    theirs, theirs_state, adamw = hf_peft_step_fn(arch, tokens, args.dtype, args.rank, args.alpha)
    full, full_setup = ours_step_fn(arch, tokens, args.dtype, 0, args.alpha)
    mx, mx_setup = ours_step_fn(arch, tokens, args.dtype, args.rank, args.alpha, base_experts="mxfp4")
    steps = dict(zip(SIDES, (ours, theirs, full, mx)))
    # interleaved step by step, the order rotating, so a slow phase of the machine hits all
    timed = harness.interleave(steps, args.repeats, steps=args.steps, warmup=2, clock=args.clock)
    case = f"{args.preset} batch {args.batch} x {args.seq}, rank {args.rank}"
    run.add_rounds(case, timed)
    med = {k: timed.median(k) for k in SIDES}
    speed = run.ratio(case, "hf_peft", "ours_lora", name="ours_lora / hf_peft speed")["median"]
    run.ratio(case, "ours_lora_mxfp4", "ours_lora", name="MXFP4 base / bf16 base step time")
    state = {"ours_lora": ours_state_bytes(ours_setup), "hf_peft": theirs_state(),
             "ours_full": ours_state_bytes(full_setup), "ours_lora_mxfp4": ours_state_bytes(mx_setup)}
    for k, v in state.items():
        run.add(case, k, "trainable_state_bytes", v)
    base = {"ours_lora": frozen_base_bytes(ours_setup), "ours_lora_mxfp4": frozen_base_bytes(mx_setup)}
    tok = args.batch * args.seq
    print(f"{args.preset}, batch {args.batch} x {args.seq} tokens, rank {args.rank}, {args.dtype}, "
          f"torch AdamW {adamw} for transformers + PEFT; threads {torch.get_num_threads()}, {args.clock} clock, "
          f"glibc's default allocator for every side (one process)")
    print(f"{'run':<15} {'step ms':>10} {'tokens/s':>10} {'trainable state':>16}")
    for k in SIDES:
        print(f"{k:<15} {1e3 * med[k]:>10.1f} {tok / med[k]:>10.0f} {state[k] / 1e6:>13.2f} MB")
    per_repeat = timed.ratios("hf_peft", "ours_lora")
    share = state["ours_lora"] / state["ours_full"]
    print(f"LoRA step: ours {speed:.2f}x transformers + PEFT (per repeat {min(per_repeat):.2f}-{max(per_repeat):.2f}; "
          f"goal >= 1.5); "
          f"ours LoRA / ours full step time {med['ours_lora'] / med['ours_full']:.2f}")
    print(f"trainable state: ours LoRA {100 * share:.2f}% of our full fine-tune's (goal < 5%); "
          f"transformers + PEFT {state['hf_peft'] / state['ours_lora']:.2f}x ours")
    mx_base, bf_base = base["ours_lora_mxfp4"], base["ours_lora"]
    print(f"MXFP4 base (lora.base_experts=mxfp4) vs bf16 base: step time {med['ours_lora_mxfp4'] / med['ours_lora']:.2f}x; "
          f"frozen base {mx_base['base'] / 1e6:.2f} MB vs {bf_base['base'] / 1e6:.2f} MB "
          f"({mx_base['base'] / bf_base['base']:.3f}); expert weights {mx_base['experts'] / 1e6:.2f} MB vs "
          f"{bf_base['experts'] / 1e6:.2f} MB ({mx_base['experts'] / bf_base['experts']:.4f})")
    run.extra.update(torch_adamw_for_peft=adamw, state_share_of_full=share, frozen_base_bytes=base)
    if args.profile:
        share_ours = profile_steps("ours_lora", ours, args.profile)
        share_hf = profile_steps("hf_peft", theirs, args.profile)
        # What bounds the ratio: with every non-GEMM operator of ours free, our step is its GEMM share
        # of the measured median (the GEMMs as fast as they ran).
        ceiling = med["hf_peft"] / (med["ours_lora"] * share_ours)
        run.extra["ceiling_non_gemm_free"] = ceiling
        print(f"\nGEMM share of the step: ours-LoRA {100 * share_ours:.0f}%, transformers + PEFT {100 * share_hf:.0f}%; "
              f"ours / theirs ceiling with every non-GEMM operator of ours free: {ceiling:.2f}x")
    run.finish()


if __name__ == "__main__":
    main()
