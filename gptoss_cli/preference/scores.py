"""dpo.reference=precomputed: the reference's log-probabilities scored once, stored next to the token files.

For a token file PREFIX (data.path, validation.data) the reference's scores are the folder PREFIX.reference,
in `gptoss score`'s format (gptoss_cli/score/: each trained token's log-prob, the digests of the data, the
reference checkpoint and its tokenizer). Before the policy is built, a run whose folder is absent scores the
file with `score()` itself, the function `gptoss score` runs (a user may run that command as its own step
instead: `gptoss score CHECKPOINT --data PREFIX --out PREFIX.reference --seq-length S`), with the reference
being checkpoint.pretrained (the initial policy; under LoRA the base the adapters start from), at the
recipe's training.seq_length, parameter dtype and kernels, one row per forward pass, in the run's EP
layout; the scoring model is freed before the policy is built, so the reference never sits in memory
beside it. The folder is written whole or not at all (a run killed while scoring leaves none, and the next
one scores again). A folder that exists is opened with `open_scores`, which refuses one scored from other
data or another checkpoint in one line naming both digests (exit 2): delete it, or point the recipe at
the data and checkpoint it was scored from.

The scores are looked up per microbatch by the trained-token numbers training gives every label
(`Microbatch.token_index`), so packing order, the DP split and CP slices do not matter. The pass packs the
rows as training does (a pair at a time, at training.seq_length), so at micro_batch_size 1 on one process
each row's forward is the one the `model` reference would run, and the two give the same losses bit for bit;
elsewhere they agree to rounding.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gptoss_cli.data.preference import reference_folder
from gptoss_cli.errors import ConfigError
from gptoss_cli.model.dtypes import torch_dtype
from gptoss_cli.preference.objective import REF_LOGP
from gptoss_cli.score import checkpoint_digest, data_digest, open_scores
from gptoss_cli.train.data import Microbatch
from gptoss_cli.train.objective import StepContext

def _kernels(cfg: Any):
    def setup(model: Any) -> None:
        model.set_swiglu_kernel(cfg.model.swiglu_kernel)
        model.set_attention_backend(cfg.model.attention_backend)
    return setup


def _broadcast(value: Any, state: Any) -> Any:
    if not state.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def score_reference(cfg: Any, state: Any, prefix: str) -> Path:
    """PREFIX.reference, scored now (every rank takes part) when it is absent; see the module docstring."""
    from gptoss_cli.score.command import score  # noqa: PLC0415

    folder = reference_folder(prefix)
    if _broadcast(folder.is_dir(), state):  # a killed pass leaves no folder (score writes it whole or not at all)
        return folder
    if state.pp_size > 1 or state.cp_size > 1:
        raise ConfigError(f"{folder}: no reference scores for {prefix}, and a run with pipeline or context parallel "
                          "ranks does not score them itself",
                          hint=f"gptoss score {cfg.checkpoint.pretrained} --data {prefix} --out {folder} "
                               f"--seq-length {cfg.training.seq_length} (under torchrun with --expert-parallel)")
    score(cfg.checkpoint.pretrained, prefix, folder, seq_length=cfg.training.seq_length,
          dtype=torch_dtype(cfg.precision.params_dtype), device=cfg.system.device, micro_batch_size=1,
          expert_parallel=state.ep_size, model_setup=_kernels(cfg))
    gc.collect()
    return folder


class PrecomputedReference:
    """The stored reference log-probabilities of one token file, attached to its microbatches."""

    def __init__(self, cfg: Any, state: Any, prefix: str, vocab_size: int):
        folder = reference_folder(prefix)
        digests = _broadcast((data_digest(prefix), checkpoint_digest(cfg.checkpoint.pretrained))
                             if state.rank == 0 else None, state)
        self.scores = open_scores(folder, data=prefix, data_digest=digests[0], model_digest=digests[1], top_k=0,
                                  vocab_size=vocab_size, temperature=1.0)

    def attach(self, microbatches: list[Microbatch], context: StepContext) -> None:
        for mb in microbatches:
            got = self.scores.for_microbatch(mb)
            mb.extras[REF_LOGP] = got.logprobs.to(torch.float32)


__all__ = ["PrecomputedReference", "score_reference"]
