"""The trainer/engine mismatch of one gptoss rollout, measured without and with routing replay (what a GRPO
step logs at the rollout's weights): shared by tests/rl/test_routing_replay.py and bench/rl_replay.py.

A randomly initialised model in the recipe's dtype samples completions of random prompts with gptoss's
engine (rl/sampling.py: the KV cache's decode path, every fed token's experts recorded); the trainer's
forward of the same rows (the full forward: other kernels and shapes, so bf16 rounds differently) is then
run routing live (`none`) and replaying the engine's experts (`rollout`). Per mode: `routing_flip_rate`
and `mismatch_kl` as rl/objective.py defines them (its own loss computes them), and whether every token
with engine ids went to exactly those experts.
"""

from __future__ import annotations

from typing import Any

import torch

from gptoss_cli.generate.decode import Sampling
from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.routes import ExpertRoutes
from gptoss_cli.rl.batch import SampledCompletion, completion_rows
from gptoss_cli.rl.objective import GRPOObjective
from gptoss_cli.rl.sampling import sample_completions

MODES = ("none", "rollout")


def rollout_rows(arch: Any, seed: int, *, prompts: int = 8, new_tokens: int = 16, dtype=torch.bfloat16):
    """(model, microbatch): `prompts` random prompts of 6..13 tokens, each sampled once for `new_tokens`."""
    torch.manual_seed(seed)
    model = HybridModel(arch).to(dtype).train()
    g = torch.Generator().manual_seed(seed + 1000)
    ids = [torch.randint(0, arch.vocab_size, (6 + i % 8,), generator=g).tolist() for i in range(prompts)]
    samples = sample_completions(model, ids, max_new_tokens=new_tokens, stop_ids=[], sampling=Sampling(1.0, 1.0),
                                 generator=torch.Generator().manual_seed(seed), routes=True)
    completions = [SampledCompletion(i, p, *s) for i, (p, s) in enumerate(zip(ids, samples))]
    seq = max(len(p) for p in ids) + new_tokens
    return model, completion_rows(completions, [0.0] * len(completions), seq, torch.device("cpu"))


def used_experts(model: HybridModel) -> tuple[list, list]:
    """Hooks recording the experts every router sent its tokens to (after replay); (ids per forward, handles)."""
    used: list = []
    handles = [layer.mlp.router.register_forward_hook(lambda m, i, o: used.append(o.indices))
               for _, layer in model.moe_layers()]
    return used, handles


@torch.no_grad()
def measure(arch: Any, seed: int, **rows: Any) -> dict[str, dict[str, float]]:
    """{mode: {routing_flip_rate, mismatch_kl, replayed_as_engine}} of one rollout (see the module docstring)."""
    model, mb = rollout_rows(arch, seed, **rows)
    engine = mb.routes.engine
    out: dict[str, dict[str, float]] = {}
    for mode in MODES:
        used, handles = used_experts(model)
        output = model(mb.tokens, routes=ExpertRoutes(engine=engine, replay=engine if mode == "rollout" else None))
        for h in handles:
            h.remove()
        _, _, logs = GRPOObjective().loss(mb, None, output)
        as_engine = True
        for i, ids in enumerate(used):  # layer i: every token with engine ids went to those experts
            given = engine[:, :, i, 0] >= 0
            as_engine &= torch.equal(ids.reshape(*engine.shape[:2], -1)[given].sort(-1).values,
                                     engine[:, :, i][given].long().sort(-1).values)
        out[mode] = {"routing_flip_rate": float(logs["route_flip_sum"] / logs["route_pairs"]),
                     "mismatch_kl": float(logs["mismatch_sum"] / logs["completion_tokens"]),
                     "replayed_as_engine": float(as_engine)}
    return out


__all__ = ["MODES", "measure", "rollout_rows", "used_experts"]
