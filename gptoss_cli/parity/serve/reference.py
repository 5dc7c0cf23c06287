"""gptoss's side of serve-check: its own forward of the checkpoint on the same ids, with the error budget.

Per prompt: gptoss's greedy continuation (the KV-cache decoding `gptoss generate` runs), then one
forward over prompt + continuation that keeps the log-probabilities of every next token, the final
normalised hidden states and the output weight (for the budget, budget.py) and every router's
input and logits (for near-ties); then, where routers are near-tied, batched forwards with each such
token's routers flipped (how far a flip on the engine's side can move each position).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gptoss_cli.parity.serve.budget import logit_budgets, router_near_ties


MAX_FLIPS = 64  # near-tie tokens flipped one by one; the rest together
FLIP_BATCH = 16  # rows per batched forward


@dataclass
class Reference:
    """gptoss's numbers for one prompt (sequence = prompt + gptoss's greedy continuation)."""

    name: str
    prompt_len: int
    ids: list[int]  # the scored sequence
    greedy: list[int]  # gptoss's greedy continuation (ids[prompt_len:])
    logprobs: torch.Tensor  # [len(ids) - 1, V] float64: row p is token p + 1's distribution
    budget: torch.Tensor  # [len(ids) - 1]
    logit_bound: torch.Tensor  # [len(ids)]
    near_tie: torch.Tensor  # [len(ids)] bool
    near_tie_layers: dict[int, list[int]] = field(default_factory=dict)
    # [len(ids) - 1]: how far gptoss's logprobs move with every near-tie router flipped (0 without near-ties)
    flip_spread: torch.Tensor | None = None


def _routers(model) -> list:
    from gptoss_cli.model.moe import Router

    return [m for m in model.modules() if isinstance(m, Router)]


def _capture_hooks(model, captured: list):
    """Keep every router's (input, weight, logits), in block order."""
    def hook(mod, inputs, output):
        x = inputs[0].detach()
        captured.append((x.reshape(-1, x.shape[-1]), mod.weight.detach(),
                         output.logits.detach().reshape(-1, output.logits.shape[-1])))
    return [r.register_forward_hook(hook) for r in _routers(model)]


def _flip_hooks(model, ties: list[torch.Tensor]):
    """Where `ties[block]` ([rows * T] bool, the batch flattened) is set, that block's router chooses the
    (k+1)-th expert instead of the k-th."""
    from gptoss_cli.model.moe import RouterOutput

    def make(tie: torch.Tensor):
        def hook(mod, inputs, output):
            logits = output.logits
            flat = logits.reshape(-1, logits.shape[-1])
            order = flat.argsort(dim=-1, descending=True)[:, : mod.top_k + 1]
            chosen = order[:, : mod.top_k].clone()
            rows = tie.nonzero().flatten()
            chosen[rows, mod.top_k - 1] = order[rows, mod.top_k]
            top = flat.gather(1, chosen)
            shape = output.indices.shape
            return RouterOutput(logits=logits, probs=torch.softmax(top, dim=-1).reshape(shape),
                                indices=chosen.reshape(shape))
        return hook
    return [r.register_forward_hook(make(t)) for r, t in zip(_routers(model), ties)]


def _forward(model, ids: list[int], hooks, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids] * rows, device=next(model.parameters()).device))
            hidden = out.hidden.reshape(-1, out.hidden.shape[-1]).detach()
            logits = out.logits.reshape(rows, len(ids), -1).detach().squeeze(0)
    finally:
        for h in hooks:
            h.remove()
    return hidden, out.head_weight.detach(), logits


def flip_spread(model, ids: list[int], ties: list[torch.Tensor], near: torch.Tensor,
                logprobs: torch.Tensor) -> torch.Tensor:
    """Per position, the sum over near-tie tokens q of how far flipping q's near-tie routers (alone) moves
    gptoss's logprobs there (max over the vocabulary): a first-order envelope of any subset of flips
    the engine's rounding may take. One batched forward, a row per flipped token; past MAX_FLIPS
    tokens the rest are flipped together in one more row."""
    spread = torch.zeros(len(ids) - 1, dtype=torch.float64)
    positions = near.nonzero().flatten().tolist()
    if not positions:
        return spread
    groups = [[q] for q in positions[:MAX_FLIPS]] + ([positions[MAX_FLIPS:]] if positions[MAX_FLIPS:] else [])
    for start in range(0, len(groups), FLIP_BATCH):
        batch = groups[start:start + FLIP_BATCH]
        masks = []
        for t in ties:
            rows = torch.zeros(len(batch), len(ids), dtype=torch.bool)
            for r, group in enumerate(batch):
                rows[r, group] = t[group]
            masks.append(rows.flatten())
        _, _, flipped = _forward(model, ids, _flip_hooks(model, masks), rows=len(batch))
        flipped = flipped.reshape(len(batch), len(ids), -1)
        moved = (torch.log_softmax(flipped.double(), dim=-1)[:, :-1] - logprobs).abs().max(dim=-1).values
        spread += moved.sum(dim=0)
    return spread


def reference_for(model, name: str, prompt: list[int], *, greedy_tokens: int, dtype: torch.dtype) -> Reference:
    """gptoss's greedy continuation of `prompt`, then the forward over prompt + continuation (no grad)."""
    from gptoss_cli.generate.decode import Sampling, generate_ids

    arch = model.arch
    greedy: list[int] = []
    if greedy_tokens > 0:
        gen = generate_ids(model, [prompt], max_new_tokens=greedy_tokens, stop_ids=[], sampling=Sampling())
        greedy = list(gen[0].output_ids)
    ids = list(prompt) + greedy
    captured: list = []
    hidden, head, logits = _forward(model, ids, _capture_hooks(model, captured))
    logprobs = torch.log_softmax(logits.double(), dim=-1)[:-1]
    n_terms = max(arch.hidden_size, arch.intermediate_size, arch.head_dim, len(ids))
    budget, bound = logit_budgets(hidden.float(), head.float(), logits.float(), dtype, arch.num_hidden_layers, n_terms)
    ties = router_near_ties([(x.float(), w.float(), lg.float()) for x, w, lg in captured],
                            arch.num_experts_per_tok, dtype, n_terms)
    near = torch.stack(ties).any(dim=0) if ties else torch.zeros(len(ids), dtype=torch.bool)
    flip = flip_spread(model, ids, ties, near, logprobs)
    layers = {int(p): [b for b, t in enumerate(ties) if t[p]] for p in near.nonzero().flatten().tolist()}
    return Reference(name, len(prompt), ids, greedy, logprobs.cpu(), budget[:-1].cpu(), bound.cpu(), near.cpu(),
                     layers, flip.cpu())


def references(checkpoint: str, prompts: list[tuple[str, list[int]]], *, dtype: torch.dtype, greedy_tokens: int,
               device: str = "cpu") -> list[Reference]:
    """gptoss's Reference of every prompt; the model is loaded once and dropped before returning."""
    from gptoss_cli.checkpoint.load import model_from_checkpoint

    model = model_from_checkpoint(checkpoint, dtype=dtype, device=device).eval()
    try:
        return [reference_for(model, name, ids, greedy_tokens=greedy_tokens, dtype=dtype) for name, ids in prompts]
    finally:
        del model


__all__ = ["Reference", "reference_for", "references"]
