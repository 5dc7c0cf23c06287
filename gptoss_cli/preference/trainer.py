"""DPO training: the loop's Trainer (train/loop.py) on preference pairs, with its reference and held-out pairs.

`PreferenceTrainer` differs from the loop's Trainer in three places: its data are the pairs of data.path
(preference/data.py, `PairSource`: a pair packed as one unit), it binds the objective (preference/objective.py)
to this rank's context-parallel group and to the reference's log-probabilities (preference/reference.py),
and its validation scores the held-out pairs of validation.data with the same objective: the DPO loss and
the four reward statistics with a `val_` prefix (`val_loss`, `val_rewards_chosen`, `val_rewards_rejected`,
`val_rewards_margin`, `val_rewards_accuracy`, and `val_pairs`), in eval mode and without gradients, every
data-parallel rank taking every dp-th row (a rank left without one runs a row with no pair, so the
collectives inside the forward pass stay matched), the sums all-reduced once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gptoss_cli.model.loss import IGNORE_INDEX
from gptoss_cli.preference.data import PAIR_FIRST, PAIR_SIDE, PairSource
from gptoss_cli.preference.objective import DPOObjective
from gptoss_cli.preference.reference import AdaptersOffReference, FrozenModelReference
from gptoss_cli.train.data import DataLoaderState, Microbatch, file_rows
from gptoss_cli.train.loop import Trainer
from gptoss_cli.train.objective import StepContext

VAL_METRICS = ("loss", "rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "pairs")


def reference_for(trainer: Trainer, prefix: str) -> Any:
    """What attaches the reference's log-probabilities to the microbatches of the token file `prefix` (None:
    the loss needs none)."""
    cfg = trainer.cfg
    if not trainer.objective.needs_reference:
        return None
    if cfg.dpo.reference == "precomputed":
        from gptoss_cli.preference.scores import PrecomputedReference  # noqa: PLC0415

        return PrecomputedReference(cfg, trainer.state, prefix, trainer.job.arch.vocab_size)
    if cfg.lora.rank > 0:
        return AdaptersOffReference()
    if trainer.frozen_reference is None:
        from gptoss_cli.train.provider import HybridModelProvider  # noqa: PLC0415

        trainer.frozen_reference = FrozenModelReference.from_provider(
            HybridModelProvider(trainer.runtime, seed=cfg.training.seed, weights=cfg.checkpoint.pretrained),
            trainer.state)
    return trainer.frozen_reference


class PairValidator:
    """The held-out pairs' DPO loss and reward statistics (module docstring)."""

    def __init__(self, trainer: "PreferenceTrainer"):
        cfg = trainer.cfg
        t, v = cfg.training, cfg.validation
        self.trainer, self.state, self.interval, self.train_iters = trainer, trainer.state, v.interval, t.train_iters
        self.source = PairSource(v.data, t.seq_length, seed=0, vocab_size=trainer.job.arch.vocab_size)
        rows = self.source.num_samples
        self.rows = rows if v.iters is None else min(rows, v.iters * t.global_batch_size)
        self.micro_batch_size = t.micro_batch_size
        self.reference = reference_for(trainer, v.data)

    def due(self, done: int) -> bool:
        return done == self.train_iters or bool(self.interval and done % self.interval == 0)

    def microbatches(self) -> list[Microbatch]:
        s, seq = self.state, self.source.seq_length
        mine = list(range(s.data_parallel_rank, self.rows, s.data_parallel_size))
        rounds = -(-(-(-self.rows // s.data_parallel_size)) // self.micro_batch_size)
        out = []
        for k in range(rounds):
            js = mine[k * self.micro_batch_size:(k + 1) * self.micro_batch_size]
            if js:
                out.append(file_rows(self.source, js, s.device))
                continue
            pad = torch.zeros(1, seq, dtype=torch.long, device=s.device)
            out.append(Microbatch(tokens=pad, labels=torch.full_like(pad, IGNORE_INDEX), token_index=torch.full_like(pad, -1),
                                  extras={PAIR_SIDE: torch.full_like(pad, -1), PAIR_FIRST: torch.zeros_like(pad)}))
        return [mb.context_slice(s.cp_size, s.cp_rank) for mb in out]

    def run(self, done: int, beat: Any = None) -> dict[str, Any]:
        tr, s = self.trainer, self.state
        objective: DPOObjective = tr.objective
        model = tr.model
        mbs = self.microbatches()
        totals = torch.zeros(len(objective.sums), dtype=torch.float64, device=s.device)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                context = StepContext(step=done, model=model, state=s)  # the plain schedule: forward only
                if self.reference is not None:
                    self.reference.attach(mbs, context)
                if objective.rpo_alpha > 0:
                    objective.attach_rpo_weight(mbs, s)
                for mb in mbs:
                    if beat is not None:
                        beat()
                    _, normaliser, logs = objective.loss(mb, None, model(mb.tokens, **mb.model_inputs()))
                    logs["num_tokens"] = normaliser
                    for i, name in enumerate(objective.sums):
                        if name in logs:
                            totals[i] += logs[name].double()
        finally:
            model.train(was_training)
        if s.distributed:
            dist.all_reduce(totals, group=s.dp_group)
        metrics = objective.metrics(dict(zip(objective.sums, totals.tolist())))
        return {f"val_{k}": metrics[k] for k in VAL_METRICS}


class PreferenceTrainer(Trainer):
    """The Trainer for objective.kind=dpo (module docstring)."""

    def __init__(self, job, state, **kw):
        cfg = job.config
        if cfg.dpo.reference == "precomputed" and job.objective.needs_reference:
            # scored (when absent) before the policy is built: the reference never sits beside it
            from gptoss_cli.preference.scores import score_reference  # noqa: PLC0415

            for prefix in filter(None, (cfg.data.path, cfg.validation.data)):
                score_reference(cfg, state, prefix)
        self.frozen_reference = None
        super().__init__(job, state, **kw)
        self.objective.cp_group = state.cp_group if state.cp_size > 1 else None
        self.objective.reference = reference_for(self, cfg.data.path)
        self.validator = PairValidator(self) if cfg.validation.data else None

    def _build_data(self) -> DataLoaderState:
        t, state = self.cfg.training, self.state
        source = PairSource(self.cfg.data.path, t.seq_length, t.seed, self.job.arch.vocab_size)
        self.packing = {"efficiency": source.efficiency, "rows": source.num_samples, "seq_length": t.seq_length}
        return DataLoaderState(source, global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                               dp_rank=state.data_parallel_rank, dp_size=state.data_parallel_size, device=state.device,
                               cp_size=state.cp_size, cp_rank=state.cp_rank)

    def validate(self, done: int) -> dict[str, Any]:
        if self.validator is None or not self.validator.due(done):
            return {}
        self.heartbeat.progress(done, "validation")
        return self.validator.run(done, beat=lambda: self.heartbeat.progress(done, "validation"))


__all__ = ["PreferenceTrainer", "PairValidator", "reference_for", "VAL_METRICS"]
