"""Benchmark one attention layer's step (forward + backward) at context parallel 2 against CP=1.

The layer is gptoss's `AttentionLayer` (fused QKV + RMSNorm, YaRN RoPE, sinks, GQA) with GPT-OSS's
head layout scaled down to CPU size by default (16 query heads, 8 kv heads, head_dim 64, hidden 512),
a sliding-window layer (window 128) and a full-attention layer, on one row of --seq tokens, fp32.

  * baseline, CP=1: one process holding the whole row, with all --threads CPU threads (the strongest
    setting of the peer: one process uses every core);
  * CP=2: two gloo processes, --threads / 2 threads each, each holding half of the row; an
    all-to-all trades sequence halves for head halves around attention (model/context_parallel.py).

It prints, per layer kind, the median step time (over --repeats, after a warm-up; wall clock) per
token of the row, the ratio CP=2 / CP=1 (of the medians: CP=1 runs first in this process, then CP=2
in its two, so the two settings do not share rounds), and the all-to-all bytes one rank sends per step (counted on the wire by
wrapping the all-to-all; forward q, k, v and output, backward the same again), next to the
analytic count 2 x (2h + 2kv) x d x S/CP x (CP-1)/CP x 4 bytes. It also checks CP=2's output and
input gradient against CP=1's (max |diff|).

    python bench/context_parallel.py --seq 2048 --repeats 5 --threads 2
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench import harness  # noqa: E402
from gptoss_cli.model.config import preset  # noqa: E402


def make_arch(args):
    return replace(preset("tiny"), hidden_size=args.hidden, num_attention_heads=args.heads,
                   num_key_value_heads=args.kv_heads, head_dim=64, sliding_window=args.window)


def layer_and_input(args, window):
    from gptoss_cli.model.attention.layer import AttentionLayer
    from gptoss_cli.model.rope import YarnRotaryEmbedding

    arch = make_arch(args)
    torch.manual_seed(0)
    layer = AttentionLayer(arch, window)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(1, args.seq, args.hidden)
    cos, sin = YarnRotaryEmbedding(arch)(torch.arange(args.seq)[None], torch.float32)
    return layer, x, cos, sin


def time_steps(layer, x, cos, sin, repeats, group=None):
    """Seconds of forward + backward per round (after one warm-up; bench/harness.py, wall clock, the
    ranks meeting at a barrier before and after each step); output and dx of the last step."""
    last = {}

    def fresh_input() -> None:
        layer.zero_grad(set_to_none=True)
        last["x"] = x.detach().clone().requires_grad_()
        if group is not None:
            dist.barrier(group)

    def step() -> None:
        last["out"] = layer(last["x"], cos, sin)
        last["out"].backward(torch.ones_like(last["out"]))
        if group is not None:
            dist.barrier(group)

    timed = harness.interleave({"step": step}, repeats, warmup=1, clock="wall", before=fresh_input)
    return timed["step"]["time_s"], last["out"].detach(), last["x"].grad


def cp_worker(rank, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(max(1, args.threads // 2))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import gptoss_cli.model.dispatcher as dispatcher

    sent = [0]
    real = dispatcher.DIST_COMM.all_to_all  # what the differentiable all-to-all calls, forward and backward

    def counting(out, x, output_splits, input_splits, group, *, control=False):
        me = dist.get_rank(group)
        row = x[0].numel() * x.element_size()
        sent[0] += row * (sum(input_splits) - input_splits[me])
        return real(out, x, output_splits, input_splits, group, control=control)

    dispatcher.DIST_COMM.all_to_all = counting
    results = {}
    for kind, window in (("sliding", args.window), ("full", None)):
        layer, x, cos, sin = layer_and_input(args, window)
        layer.self_attention.cp_group = dist.group.WORLD
        half = args.seq // 2
        sl = slice(rank * half, (rank + 1) * half)
        sent[0] = 0
        times, out, dx = time_steps(layer, x[:, sl], cos[:, sl], sin[:, sl], args.repeats, dist.group.WORLD)
        results[kind] = {"times": times, "bytes": sent[0] // (args.repeats + 1), "out": out, "dx": dx}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        args.port = s.getsockname()[1]
    torch.set_num_threads(args.threads)
    run = harness.Run("context_parallel", args, clock="wall").__enter__()
    run.options.pop("port", None)
    base = {}
    for kind, window in (("sliding", args.window), ("full", None)):
        base[kind] = time_steps(*layer_and_input(args, window), args.repeats)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(cp_worker, args=(args, out_dir), nprocs=2, start_method="spawn")
        ranks = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(2)]
    cp, d = 2, 64
    analytic = 2 * (2 * args.heads + 2 * args.kv_heads) * d * (args.seq // cp) * (cp - 1) // cp * 4
    print(f"attention layer step, fp32, 1 row of {args.seq} tokens, hidden {args.hidden}, "
          f"{args.heads} heads / {args.kv_heads} kv heads x 64, {args.threads} threads in all")
    print(f"{'layer':8} {'CP=1 us/token':>14} {'CP=2 us/token':>14} {'CP2/CP1':>8} {'a2a MB/rank':>12} "
          f"{'analytic MB':>12} {'max|dout|':>10} {'max|dx|':>10}")
    for kind in ("sliding", "full"):
        t1, out1, dx1 = base[kind]
        t2 = [max(ts) for ts in zip(*(r[kind]["times"] for r in ranks))]  # the slower rank sets the step
        out2 = torch.cat([r[kind]["out"] for r in ranks], dim=1)
        dx2 = torch.cat([r[kind]["dx"] for r in ranks], dim=1)
        case = f"{kind} attention layer, {args.seq} tokens"
        run.add(case, "CP=1", "us_per_token", [1e6 * t / args.seq for t in t1])
        run.add(case, "CP=2", "us_per_token", [1e6 * t / args.seq for t in t2])
        run.add(case, "CP=2", "all_to_all_bytes", ranks[0][kind]["bytes"])
        run.add(case, "analytic", "all_to_all_bytes", analytic)
        s1, s2 = (run.cases[case]["settings"][k]["us_per_token"]["median"] for k in ("CP=1", "CP=2"))
        run.ratio(case, "CP=2", "CP=1", "us_per_token", values=[s2 / s1])
        diff = ((out2 - out1).abs().max().item(), (dx2 - dx1).abs().max().item())
        run.extra[f"{kind}_max_abs_diff_out_dx"] = diff
        print(f"{kind:8} {s1:14.2f} {s2:14.2f} {s2 / s1:8.2f} "
              f"{ranks[0][kind]['bytes'] / 1e6:12.2f} {analytic / 1e6:12.2f} {diff[0]:10.2e} {diff[1]:10.2e}")
    run.finish()


if __name__ == "__main__":
    main()
