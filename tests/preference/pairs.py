"""Preference token files written directly (random ids for the tiny vocabulary), and one DPO step of them through
the training path (the objective's prepare_step, the run's schedule, the gradient buffers' finalisation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptoss_cli.data.token_format import document_file_paths, token_file_paths, write_atomically, write_document_index, write_token_header

Pair = tuple[list[int], list[int], list[int]]  # prompt, chosen completion, rejected completion


def random_pairs(n: int, vocab: int, seed: int = 0, prompt: tuple[int, int] = (4, 8),
                 completion: tuple[int, int] = (2, 7)) -> list[Pair]:
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(0, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()

    return [(ids(*prompt), ids(*completion), ids(*completion)) for _ in range(n)]


def write_pair_file(prefix: Path, pairs: list[Pair], vocab: int) -> Path:
    """PREFIX.{bin,idx,mask,json} as `prepare-data --format preference` writes them: documents prompt + chosen and
    prompt + rejected, the completions trained."""
    docs, masks = [], []
    for prompt, chosen, rejected in pairs:
        for side in (chosen, rejected):
            docs.append(prompt + side)
            masks.append([0] * len(prompt) + [1] * len(side))
    bin_path, json_path = token_file_paths(prefix)
    tokens = np.asarray([t for d in docs for t in d], dtype=np.uint16)
    write_atomically(bin_path, tokens)
    write_document_index(prefix, np.concatenate([[0], np.cumsum([len(d) for d in docs])]))
    write_atomically(document_file_paths(prefix)[1], np.asarray([m for ms in masks for m in ms], dtype=np.uint8))
    write_token_header(json_path, dtype="uint16", num_tokens=len(tokens), num_documents=len(docs), vocab_size=vocab,
                       eos_token_id=None, tokenizer=None, sources=["test"], documents={
                           "loss_mask": True, "kind": "preference", "num_loss_tokens": int(sum(map(sum, masks))),
                           "max_document_length": max(map(len, docs)), "num_dropped": 0, "rendering": {}})
    return prefix


class ModelReference:
    """A frozen model's log-probabilities as the reference (preference/reference.py's FrozenModelReference)."""

    def __init__(self, model: torch.nn.Module):
        from gptoss_cli.preference.reference import FrozenModelReference

        self.inner = FrozenModelReference(model)

    def attach(self, mbs, context) -> None:
        self.inner.attach(mbs, context)


def dpo_step_worker(rank: int, prefix: str, policy: str, reference: str, seq: int, global_batch: int, mbs: int,
                    ep: int, cases: list[dict[str, Any]], cp: int = 1) -> list[dict[str, Any]]:
    """Per case (DPOObjective keywords): the step's metrics and the finalised gradients of this rank's tensors."""
    from gptoss_cli.model.config import preset
    from gptoss_cli.parallel.state import init_parallel
    from gptoss_cli.preference.data import PairSource
    from gptoss_cli.preference.objective import DPOObjective
    from gptoss_cli.rl.reference import frozen_copy
    from gptoss_cli.schedule import get_forward_backward_func
    from gptoss_cli.train.data import DataLoaderState
    from gptoss_cli.train.objective import StepContext
    from gptoss_cli.train.provider import HybridModelProvider
    from gptoss_cli.train.setup import setup_model_and_optimizer
    from tests.train.dist_helpers import named_grads
    from tests.train.jobs import optimizer_config, runtime_config

    tiny = preset("tiny")
    state = init_parallel(ep, "cpu", cp_size=cp)
    runtime = runtime_config(ep_size=ep, aux_loss_coeff=0.0)
    setup = setup_model_and_optimizer(HybridModelProvider(runtime, weights=policy), state, optimizer_config(), 1e-3)
    ref = ModelReference(frozen_copy(HybridModelProvider(runtime, weights=reference), state))
    schedule = get_forward_backward_func(setup.config)
    out = []
    for case in cases:
        objective = DPOObjective(**case)
        objective.reference, objective.cp_group = ref, state.cp_group if cp > 1 else None
        data = DataLoaderState(PairSource(prefix, seq, 0, tiny.vocab_size), global_batch_size=global_batch,
                               micro_batch_size=mbs, dp_rank=state.data_parallel_rank, dp_size=state.data_parallel_size,
                               cp_size=state.cp_size, cp_rank=state.cp_rank)
        setup.model.zero_grad_buffer()
        context = StepContext(step=0, model=setup.model, state=state, schedule=schedule)
        logs = schedule(forward_step_func=objective.forward_step,
                        data_iterator=objective.prepare_step(data.step_iterator(), context), model=setup.model,
                        num_microbatches=data.num_microbatches)
        sums = torch.tensor([float(sum(float(log[k]) for log in logs if k in log)) for k in objective.sums],
                            dtype=torch.float64)
        if state.distributed:  # the loop's one collective: every rank (a CP group's ranks each count their part)
            torch.distributed.all_reduce(sums)
        out.append({"metrics": objective.metrics(dict(zip(objective.sums, sums.tolist()))),
                    "grads": named_grads(setup.model)})
    return out
