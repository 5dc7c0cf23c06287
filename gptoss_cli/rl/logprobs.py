"""The policy's per-token log-probabilities and entropies at a sampling temperature, chunked over tokens.

GRPO's policy is the distribution the completions were sampled from before nucleus truncation:
softmax(logits / temperature) (TRL's GRPOTrainer divides the logits by the temperature likewise).
`policy_log_probs(output, labels, temperature)` returns log p(label) with gradients and the entropy
of that distribution (no gradients) at every position, 0 where the label is IGNORE_INDEX. From a
HybridOutput it computes `chunk` positions at a time from the final hidden states and the output
layer (model/lm_head.py, `chunked_log_probs`: each chunk's logits recomputed in backward rather than
kept, in buffers reused from chunk to chunk on the CPU), so no [tokens, vocabulary] tensor outlives
its chunk.
"""

from __future__ import annotations

import torch

from gptoss_cli.model.lm_head import chunked_log_probs, labelled_rows
from gptoss_cli.model.loss import IGNORE_INDEX, HybridOutput
from gptoss_cli.model.loss_chunk import lm_loss_chunk_tokens


def policy_log_probs(output: HybridOutput, labels: torch.Tensor, temperature: float = 1.0,
                     chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label) [*labels.shape] fp32 with gradients, entropy [*labels.shape] fp32 detached) of
    softmax(logits / temperature); both 0 where the label is IGNORE_INDEX."""
    flat = labels.reshape(-1)
    valid = flat != IGNORE_INDEX
    safe = torch.where(valid, flat, torch.zeros_like(flat))
    hidden = getattr(output, "hidden", None)
    if hidden is None:  # an output that carries logits (transformers' models)
        logp, entropy = _chunk_logits(output.logits.reshape(flat.shape[0], -1), safe, temperature)
    else:
        h = hidden.reshape(-1, hidden.shape[-1])
        chunk = chunk_tokens or getattr(output, "loss_chunk_tokens", None)
        chunk = max(1, int(chunk or lm_loss_chunk_tokens(output.head_weight.shape[0], h.element_size(), h.device.type)))
        rows = labelled_rows(h, valid)  # the CPU: only the labelled positions (model/lm_head.py)
        if rows is None:
            logp, entropy = chunked_log_probs(h, output.head_weight, safe, temperature, chunk)
        else:
            picked, ent = chunked_log_probs(h[rows], output.head_weight, safe[rows], temperature, chunk)
            logp = h.new_zeros(flat.shape[0], dtype=torch.float32).index_put((rows,), picked)
            entropy = h.new_zeros(flat.shape[0], dtype=torch.float32).index_put_((rows,), ent)
    zero = torch.zeros_like(logp)
    return (torch.where(valid, logp, zero).reshape(labels.shape),
            torch.where(valid, entropy.detach(), zero.detach()).reshape(labels.shape))


def _chunk_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float() / temperature if temperature != 1.0 else logits.float()
    logp_all = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, labels[:, None])[:, 0], entropy


__all__ = ["policy_log_probs"]
