"""`gptoss score`: a frozen model's per-token scores of every trained token of a token file, written once.

The rows are `gptoss eval`'s (train/evaluate.py, `scoring_run`): the same packing, loss mask, EP layout
under torchrun and row split over ranks, so the mean of the stored log-probs at T=1 is minus eval's
loss. Per round of rows: one forward, then only the trained positions through the chunked LM head
(gptoss_cli/score/compute.py), their scores added to the rank's shard writer with their trained-token
numbers (`Microbatch.token_index`). Memory: one round's activations, one LM-head chunk's logits, and
at most one shard's rows (`shard_tokens`) on the host.

Whole or not at all: rank 0 creates `.DIR.partial-PID` next to DIR (after removing the leftovers of
killed runs), every rank writes its shards there, and rank 0 writes the manifest last and renames the
folder into place (replacing an old DIR only with --force, in one exchange: gptoss_cli/outputs.py).
A kill at any point leaves the old DIR (or none) and a leftover the next run removes.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from gptoss_cli import outputs
from gptoss_cli.errors import ConfigError, UsageError
from gptoss_cli.json_input import parse_json
from gptoss_cli.model.dtypes import dtype_name
from gptoss_cli.model.loss import IGNORE_INDEX
from gptoss_cli.score.compute import score_positions
from gptoss_cli.score.digests import checkpoint_digest, data_digest, tokenizer_digest
from gptoss_cli.score.files import (DEFAULT_SHARD_BYTES, MANIFEST, SCORE_FORMAT, SHARD_PREFIX, ScoreManifest, ShardWriter,
                                    bytes_per_token)
from gptoss_cli.train.data import file_rows
from gptoss_cli.train.evaluate import scoring_run

ScoreProgress = Callable[[int, int], None]  # (rows done, rows in all)


@dataclass
class ScoreResult:
    out: str
    checkpoint: str
    data: str
    format_version: int
    seq_length: int
    dtype: str
    device: str
    top_k: int
    temperature: float
    trained_tokens: int
    rows: int
    shards: int
    bytes: int
    mean_logprob: float  # over every trained token (at T=1: minus `gptoss eval`'s loss); nan when none
    data_digest: str
    model_digest: str
    tokenizer_digest: str | None
    vocab_size: int
    seconds: float
    world_size: int = 1
    expert_parallel: int = 1
    notes: list[str] | None = None  # leftovers of killed runs that were removed

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if not math.isfinite(out["mean_logprob"]):
            out["mean_logprob"] = None
        return out


def _is_score_folder(folder: Path) -> bool:
    try:
        raw = parse_json((folder / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("format") == SCORE_FORMAT


def check_out(out: Path, force: bool) -> None:
    """DIR absent or empty; with --force also a previous score folder (its manifest and shards only)."""
    outputs.check_writable_location(out, "--out")
    if os.path.lexists(out) and not out.is_dir():
        raise UsageError(f"{out}: --out exists and is not a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise UsageError(f"{out}: --out exists and is not empty", hint="pass --force to replace a previous score folder")
    if not _is_score_folder(out):
        raise UsageError(f"{out}: --force replaces only an empty folder or a previous gptoss score folder, and it has "
                         f"no gptoss {MANIFEST}", hint="choose another --out, or empty it yourself")
    for entry in out.iterdir():
        if not (entry.is_file() and (entry.name == MANIFEST or entry.name.startswith(SHARD_PREFIX))):
            raise UsageError(f"{out}: --force replaces only a previous gptoss score folder; it also holds "
                             f"{entry.name!r}, which gptoss does not write", hint="move that file out first")


def _check_options(top_k: int, temperature: float) -> None:
    if top_k < 0:
        raise UsageError(f"--top-k {top_k} is negative", hint="0 stores the log-prob of each trained token only")
    if not (math.isfinite(temperature) and 1e-6 <= temperature <= 100):  # logits / T stay finite (generate's bound)
        raise UsageError(f"--temperature {temperature} must be a finite number in [1e-06, 100]")


def _rank() -> int:
    import torch.distributed as dist  # noqa: PLC0415

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _trained_tokens(source: Any, packed: bool) -> int:
    return int(source.trained_before[-1]) if packed else source.num_samples * source.seq_length


def _score_rows(run: Any, js: list[int], writer: ShardWriter, top_k: int, temperature: float) -> None:
    mb = file_rows(run.source, js, run.state.device)
    out = run.model(mb.tokens, **mb.model_inputs())
    labels = mb.labels.reshape(-1)
    sel = torch.nonzero(labels != IGNORE_INDEX).flatten()
    hidden = out.hidden.reshape(-1, out.hidden.shape[-1]).index_select(0, sel)
    scores = score_positions(hidden, out.head_weight, labels[sel], top_k=top_k, temperature=temperature,
                             chunk_tokens=run.model.loss_chunk_tokens)
    writer.add(mb.token_index.reshape(-1)[sel], labels[sel], scores)


def score(checkpoint: str | Path, data: str | Path, out: str | Path, *, top_k: int = 0, temperature: float = 1.0,
          seq_length: int | None = None, dtype: torch.dtype = torch.float32, device: str = "auto",
          micro_batch_size: int = 1, expert_parallel: int = 1, force: bool = False, shard_tokens: int | None = None,
          progress: ScoreProgress | None = None, load_progress: Callable[[str], None] | None = None,
          model_setup: Callable[[Any], None] | None = None) -> ScoreResult:
    """Score every trained token of the token file `data` with `checkpoint` into the folder `out`
    (gptoss_cli/score/files.py's format); the module docstring says how. Under torchrun every rank
    returns the result. `model_setup(model)`: what a training run's pre-pass sets on the loaded model
    (its recipe's kernels), so the scores are what its own reference would compute."""
    import torch.distributed as dist  # noqa: PLC0415

    _check_options(top_k, temperature)
    out, started, leader = Path(out), time.perf_counter(), _rank() == 0
    check_out(out, force)
    notes = outputs.recover(out) if leader else []
    with ThreadPoolExecutor(max_workers=1) as pool, scoring_run(
            checkpoint, data, seq_length=seq_length, dtype=dtype, device=device, expert_parallel=expert_parallel,
            load_progress=load_progress, command="score", model_setup=model_setup) as run:
        arch, state = run.arch, run.state
        if top_k > arch.vocab_size:
            raise UsageError(f"--top-k {top_k} exceeds the model's vocabulary ({arch.vocab_size})")
        total = _trained_tokens(run.source, run.packed)
        tmp = outputs.start_folder(out, total * bytes_per_token(top_k) + (1 << 20)) if leader else None
        # the digests are read while the model scores (hashlib releases the GIL)
        digests = pool.submit(lambda: (data_digest(data), checkpoint_digest(checkpoint), tokenizer_digest(checkpoint))
                              ) if leader else None
        with outputs.removed_on_error(tmp, out) if leader else contextlib.nullcontext():
            if state.distributed:
                box = [str(tmp) if leader else None]
                dist.broadcast_object_list(box, src=0)
                tmp = Path(box[0])
            per_shard = shard_tokens or max(1, DEFAULT_SHARD_BYTES // bytes_per_token(top_k))
            writer = ShardWriter(tmp, state.rank, top_k, per_shard)
            for js in run.rows(micro_batch_size, progress):
                _score_rows(run, js, writer, top_k, temperature)
            mine = (writer.close(), writer.logprob_sum)
            parts = [mine]
            if state.distributed:
                parts = [None] * state.world_size
                dist.all_gather_object(parts, mine)
            entries = [e for p in parts for e in p[0]]
            logprob_sum = sum(p[1] for p in parts)
            scored = sum(e.tokens for e in entries)
            if scored != total:  # every trained token exactly once, or nothing is written
                raise RuntimeError(f"scored {scored} trained tokens of {data}, which holds {total}")
            d_digest, m_digest, t_digest = digests.result() if leader else (None, None, None)
            manifest = ScoreManifest(
                data_path=str(data), data_digest=d_digest or "", data_format_version=int(run.header.get("version", 1)),
                seq_length=run.seq_length, trained_tokens=total, checkpoint=str(checkpoint),
                model_digest=m_digest or "", vocab_size=arch.vocab_size, tokenizer_digest=t_digest,
                dtype=dtype_name(dtype), top_k=top_k, temperature=float(temperature), shards=tuple(entries))
            if leader:
                manifest.write(tmp)
                outputs.commit(tmp, out)
        if state.distributed:  # every rank returns once DIR is in place
            box = [(d_digest, m_digest, t_digest)]
            dist.broadcast_object_list(box, src=0)
            d_digest, m_digest, t_digest = box[0]
        return ScoreResult(
            out=str(out), checkpoint=str(checkpoint), data=str(data), format_version=manifest.data_format_version,
            seq_length=run.seq_length, dtype=dtype_name(dtype), device=str(state.device), top_k=top_k,
            temperature=float(temperature), trained_tokens=total, rows=run.source.num_samples, shards=len(entries),
            bytes=sum((out / e.file).stat().st_size for e in entries) if leader else 0,
            mean_logprob=logprob_sum / total if total else float("nan"), data_digest=d_digest or "",
            model_digest=m_digest or "", tokenizer_digest=t_digest, vocab_size=arch.vocab_size,
            seconds=time.perf_counter() - started, world_size=state.world_size, expert_parallel=state.ep_size,
            notes=notes or None)


__all__ = ["score", "ScoreResult", "check_out"]
