"""gptoss's side of serve-check: its own forward of the checkpoint on the same ids, with the error budget.

Per prompt: gptoss's greedy continuation (the KV-cache decoding `gptoss generate` runs), then one
forward over prompt + continuation that keeps the log-probabilities of every next token, the logits
and every router's input, logits and choice (for near-ties); then one batched forward whose rows carry
the error model's roundings (budget.py), drawn at random after every sublayer with the routers held to
their choices, which says how far this model's own layers carry a rounding to each logprob (the
budget); then, where routers are near-tied, batched forwards with each such token's routers flipped
(how far a flip on the engine's side can move each position).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gptoss_cli.parity.serve.budget import (ROUNDING_SAMPLES, amplification, head_rounding_sd, logit_budgets,
                                            point_sigma, router_near_ties)


MAX_FLIPS = 64  # near-tie tokens flipped one by one; the rest together
FLIP_BATCH = 16  # rows per batched forward
ROUNDING_SEED = 0x5EED  # the injected roundings are drawn from a generator of their own: the budget is reproducible


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


def _capture_hooks(model, captured: list, chosen: list):
    """Keep every router's (input, weight, logits) and its chosen experts, in block order."""
    def hook(mod, inputs, output):
        x = inputs[0].detach()
        captured.append((x.reshape(-1, x.shape[-1]), mod.weight.detach(),
                         output.logits.detach().reshape(-1, output.logits.shape[-1])))
        chosen.append(output.indices.detach().reshape(-1, output.indices.shape[-1]))
    return [r.register_forward_hook(hook) for r in _routers(model)]


def _held_router_hooks(model, chosen: list[torch.Tensor], rows: int):
    """Every router takes the experts it chose in the plain forward (`chosen[block]`, [T, k]) in each of `rows`
    rows, weighted by the softmax of its own logits there: a rounding moves the weights, never the choice
    (a choice that a rounding can change is a near-tie, budgeted by the flips)."""
    from gptoss_cli.model.moe import RouterOutput

    def make(idx: torch.Tensor):
        def hook(mod, inputs, output):
            logits = output.logits
            flat = logits.reshape(-1, logits.shape[-1])
            keep = idx.to(flat.device).repeat(rows, 1)
            shape = output.indices.shape
            return RouterOutput(logits=logits, probs=torch.softmax(flat.gather(1, keep), dim=-1).reshape(shape),
                                indices=keep.reshape(shape))
        return hook
    return [r.register_forward_hook(make(c)) for r, c in zip(_routers(model), chosen)]


def _rounding_hooks(model, scale_of, generator: torch.Generator):
    """At every rounding point of budget.ROUNDING_POINTS (a module's output; "residual" is each decoder layer's), the
    output times (1 + scale_of(point) * xi), xi ~ N(0, 1) per element."""
    from gptoss_cli.parity.serve.budget import ROUNDING_POINTS

    def make(scale: float):
        def hook(mod, inputs, output):
            x = output[0] if isinstance(output, tuple) else output
            xi = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x.device, x.dtype)
            y = x + scale * xi * x
            return (y, *output[1:]) if isinstance(output, tuple) else y
        return hook

    hooks = []
    for name, module in model.named_modules():
        parts = name.split(".")
        point = "residual" if parts[:2] == ["decoder", "layers"] and len(parts) == 3 else parts[-1]
        if point in ROUNDING_POINTS:
            hooks.append(module.register_forward_hook(make(scale_of(point))))
    return hooks


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


def rounding_spread(model, ids: list[int], chosen: list[torch.Tensor], hidden: torch.Tensor, head: torch.Tensor,
                    logits: torch.Tensor, dtype: torch.dtype, n_terms: int) -> torch.Tensor:
    """Per position, the largest over the vocabulary of the standard deviation of gptoss's logprob under the
    error model's roundings, carried to the logprobs by this model's own layers ([len(ids)], float64), from the
    plain forward's final normalised `hidden` [len(ids), H], output weight `head` [V, H] and `logits`.

    One batched forward of ROUNDING_SAMPLES rows, each with its own draw at every rounding point inside the
    blocks (amplified by budget.amplification, then scaled back: far above the forward's own rounding, well
    inside its linear response), the routers held to their choices; the output layer's own rounding is then
    drawn at its size on each row's logits, its effect on the logprobs (through the log-sum-exp) to first order."""
    gain = amplification(dtype, n_terms)
    generator = torch.Generator().manual_seed(ROUNDING_SEED)
    hooks = _held_router_hooks(model, chosen, ROUNDING_SAMPLES) + _rounding_hooks(
        model, lambda point: gain * point_sigma(dtype, point, n_terms), generator)
    _, _, noisy = _forward(model, ids, hooks, rows=ROUNDING_SAMPLES)
    noisy = noisy.reshape(ROUNDING_SAMPLES, len(ids), -1)
    plain = torch.log_softmax(logits.double(), dim=-1).to(noisy.device)
    p = plain.exp()
    head_sd = head_rounding_sd(hidden, head, logits, dtype, n_terms).to(noisy.device)
    squares = torch.zeros_like(plain)
    for k in range(ROUNDING_SAMPLES):
        inner = (torch.log_softmax(noisy[k].double(), dim=-1) - plain) / gain
        d = head_sd * torch.randn(head_sd.shape, generator=generator, dtype=torch.float64).to(head_sd.device)
        squares += (inner + d - (p * d).sum(dim=-1, keepdim=True)) ** 2
    return (squares / ROUNDING_SAMPLES).sqrt().amax(dim=-1).cpu()


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
    chosen: list = []
    hidden, head, logits = _forward(model, ids, _capture_hooks(model, captured, chosen))
    logprobs = torch.log_softmax(logits.double(), dim=-1)[:-1]
    n_terms = max(arch.hidden_size, arch.intermediate_size, arch.head_dim, len(ids))
    spread = rounding_spread(model, ids, chosen, hidden, head, logits, dtype, n_terms)
    budget, bound = logit_budgets(spread)
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


__all__ = ["Reference", "reference_for", "references", "rounding_spread", "flip_spread"]
