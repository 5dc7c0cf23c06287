"""Measure the trainer/engine routing mismatch of gptoss rollouts in bf16, without and with routing replay.

Per preset and seed: a randomly initialised model in bf16 samples one rollout (8 random prompts of 6-13
tokens x 16 tokens, temperature 1) with gptoss's engine, which records every fed token's experts; the
trainer's full forward of the same rows (other kernels and shapes than the KV cache's decode, so bf16
rounds differently) then runs routing live (`none`) and replaying the engine's experts (`rollout`,
rl.routing_replay's R3). Per mode, what a GRPO step logs at the rollout's weights (rl/objective.py computes
both): `routing_flip_rate`, the share of token-layer pairs whose trainer top-k set differs from the
engine's, and `mismatch_kl`, the per-token KL(engine || trainer) estimate of the sampled tokens; and
whether every replayed token went to exactly the engine's experts. tests/rl/replay_mismatch.py is the
measurement, shared with the test that asserts the ordering (tests/rl/test_routing_replay.py).

Presets: `tiny` (4 experts, top-2), `small` (tiny with 16 experts, top-4: near-ties are common),
`medium` (bench/peers.py: 512 wide, 16 experts, top-4). Accuracy, not time: no clock is compared.

    python bench/rl_replay.py --presets tiny small medium --seeds 8 --json bench/results/rl-replay.json
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench import harness  # noqa: E402
from bench.peers import bench_arch  # noqa: E402

SMALL = "num_local_experts=16,num_experts_per_tok=4"


def arch_of(name: str):
    return bench_arch("tiny", SMALL) if name == "small" else bench_arch(name)


def main() -> int:
    import torch

    from tests.rl.replay_mismatch import MODES, measure

    p = harness.parser(__doc__)
    p.add_argument("--presets", nargs="+", default=["tiny", "small", "medium"], help="tiny, small or medium")
    p.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1 per preset")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'preset':<8} {'seed':>4}  {'flips none':>10} {'flips R3':>9}  {'mismatch_kl none':>16} "
          f"{'mismatch_kl R3':>14}  {'none / R3':>9}  replayed as engine")
    with harness.Run("rl_replay", args) as run:
        for name in args.presets:
            arch = arch_of(name)
            rows = [measure(arch, seed) for seed in range(args.seeds)]
            for seed, r in enumerate(rows):
                n, m = r["none"], r["rollout"]
                print(f"{name:<8} {seed:>4}  {100 * n['routing_flip_rate']:>9.2f}% {100 * m['routing_flip_rate']:>8.2f}%  "
                      f"{n['mismatch_kl']:>16.3g} {m['mismatch_kl']:>14.3g}  {n['mismatch_kl'] / m['mismatch_kl']:>8.1f}x  "
                      f"{'yes' if m['replayed_as_engine'] else 'NO'}")
            for mode in MODES:
                run.add(name, mode, "routing_flip_share", [r[mode]["routing_flip_rate"] for r in rows])
                run.add(name, mode, "mismatch_kl", [r[mode]["mismatch_kl"] for r in rows])
            ratio = run.ratio(name, "none", "rollout", "mismatch_kl", name="mismatch_kl none / rollout replay")
            print(f"{name:<8} mismatch_kl falls {ratio['median']:.1f}x with replay (median over {args.seeds} seeds, "
                  f"{ratio['min']:.1f}x - {ratio['max']:.1f}x); flip rate without replay median "
                  f"{100 * statistics.median(r['none']['routing_flip_rate'] for r in rows):.2f}%")
            run.extra[name] = rows
    run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
