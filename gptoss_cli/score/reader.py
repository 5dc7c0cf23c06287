"""Reading a score file back for training: precomputed per-token scores aligned with a microbatch's trained positions.

The API the objectives use (DPO's precomputed reference, distillation's precomputed teacher):

    from gptoss_cli.score import open_scores, checkpoint_digest

    scores = open_scores(DIR, data=data.path, model_digest=checkpoint_digest(ref), top_k=0, vocab_size=V)
    got = scores.for_microbatch(mb)      # MicrobatchScores, on mb's device, shaped like mb.labels
    got.trained                          # [mbs, S] bool: the positions the file scored (labels trained)
    got.logprobs                         # [mbs, S] fp32 log p(label), 0 elsewhere
    got.topk_ids, got.topk_logprobs      # [mbs, S, K] int64 / fp32 (K > 0), 0 elsewhere
    got.tail_logmass                     # [mbs, S] fp32 (K > 0), 0 elsewhere
    scores.attach(mb)                    # the same into mb.extras under EXTRAS' names (CP slices them)

`open_scores` refuses, in one line naming both values (ConfigError, exit 2), a file whose data digest,
model digest, K, vocabulary, tokenizer digest, temperature or (version-1 data) row length differs from
what the caller passes; an argument left None is not checked. It opens the shards lazily and reads only
the rows a microbatch needs (row ranges of safetensors shards), so memory stays bounded whatever the
file's size, and a `ScoreFile` pickles (to spawned workers) without its open files.

Alignment: the training data path numbers every label by its place among the token file's trained
tokens (`Microbatch.token_index`, gptoss_cli/train/data.py), whatever the packing, the DP split, the
microbatch order or the CP slice; the file stores each trained token's scores under that number
(gptoss_cli/score/files.py). `for_microbatch` looks the numbers up and checks that the stored labels
are the microbatch's labels, so a file that does not belong to the data fails loudly, never silently.
Open it where the data is read (a worker's `prepare_step`), and attach the scores there: `loss` then
reads them from `mb.extras`, as it must (train/objective.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptoss_cli.checkpoint.storage.safetensors_io import SafetensorsFile
from gptoss_cli.errors import CheckpointError, ConfigError
from gptoss_cli.score.files import ScoreManifest

EXTRAS = {"logprobs": "score_logprobs", "topk_ids": "score_topk_ids", "topk_logprobs": "score_topk_logprobs",
          "tail_logmass": "score_tail_logmass"}
_HINT = "score the data again with `gptoss score`"


@dataclass
class MicrobatchScores:
    """The stored scores at a microbatch's positions (see the module docstring); 0 where not trained."""

    trained: torch.Tensor
    logprobs: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    tail_logmass: torch.Tensor | None = None


GAP_ROWS = 1024  # needed rows of a shard this close together are read in one read


def _clusters(shards: np.ndarray, rows: np.ndarray):
    """(shard, positions sorted by row) of each group of needed rows read at once: the rows of one shard
    with gaps of at most GAP_ROWS between them, so a read holds little besides what is needed."""
    order = np.lexsort((rows, shards))
    s, r = shards[order], rows[order]
    cut = np.flatnonzero((s[1:] != s[:-1]) | (r[1:] - r[:-1] > GAP_ROWS)) + 1
    for part in np.split(order, cut):
        if part.size:
            yield int(shards[part[0]]), part


def _refuse(folder: Path, what: str, stored: Any, wanted: Any, whose: str) -> ConfigError:
    return ConfigError(f"{folder}: scores of {what} {stored}, but {whose} {wanted} (a stale or foreign score file)",
                       hint=_HINT)


def open_scores(folder: str | Path, *, data: str | Path | None = None, data_digest: str | None = None,
                model_digest: str | None = None, top_k: int | None = None, vocab_size: int | None = None,
                tokenizer_digest: str | None = None, temperature: float | None = None,
                seq_length: int | None = None) -> "ScoreFile":
    """The score file DIR, checked against what the caller expects (module docstring). `data`: the token
    file prefix training reads (its digest is computed here; or pass `data_digest`)."""
    folder = Path(folder)
    manifest = ScoreManifest.read(folder)
    if data is not None and data_digest is None:
        from gptoss_cli.score.digests import data_digest as digest_of  # noqa: PLC0415

        data_digest = digest_of(data)
    where = f"data {data}" if data is not None else "the data"
    checks = [("data", manifest.data_digest, data_digest, where),
              ("model", manifest.model_digest, model_digest, "the model is"),
              ("top-k", manifest.top_k, top_k, "top-k is"),
              ("vocabulary", manifest.vocab_size, vocab_size, "the vocabulary is"),
              ("tokenizer", manifest.tokenizer_digest, tokenizer_digest, "the tokenizer is"),
              ("temperature", manifest.temperature, temperature, "the temperature is")]
    if manifest.data_format_version == 1:  # a version-1 file's windows (each token's context) depend on S
        checks.append(("row length", manifest.seq_length, seq_length, "training.seq_length is"))
    for what, stored, wanted, whose in checks:
        if wanted is None:
            continue
        if what == "temperature" and math.isclose(float(wanted), stored, rel_tol=1e-12):
            continue
        if stored != wanted:
            if what == "data":
                whose = f"{where} is"
            raise _refuse(folder, what, stored, wanted, whose)
    return ScoreFile(folder, manifest)


class ScoreFile:
    """An opened score folder; `for_microbatch` / `lookup` / `attach` (module docstring)."""

    def __init__(self, folder: Path, manifest: ScoreManifest):
        self.folder, self.manifest = Path(folder), manifest
        self._files: list[SafetensorsFile] | None = None
        self._runs: tuple[np.ndarray, ...] | None = None

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "manifest": self.manifest}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["folder"], state["manifest"])

    def close(self) -> None:
        for f in self._files or ():
            f.close()
        self._files, self._runs = None, None

    def _open(self) -> None:
        """Open every shard, check it against the manifest and index its runs (once)."""
        if self._runs is not None:
            return
        m, k = self.manifest, self.manifest.top_k
        files, starts, counts, shards, rows = [], [], [], [], []
        for s, entry in enumerate(m.shards):
            f = SafetensorsFile(self.folder / entry.file)
            files.append(f)
            n, want = entry.tokens, {"runs": ((entry.runs, 2), torch.int64), "labels": ((entry.tokens,), torch.int32),
                                     "logprobs": ((entry.tokens,), torch.float32)}
            if k > 0:
                want.update(topk_ids=((n, k), torch.int32), topk_logprobs=((n, k), torch.float32),
                            tail_logmass=((n,), torch.float32))
            for name, (shape, dtype) in want.items():
                spec = f.specs.get(name)
                if spec is None or spec.shape != shape or spec.dtype != dtype:
                    got = "missing" if spec is None else f"{list(spec.shape)} {spec.dtype}"
                    raise CheckpointError(f"{f.path}: tensor {name} is {got}, the manifest needs {list(shape)} {dtype}",
                                          hint=_HINT)
            runs = f.read("runs").numpy()
            if (runs[:, 1] < 1).any() or (runs[:, 0] < 0).any() or int(runs[:, 1].sum()) != n:
                raise CheckpointError(f"{f.path}: its runs do not hold its {n} tokens", hint=_HINT)
            starts.append(runs[:, 0])
            counts.append(runs[:, 1])
            shards.append(np.full(len(runs), s, dtype=np.int64))
            rows.append(np.concatenate([[0], np.cumsum(runs[:, 1])[:-1]]).astype(np.int64))
        cat = (lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))  # noqa: E731
        start, count, shard, row = cat(starts), cat(counts), cat(shards), cat(rows)
        order = np.argsort(start, kind="stable")
        start, count, shard, row = start[order], count[order], shard[order], row[order]
        ends = start + count
        if len(start) and (start[0] != 0 or (start[1:] != ends[:-1]).any() or ends[-1] != m.trained_tokens):
            raise CheckpointError(f"{self.folder}: its shards do not hold every trained token exactly once", hint=_HINT)
        self._files, self._runs = files, (start, shard, row)

    def lookup(self, token_index: torch.Tensor, labels: torch.Tensor | None = None) -> MicrobatchScores:
        """The stored scores at positions numbered `token_index` (any shape, -1: not trained), on its device;
        with `labels` (same shape), the stored labels must equal them."""
        self._open()
        start, shard, row = self._runs
        flat = token_index.reshape(-1).cpu().numpy()
        pos = np.flatnonzero(flat >= 0)
        idx = flat[pos]
        if idx.size and int(idx.max()) >= self.manifest.trained_tokens:
            raise ConfigError(f"{self.folder}: trained token {int(idx.max())} of the data is past the "
                              f"{self.manifest.trained_tokens} this file scored (not the data it was scored on)",
                              hint=_HINT)
        r = np.searchsorted(start, idx, side="right") - 1
        at = row[r] + (idx - start[r])
        k = self.manifest.top_k
        names = ["labels", "logprobs"] + (["topk_ids", "topk_logprobs", "tail_logmass"] if k > 0 else [])
        got = {name: None for name in names}
        for s, sel in _clusters(shard[r], at):
            lo, hi = int(at[sel[0]]), int(at[sel[-1]]) + 1
            for name in names:
                part = self._files[s].read(name, lo, hi)[torch.from_numpy(at[sel] - lo)]
                if got[name] is None:
                    got[name] = part.new_zeros((idx.size, *part.shape[1:]))
                got[name][torch.from_numpy(sel)] = part
        if not idx.size:
            got = {"labels": torch.zeros(0, dtype=torch.int32), "logprobs": torch.zeros(0),
                   **({"topk_ids": torch.zeros(0, k, dtype=torch.int32), "topk_logprobs": torch.zeros(0, k),
                       "tail_logmass": torch.zeros(0)} if k > 0 else {})}
        if labels is not None:
            self._check_labels(labels.reshape(-1).cpu()[torch.from_numpy(pos)], got["labels"], idx)
        return self._place(token_index, pos, got)

    def _check_labels(self, want: torch.Tensor, stored: torch.Tensor, idx: np.ndarray) -> None:
        bad = torch.nonzero(want != stored.to(want.dtype)).flatten()
        if bad.numel():
            b = int(bad[0])
            raise ConfigError(f"{self.folder}: trained token {int(idx[b])} is {int(want[b])} in the data but "
                              f"{int(stored[b])} in the scores (not the data this file was scored on)", hint=_HINT)

    def _place(self, token_index: torch.Tensor, pos: np.ndarray, got: dict) -> MicrobatchScores:
        shape, device = token_index.shape, token_index.device
        where = torch.from_numpy(pos)
        trained = torch.zeros(token_index.numel(), dtype=torch.bool)
        trained[where] = True

        def spread(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            out = torch.zeros((token_index.numel(), *values.shape[1:]), dtype=dtype)
            out[where] = values.to(dtype)
            return out.reshape(*shape, *values.shape[1:]).to(device)

        result = MicrobatchScores(trained.reshape(shape).to(device), spread(got["logprobs"], torch.float32))
        if self.manifest.top_k > 0:
            result.topk_ids = spread(got["topk_ids"], torch.int64)
            result.topk_logprobs = spread(got["topk_logprobs"], torch.float32)
            result.tail_logmass = spread(got["tail_logmass"], torch.float32)
        return result

    def for_microbatch(self, mb: Any) -> MicrobatchScores:
        """The stored scores at a microbatch's positions (`mb.token_index`), its labels checked."""
        if getattr(mb, "token_index", None) is None:
            raise ConfigError("precomputed scores need the training data to number its trained tokens: one token "
                              "file (data.kind=tokens, data.path), not mock data or a blend")
        return self.lookup(mb.token_index, mb.labels)

    def attach(self, mb: Any) -> Any:
        """`for_microbatch(mb)` into `mb.extras` under EXTRAS' names (those the file has); returns mb."""
        got = self.for_microbatch(mb)
        for field_name, key in EXTRAS.items():
            value = getattr(got, field_name)
            if value is not None:
                mb.extras[key] = value
        return mb


__all__ = ["open_scores", "ScoreFile", "MicrobatchScores", "EXTRAS"]
