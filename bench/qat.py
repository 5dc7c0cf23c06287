"""MXFP4 QAT against post-training quantisation: how much of a fine-tune survives the MXFP4 export.

The tiny GPT-OSS model (same architecture, H=64, I=96, 4 experts) starts from a seeded random
init whose experts are rounded to MXFP4 (as GPT-OSS is released: a fine-tune starts on the grid
and small updates are what post-training rounding erases) and is fine-tuned, through the real training stack (schedule, gradient buffers, distributed
AdamW, fp32 parameters, one process), on a shifted distribution: token windows drawn from a fixed
random sparse Markov chain (each token has 4 likely successors), which the base model knows
nothing of. Three runs per seed, the same data and steps:

  full  precision.qat=none, evaluated in full precision (the fine-tune at its best)
  ptq   the same weights, exported to MXFP4 (every expert weight rounded as `convert --experts
        mxfp4` writes it; tests/train/test_qat.py proves the export equals this rounding bit for bit)
  qat   precision.qat=mxfp4, exported the same way (which equals its own training forward)
  full-then-qat  the full run's weights after steps - qat_steps steps, then QAT for the rest
        (ModelOpt's SFT -> QAT workflow; fresh Adam moments), exported the same way

Held-out loss (mean token cross-entropy on windows the runs never saw) of each, and two gaps:

  export gap  (the issue's measure: the export against the model that was trained)
      PTQ: loss(ptq) - loss(full)       QAT: loss(qat export) - loss(qat's own forward)
  quality gap (the export against the full-precision fine-tune of the same seed)
      PTQ: loss(ptq) - loss(full)       QAT: loss(qat export) - loss(full)

with the ratio QAT / PTQ of each, median and [min, max] over seeds. Goal (issue 25): export-gap
ratio < 1/3. QAT's export gap is zero by construction (the forward is the export); the quality
gap says whether training with rounded weights also ends better than rounding afterwards, which
in this tiny setting depends on the steps and the learning rate (see docs/qat.md).

    python bench/qat.py                      # 3 seeds x 120 steps, about 5 minutes on 2 CPU cores
    python bench/qat.py --seeds 5 --steps 200
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import harness  # noqa: E402
from gptoss_cli.model.config import preset  # noqa: E402
from gptoss_cli.model.moe import ExpertLinear  # noqa: E402
from gptoss_cli.model.mxfp4.qat import rounded_weight  # noqa: E402
from gptoss_cli.model.pattern import default_pattern  # noqa: E402
from gptoss_cli.parallel.grads import unwrap_model  # noqa: E402
from gptoss_cli.parallel.state import ParallelState  # noqa: E402
from gptoss_cli.recipe.schema import RecipeConfig  # noqa: E402
from gptoss_cli.schedule import get_forward_backward_func  # noqa: E402
from gptoss_cli.train.data import DataLoaderState  # noqa: E402
from gptoss_cli.train.objective import forward_step  # noqa: E402
from gptoss_cli.train.provider import HybridModelProvider, ModelRuntimeConfig  # noqa: E402
from gptoss_cli.train.setup import setup_model_and_optimizer  # noqa: E402

ARCH = preset("tiny")


class MarkovTokens:
    """Windows of a fixed random Markov chain: each token's next token is one of `fanout` successors
    (fixed per token, drawn with fixed probabilities). Sample i is the same for every run."""

    def __init__(self, vocab: int, seq: int, chain_seed: int, offset: int = 0, fanout: int = 4):
        g = torch.Generator().manual_seed(chain_seed)
        self.vocab, self.seq, self.offset = vocab, seq, offset
        self.successors = torch.randint(0, vocab, (vocab, fanout), generator=g)
        self.probs = torch.softmax(torch.randn(vocab, fanout, generator=g) * 1.5, dim=-1)

    def sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1_000_003 * (index + self.offset) + 17)
        out = torch.empty(self.seq + 1, dtype=torch.long)
        out[0] = torch.randint(0, self.vocab, (1,), generator=g)
        choice = torch.multinomial(self.probs, self.seq, replacement=True, generator=g)  # [vocab, seq]
        for t in range(self.seq):
            tok = int(out[t])
            out[t + 1] = self.successors[tok, choice[tok, t]]
        return out


class Mxfp4BaseProvider(HybridModelProvider):
    """The seeded model with its experts on the MXFP4 grid, as GPT-OSS is released (or, with `start`,
    the weights of an earlier run); set before the optimizer copies its master weights."""

    def __init__(self, *args, start: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = start

    def provide(self, state):
        model = super().provide(state)
        with torch.no_grad():
            if self.start is not None:
                model.load_state_dict(self.start)
                return model
            for m in model.modules():
                if isinstance(m, ExpertLinear):
                    m.weight.copy_(rounded_weight(m.weight))
        return model


def fine_tune(seed: int, qat: str, steps: int, lr: float, seq: int, batch: int, *, start: dict | None = None,
              first_step: int = 0, snapshot_at: int | None = None):
    """The trained model (and, with `snapshot_at`, a copy of its weights after that many steps).
    `start`/`first_step` continue an earlier run: its weights, its data position and lr schedule
    (the Adam moments start afresh)."""
    cfg = RecipeConfig()
    cfg.precision.params_dtype, cfg.precision.qat = "fp32", qat
    cfg.moe.aux_loss_coeff = 0.01
    cfg.optimizer.weight_decay, cfg.optimizer.clip_grad = 0.0, 1.0
    runtime = ModelRuntimeConfig.from_recipe(cfg, ARCH, default_pattern(ARCH))
    provider = Mxfp4BaseProvider(runtime, seed=seed, start=start)
    setup = setup_model_and_optimizer(provider, ParallelState(), cfg.optimizer, lr)
    data = DataLoaderState(MarkovTokens(ARCH.vocab_size, seq, chain_seed=seed), global_batch_size=batch,
                           micro_batch_size=batch, dp_rank=0, dp_size=1, consumed_samples=first_step * batch)
    schedule = get_forward_backward_func(setup.config)
    snapshot = None
    for step in range(first_step, first_step + steps):
        if step == snapshot_at:
            snapshot = {k: v.detach().clone() for k, v in unwrap_model(setup.model).state_dict().items()}
        setup.model.zero_grad_buffer()
        schedule(forward_step_func=forward_step, data_iterator=data.step_iterator(), model=setup.model,
                 num_microbatches=data.num_microbatches)
        warm = min(1.0, (step + 1) / 10)
        setup.optimizer.step(lr * warm)
    return unwrap_model(setup.model), snapshot


@torch.no_grad()
def held_out_loss(model, seed: int, seq: int, rows: int) -> float:
    held = MarkovTokens(ARCH.vocab_size, seq, chain_seed=seed, offset=10_000_000)  # windows never trained on
    windows = torch.stack([held.sample(i) for i in range(rows)])
    logits = model.eval()(windows[:, :-1]).logits.float()
    model.train()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item()


@torch.no_grad()
def export_mxfp4(model) -> None:
    """In place: the expert weights as `convert --experts mxfp4` writes them, plain GEMMs (no QAT)."""
    model.set_gemms(grouped=None)
    for m in model.modules():
        if isinstance(m, ExpertLinear):
            m.weight.copy_(rounded_weight(m.weight))


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--qat-steps", type=int, default=40, help="QAT steps of the full-then-QAT run (of --steps)")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--eval-rows", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = []
    run = harness.Run("qat", args, clock="wall").__enter__()
    for seed in range(args.seeds):
        r: dict[str, float] = {}
        split = args.steps - args.qat_steps
        full, snap = fine_tune(seed, "none", args.steps, args.lr, args.seq, args.batch, snapshot_at=split)
        r["full"] = held_out_loss(full, seed, args.seq, args.eval_rows)
        export_mxfp4(full)
        r["ptq"] = held_out_loss(full, seed, args.seq, args.eval_rows)
        qat, _ = fine_tune(seed, "mxfp4", args.steps, args.lr, args.seq, args.batch)
        r["qat_trained"] = held_out_loss(qat, seed, args.seq, args.eval_rows)  # its own (rounded) forward
        export_mxfp4(qat)
        r["qat"] = held_out_loss(qat, seed, args.seq, args.eval_rows)
        # SFT then QAT (ModelOpt's workflow): the full run's weights after `split` steps, QAT for the rest
        after, _ = fine_tune(seed, "mxfp4", args.qat_steps, args.lr, args.seq, args.batch, start=snap, first_step=split)
        export_mxfp4(after)
        r["after"] = held_out_loss(after, seed, args.seq, args.eval_rows)
        r["after_gap"] = r["after"] - r["full"]
        r["ptq_gap"] = r["ptq"] - r["full"]  # PTQ's export gap and quality gap are the same number
        r["qat_export_gap"], r["qat_quality_gap"] = r["qat"] - r["qat_trained"], r["qat"] - r["full"]
        r["export_ratio"] = r["qat_export_gap"] / r["ptq_gap"] if r["ptq_gap"] > 0 else float("nan")
        r["quality_ratio"] = r["qat_quality_gap"] / r["ptq_gap"] if r["ptq_gap"] > 0 else float("nan")
        rows.append(r)
        r["after_ratio"] = r["after_gap"] / r["ptq_gap"] if r["ptq_gap"] > 0 else float("nan")
        print(f"seed {seed}: loss full {r['full']:.4f}  ptq {r['ptq']:.4f}  qat trained {r['qat_trained']:.4f} "
              f"qat export {r['qat']:.4f}  full-then-qat export {r['after']:.4f}", flush=True)
    base = held_out_loss(fine_tune(0, "none", 0, args.lr, args.seq, args.batch)[0], 0, args.seq, args.eval_rows)

    def med(key: str, fmt: str = "+.4f") -> str:
        s = harness.stats([r[key] for r in rows])
        return f"{s['median']:{fmt}} [{s['min']:{fmt}}, {s['max']:{fmt}}]"

    case = f"tiny, {args.steps} steps, lr {args.lr}"  # one value per seed
    for setting, key in (("full", "full"), ("ptq", "ptq"), ("qat (trained forward)", "qat_trained"),
                         ("qat", "qat"), ("full-then-qat", "after")):
        run.add(case, setting, "held_out_loss", [r[key] for r in rows])
    for name, key in (("export-gap ratio QAT / PTQ", "export_ratio"), ("quality-gap ratio QAT / PTQ", "quality_ratio"),
                      ("quality-gap ratio full-then-QAT / PTQ", "after_ratio")):
        run.ratio(case, "qat", "ptq", "held_out_loss", name=name, values=[r[key] for r in rows])
    run.extra.update(untrained_held_out_loss=base, per_seed=rows)

    print(f"\n{args.seeds} seeds x {args.steps} steps (fp32 params, lr {args.lr}, {args.batch} x {args.seq} tokens/step), "
          f"{time.perf_counter() - t0:.0f} s; untrained model's held-out loss (seed 0) {base:.4f}")
    print("median [min, max] over seeds")
    print(f"  fine-tune gain (full - untrained)              {statistics.median(r['full'] for r in rows) - base:+.4f}")
    print(f"  PTQ gap (ptq export - full)                    {med('ptq_gap')}")
    print(f"  QAT export gap (export - its trained forward)  {med('qat_export_gap')}")
    print(f"  QAT quality gap (export - full)                {med('qat_quality_gap')}")
    print(f"  export-gap ratio QAT / PTQ                     {med('export_ratio', '.3f')}   goal < 0.333")
    print(f"  quality-gap ratio QAT / PTQ                    {med('quality_ratio', '.3f')}")
    print(f"  full then QAT ({args.qat_steps} steps): gap (export - full)  {med('after_gap')}")
    print(f"  quality-gap ratio full-then-QAT / PTQ          {med('after_ratio', '.3f')}")
    run.finish()


if __name__ == "__main__":
    main()
