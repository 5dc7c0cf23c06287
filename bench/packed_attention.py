"""Benchmark per-document attention on packed rows: our per-document loop vs one block-diagonal masked SDPA call.

`document_attention` (gptoss_cli/model/attention.py) runs the sink attention once per document of a
packed row. The peer is what an SDPA user without a varlen kernel writes: one
`scaled_dot_product_attention` over the whole row with a boolean mask that is block-diagonal
(documents), causal, windowed (sliding layers) and has the sink column, computing every masked
score. Both compute the same attention (checked here before timing). Forward + backward, GPT-OSS's
head layout scaled down (--heads query heads over --kv kv heads of 64), rows of --seq tokens split
into --docs equal documents, full and sliding (window 128) layers.

Prints per setting the median over --repeats of the forward+backward time (wall clock; the three
sides interleaved, the order rotating each round) and the ratio masked / ours (> 1: ours is faster),
the median of the per-round ratios, plus the unpacked row (one causal sequence) for scale.

    python bench/packed_attention.py --seq 1024 --docs 1,4,16,64 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import harness  # noqa: E402
from gptoss_cli.model.attention.backends import document_attention, sink_attention  # noqa: E402


def masked_peer(q, k, v, sinks, window, cu):
    """One SDPA call over the row: the sink as an extra key (score sink_h, value 0), then a mask."""
    b, nh, s, d = q.shape
    doc = torch.zeros(b * s, dtype=torch.long)
    doc[torch.tensor(cu[1:-1], dtype=torch.long)] = 1
    doc = doc.cumsum(0).view(b, s)
    qi = torch.arange(s)[:, None]
    ki = torch.arange(s)[None, :]
    visible = (doc[:, :, None] == doc[:, None, :]) & (ki <= qi)
    if window is not None:
        visible &= ki > qi - window
    mask = torch.cat([torch.ones(b, s, 1, dtype=torch.bool), visible], dim=2)[:, None]
    scores_sink = sinks.view(1, nh, 1, 1).expand(b, nh, s, 1)
    # sink as a key whose score is the sink logit: q . k_sink / sqrt(d) = sink  ->  append a feature
    q_aug = torch.cat([q, scores_sink, q.new_zeros(b, nh, s, 7)], dim=-1)
    k_sink = k.new_zeros(b, k.shape[1], 1, d + 8)
    k_sink[..., d] = d**0.5
    keys = torch.cat([k_sink, F.pad(k, (0, 8))], dim=2)
    values = F.pad(F.pad(v, (0, 8)), (0, 0, 1, 0))
    out = F.scaled_dot_product_attention(q_aug, keys, values, attn_mask=mask, scale=d**-0.5,
                                         enable_gqa=k.shape[1] != nh)
    return out[..., :d]


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--docs", default="1,4,16,64")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    s, d = args.seq, 64
    q = torch.randn(1, args.heads, s, d, requires_grad=True)
    k = torch.randn(1, args.kv, s, d, requires_grad=True)
    v = torch.randn(1, args.kv, s, d, requires_grad=True)
    sinks = torch.randn(args.heads, requires_grad=True)
    inputs = (q, k, v, sinks)

    def clear_grads() -> None:
        for t in inputs:
            t.grad = None

    def fwd_bwd(fn):
        return lambda: fn(*inputs).square().sum().backward()

    print(f"rows of {s} tokens, {args.heads} query / {args.kv} kv heads of {d}; median of {args.repeats}, "
          f"forward + backward, {torch.get_num_threads()} threads")
    print(f"{'layer':<8}{'docs':>6}{'ours ms':>10}{'masked ms':>11}{'masked/ours':>13}{'unpacked ms':>13}")
    with harness.Run("packed_attention", args, clock="wall") as run:
        for window in (None, 128):
            for n in (int(x) for x in args.docs.split(",")):
                cu = tuple(range(0, s + 1, s // n))
                cu = cu if cu[-1] == s else cu + (s,)
                with torch.no_grad():
                    a = document_attention(q, k, v, sinks, window, cu)
                    b = masked_peer(q, k, v, sinks, window, cu)
                    assert torch.allclose(a, b, atol=1e-5), (window, n, (a - b).abs().max())
                sides = {"ours": fwd_bwd(lambda q, k, v, sk: document_attention(q, k, v, sk, window, cu)),
                         "masked": fwd_bwd(lambda q, k, v, sk: masked_peer(q, k, v, sk, window, cu)),
                         "unpacked": fwd_bwd(lambda q, k, v, sk: sink_attention(q, k, v, sk, window))}
                timed = harness.interleave(sides, args.repeats, clock="wall", before=clear_grads)
                name = "full" if window is None else f"win{window}"
                case = f"{name}, {n} docs"
                run.add_rounds(case, timed, ("time_s",))
                ratio = run.ratio(case, "masked", "ours")["median"]
                ms = {k: 1e3 * timed.median(k) for k in sides}
                print(f"{name:<8}{n:>6}{ms['ours']:>10.2f}{ms['masked']:>11.2f}{ratio:>13.2f}{ms['unpacked']:>13.2f}")
    run.finish()


if __name__ == "__main__":
    main()
