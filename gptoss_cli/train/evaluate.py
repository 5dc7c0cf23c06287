"""`gptoss eval`: the mean loss of a checkpoint over the trained tokens of a token file, as training computes it.

The data goes through training's own sources (gptoss_cli/train/data.py): a version-2 file is
packed into rows of whole documents with per-document attention and its loss mask; a version-1
file is cut into training's windows of S+1 tokens, every next-token prediction counted. Rows run
in file order, without shuffling. The loss is the sum of the token cross-entropies over the trained
tokens / their number (the model's chunked LM loss, never the full logits of a row); perplexity is
exp(loss). For a version-2 file every document's own sum and count are kept too.

One process, one device: the whole model must fit on it (multi-process expert-parallel eval is
not implemented).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from gptoss_cli.model.dtypes import dtype_name
from gptoss_cli.model.hybrid import IGNORE_INDEX, chunked_lm_loss_sum, lm_loss_sum
from gptoss_cli.token_format import INDEX_DTYPE, document_file_paths, has_documents, read_token_header
from gptoss_cli.train.data import PackedDocumentSource, TokenFileSource, packed_microbatch

Progress = Callable[[int, int], None]  # (rows done, rows in all)
DEFAULT_SEQ_LENGTH = 4096


@dataclass
class EvalResult:
    checkpoint: str
    data: str
    format_version: int
    seq_length: int
    dtype: str
    device: str
    loss: float  # mean token cross-entropy over the trained tokens (nan when there are none)
    loss_tokens: int
    perplexity: float
    rows: int
    tokens: int  # input positions that hold real tokens (not padding)
    packing_efficiency: float | None = None  # version-2 files: real tokens / row positions
    # version-2 files: one entry per document, in file order: index, tokens, loss_tokens, loss_sum, loss
    documents: list[dict[str, Any]] | None = field(default=None)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("loss", "perplexity"):  # JSON has no NaN/inf
            if not math.isfinite(out[key]):
                out[key] = None
        return out


def default_seq_length(data: str | Path) -> int:
    """Rows of 4096 tokens, or the longest document of a version-2 file when it is longer; one window
    of a version-1 file shorter than that."""
    header = read_token_header(data)
    if not has_documents(header):
        return max(1, min(DEFAULT_SEQ_LENGTH, int(header.get("num_tokens") or 2) - 1))
    import numpy as np  # noqa: PLC0415

    offsets = np.fromfile(document_file_paths(data)[0], dtype=INDEX_DTYPE)
    longest = int(np.diff(offsets).max()) if len(offsets) > 1 else 1
    return max(DEFAULT_SEQ_LENGTH, longest)


def evaluate(checkpoint: str | Path, data: str | Path, *, seq_length: int | None = None,
             dtype: torch.dtype = torch.float32, device: str = "auto", micro_batch_size: int = 1,
             progress: Progress | None = None, load_progress: Callable[[str], None] | None = None) -> EvalResult:
    """Evaluate `checkpoint` (any kind `gptoss_cli/checkpoint/load.py` reads) on the token file `data`."""
    from gptoss_cli.checkpoint.load import checkpoint_architecture, model_from_checkpoint  # noqa: PLC0415
    from gptoss_cli.parallel.state import pick_device  # noqa: PLC0415

    dev = pick_device(device)
    arch, _ = checkpoint_architecture(checkpoint)
    header = read_token_header(data)
    packed = has_documents(header)
    seq = seq_length if seq_length is not None else default_seq_length(data)
    if packed:
        source: Any = PackedDocumentSource(data, seq, seed=0, vocab_size=arch.vocab_size)
    else:
        source = TokenFileSource(data, seq, seed=0, vocab_size=arch.vocab_size)
    model = model_from_checkpoint(checkpoint, dtype=dtype, device=dev, progress=load_progress).eval()

    rows, total_sum, total_count, real = source.num_samples, 0.0, 0, 0
    docs: list[dict[str, Any]] | None = [None] * len(source.lengths) if packed else None  # type: ignore[list-item]
    with torch.no_grad():
        for first in range(0, rows, micro_batch_size):
            js = range(first, min(rows, first + micro_batch_size))
            if packed:
                row_data = [source.row(j) for j in js]
                mb = packed_microbatch(row_data, dev)
                out = model(mb.tokens, position_ids=mb.position_ids, cu_seqlens=mb.cu_seqlens)
                hidden = out.hidden.reshape(-1, out.hidden.shape[-1])
                labels = mb.labels.reshape(-1)
                for r, (j, row) in enumerate(zip(js, row_data)):
                    at = r * seq  # the row's padding, after its documents, is skipped
                    for d, n in zip(source.rows[j], row.lengths):
                        lab = labels[at:at + n]
                        s = float(chunked_lm_loss_sum(hidden[at:at + n], out.head_weight, lab,
                                                      model.loss_chunk_tokens))
                        c = int((lab != IGNORE_INDEX).sum())
                        docs[d] = {"index": d, "tokens": n, "loss_tokens": c, "loss_sum": s,
                                   "loss": s / c if c else None}
                        total_sum, total_count, real = total_sum + s, total_count + c, real + n
                        at += n
            else:
                batch = torch.stack([source.window(j) for j in js]).to(dev)
                tokens, labels = batch[:, :-1], batch[:, 1:]
                total_sum += float(lm_loss_sum(model(tokens), labels))
                total_count += int(labels.numel())
                real += int(tokens.numel())
            if progress is not None:
                progress(js.stop, rows)
    loss = total_sum / total_count if total_count else float("nan")
    return EvalResult(
        checkpoint=str(checkpoint), data=str(data), format_version=int(header.get("version", 1)), seq_length=seq,
        dtype=dtype_name(dtype), device=str(dev), loss=loss, loss_tokens=total_count,
        perplexity=math.inf if loss > 709 else math.exp(loss),  # exp overflows past 709; nan stays nan
        rows=rows, tokens=real, packing_efficiency=source.efficiency if packed else None, documents=docs,
    )


__all__ = ["EvalResult", "evaluate", "default_seq_length", "DEFAULT_SEQ_LENGTH"]
