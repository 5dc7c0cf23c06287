"""Version-2 token files (documents + loss mask) written directly, with small ids for the tiny vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gptoss_cli.token_format import document_file_paths, token_file_paths, write_atomically, write_document_index, write_token_header


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
