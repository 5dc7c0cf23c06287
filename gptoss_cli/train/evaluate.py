"""`gptoss eval`: the mean loss of a checkpoint over the trained tokens of a token file, as training computes it.

The data goes through training's own sources (gptoss_cli/train/data.py): a version-2 file is
packed into rows of whole documents with per-document attention and its loss mask; a version-1
file is cut into training's windows of S+1 tokens, every next-token prediction counted. Rows run
in file order, without shuffling. The loss is the sum of the token cross-entropies over the trained
tokens / their number (the model's chunked LM loss, never the full logits of a row); perplexity is
exp(loss). For a version-2 file every document's own sum and count are kept too.

Multi-process under torchrun: `expert_parallel` ranks share the experts (training's EP layout),
every rank scores its share of the rows, and the figures are gathered. Validation during training
(train/validation.py) scores the same rows (`file_rows`) with the same loss.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.dtypes import dtype_name
from gptoss_cli.model.loss import IGNORE_INDEX, chunked_lm_loss_sum
from gptoss_cli.data.preference import PREFERENCE_KIND
from gptoss_cli.data.token_format import document_file_paths, has_documents, read_document_offsets, read_token_header
from gptoss_cli.train.data import PackedDocumentSource, TokenFileSource, file_rows, packed_microbatch

EvalProgress = Callable[[int, int], None]  # (rows done, rows in all)
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
    world_size: int = 1  # processes that scored the rows
    expert_parallel: int = 1  # the experts were split over this many ranks

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

    offsets = read_document_offsets(document_file_paths(data)[0])
    longest = int(np.diff(offsets).max()) if len(offsets) > 1 else 1
    return max(DEFAULT_SEQ_LENGTH, longest)


def check_seq_length(seq: int, max_positions: int, data: str | Path, header: dict[str, Any]) -> None:
    """Refuse an explicit `--seq-length` longer than the model's positions or than the data can fill: a
    version-1 file needs one window of seq+1 tokens; a version-2 file's rows hold whole documents, so a
    row longer than the default (4096, or the longest document) and than all its tokens is padding only
    (which grew, row after row, until the process was killed for memory)."""
    if seq > max_positions:
        raise ConfigError(f"--seq-length {seq} is longer than the checkpoint's max_position_embeddings {max_positions}",
                          hint=f"use at most {max_positions}")
    tokens = int(header.get("num_tokens") or 0)
    if not has_documents(header):
        if seq + 1 > tokens:
            raise ConfigError(f"--seq-length {seq} needs windows of {seq + 1} tokens, but {data} holds only "
                              f"a window of {tokens} tokens", hint=f"use at most {max(1, tokens - 1)}")
        return
    most = max(default_seq_length(data), tokens)
    if seq > most:
        raise ConfigError(f"--seq-length {seq} is longer than {data} can fill: its {tokens} tokens need no row "
                          f"longer than the default, and a row of {most} holds them all",
                          hint=f"use at most {most}")


def _score_rows(model: Any, source: Any, js: list[int], packed: bool, device: torch.device) -> list[dict[str, Any]]:
    """One forward pass over rows `js`: per document of a packed row (or per window) its index, tokens,
    trained tokens and summed loss."""
    seq = source.seq_length
    if not packed:
        mb = file_rows(source, js, device)  # the rows validation during training scores too
        out = model(mb.tokens)
        hidden = out.hidden.reshape(-1, out.hidden.shape[-1])
        labels = mb.labels.reshape(-1)
        return [{"index": None, "tokens": seq, "loss_tokens": seq,
                 "loss_sum": float(chunked_lm_loss_sum(hidden[r * seq:(r + 1) * seq], out.head_weight,
                                                       labels[r * seq:(r + 1) * seq], model.loss_chunk_tokens))}
                for r in range(len(js))]
    row_data = [source.row(j) for j in js]
    mb = packed_microbatch(row_data, device)
    out = model(mb.tokens, **mb.model_inputs())
    hidden = out.hidden.reshape(-1, out.hidden.shape[-1])
    labels = mb.labels.reshape(-1)
    scores = []
    for r, (j, row) in enumerate(zip(js, row_data)):
        at = r * seq  # the row's padding, after its documents, is skipped
        for d, n in zip(source.rows[j], row.lengths):
            lab = labels[at:at + n]
            scores.append({"index": d, "tokens": n, "loss_tokens": int((lab != IGNORE_INDEX).sum()),
                           "loss_sum": float(chunked_lm_loss_sum(hidden[at:at + n], out.head_weight, lab,
                                                                 model.loss_chunk_tokens))})
            at += n
    return scores


@dataclass
class ScoringRun:
    """A frozen checkpoint ready to score a token file's rows on this rank: what `gptoss eval` and
    `gptoss score` (gptoss_cli/score/) share. `rows(micro_batch_size)` yields this rank's rows in
    rounds; `source` gives them (`file_rows`, or `source.row(j)` for packed documents)."""

    model: Any
    source: Any  # PackedDocumentSource (version 2) or TokenFileSource (version 1)
    state: Any  # the rank's ParallelState
    arch: Any  # GptOssArch
    header: dict[str, Any]  # the token file's header
    packed: bool
    seq_length: int

    def rows(self, micro_batch_size: int, progress: EvalProgress | None = None) -> Iterator[list[int]]:
        """This rank's rows (every world_size-th, from its rank on), `micro_batch_size` per round, with
        no gradients. A rank without a row left in a round runs one padding row itself, so the expert
        all-to-alls of its EP group still match; `progress(rows done, rows)` after every round."""
        rows, world = self.source.num_samples, self.state.world_size
        mine = list(range(self.state.rank, rows, world))
        per_rank = -(-rows // world)  # rows of the busiest rank
        with torch.no_grad():
            for k in range(-(-per_rank // micro_batch_size)):
                js = mine[k * micro_batch_size:(k + 1) * micro_batch_size]
                if js:
                    yield js
                elif self.state.ep_size > 1:  # keep the EP group's all-to-alls matched
                    self.model(torch.zeros(1, self.seq_length, dtype=torch.long, device=self.state.device))
                if progress is not None:
                    progress(min(rows, (k + 1) * micro_batch_size * world), rows)


@contextlib.contextmanager
def scoring_run(checkpoint: str | Path, data: str | Path, *, seq_length: int | None = None,
                dtype: torch.dtype = torch.float32, device: str = "auto", expert_parallel: int = 1,
                load_progress: Callable[[str], None] | None = None, command: str = "eval",
                model_setup: Callable[[Any], None] | None = None) -> Iterator[ScoringRun]:
    """Load `checkpoint` (any kind gptoss_cli/checkpoint/load.py reads) frozen in eval mode over the
    token file `data`, in training's EP layout under torchrun (or in a process group joined already:
    every rank holds 1/expert_parallel of the experts); the process group it made is torn down after.
    A preference file's rows are packed a pair at a time, as training packs them (gptoss_cli/preference/);
    `model_setup(model)` may set the loaded model's kernels as a training run's recipe sets them."""
    import torch.distributed as dist  # noqa: PLC0415

    from gptoss_cli.checkpoint.load import checkpoint_architecture, model_from_checkpoint  # noqa: PLC0415
    from gptoss_cli.parallel.state import destroy_parallel, init_parallel, torchrun_env  # noqa: PLC0415
    from gptoss_cli.train.provider import dispatcher_factory  # noqa: PLC0415

    if expert_parallel > 1 and not dist.is_initialized() and torchrun_env() is None:
        raise ConfigError(f"--expert-parallel {expert_parallel} splits the experts over {expert_parallel} processes, "
                          "but this is one process",
                          hint=f"torchrun --nproc-per-node {expert_parallel} -m gptoss_cli {command} ... "
                               f"--expert-parallel {expert_parallel}")
    arch, _ = checkpoint_architecture(checkpoint)
    header = read_token_header(data)
    packed = has_documents(header)
    if seq_length is not None:
        check_seq_length(seq_length, arch.max_position_embeddings, data, header)
    seq = seq_length if seq_length is not None else default_seq_length(data)
    if packed:
        unit = 2 if header.get("kind") == PREFERENCE_KIND else 1  # both sides of a pair in one row
        source: Any = PackedDocumentSource(data, seq, seed=0, vocab_size=arch.vocab_size, unit=unit)
    else:
        source = TokenFileSource(data, seq, seed=0, vocab_size=arch.vocab_size)
    owns_group = not dist.is_initialized()
    state = init_parallel(expert_parallel, device)
    try:
        offset, n_local = state.local_expert_range(arch.num_local_experts)
        model = model_from_checkpoint(
            checkpoint, dtype=dtype, device=state.device, progress=load_progress, expert_offset=offset,
            num_local_experts=n_local, token_dispatcher_factory=dispatcher_factory(arch.num_local_experts, state),
        ).eval()
        if model_setup is not None:
            model_setup(model)
        yield ScoringRun(model, source, state, arch, header, packed, seq)
    finally:
        if owns_group:
            destroy_parallel()


def evaluate(checkpoint: str | Path, data: str | Path, *, seq_length: int | None = None,
             dtype: torch.dtype = torch.float32, device: str = "auto", micro_batch_size: int = 1,
             expert_parallel: int = 1, progress: EvalProgress | None = None,
             load_progress: Callable[[str], None] | None = None) -> EvalResult:
    """Evaluate `checkpoint` (any kind `gptoss_cli/checkpoint/load.py` reads) on the token file `data`.

    Under torchrun (or in a process group joined already) every rank holds 1/expert_parallel of the
    experts (training's EP layout and all-to-all dispatcher) and scores every world_size-th row; the
    figures are gathered so every rank returns the whole result (`scoring_run`)."""
    import torch.distributed as dist  # noqa: PLC0415

    with scoring_run(checkpoint, data, seq_length=seq_length, dtype=dtype, device=device,
                     expert_parallel=expert_parallel, load_progress=load_progress) as run:
        source, state, packed, seq, header = run.source, run.state, run.packed, run.seq_length, run.header
        scores: list[dict[str, Any]] = []
        for js in run.rows(micro_batch_size, progress):
            scores += _score_rows(run.model, source, js, packed, state.device)
        if state.distributed:
            gathered: list[Any] = [None] * state.world_size
            dist.all_gather_object(gathered, scores)
            scores = [x for part in gathered for x in part]
        rows = source.num_samples

    total_sum = sum(x["loss_sum"] for x in scores)
    total_count = sum(x["loss_tokens"] for x in scores)
    docs = None
    if packed:
        docs = sorted(({**x, "loss": x["loss_sum"] / x["loss_tokens"] if x["loss_tokens"] else None} for x in scores),
                      key=lambda x: x["index"])
    loss = total_sum / total_count if total_count else float("nan")
    return EvalResult(
        checkpoint=str(checkpoint), data=str(data), format_version=int(header.get("version", 1)), seq_length=seq,
        dtype=dtype_name(dtype), device=str(state.device), loss=loss, loss_tokens=total_count,
        perplexity=math.inf if loss > 709 else math.exp(loss),  # exp overflows past 709; nan stays nan
        rows=rows, tokens=sum(x["tokens"] for x in scores),
        packing_efficiency=source.efficiency if packed else None, documents=docs, world_size=state.world_size,
        expert_parallel=state.ep_size,
    )


__all__ = ["EvalResult", "evaluate", "ScoringRun", "scoring_run", "default_seq_length", "check_seq_length", "DEFAULT_SEQ_LENGTH"]
