"""The language-model loss: token cross-entropy, its chunked LM head + loss, and the model's output (`HybridOutput`).

`HybridOutput` keeps the final-norm hidden states and the output layer's weight rather than the
logits; the loss is computed chunk by chunk from them (`chunked_lm_loss_sum`), the logits only when
asked for. The router losses and telemetry the MoE layers returned are attached to it here too
(model/router_stats.py, `RouterStats`; docs/architecture.md, "Aux loss").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gptoss_cli.model.gemm.main_grad import added_to_main_grad, main_grad_target
from gptoss_cli.model import host_reads
from gptoss_cli.model.lm_head import (WeightGradSum, chunk_activation_grad, chunk_log_softmax, chunk_logits,
                                      labelled_rows)
from gptoss_cli.model.loss_chunk import LM_LOSS_CHUNK_TOKENS, lm_loss_chunk_tokens
from gptoss_cli.model.workspace import borrow, give_back
from gptoss_cli.model.router_stats import RouterStats, load_balancing_loss, router_table, router_z_loss

IGNORE_INDEX = -100


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of next-token labels in fp32, ignoring IGNORE_INDEX: the one definition of the
    language-model loss (the model's forward, the schedule plan and the trainer's loss_func; the
    chunked form below applies it to one chunk of tokens at a time)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction=reduction)


class _ChunkedLMLoss(torch.autograd.Function):
    """sum over tokens of token_cross_entropy(hidden @ weight^T, labels), one chunk of tokens at a time.

    The loss is the last op of the graph, so its gradients are computed in the same pass (the
    fused linear + cross-entropy of Liger and Megatron): per chunk, the logits, their log-softmax,
    the loss (nll_loss of the log-softmax: F.cross_entropy's own two ops) and its gradient with
    respect to the logits, softmax - onehot on the labelled rows (what autograd of
    token_cross_entropy computes), then dhidden = dlogits @ W and dW += dlogits^T @ hidden.
    backward scales them by the incoming gradient; no chunk's logits outlive it. A chunk's
    [tokens x vocabulary] tensors live in reusable buffers (model/lm_head.py, model/workspace.py:
    on the CPU the same pages every chunk and step). dW is summed over the chunks in fp32: for a
    bf16 layer on a device with fp32-accumulating GEMMs (model/gemm/main_grad.py) by the GEMM
    itself, elsewhere by adding each chunk's bf16 product (the CPU's path). Chunk sizes:
    model/loss_chunk.py."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                want_grad: bool) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if want_grad else None
        # A frozen output layer (LoRA) gets no gradient: its V x H accumulator is never allocated.
        grad_w = WeightGradSum(weight, borrowed=True) if want_grad and weight.requires_grad else None
        for start in range(0, hidden.shape[0], chunk):
            h, lab = hidden[start:start + chunk], labels[start:start + chunk]
            logp = chunk_log_softmax(chunk_logits(h, weight))
            total += F.nll_loss(logp, lab, ignore_index=IGNORE_INDEX, reduction="sum")
            if not want_grad:
                continue
            # d loss / d logits: exp(logp) - onehot(label) on labelled rows, 0 on ignored ones (in place)
            valid = lab != IGNORE_INDEX
            dlogits = logp.exp_()
            dlogits.scatter_add_(-1, torch.where(valid, lab, 0)[:, None], valid.to(dlogits.dtype).neg()[:, None])
            if not host_reads.free(h.device) or not bool(valid.all()):  # (a GPU is not made to wait for the answer)
                dlogits.masked_fill_(~valid[:, None], 0.0)
            d = chunk_activation_grad(dlogits, hidden.dtype)
            torch.mm(d, weight, out=grad_h[start:start + chunk])
            if grad_w is not None:
                grad_w.add(d, h)
        if grad_w is not None:
            grad_w = grad_w.total()
            if grad_w.dtype != weight.dtype:
                # Held until backward in the weight's dtype (the memory estimate's b*V*h): a bf16 layer
                # keeps its bf16 gradient; only an fp32 layer's accumulator goes straight into main_grad.
                grad_w = borrow(tuple(weight.shape), weight.dtype, weight.device).copy_(grad_w)
        ctx.grads = (grad_h, grad_w)
        ctx.weight = weight
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.grads
        weight, ctx.grads, ctx.weight = ctx.weight, None, None
        if grad_h is None:
            raise RuntimeError("the chunked LM loss was computed without gradients (no_grad) and cannot back-propagate")
        if grad_w is not None:
            # In training, scaled and added into the buffers' fp32 main_grad in one pass
            # (model/gemm/main_grad.py) instead of a scaled copy that the buffers' hook adds.
            # A bf16 layer's gradient goes in too where main_grad_target allows it (an fp32 add of
            # the bf16 gradient held since forward, in the same pass as the scaling).
            # The held gradient is borrowed (model/workspace.py): handed back once read, the next
            # microbatch's forward takes it again instead of mapping a fresh [V, h] tensor.
            target = main_grad_target(weight)
            if target is not None:
                target.addcmul_(grad_w, grad_out.to(target.dtype))
                give_back(grad_w)
                grad_w = added_to_main_grad(weight)
            else:
                held, grad_w = grad_w, grad_w * grad_out.to(grad_w.dtype)
                give_back(held)
        return grad_h * grad_out.to(grad_h.dtype), grad_w, None, None, None


def chunked_lm_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                        chunk_tokens: int | None = None) -> torch.Tensor:
    """`token_cross_entropy(hidden @ weight^T, labels, reduction="sum")` without the logits of every
    token in memory at once: hidden [..., H] (after the final norm), weight [V, H], labels [...];
    `chunk_tokens` None: the device's chunk (model/loss_chunk.py)."""
    h, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    rows = labelled_rows(h, labels != IGNORE_INDEX)  # the CPU: only the labelled positions (model/lm_head.py)
    if rows is not None:
        h, labels = h[rows], labels[rows]
    if chunk_tokens is None:
        chunk_tokens = lm_loss_chunk_tokens(weight.shape[0], hidden.element_size(), hidden.device.type)
    want_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedLMLoss.apply(h, weight, labels, max(1, int(chunk_tokens)), want_grad)


class HybridOutput:
    """The model's output. The LM head is applied lazily: the final-norm hidden states and the
    output layer's weight are kept, `logits` computes them on first access, and `lm_loss_sum`
    computes the loss chunk by chunk without them (or from the logits, once they exist)."""

    def __init__(self, logits: torch.Tensor | None = None, *, hidden: torch.Tensor | None = None,
                 head_weight: torch.Tensor | None = None, loss_chunk_tokens: int | None = None):
        if logits is None and (hidden is None or head_weight is None):
            raise ValueError("HybridOutput needs logits, or hidden and head_weight")
        self._logits, self.hidden, self.head_weight = logits, hidden, head_weight
        self.loss_chunk_tokens = loss_chunk_tokens
        # lm_loss + aux_loss_coef * aux_loss when labels are given (the HF convention), else None
        self.loss: torch.Tensor | None = None
        self.lm_loss: torch.Tensor | None = None  # mean token cross-entropy over labels != -100
        self.aux_loss: torch.Tensor | None = None  # unscaled load-balancing loss, when collected
        self.z_loss: torch.Tensor | None = None  # unscaled router z-loss, when collected
        # float64 [MoE layers, E + 2] routing telemetry in training (model/router_stats.py, `router_table`)
        self.router_table: torch.Tensor | None = None
        # routing replay (model/routes.py), when the forward was handed routes: per position [B, S], the MoE
        # layers whose live top-k set differs from the engine's ids and those with engine ids; the live ids [B, S, L, k]
        self.route_flips: torch.Tensor | None = None
        self.route_pairs: torch.Tensor | None = None
        self.live_routes: torch.Tensor | None = None

    @property
    def logits(self) -> torch.Tensor:
        """[B, S, V]"""
        if self._logits is None:
            self._logits = F.linear(self.hidden, self.head_weight)
        return self._logits

    def lm_loss_sum(self, labels: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy over labels != IGNORE_INDEX (fp32 scalar)."""
        if self._logits is not None:
            return token_cross_entropy(self._logits, labels, reduction="sum")
        return chunked_lm_loss_sum(self.hidden, self.head_weight, labels, self.loss_chunk_tokens)

    def add_router_stats(self, stats: list[RouterStats], num_experts: int, *, aux_loss: bool, z_loss: bool) -> None:
        """The MoE layers' statistics -> router_table, and the unscaled aux_loss / z_loss when on."""
        if not stats:
            return
        self.router_table = router_table(stats)
        if aux_loss:
            self.aux_loss = load_balancing_loss(stats, num_experts)
        if z_loss:
            self.z_loss = router_z_loss(stats)

    def add_losses(self, labels: torch.Tensor | None, aux_loss_coef: float, z_loss_coef: float) -> "HybridOutput":
        """HF's convention: loss = mean token cross-entropy + aux_loss_coef * aux loss
        (+ z_loss_coef * z-loss, Megatron's, when on)."""
        if labels is not None:
            self.lm_loss = self.lm_loss_sum(labels) / (labels != IGNORE_INDEX).sum()
            self.loss = self.lm_loss if self.aux_loss is None else self.lm_loss + aux_loss_coef * self.aux_loss
            if self.z_loss is not None:
                self.loss = self.loss + z_loss_coef * self.z_loss
        return self


def lm_loss_sum(output: object, labels: torch.Tensor) -> torch.Tensor:
    """The summed token cross-entropy of a model output: `output.lm_loss_sum(labels)` where the
    output offers it (HybridOutput: chunked), else token_cross_entropy of `output.logits`."""
    own = getattr(output, "lm_loss_sum", None)
    if callable(own):
        return own(labels)
    return token_cross_entropy(output.logits, labels, reduction="sum")


__all__ = ["IGNORE_INDEX", "LM_LOSS_CHUNK_TOKENS", "HybridOutput", "token_cross_entropy", "chunked_lm_loss_sum",
           "lm_loss_sum"]
