"""Routing replay: the expert ids a forward is handed per token and MoE layer, and what it hands back.

A GRPO trainer recomputes the log-probabilities of tokens a rollout engine sampled; on a mixture of
experts the two route some tokens differently (a top-4 choice flips on a near-tie when kernels, batch
shapes or precisions round differently), and every flipped token is computed by other experts than
the ones that sampled it. Replay (docs/rl.md, "Routing replay") routes each token of the trainer's
forward to the experts the engine chose, and keeps the router learning: the combine weights are the
softmax of the LIVE router's logits gathered at the given ids, so their gradient reaches the router.

`ExpertRoutes` is what a forward takes (`HybridModel.forward(..., routes=)`): integer tensors
[B, S, L, k] of global expert ids per position of the rows and per MoE layer of the model (L: the
`E` layers of the full pattern, in order), -1 where a token has none (then it routes live):

- `engine`: the ids the rollout engine routed each token to. The forward counts, before any replay,
  per position the MoE layers whose live top-k SET differs from them (`routing_flip_rate`); each
  router counts on its own input, i.e. after the layers before it routed as the forward routes them;
- `replay`: route each token to these ids instead of its live top-k;
- `record`: hand back the forward's own live ids (what `rl.routing_replay: old_policy` replays).

Each MoE layer reads its slice through a `LayerRoutes` (`Router.forward(x, routes)`), which also keeps
what the layer found (flips, live ids); the model adds those up into its output
(`HybridOutput.route_flips`, `route_pairs`, `live_routes`). A recomputed forward (activation
recompute) routes the same tokens to the same ids: the ids ride in the checkpointed call's arguments.
Under context parallelism each rank holds a slice of every row; `context_slice` cuts the ids as the
tokens are cut, so each id stays with its token. Under expert parallelism the ids are global and the
dispatcher sends each token to the rank that holds its expert, as for live routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_ROUTE = -1  # a position without given ids: its token routes live


@dataclass
class ExpertRoutes:
    """Expert ids handed to one forward (see the module docstring); tensors [B, S, L, k]."""

    engine: torch.Tensor | None = None
    replay: torch.Tensor | None = None
    record: bool = False

    def context_slice(self, cp_size: int, cp_rank: int) -> "ExpertRoutes":
        """CP rank `cp_rank`'s contiguous slice of the rows, as Microbatch.context_slice cuts the tokens."""
        from gptoss_cli.model.context_parallel import slice_sequence

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None or cp_size == 1 else slice_sequence(t, cp_size, cp_rank)

        if cp_size == 1:
            return self
        return ExpertRoutes(engine=cut(self.engine), replay=cut(self.replay), record=self.record)

    def to(self, device: torch.device) -> "ExpertRoutes":
        return ExpertRoutes(engine=None if self.engine is None else self.engine.to(device),
                            replay=None if self.replay is None else self.replay.to(device), record=self.record)

    def layer(self, index: int) -> "LayerRoutes":
        """MoE layer `index`'s view: its [B*S, k] ids."""
        def of(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:, :, index].reshape(-1, t.shape[-1])

        return LayerRoutes(engine=of(self.engine), replay=of(self.replay), record=self.record)


class LayerRoutes:
    """One MoE layer's ids of a forward, and what its router found: `flips` and `pairs` ([T] int: the token
    has engine ids and its live top-k set differs from them; the token has engine ids), `live` [T, k]
    (when recording). A recompute of the layer sets them again to the same values."""

    def __init__(self, engine: torch.Tensor | None = None, replay: torch.Tensor | None = None, record: bool = False):
        self.engine, self.replay, self.record = engine, replay, record
        self.flips: torch.Tensor | None = None
        self.pairs: torch.Tensor | None = None
        self.live: torch.Tensor | None = None

    def route(self, logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, k], global expert ids [T, k]) of router logits [T, E]: the live top-k
        with the softmax over its k logits, or, for tokens with replay ids, those ids with the softmax
        over the live logits at them (docs/architecture.md, "Router"; the same softmax on the same
        values where the two agree)."""
        top, live = torch.topk(logits, top_k, dim=-1)
        with torch.no_grad():
            if self.record:
                self.live = live.detach()
            if self.engine is not None:
                given = self.engine[:, 0] >= 0
                same = (torch.sort(live, dim=-1).values == torch.sort(self.engine.long(), dim=-1).values).all(-1)
                self.flips = (given & ~same).to(torch.int32)
                self.pairs = given.to(torch.int32)
        if self.replay is None:
            return torch.softmax(top, dim=-1), live
        forced = (self.replay[:, :1] >= 0)
        indices = torch.where(forced, self.replay.long(), live)
        return torch.softmax(logits.gather(-1, indices), dim=-1), indices


def collect(layers: list[LayerRoutes], batch: int, seq: int) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                                      torch.Tensor | None]:
    """(flips, pairs [B, S]: summed over the MoE layers, live ids [B, S, L, k]; None where not counted or
    recorded) of one forward."""
    counted = [lr for lr in layers if lr.pairs is not None]
    flips = torch.stack([lr.flips for lr in counted]).sum(0).reshape(batch, seq) if counted else None
    pairs = torch.stack([lr.pairs for lr in counted]).sum(0).reshape(batch, seq) if counted else None
    live = None
    if layers and all(lr.live is not None for lr in layers):
        live = torch.stack([lr.live.reshape(batch, seq, -1) for lr in layers], dim=2)
    return flips, pairs, live


def routes_dtype(num_experts: int) -> torch.dtype:
    """The narrowest dtype a captured route is stored in (as vLLM returns them: uint8 up to 256 experts)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


__all__ = ["ExpertRoutes", "LayerRoutes", "NO_ROUTE", "collect", "routes_dtype"]
