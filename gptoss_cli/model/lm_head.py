"""The LM head one chunk of tokens at a time on reusable buffers: a chunk's logits and log-softmax, its
backward's GEMMs, and the per-token log-probabilities (and entropy) at a temperature.

A chunk's [tokens x vocabulary] tensors live in model/workspace.py's slots (on the CPU kept and
reused; elsewhere fresh), and every function here computes what the plain expression computes, op for
op: `chunk_logits(h, w, t)` is `F.linear(h, w).float() / t` and `chunk_log_softmax` is
`torch.log_softmax(z, -1)`, each written into its slot. Nothing returned and nothing saved for
backward is a view of a slot (the workspace's contract).

`chunked_log_probs(hidden, weight, labels, temperature)` is log softmax(hidden @ weight^T /
temperature)[label] per token with gradients, and the distribution's entropy without: the policy
log-probabilities of GRPO (rl/logprobs.py) and the per-token log-probabilities of an objective
(train/objective.py's `token_log_probs`). Forward keeps no chunk; backward recomputes each chunk's
log-softmax (what the per-chunk activation checkpoint it replaces did) and turns it into the
gradient in place: d logp[label] / d z = onehot - softmax(z), times the incoming gradient, divided
by the temperature, then dhidden = dz @ W and dW = sum over chunks of dz^T @ hidden in fp32.
"""

from __future__ import annotations

import torch

from gptoss_cli.model import host_reads
from gptoss_cli.model.gemm.main_grad import add_cast_, addmm_fp32_, fp32_accumulating_gemm, mm_fp32
from gptoss_cli.model.workspace import borrow, buffer

# The workspace's slots (model/workspace.py): the chunk's fp32 logits (also the entropy's scratch), its
# log-softmax (turned into the gradient in place), and the GEMM's output in a non-fp32 activation dtype;
# for a non-fp32 output layer without fp32-accumulating GEMMs (the CPU's bf16), the weight gradient's
# fp32 sum and each chunk's product.
LOGITS, LOG_SOFTMAX, ACTIVATION = "lm_head.logits", "lm_head.log_softmax", "lm_head.activation"
WEIGHT_GRAD_SUM, WEIGHT_GRAD_CHUNK = "lm_head.weight_grad_sum", "lm_head.weight_grad_chunk"


def chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """`F.linear(h, weight).float() / temperature` of h [c, H] against weight [V, H], fp32 [c, V] in the
    LOGITS slot (a non-fp32 GEMM writes the ACTIVATION slot first, as F.linear's output before .float())."""
    shape = (h.shape[0], weight.shape[0])
    out = buffer(LOGITS, shape, torch.float32, h.device)
    if h.dtype == torch.float32:
        torch.mm(h, weight.t(), out=out)
    else:
        out.copy_(torch.mm(h, weight.t(), out=buffer(ACTIVATION, shape, h.dtype, h.device)))
    if temperature != 1.0:
        out.div_(temperature)
    return out


def chunk_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """`torch.log_softmax(logits, -1)` of a chunk's fp32 logits, in the LOG_SOFTMAX slot."""
    return torch.log_softmax(logits, -1, out=buffer(LOG_SOFTMAX, tuple(logits.shape), torch.float32, logits.device))


def chunk_activation_grad(dlogits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A chunk's fp32 gradient with respect to the logits in the GEMMs' dtype (autograd's cast back through
    `.float()`): itself for fp32, else its copy in the ACTIVATION slot."""
    if dtype == torch.float32:
        return dlogits
    return buffer(ACTIVATION, tuple(dlogits.shape), dtype, dlogits.device).copy_(dlogits)


class WeightGradSum:
    """dW = sum over chunks of dlogits^T @ h for an output layer `weight`, summed in fp32 (then cast once, as
    one GEMM would round once): for a bf16 layer on a device with fp32-accumulating GEMMs
    (model/gemm/main_grad.py) by the GEMM itself, elsewhere by adding each chunk's product.

    The fp32 sum is the caller's to keep (`total()`) for an fp32 layer: `borrowed` (model/workspace.py,
    the caller hands it back) or fresh (autograd will hold it). For another dtype it is scratch (the
    caller keeps its cast), and it and the chunks' products live in the workspace's slots."""

    def __init__(self, weight: torch.Tensor, borrowed: bool = False):
        self.weight = weight
        # Written by the first chunk's GEMM, accumulated by the others: no pass to zero it first.
        if weight.dtype == torch.float32:
            self.sum = (borrow if borrowed else torch.empty)(tuple(weight.shape), dtype=torch.float32,
                                                             device=weight.device)
        else:
            self.sum = buffer(WEIGHT_GRAD_SUM, tuple(weight.shape), torch.float32, weight.device)
        self.fused_fp32 = fp32_accumulating_gemm(weight.device)
        self.chunks = 0

    def add(self, dlogits: torch.Tensor, h: torch.Tensor) -> None:
        """Add one chunk's dlogits [c, V] (in the GEMMs' dtype) ^T @ h [c, H]."""
        first, self.chunks = self.chunks == 0, self.chunks + 1
        if self.sum.dtype == dlogits.dtype or self.fused_fp32:
            if first:
                mm_fp32(dlogits.t(), h, out=self.sum)
            else:
                addmm_fp32_(self.sum, dlogits.t(), h)
            return
        product = torch.mm(dlogits.t(), h, out=buffer(WEIGHT_GRAD_CHUNK, tuple(self.sum.shape), dlogits.dtype,
                                                      dlogits.device))
        if first:
            self.sum.copy_(product)
        else:
            add_cast_(self.sum, product)

    def total(self) -> torch.Tensor:
        """The fp32 sum (zeros when no chunk was added)."""
        if self.chunks == 0:
            self.sum.zero_()
        return self.sum


class _ChunkedLogProbs(torch.autograd.Function):
    """(log p(label), entropy) per token of softmax(hidden @ weight^T / temperature), chunk by chunk (see the
    module docstring); labels must be valid ids (the caller masks ignored positions)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                chunk: int, with_entropy: bool):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            lp = chunk_log_softmax(chunk_logits(hidden[start:end], weight, temperature))
            logp[start:end] = lp.gather(-1, labels[start:end, None])[:, 0]
            if entropy is not None:  # -(exp(lp) * lp).sum(-1), the exp in the logits' slot (done with)
                p_lp = torch.exp(lp, out=buffer(LOGITS, tuple(lp.shape), torch.float32, lp.device)).mul_(lp)
                torch.sum(p_lp, -1, out=entropy[start:end])
        if entropy is not None:
            entropy.neg_()
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor | None, _grad_entropy):
        hidden, weight, labels = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logp is None or not (want_h or want_w):
            return None, None, None, None, None, None
        t = ctx.temperature
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = WeightGradSum(weight) if want_w else None
        g = grad_logp.float()
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(hidden.shape[0], start + ctx.chunk)
            h, gc = hidden[start:end], g[start:end, None]
            # autograd's log_softmax backward of a gradient gc at the label: gc * onehot - exp(lp) * gc
            dz = chunk_log_softmax(chunk_logits(h, weight, t)).exp_().mul_(gc.neg())
            dz.scatter_add_(-1, labels[start:end, None], gc)
            if t != 1.0:
                dz.div_(t)
            d = chunk_activation_grad(dz, hidden.dtype)
            if grad_h is not None:
                torch.mm(d, weight, out=grad_h[start:end])
            if grad_w is not None:
                grad_w.add(d, h)
        return grad_h, None if grad_w is None else grad_w.total().to(weight.dtype), None, None, None, None


def labelled_rows(hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
    """The indices of the rows of hidden [N, H] whose label is `valid` [N], when the head should be applied to
    those rows only; None to apply it to every row. On the CPU only, where reading the mask costs nothing:
    a GRPO row of 136 prompt and 16 completion tokens then computes 16 rows of [vocabulary] logits, not 152
    (elsewhere the dynamic shape would make the device wait for the host)."""
    if not host_reads.free(hidden.device) or bool(valid.all()):
        return None
    return valid.nonzero()[:, 0]


def chunked_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                      chunk_tokens: int, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log softmax(hidden @ weight^T / temperature)[labels] fp32 [N], with gradients; its entropy fp32 [N],
    detached, or None) for hidden [N, H], weight [V, H] and valid labels [N], `chunk_tokens` tokens at a time."""
    return _ChunkedLogProbs.apply(hidden, weight, labels, float(temperature), max(1, int(chunk_tokens)), with_entropy)


__all__ = ["ACTIVATION", "LOGITS", "LOG_SOFTMAX", "WEIGHT_GRAD_CHUNK", "WEIGHT_GRAD_SUM", "WeightGradSum",
           "chunk_activation_grad", "chunk_log_softmax", "chunk_logits", "chunked_log_probs", "labelled_rows"]
