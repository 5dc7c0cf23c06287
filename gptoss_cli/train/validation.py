"""Validation during training (`validation.*`): the held-out loss over the trained tokens, as `gptoss eval` computes it.

The rows are those `gptoss eval --seq-length S` scores (train/evaluate.py): the token file's windows
of S+1 tokens (version 1) or its packed rows of whole documents with their loss mask (version 2),
in file order, never shuffled, at S = training.seq_length; `validation.iters` batches of
training.global_batch_size rows (null: all of them). The loss is the model's chunked token
cross-entropy summed over the trained tokens of every row, divided by their number (`val_loss`,
with `val_tokens` and `val_perplexity`), on the step's metrics.jsonl line, TensorBoard / W&B and
the report.

Every data-parallel rank scores every dp_size-th row, `micro_batch_size` rows per forward pass,
without gradients and in eval mode; context-parallel ranks take their slice of the same rows as in
training. A rank left without a row in the last round runs a padding row with no trained token, so
the expert-parallel and context-parallel collectives inside the forward pass stay matched. The sums
are all-reduced once and read back once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from gptoss_cli.model.loss import IGNORE_INDEX, lm_loss_sum
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.train.data import Microbatch, file_rows, token_file_source


class Validator:
    """The held-out loss of a training run (see the module docstring)."""

    def __init__(self, cfg: RecipeConfig, state: ParallelState, vocab_size: int):
        t, v = cfg.training, cfg.validation
        self.interval, self.train_iters, self.state = v.interval, t.train_iters, state
        self.source = token_file_source(v.data, t.seq_length, seed=0, vocab_size=vocab_size)
        rows = self.source.num_samples if v.iters is None else min(self.source.num_samples, v.iters * t.global_batch_size)
        self.rows, self.micro_batch_size = rows, t.micro_batch_size

    def due(self, done: int) -> bool:
        """Validate after step `done`: every validation.interval steps and after the last."""
        return done == self.train_iters or bool(self.interval and done % self.interval == 0)

    def _microbatches(self) -> list[Microbatch | None]:
        """This rank's microbatches of every round, None where it has no row left (a padding row)."""
        s = self.state
        mine = list(range(s.data_parallel_rank, self.rows, s.data_parallel_size))
        rounds = -(-(-(-self.rows // s.data_parallel_size)) // self.micro_batch_size)
        out: list[Microbatch | None] = []
        for k in range(rounds):
            js = mine[k * self.micro_batch_size:(k + 1) * self.micro_batch_size]
            out.append(file_rows(self.source, js, s.device) if js else None)
        return out

    def run(self, model: torch.nn.Module, beat: Any = None) -> dict[str, float]:
        """Score the rows with `model` (eval mode, no gradients; train mode again after); `beat()` is
        called at every forward pass (the heartbeat)."""
        s, seq = self.state, self.source.seq_length
        totals = torch.zeros(2, dtype=torch.float64, device=s.device)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for mb in self._microbatches():
                    if beat is not None:
                        beat()
                    if mb is None:
                        pad = torch.zeros(1, seq, dtype=torch.long, device=s.device)
                        mb = Microbatch(tokens=pad, labels=torch.full_like(pad, IGNORE_INDEX))
                    mb = mb.context_slice(s.cp_size, s.cp_rank)
                    out = model(mb.tokens, **mb.model_inputs())
                    totals[0] += lm_loss_sum(out, mb.labels).double()
                    totals[1] += (mb.labels != IGNORE_INDEX).sum()
        finally:
            model.train(was_training)
        if s.distributed:
            dist.all_reduce(totals, group=s.dp_group)
        loss_sum, tokens = totals.tolist()
        loss = loss_sum / tokens if tokens else math.nan
        finite = math.isfinite(loss) and loss <= 709  # exp overflows past 709; JSON has no NaN or inf
        return {"val_loss": loss if math.isfinite(loss) else None, "val_tokens": int(tokens),
                "val_perplexity": math.exp(loss) if finite else None}


__all__ = ["Validator"]
