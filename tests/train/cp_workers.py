"""Per-rank bodies of the context-parallel tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import torch

from gptoss_cli.model.attention.layer import CoreAttention
from gptoss_cli.model.loss import IGNORE_INDEX
from gptoss_cli.parallel.state import ParallelState, init_parallel
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.data import DataLoaderState, PackedRow
from gptoss_cli.train.objective import forward_step
from gptoss_cli.train.provider import HybridModelProvider
from gptoss_cli.train.setup import setup_model_and_optimizer
from tests.train.dist_helpers import named_grads
from tests.train.jobs import optimizer_config, runtime_config
from tests.train.workers import TINY, RandomTokens

# 24 positions: at CP=2 each rank holds 12, and the tiny model's sliding window of 8 crosses the
# slice boundary (queries 12..18 see keys before 12).
SEQ = 24
GLOBAL_BATCH, MBS = 4, 2
# Per sample index (mod 4): document lengths of a packed row; several documents cross position 12,
# and rows with fewer than SEQ tokens end in padding.
DOC_LENGTHS = ([5, 9, 7], [11, 13], [24], [3, 10, 4, 6])


class PackedRandomDocuments:
    """Packed rows of random documents (the shape of train/data.py's PackedDocumentSource's rows)."""

    documents = True

    def __init__(self, vocab: int, seq: int, seed: int = 0):
        self.vocab, self.seq, self.seed = vocab, seq, seed

    def sample(self, index: int) -> PackedRow:
        g = torch.Generator().manual_seed(self.seed * 7919 + index)
        lengths = DOC_LENGTHS[index % len(DOC_LENGTHS)]
        tokens = torch.zeros(self.seq, dtype=torch.int64)
        labels = torch.full((self.seq,), IGNORE_INDEX, dtype=torch.int64)
        at = 0
        for n in lengths:
            doc = torch.randint(0, self.vocab, (n,), generator=g)
            tokens[at:at + n] = doc
            labels[at:at + n - 1] = doc[1:]
            at += n
        return PackedRow(tokens, labels, list(lengths))


def trained_like_(model: torch.nn.Module, seed: int = 11) -> None:
    """Weights at the scales a trained model has, where every part moves the loss (at initialisation the
    sinks are ~0.02 and the attention output is small, so a rank that attends with another rank's sinks
    or heads changes the loss by less than rounding): sinks ~ N(0, 1), norms 1 + 0.2 N, biases 0.1 N,
    the router 0.3 N, the rest 0.08 N; each tensor from its own (seed, checkpoint name) generator, so
    every CP/EP layout holds the same values."""
    from gptoss_cli.model.expert_names import checkpoint_slots
    from gptoss_cli.model.init import name_generator

    with torch.no_grad():
        for name, dest in checkpoint_slots(model):
            if dest is None:
                continue
            noise = torch.randn(dest.shape, generator=name_generator(seed, name), dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("softmax_offset"):
                dest.copy_(noise)
            elif ("norm" in name and leaf.startswith("weight")) or leaf == "layer_norm_weight":
                dest.copy_(1 + 0.2 * noise)
            elif leaf.startswith("bias"):
                dest.copy_(0.1 * noise)
            elif "router" in name:
                dest.copy_(0.3 * noise)
            else:
                dest.copy_(0.08 * noise)


def cp_step(state: ParallelState, packed: bool, seed: int = 7, recompute: str | None = None) -> dict[str, Any]:
    """One global batch forward+backward through the real schedule at this state's CP x EP layout:
    the summed loss, token count and finalised gradients (sinks included); then the same batch's loss
    forward only at trained-like weights (`trained_like_`). `recompute`: a selective recompute module
    (e.g. core_attn: backward re-runs attention, its all-to-alls included)."""
    extra = {"recompute_granularity": "selective", "recompute_modules": [recompute]} if recompute else {}
    provider = HybridModelProvider(runtime_config(aux_loss_coeff=0.0, ep_size=state.ep_size, **extra), seed=seed)
    setup = setup_model_and_optimizer(provider, state, optimizer_config(clip_grad=1.0), 1e-3)
    if recompute == "core_attn":  # the premise: backward does re-run attention
        assert all(m.recompute for m in setup.model.modules() if isinstance(m, CoreAttention))
    source = PackedRandomDocuments(TINY.vocab_size, SEQ) if packed else RandomTokens(TINY.vocab_size, SEQ, seed=5)
    data = DataLoaderState(source, global_batch_size=GLOBAL_BATCH, micro_batch_size=MBS,
                           dp_rank=state.data_parallel_rank, dp_size=state.data_parallel_size,
                           cp_size=state.cp_size, cp_rank=state.cp_rank)
    schedule = get_forward_backward_func(setup.config)
    logs = schedule(forward_step_func=forward_step, data_iterator=data.step_iterator(), model=setup.model,
                    num_microbatches=data.num_microbatches)
    out = {"loss_sum": float(sum(l["lm_loss_sum"] for l in logs)),
           "tokens": float(sum(l["num_tokens"] for l in logs)),
           "grads": named_grads(setup.model), "grad_norm": setup.optimizer.grad_norm()}
    trained_like_(setup.model)
    data.consumed_samples = 0  # the same global batch again
    logs = schedule(forward_step_func=forward_step, data_iterator=data.step_iterator(), model=setup.model,
                    num_microbatches=data.num_microbatches, forward_only=True)
    out["trained_loss_sum"] = float(sum(l["lm_loss_sum"] for l in logs))
    return out


# (cp, ep, packed[, recompute module]) layouts the 2-process worker runs, one after another in the
# same process group
LAYOUTS = ((2, 1, False), (2, 1, True), (2, 2, False), (2, 2, True), (2, 2, True, "core_attn"))


def cp_worker(rank: int, layouts: tuple = LAYOUTS) -> dict[tuple, dict[str, Any]]:
    out = {}
    for layout in layouts:
        cp, ep, packed, *recompute = layout
        state = init_parallel(ep, "cpu", cp_size=cp)
        out[layout] = cp_step(state, packed, recompute=recompute[0] if recompute else None)
    return out
