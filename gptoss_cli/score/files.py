"""The score file: a folder of safetensors shards and one manifest.json (what `gptoss score` writes, `open_scores` reads).

DIR/manifest.json (version 1):

    {"format": "gptoss-scores", "version": 1,
     "data":  {"path", "digest", "format_version", "seq_length", "trained_tokens"},
     "model": {"checkpoint", "digest", "digest_of": "files", "vocab_size", "tokenizer_digest", "dtype"},
     "top_k": K, "temperature": T,
     "shards": [{"file", "tokens", "runs"}, ...],
     "counts": {"trained_tokens", "shards", "bytes"}, "gptoss_version"}

Digests: gptoss_cli/score/digests.py. `data.seq_length` is the row length the file was scored at; it
matters only for a version-1 token file, whose windows (and so each token's context) it cuts.

DIR/scores-RRRRR-KKKKK.safetensors, shard K of rank R; every trained token of the data is in exactly
one shard, in one run:
    runs           int64 [r, 2]  (first trained-token index, count) of each run of consecutive trained
                                 tokens the shard holds, in the order of its rows
    labels         int32 [n]     the token each row scores (checked against a microbatch's labels)
    logprobs       fp32  [n]     log p(label) at the temperature
    topk_ids       int32 [n, K]  (K > 0) the K most likely tokens, most likely first
    topk_logprobs  fp32  [n, K]  (K > 0) their log-probs
    tail_logmass   fp32  [n]     (K > 0) log of the probability outside the top K (-inf when K = V)
A trained token's index is its place among the token file's trained tokens in file order
(gptoss_cli/train/data.py, `Microbatch.token_index`). The folder is written under a temporary name
and renamed into place whole (gptoss_cli/outputs.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from gptoss_cli import __version__
from gptoss_cli.checkpoint.storage.safetensors_io import ShardedWriter, TensorSpec
from gptoss_cli.errors import ConfigError
from gptoss_cli.json_input import parse_json
from gptoss_cli.score.compute import TokenScores

SCORE_FORMAT = "gptoss-scores"
SCORE_FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_PREFIX = "scores-"
DEFAULT_SHARD_BYTES = 1 << 30  # a shard's tensors (and the rows a rank holds before writing it)
_HINT = "score the data again with `gptoss score`"


def shard_name(rank: int, k: int) -> str:
    return f"{SHARD_PREFIX}{rank:05d}-{k:05d}.safetensors"


def bytes_per_token(top_k: int) -> int:
    """Bytes a shard stores per trained token: label and log-prob, and K ids and log-probs and the tail."""
    return 8 + (8 * top_k + 4 if top_k > 0 else 0)


@dataclass(frozen=True)
class ShardEntry:
    file: str
    tokens: int
    runs: int


@dataclass(frozen=True)
class ScoreManifest:
    """DIR/manifest.json (see the module docstring); `read` checks every field of a file it is handed."""

    data_path: str
    data_digest: str
    data_format_version: int
    seq_length: int
    trained_tokens: int
    checkpoint: str
    model_digest: str
    vocab_size: int
    tokenizer_digest: str | None
    dtype: str
    top_k: int
    temperature: float
    shards: tuple[ShardEntry, ...] = field(default_factory=tuple)
    gptoss_version: str = __version__

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SCORE_FORMAT, "version": SCORE_FORMAT_VERSION,
            "data": {"path": self.data_path, "digest": self.data_digest, "format_version": self.data_format_version,
                     "seq_length": self.seq_length, "trained_tokens": self.trained_tokens},
            "model": {"checkpoint": self.checkpoint, "digest": self.model_digest, "digest_of": "files",
                      "vocab_size": self.vocab_size, "tokenizer_digest": self.tokenizer_digest, "dtype": self.dtype},
            "top_k": self.top_k, "temperature": self.temperature,
            "shards": [asdict(s) for s in self.shards],
            "counts": {"trained_tokens": self.trained_tokens, "shards": len(self.shards),
                       "bytes": self.trained_tokens * bytes_per_token(self.top_k)},
            "gptoss_version": self.gptoss_version,
        }

    def write(self, folder: Path) -> None:
        (Path(folder) / MANIFEST).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def read(cls, folder: str | Path) -> "ScoreManifest":
        """The checked manifest of a score folder; ConfigError naming the file and field otherwise."""
        path = Path(folder) / MANIFEST
        if not Path(folder).is_dir():
            raise ConfigError(f"score folder {folder} not found", hint="write it with `gptoss score`")
        if not path.is_file():
            raise ConfigError(f"{path} not found: {folder} is not a score folder (or an incomplete one)", hint=_HINT)
        try:
            raw = parse_json(path.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: not JSON ({exc})", hint=_HINT) from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
        return _parse_manifest(raw, path)


def _get(raw: Any, path: Path, where: str, key: str, kind: type | tuple, *, optional: bool = False) -> Any:
    value = raw.get(key) if isinstance(raw, dict) else None
    if value is None and optional:
        return None
    ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)))
    if not ok:
        raise ConfigError(f"{path}: {where}{key}={value!r} is not what a score manifest holds", hint=_HINT)
    return value


def _count(raw: Any, path: Path, where: str, key: str, low: int = 0) -> int:
    value = _get(raw, path, where, key, int)
    if not low <= value < 1 << 62:
        raise ConfigError(f"{path}: {where}{key}={value} is out of range", hint=_HINT)
    return value


def _parse_manifest(raw: Any, path: Path) -> ScoreManifest:
    if not isinstance(raw, dict) or raw.get("format") != SCORE_FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise ConfigError(f"{path}: not a gptoss score manifest (format {got!r})", hint=_HINT)
    if raw.get("version") != SCORE_FORMAT_VERSION or isinstance(raw.get("version"), bool):
        raise ConfigError(f"{path}: score format version {raw.get('version')!r} is not one this gptoss reads "
                          f"({SCORE_FORMAT_VERSION})", hint="upgrade gptoss, or score the data again")
    data, model = _get(raw, path, "", "data", dict), _get(raw, path, "", "model", dict)
    temperature = _get(raw, path, "", "temperature", (int, float))
    if not (math.isfinite(temperature) and temperature > 0):
        raise ConfigError(f"{path}: temperature={temperature!r} is not a positive number", hint=_HINT)
    shards = []
    for i, entry in enumerate(_get(raw, path, "", "shards", list)):
        name = _get(entry, path, f"shards[{i}].", "file", str)
        if Path(name).name != name or not name.startswith(SHARD_PREFIX) or not name.endswith(".safetensors"):
            raise ConfigError(f"{path}: shards[{i}].file={name!r} is not a shard of this folder", hint=_HINT)
        shards.append(ShardEntry(name, _count(entry, path, f"shards[{i}].", "tokens"),
                                 _count(entry, path, f"shards[{i}].", "runs")))
    if len({s.file for s in shards}) != len(shards):
        raise ConfigError(f"{path}: a shard is listed twice", hint=_HINT)
    manifest = ScoreManifest(
        data_path=_get(data, path, "data.", "path", str), data_digest=_get(data, path, "data.", "digest", str),
        data_format_version=_count(data, path, "data.", "format_version", 1),
        seq_length=_count(data, path, "data.", "seq_length", 1),
        trained_tokens=_count(data, path, "data.", "trained_tokens"),
        checkpoint=_get(model, path, "model.", "checkpoint", str), model_digest=_get(model, path, "model.", "digest", str),
        vocab_size=_count(model, path, "model.", "vocab_size", 1),
        tokenizer_digest=_get(model, path, "model.", "tokenizer_digest", str, optional=True),
        dtype=_get(model, path, "model.", "dtype", str), top_k=_count(raw, path, "", "top_k"),
        temperature=float(temperature), shards=tuple(shards),
        gptoss_version=str(raw.get("gptoss_version", "")))
    if manifest.top_k > manifest.vocab_size:
        raise ConfigError(f"{path}: top_k={manifest.top_k} exceeds the vocabulary ({manifest.vocab_size})", hint=_HINT)
    if sum(s.tokens for s in shards) != manifest.trained_tokens:
        raise ConfigError(f"{path}: the shards hold {sum(s.tokens for s in shards)} tokens, not the "
                          f"{manifest.trained_tokens} trained tokens of the data", hint=_HINT)
    return manifest


def token_runs(index: torch.Tensor) -> torch.Tensor:
    """[r, 2] (start, count) of the runs of consecutive values in `index` [n] (in its order)."""
    if index.numel() == 0:
        return torch.zeros((0, 2), dtype=torch.int64)
    breaks = torch.nonzero(index[1:] != index[:-1] + 1).flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    ends = torch.cat([breaks, torch.tensor([index.numel()])])
    return torch.stack([index[starts], ends - starts], dim=1)


class ShardWriter:
    """One rank's shards: scores added round by round, a shard written whenever `shard_tokens` are held."""

    def __init__(self, folder: Path, rank: int, top_k: int, shard_tokens: int):
        self.folder, self.rank, self.top_k = Path(folder), rank, top_k
        self.shard_tokens = max(1, shard_tokens)
        self.entries: list[ShardEntry] = []
        self._pending: list[tuple[torch.Tensor, torch.Tensor, TokenScores]] = []
        self._held = 0
        self.logprob_sum = 0.0  # float64 sum of every log-prob written (the mean the results table shows)

    def add(self, token_index: torch.Tensor, labels: torch.Tensor, scores: TokenScores) -> None:
        """Trained tokens `token_index` [n] (their labels [n], their scores), in the order of their rows."""
        if token_index.numel() == 0:
            return
        self._pending.append((token_index.cpu(), labels.cpu(), scores.to("cpu")))
        self._held += token_index.numel()
        self.logprob_sum += float(scores.logprobs.double().sum())
        if self._held >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        index = torch.cat([p[0] for p in self._pending])
        tensors = {"runs": token_runs(index), "labels": torch.cat([p[1] for p in self._pending]).to(torch.int32),
                   "logprobs": torch.cat([p[2].logprobs for p in self._pending])}
        if self.top_k > 0:
            for name in ("topk_ids", "topk_logprobs", "tail_logmass"):
                tensors[name] = torch.cat([getattr(p[2], name) for p in self._pending])
        name = shard_name(self.rank, len(self.entries))
        plan = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
        writer = ShardedWriter(self.folder, plan, background=False, direct_io=False, single_file=name,
                               metadata={"content": SCORE_FORMAT})
        try:
            for k, v in tensors.items():
                writer.write(k, v.contiguous())
            writer.close()
        except BaseException:
            writer.abort()
            raise
        self.entries.append(ShardEntry(name, int(index.numel()), int(tensors["runs"].shape[0])))
        self._pending, self._held = [], 0

    def close(self) -> list[ShardEntry]:
        self.flush()
        return self.entries


__all__ = ["SCORE_FORMAT", "SCORE_FORMAT_VERSION", "MANIFEST", "ScoreManifest", "ShardEntry", "ShardWriter",
           "shard_name", "bytes_per_token", "token_runs", "DEFAULT_SHARD_BYTES"]
