"""What `gptoss score` computes at each trained position: the label's log-prob, and the top-K and tail of the distribution.

From the final-norm hidden states and the output layer (`HybridOutput.hidden`, `.head_weight`), chunk
by chunk of positions (model/loss_chunk.py's chunk, as the loss and `token_log_probs` take it), so no
[positions x vocabulary] tensor outlives its chunk. Per position, with z the logits in fp32 divided by
the temperature T and lse = logsumexp(z):

- `logprobs`: z[label] - lse, computed as training's `token_log_probs` computes it (-cross_entropy of
  the fp32 logits), so a reference scored at T=1 is the number a `model` reference would give;
- `topk_ids`, `topk_logprobs`: the K largest z (ties broken as torch.topk breaks them), as z - lse,
  in decreasing order;
- `tail_logmass`: log of the probability outside the top K, log(1 - sum exp(topk_logprobs)). It is
  computed directly, as logsumexp of the other V - K logits minus lse, not as
  log1p(-exp(logsumexp(topk_logprobs))): when the top K hold nearly all the mass, that difference
  cancels (fp32 rounding of lse alone is 1e-7 relative, larger than a tail of 1e-9) and can even come
  out >= 0; the direct form keeps the tail's own relative precision. -inf when K = V.

Temperature: every stored value is at the file's temperature. The top-K *ids* are the same at every
T (z/T keeps the order), and the top-K values at T could be re-normalised from those at 1, but the tail
mass at T cannot be recovered from the tail mass at 1 (it needs every tail logit), so a distillation
at temperature T scores with `--temperature T`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gptoss_cli.model.lm_head import chunk_log_softmax, chunk_logits
from gptoss_cli.model.loss_chunk import lm_loss_chunk_tokens


@dataclass
class TokenScores:
    """The scores of n positions, in the order they were given."""

    logprobs: torch.Tensor  # [n] fp32
    topk_ids: torch.Tensor | None = None  # [n, K] int32
    topk_logprobs: torch.Tensor | None = None  # [n, K] fp32
    tail_logmass: torch.Tensor | None = None  # [n] fp32

    def to(self, device: str | torch.device) -> "TokenScores":
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return TokenScores(move(self.logprobs), move(self.topk_ids), move(self.topk_logprobs), move(self.tail_logmass))


def score_chunk(logits: torch.Tensor, labels: torch.Tensor, top_k: int, temperature: float = 1.0) -> TokenScores:
    """The scores of positions whose logits are `logits` [n, V] (any float dtype) and labels `labels` [n]."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    # -cross_entropy(z, labels), as its log-softmax gathered at the labels, the log-softmax in the LM
    # head's reused buffer (model/workspace.py)
    logprobs = chunk_log_softmax(z).gather(-1, labels[:, None])[:, 0]
    if top_k <= 0:
        return TokenScores(logprobs)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    values, ids = z.topk(top_k, dim=-1)
    rest = z.scatter(-1, ids, float("-inf"))
    tail = torch.logsumexp(rest, dim=-1) - lse.squeeze(-1)
    return TokenScores(logprobs, ids.to(torch.int32), values - lse, tail)


def score_positions(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, top_k: int = 0,
                    temperature: float = 1.0, chunk_tokens: int | None = None) -> TokenScores:
    """`score_chunk` of the logits `hidden @ weight^T` of n positions (hidden [n, H], weight [V, H],
    labels [n]), `chunk_tokens` positions at a time (None: the LM head's chunk for this device)."""
    if chunk_tokens is None:
        chunk_tokens = lm_loss_chunk_tokens(weight.shape[0], hidden.element_size(), hidden.device.type)
    chunk = max(1, int(chunk_tokens))
    # a chunk's fp32 logits / temperature in the LM head's reused buffer (model/lm_head.py: op for op
    # F.linear(h, weight).float() / temperature)
    parts = [score_chunk(chunk_logits(hidden[s:s + chunk], weight, temperature), labels[s:s + chunk], top_k)
             for s in range(0, hidden.shape[0], chunk)]
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        if top_k <= 0:
            return TokenScores(empty)
        return TokenScores(empty, hidden.new_zeros((0, top_k), dtype=torch.int32),
                           hidden.new_zeros((0, top_k), dtype=torch.float32), empty)
    cat = (lambda name: None if getattr(parts[0], name) is None  # noqa: E731
           else torch.cat([getattr(p, name) for p in parts]))
    return TokenScores(cat("logprobs"), cat("topk_ids"), cat("topk_logprobs"), cat("tail_logmass"))


__all__ = ["TokenScores", "score_chunk", "score_positions"]
