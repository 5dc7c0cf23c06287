"""A rollout's expert routes (routing replay, docs/rl.md "Routing replay"): checked, mapped from vLLM, laid into rows.

Each sampled completion may carry the experts its engine sent every fed token to: a [prompt +
completion - 1, MoE layers, k] integer tensor (the prompt's tokens from the prefill, then every sampled
token but the last, which the engine never feeds back). This module

- checks one before anything trains on it (`check_routes`): every token has k distinct ids in
  [0, experts) for every MoE layer, none is missing or short, and a capture of zeros (vLLM's fused MoE
  capture has returned all-zero routes without an error) is refused as such. A bad capture stops the step
  with one line naming the step, the prompt and the layer: never a silent fallback to live routing;
- maps vLLM's `CompletionOutput.routed_experts` (numpy [tokens, HF layers, k], uint8 up to 256 experts,
  HF block numbering, the logical expert ids before any EPLB remapping; tokens: the prompt's and the fed
  completion's, as here) to this numbering: MoE layer i of the Hybrid pattern is HF block b(i), the
  block of the attention layer it follows (`vllm_routes`);
- lays a microbatch's completions into the trainer's rows (`rows_routes`): the ids at each token's
  position of its row, NO_ROUTE (-1: route live) where a row has no token the engine fed (the last
  sampled token, padding).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from gptoss_cli.errors import TrainingError
from gptoss_cli.model.pattern import ATTENTION, MOE
from gptoss_cli.model.routes import NO_ROUTE


def moe_blocks(layers: Sequence[str]) -> list[tuple[int, int]]:
    """(physical layer index, HF block) of every MoE layer of a Hybrid pattern's layer symbols, in order."""
    out, block = [], -1
    for j, symbol in enumerate(layers):
        if symbol == ATTENTION:
            block += 1
        elif symbol == MOE:
            out.append((j, block))
    return out


def check_routes(routes: torch.Tensor | None, *, tokens: int, layers: Sequence[tuple[int, int]], top_k: int,
                 num_experts: int, where: str) -> None:
    """Refuse (TrainingError, one line starting with `where`: the step and the prompt) a capture that is
    missing, short, of another shape, out of range, repeated within a token, or zeros."""
    hint = ("the rollout engine's capture is broken: train without it (rl.routing_replay=none, or "
            "rl.rollout.engine=gptoss) and report it")
    if routes is None:
        raise TrainingError(f"{where}: the rollout engine returned no expert routes", hint=hint)
    if routes.dim() != 3 or routes.shape[2] != top_k:
        raise TrainingError(f"{where}: expert routes of shape {tuple(routes.shape)}, not [tokens, MoE layers, "
                            f"{top_k}]", hint=hint)
    if routes.shape[1] != len(layers):
        short = len(layers) - routes.shape[1]
        first = layers[min(routes.shape[1], len(layers) - 1)][0]
        raise TrainingError(f"{where}: expert routes for {routes.shape[1]} MoE layers, the model has {len(layers)} "
                            f"({'missing' if short > 0 else 'extra'} from decoder.layers.{first})", hint=hint)
    if routes.shape[0] != tokens:
        raise TrainingError(f"{where}: expert routes for {routes.shape[0]} tokens; the prompt and the fed "
                            f"completion hold {tokens} (every MoE layer)", hint=hint)
    ids = routes.long()
    bad = (ids < 0) | (ids >= num_experts)
    zero = (ids == 0).all(-1).all(0)  # [L]: the layer routed every token to expert 0 k times
    repeated = (ids.sort(-1).values.diff(dim=-1) == 0).any(-1)  # [T, L]
    for i, (j, _) in enumerate(layers):
        name = f"MoE layer {i} (decoder.layers.{j})"
        if bool(zero[i]) and tokens:
            raise TrainingError(f"{where}: the expert routes of {name} are all zeros", hint=hint)
        if bool(bad[:, i].any()):
            t = int(bad[:, i].any(-1).nonzero()[0])
            raise TrainingError(f"{where}: token {t} of {name} is routed to expert {int(ids[t, i][bad[t, i]][0])}, "
                                f"outside [0, {num_experts})", hint=hint)
        if bool(repeated[:, i].any()):
            t = int(repeated[:, i].nonzero()[0])
            raise TrainingError(f"{where}: token {t} of {name} is routed to {ids[t, i].tolist()}: an expert twice",
                                hint=hint)


def vllm_routes(routed: Any, *, prompt: int, completion: int, layers: Sequence[tuple[int, int]]) -> torch.Tensor:
    """vLLM's routed_experts of one completion ([tokens, HF layers, k] array, see the module docstring) as
    this numbering's [prompt + completion - 1, MoE layers, k]: a longer array is cut to the tokens fed;
    a shorter or narrower one is kept as it is, for `check_routes` to refuse."""
    import numpy as np

    array = torch.from_numpy(np.ascontiguousarray(routed))
    fed = prompt + completion - 1
    if array.dim() != 3 or array.shape[1] <= max((b for _, b in layers), default=-1):
        return array
    blocks = torch.tensor([b for _, b in layers], dtype=torch.long)
    return array[:fed].index_select(1, blocks).clone()


def rows_routes(completions: Sequence[Any], seq_length: int) -> torch.Tensor | None:
    """[rows, seq_length, L, k] int16 ids at each fed token's position of its row (the prompt from 0, the
    completion after it), NO_ROUTE elsewhere; None when no completion carries routes."""
    have = [c.routes for c in completions if getattr(c, "routes", None) is not None]
    if not have:
        return None
    n_layers, k = have[0].shape[1:]
    out = torch.full((len(completions), seq_length, n_layers, k), NO_ROUTE, dtype=torch.int16)
    for i, c in enumerate(completions):
        if c.routes is not None:
            out[i, :c.routes.shape[0]] = c.routes.to(torch.int16)
    return out


__all__ = ["moe_blocks", "check_routes", "vllm_routes", "rows_routes"]
