"""Benchmark the sink attention's two paths: the flash kernel's log-sum-exp rescaled by the sink (unpadded) vs the padded head dim.

`sink_attention` (gptoss_cli/model/attention/backends.py) computes the sink softmax either through
model/attention/sink_flash.py (plain attention over the real keys at head dim d, its log-sum-exp rescaled
by the sink, with its own backward) or through SDPA with the sink as one more key, which pads the
head dim from d to d + 8. This times both, forward + backward, on the attention shapes of the
bench/train.py configs and of GPT-OSS, full (causal) and sliding-window layers, and checks first
that they agree (outputs and every gradient).

Then the same in a model of the bench/train.py configs, every attention layer set to one path
(`CoreAttention.backend`: flash or sdpa): its attention layers' forward + backward (QKV projection, core, output
projection, with the model's strides; 4 x --model-repeats rounds), and the whole model's forward
+ backward (training loss, no optimizer; losses checked equal to rounding), where the attention's
share of the step dilutes the gain.

Rounds alternate the two paths (unpadded, padded, padded, unpadded, ...), so host load hits both
alike; each call is timed by this process's CPU time on --threads threads (one by default).
Prints per shape the median time of each path and padded / unpadded (> 1: unpadded is faster)
as the median of the per-round ratios with their min-max; `--json FILE` writes the same.

    python bench/sink_attention.py --repeats 7 --model-repeats 5
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import harness  # noqa: E402
from bench.train import _arch  # noqa: E402
from gptoss_cli.model.attention.layer import AttentionLayer, CoreAttention  # noqa: E402
from gptoss_cli.model.attention.backends import sink_attention  # noqa: E402
from gptoss_cli.model.hybrid import HybridModel  # noqa: E402
from gptoss_cli.resources import keep_freed_memory  # noqa: E402

# name: (batch, query heads, kv heads, head dim, window of the sliding layers) at --seq tokens
SHAPES = {
    "512 config (tiny heads)": (2, 6, 2, 16, 8),
    "wide": (2, 8, 2, 64, 8),
    "gpt-oss (64 / 8 heads)": (1, 64, 8, 64, 128),
}


# name: (bench/train.py --preset, --arch) of the model-step section, at batch 2 x --seq tokens
MODELS = {
    "512 config": ("tiny", "hidden_size=512,intermediate_size=512,num_local_experts=16,num_experts_per_tok=4"),
    "wide": ("wide", None),
}


def _inputs(b, h, kv, d, s, dtype):
    g = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype).requires_grad_()  # noqa: E731
    return make(b, h, s, d), make(b, kv, s, d), make(b, kv, s, d), make(h)


def _step(inputs, window, padded: bool, grad) -> list[torch.Tensor]:
    for t in inputs:
        t.grad = None
    out = sink_attention(*inputs, window, "sdpa" if padded else "flash")
    out.backward(grad)
    return [out.detach(), *(t.grad for t in inputs)]


def _alternate(record: harness.Run, case: str, run, repeats: int) -> tuple[float, float, list[float]]:
    """run(padded) in rounds of two calls each (unpadded, padded, padded, unpadded, then rotated), CPU
    time, recorded as `case` -> (median unpadded s, median padded s, per-round ratios padded / unpadded)."""
    timed = harness.interleave({"unpadded": lambda: run(False), "padded": lambda: run(True)}, repeats, steps=2,
                               warmup=0, clock="cpu")
    record.add_rounds(case, timed)
    ratios = record.ratio(case, "padded", "unpadded")["values"]
    return timed.median("unpadded"), timed.median("padded"), ratios


def _set_path(model: HybridModel, padded: bool) -> None:
    for m in model.modules():
        if isinstance(m, CoreAttention):
            m.backend = "sdpa" if padded else "flash"


def _attention_layers(model: HybridModel, x: torch.Tensor, cos, sin, grad: torch.Tensor, padded: bool) -> None:
    """Forward + backward of every attention layer of `model` on the same input (QKV, core, projection)."""
    _set_path(model, padded)
    for layer in model.decoder.layers:
        if isinstance(layer, AttentionLayer):
            layer(x, cos, sin).backward(grad)


def _model_step(model: HybridModel, ids: torch.Tensor, padded: bool) -> float:
    _set_path(model, padded)
    out = model(ids[:, :-1])
    loss = out.lm_loss_sum(ids[:, 1:])
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.item()


def _print_row(name: str, layer: str, un: float, pad: float, ratios: list[float]) -> None:
    ratio = statistics.median(ratios)
    print(f"{name:<26}{layer:<8}{un * 1e3:>12.2f}{pad * 1e3:>11.2f}"
          f"{f'{ratio:.2f} ({min(ratios):.2f}-{max(ratios):.2f})':>28}")


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7, help="rounds; each times both paths twice")
    ap.add_argument("--model-repeats", type=int, default=3, help="rounds of the model-step section (0: skip it)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args()
    if (not 1 <= args.seq <= 1 << 16 or not 1 <= args.repeats <= 1000 or not 0 <= args.model_repeats <= 1000
            or not 1 <= args.threads <= 1024):
        ap.error("--seq must be 1..65536, --repeats 1..1000, --model-repeats 0..1000, --threads 1..1024")
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as `gptoss train` on the CPU: no page faults of freed and re-grown buffers
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    print(f"sink attention forward + backward, seq {args.seq}, {args.dtype}, {args.threads} thread(s), "
          f"CPU time, {args.repeats} alternating rounds")
    print(f"{'shape':<26}{'layer':<8}{'unpadded ms':>12}{'padded ms':>11}{'padded/unpadded (min-max)':>28}")
    rows = []
    record = harness.Run("sink_attention", args, clock="cpu").__enter__()
    for name, (b, h, kv, d, window) in SHAPES.items():
        inputs = _inputs(b, h, kv, d, args.seq, dtype)
        grad = torch.randn(b, h, args.seq, d, generator=torch.Generator().manual_seed(1)).to(dtype)
        for win in (None, window):
            ours = _step(inputs, win, False, grad)
            peer = _step(inputs, win, True, grad)
            for a, p, what in zip(ours, peer, ("out", "dq", "dk", "dv", "dsinks")):
                scale = p.double().abs().max().item()
                err = (a.double() - p.double()).abs().max().item()
                assert err <= (1e-2 if dtype == torch.bfloat16 else 1e-4) * scale, (name, win, what, err, scale)
            layer = "full" if win is None else f"win{win}"
            un, pad, ratios = _alternate(record, f"core, {name}, {layer}", lambda padded: _step(inputs, win, padded, grad),
                                         args.repeats)
            _print_row(name, layer, un, pad, ratios)
            rows.append({"shape": name, "batch": b, "heads": h, "kv_heads": kv, "head_dim": d, "seq": args.seq,
                         "window": win, "unpadded_ms": un * 1e3, "padded_ms": pad * 1e3,
                         "padded_over_unpadded": statistics.median(ratios), "ratio_min": min(ratios),
                         "ratio_max": max(ratios)})
    models = []
    if args.model_repeats:
        print(f"\nbatch 2 x {args.seq}: attn = every attention layer's forward + backward (QKV, core, projection; "
              f"{4 * args.model_repeats} rounds), step = the model's forward + backward (training loss, no optimizer; "
              f"{args.model_repeats} rounds)")
        for name, (preset_name, overrides) in MODELS.items():
            arch = _arch(preset_name, overrides)
            torch.manual_seed(0)
            model = HybridModel(arch, dtype=dtype).train()
            model.aux_loss_coef = 0.0
            ids = torch.randint(0, arch.vocab_size, (2, args.seq + 1), generator=torch.Generator().manual_seed(0))
            losses = [_model_step(model, ids, padded) for padded in (False, True)]  # also the warm-up
            assert abs(losses[0] - losses[1]) <= 1e-4 * abs(losses[1]), (name, losses)
            x = torch.randn(2, args.seq, arch.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
            cos, sin = model.rotary_pos_emb(torch.arange(args.seq)[None].expand(2, -1), x.dtype)
            grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
            x.requires_grad_()
            for part, run, rounds in (
                    ("attn", lambda padded: _attention_layers(model, x, cos, sin, grad, padded), 4 * args.model_repeats),
                    ("step", lambda padded: _model_step(model, ids, padded), args.model_repeats)):
                un, pad, ratios = _alternate(record, f"{part}, {name}", run, rounds)
                _print_row(name, part, un, pad, ratios)
                models.append({"model": name, "preset": preset_name, "arch": overrides, "seq": args.seq, "part": part,
                               "rounds": rounds, "unpadded_s": un, "padded_s": pad,
                               "padded_over_unpadded": statistics.median(ratios),
                               "ratio_min": min(ratios), "ratio_max": max(ratios)})
    record.extra.update(rows=rows, models=models)
    record.finish()


if __name__ == "__main__":
    main()
