"""The distillation divergences, per token: forward KL, reverse KL and the generalised JSD, on the full
vocabulary or on the teacher's top-K with its tail as one more outcome, chunked over tokens.

With S and T the student's and the teacher's distributions over the next token, both
softmax(logits / temperature), the per-token divergence `D` of `distill.loss` is

    forward_kl   KL(T || S) = sum_v T_v (log T_v - log S_v)          (TRL's generalized_jsd_loss, beta = 0)
    reverse_kl   KL(S || T) = sum_v S_v (log S_v - log T_v)          (beta = 1)
    jsd          beta KL(T || M) + (1 - beta) KL(S || M),  M = beta T + (1 - beta) S   (0 < beta < 1)

exactly as TRL's `GKDTrainer.generalized_jsd_loss` computes it (no temperature-squared factor), and
the loss of a trained position is `(1 - ce_weight) D + ce_weight CE`, CE the ordinary cross-entropy
of its label at temperature 1.

Top-K (a teacher stored by `gptoss score --top-k K`, or a model teacher at `distill.top_k` K): the
teacher's distribution is known at its K most likely tokens, plus the log of the mass outside them
(the tail). Both distributions are then taken over K + 1 outcomes, the K ids and "any other token":
the teacher's are its stored K probabilities and its tail mass; the student's are its probabilities
at the same K ids and `1 - their sum`, computed as the logsumexp of its other logits minus its own
logsumexp (never as log1p(-sum), which cancels when the K ids hold nearly all of its mass). The
divergence above is computed over those K + 1 outcomes. What it approximates: the divergence of the
full distributions with the tail collapsed into one bucket. By the data-processing inequality that
is a lower bound of the full KL (either direction) and of the JSD, equal to it when, inside the
tail, the student's distribution is proportional to the teacher's (every tail token's ratio S_v/T_v
the same); the gap is the tail's own divergence, weighted by the tail mass, small when the teacher
puts little mass outside its top K. The student is pushed to put the teacher's tail mass outside the
K ids, not told where.

Metrics (the same outcomes: the full vocabulary, or the K + 1 buckets): `kl_teacher`, KL(T || S) per
token, and `top1`, whether the student's most likely token (over the whole vocabulary) is the
teacher's (its top-1 id).

`distill_terms` computes all of it from a model output's final hidden states and output layer
(HybridOutput), `chunk` trained positions at a time, each chunk's logits recomputed in backward
rather than kept (torch.utils.checkpoint), so no [tokens, vocabulary] tensor outlives its chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gptoss_cli.recipe.schema_distill import DISTILL_LOSSES

DIVERGENCES = DISTILL_LOSSES  # the recipe's names (recipe/schema_distill.py)
# A chunk holds about four [tokens, vocabulary] fp32 tensors more than the LM loss's (teacher
# log-probs, the mixture, their products): distillation takes this fraction of the loss's chunk.
CHUNK_DIVISOR = 4


@dataclass(frozen=True)
class Divergence:
    """What `distill.loss`, `distill.jsd_beta`, `distill.temperature` and `distill.ce_weight` ask for."""

    loss: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    ce_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.loss not in DIVERGENCES:
            raise ValueError(f"distill.loss={self.loss!r}: one of {', '.join(DIVERGENCES)}")
        if self.loss == "jsd" and not 0.0 < self.beta < 1.0:
            raise ValueError(f"distill.jsd_beta={self.beta}: the JSD needs 0 < beta < 1 (its ends are forward_kl "
                             "and reverse_kl)")


def _kl_terms(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """Per outcome p (log p - log q), 0 where p = 0 (log p = -inf): KL(p || q) summed over the last axis."""
    p = p_log.exp()
    return torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p))


def divergence(s_log: torch.Tensor, t_log: torch.Tensor, loss: str, beta: float = 0.5) -> torch.Tensor:
    """The per-row divergence of `loss` between log-distributions over the last axis (module docstring)."""
    if loss == "forward_kl":
        return _kl_terms(t_log, s_log).sum(-1)
    if loss == "reverse_kl":
        return _kl_terms(s_log, t_log).sum(-1)
    m_log = torch.logaddexp(s_log + math.log1p(-beta), t_log + math.log(beta))
    return beta * _kl_terms(t_log, m_log).sum(-1) + (1 - beta) * _kl_terms(s_log, m_log).sum(-1)


def bucket_log_probs(s_logits: torch.Tensor, ids: torch.Tensor, t_topk: torch.Tensor, t_tail: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(student, teacher) log-probabilities over the K ids and the tail [n, K + 1], from the student's
    tempered logits [n, V] and the teacher's top-K ids [n, K], log-probs [n, K] and tail log-mass [n]."""
    lse = torch.logsumexp(s_logits, dim=-1, keepdim=True)
    at_ids = s_logits.gather(-1, ids) - lse
    s_tail = torch.logsumexp(s_logits.scatter(-1, ids, float("-inf")), dim=-1, keepdim=True) - lse
    return torch.cat([at_ids, s_tail], -1), torch.cat([t_topk, t_tail[:, None]], -1)


@dataclass
class TeacherChunk:
    """The teacher at n positions: its output layer's logits (full vocabulary), or its top-K and tail."""

    logits: torch.Tensor | None = None  # [n, V], untempered
    topk_ids: torch.Tensor | None = None  # [n, K] int64
    topk_logprobs: torch.Tensor | None = None  # [n, K] at the temperature
    tail_logmass: torch.Tensor | None = None  # [n]


def chunk_terms(s_logits: torch.Tensor, labels: torch.Tensor, teacher: TeacherChunk, spec: Divergence
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position of a chunk: (loss, divergence, cross-entropy, KL(T || S), top-1 agreement) from the
    student's untempered logits [n, V] (the first with gradients; the others detached)."""
    z = s_logits.to(torch.promote_types(s_logits.dtype, torch.float32))  # fp32, or fp64 as given
    zt = z / spec.temperature if spec.temperature != 1.0 else z
    if teacher.logits is not None:
        t = teacher.logits.to(z.dtype)
        t_log = torch.log_softmax(t / spec.temperature if spec.temperature != 1.0 else t, dim=-1)
        s_log = torch.log_softmax(zt, dim=-1)
        teacher_top1 = t.argmax(-1)
    else:
        s_log, t_log = bucket_log_probs(zt, teacher.topk_ids.long(), teacher.topk_logprobs.to(z.dtype),
                                        teacher.tail_logmass.to(z.dtype))
        teacher_top1 = teacher.topk_ids[:, 0].long()
    d = divergence(s_log, t_log, spec.loss, spec.beta)
    ce = F.cross_entropy(z, labels, reduction="none")
    loss = (1 - spec.ce_weight) * d + spec.ce_weight * ce if spec.ce_weight else d
    with torch.no_grad():
        kl = d if spec.loss == "forward_kl" else divergence(s_log, t_log, "forward_kl")
        agree = (z.argmax(-1) == teacher_top1).float()
    return loss, d.detach(), ce.detach(), kl.detach(), agree


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, teacher: TeacherChunk,
           teacher_hidden: torch.Tensor | None, teacher_weight: torch.Tensor | None, spec: Divergence):
    if teacher_hidden is not None:
        with torch.no_grad():
            teacher = TeacherChunk(logits=F.linear(teacher_hidden, teacher_weight))
    return chunk_terms(F.linear(hidden, weight), labels, teacher, spec)


@dataclass
class DistillTerms:
    """Sums over a microbatch's trained positions (each a scalar; `loss` with gradients)."""

    loss: torch.Tensor
    divergence: torch.Tensor
    ce: torch.Tensor
    kl_teacher: torch.Tensor
    top1: torch.Tensor
    tokens: torch.Tensor


def distill_terms(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, trained: torch.Tensor,
                  spec: Divergence, chunk: int, *, teacher_topk: tuple[torch.Tensor, ...] | None = None,
                  teacher_hidden: torch.Tensor | None = None, teacher_weight: torch.Tensor | None = None
                  ) -> DistillTerms:
    """The distillation sums of one microbatch: the student's final hidden states `hidden` [N, H] and output
    layer `weight` [V, H], the labels [N] and which positions are trained [N] (bool), and the teacher at
    those N positions: `teacher_topk` = (ids [N, K], log-probs [N, K], tail [N]), or its final hidden states
    [N, H_t] and output layer [V, H_t] (full vocabulary). Only trained positions are computed, `chunk` at a
    time."""
    at = torch.nonzero(trained.reshape(-1)).flatten()
    h, y = hidden.index_select(0, at), labels.reshape(-1).index_select(0, at)
    topk = None if teacher_topk is None else [x.index_select(0, at) for x in teacher_topk]
    th = None if teacher_hidden is None else teacher_hidden.index_select(0, at)
    parts = []
    for s in range(0, h.shape[0], max(1, chunk)):
        e = s + max(1, chunk)
        teacher = TeacherChunk() if topk is None else TeacherChunk(None, topk[0][s:e], topk[1][s:e], topk[2][s:e])
        args = (h[s:e], weight, y[s:e], teacher, None if th is None else th[s:e], teacher_weight, spec)
        parts.append(checkpoint(_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk(*args))
    zero = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    sums = [sum((p[i].sum() for p in parts), zero) for i in range(5)]
    return DistillTerms(*sums, tokens=at.new_tensor(at.numel(), dtype=torch.float32))


__all__ = ["DIVERGENCES", "CHUNK_DIVISOR", "Divergence", "divergence", "bucket_log_probs", "TeacherChunk",
           "chunk_terms", "distill_terms", "DistillTerms"]
