"""Version-2 token files (documents + loss mask) written directly, with small ids for the tiny vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gptoss_cli.data.token_format import document_file_paths, token_file_paths, write_atomically, write_document_index, write_token_header


def sft_documents(lengths: list[int], vocab: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(documents, masks): random tokens; each document's mask trains a random tail (never the first
    token), like an assistant reply after a prompt."""
    g = torch.Generator().manual_seed(seed)
    docs, masks = [], []
    for n in lengths:
        docs.append(torch.randint(0, vocab, (n,), generator=g))
        prompt = int(torch.randint(1, n, (1,), generator=g))
        mask = torch.zeros(n, dtype=torch.uint8)
        mask[prompt:] = 1
        masks.append(mask)
    return docs, masks


def write_sft_file(prefix: Path, docs: list[torch.Tensor], masks: list[torch.Tensor] | None, vocab: int) -> Path:
    """Write PREFIX.{bin,idx,mask,json} as `prepare-data --format harmony` does; returns the prefix."""
    bin_path, json_path = token_file_paths(prefix)
    tokens = torch.cat(docs).numpy().astype(np.uint16)
    write_atomically(bin_path, tokens)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    write_document_index(prefix, offsets)
    if masks is not None:
        write_atomically(document_file_paths(prefix)[1], torch.cat(masks).numpy().astype(np.uint8))
    write_token_header(json_path, dtype="uint16", num_tokens=len(tokens), num_documents=len(docs), vocab_size=vocab,
                       eos_token_id=None, tokenizer=None, sources=["test"], documents={
                           "loss_mask": masks is not None, "kind": "harmony",
                           "num_loss_tokens": int(sum(int(m.sum()) for m in masks)) if masks is not None else 0,
                           "max_document_length": max(len(d) for d in docs), "num_dropped": 0, "rendering": {}})
    return prefix


def packed_step_worker(rank: int, prefix: str, ep: int, overlap: bool, seq: int, global_batch: int) -> dict:
    """One rank's loss sum, trained tokens and finalised gradients of one global batch of packed rows
    (micro-batches of 1 row), through the plain schedule or combined 1F1B with EP overlap."""
    from gptoss_cli.model.config import preset
    from gptoss_cli.parallel.state import init_parallel
    from gptoss_cli.schedule import get_forward_backward_func
    from gptoss_cli.train.data import DataLoaderState, PackedDocumentSource
    from gptoss_cli.train.objective import forward_step
    from tests.schedule.workers import build
    from tests.train.dist_helpers import named_grads

    tiny = preset("tiny")
    state = init_parallel(ep, "cpu")
    setup = build(state, overlap=overlap, pattern=tiny.hybrid_layer_pattern, aux=0.0, seed=11)
    source = PackedDocumentSource(prefix, seq, 0, tiny.vocab_size)
    data = DataLoaderState(source, global_batch_size=global_batch, micro_batch_size=1, dp_rank=state.dp_rank,
                           dp_size=state.dp_size)
    schedule = get_forward_backward_func(setup.config)
    logs = schedule(forward_step_func=forward_step, data_iterator=data.step_iterator(), model=setup.model,
                    num_microbatches=data.num_microbatches)
    return {"loss_sum": float(sum(l["lm_loss_sum"] for l in logs)), "tokens": float(sum(l["num_tokens"] for l in logs)),
            "grads": named_grads(setup.model), "schedule": schedule.__name__}
