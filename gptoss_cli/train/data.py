"""Training data: a deterministic learnable mock source and memory-mapped token files, sharded by DP rank.

Token files are gptoss_cli/data/token_format.py's format (what `gptoss prepare-data` writes); epochs
reshuffle the sample order with the seed. A version-1 file is cut into windows of S+1 tokens; a
version-2 file (documents, maybe a loss mask) is packed once into rows of S tokens holding whole
documents (gptoss_cli/data/packing.py), and a row's microbatch carries the document boundaries
(`cu_seqlens`) and positions that restart per document, so attention stays within each document.

Sharding: the global batch of step s is samples [c, c + G) where c = consumed samples before the
step; DP rank r takes the contiguous slice [c + r*G/dp, c + (r+1)*G/dp) in microbatches of
`micro_batch_size`. The union over ranks is the same whatever the DP size, which is what makes a
DP=2 run equal a DP=1 run with gradient accumulation. The position (consumed samples) is saved in
the checkpoint.

Token index: each position of a token-file microbatch also carries the index of its label among the
file's trained tokens (`Microbatch.token_index`, -1 where the label is not trained): trained tokens
are numbered in file order (documents in order, positions in order, only where the loss mask trains
the label; every next token of a version-1 file's windows, window j's position p being j*S + p).
That number does not depend on the packing, the DP split or the microbatch order, so values
precomputed per trained token (gptoss_cli/score/: a reference's log-probs, a teacher's top-k) are
looked up by it. Mock data and blends carry none.

Context parallel (docs/context-parallel.md): the CP ranks of one group read the same microbatches
(`dp_rank`/`dp_size` are then the data-parallel rank and size, world / CP) and each keeps its
contiguous slice of S/CP positions of every row; positions and document boundaries are computed on
the full rows first, so per-document attention (after the all-to-all, on full rows) stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from gptoss_cli.data.packing import pack_documents, packing_efficiency
from gptoss_cli.errors import ConfigError
from gptoss_cli.model.positions import document_offsets, document_positions
from gptoss_cli.model.context_parallel import slice_sequence
from gptoss_cli.model.loss import IGNORE_INDEX
from gptoss_cli.model.routes import ExpertRoutes
from gptoss_cli.data.token_format import (
    TOKEN_ITEMSIZE, check_token_files, document_file_paths, has_documents, read_document_offsets, read_token_header,
)

# The format's dtype names (gptoss_cli/data/token_format.py) as the torch dtypes the reader maps them to.
TOKEN_DTYPES = {name: getattr(torch, name) for name in TOKEN_ITEMSIZE}


class MockSource:
    """Deterministic sequences that a model can learn, so the loss visibly falls.

    Sample i starts at a seeded random token of a small sub-vocabulary and then follows a fixed
    successor map (next = (3 * cur + 1) mod M): after learning that bigram table the next token is
    fully predictable. Identical for every process and every layout.
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        self.modulus = max(2, min(vocab_size, 128))
        self.seq_length = seq_length
        self.seed = seed
        self.num_samples = 1 << 62  # unbounded
        # x_t = a_t * x_0 + b_t (mod M) with a_{t+1} = 3 a_t, b_{t+1} = 3 b_t + 1: a sample is one
        # vectorised expression instead of a Python loop over the sequence.
        a, b = torch.empty(seq_length + 1, dtype=torch.long), torch.empty(seq_length + 1, dtype=torch.long)
        a[0], b[0] = 1, 0
        for t in range(seq_length):
            a[t + 1] = (3 * a[t]) % self.modulus
            b[t + 1] = (3 * b[t] + 1) % self.modulus
        self._a, self._b = a, b

    def sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, self.modulus, (1,), generator=g))
        return (self._a * start + self._b) % self.modulus


class _EpochOrder:
    """Sample `index` of an endless stream over `num_samples` samples: epoch by epoch, each in an
    order shuffled with the seed and the epoch (the same on every rank)."""

    num_samples: int
    seed: int
    _perm_epoch = -1
    _perm: torch.Tensor | None = None

    def sample_at(self, index: int) -> int:
        epoch, i = divmod(index, self.num_samples)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_samples, generator=g)
            self._perm_epoch = epoch
        return int(self._perm[i])


def _check_ids(ids: torch.Tensor, vocab_size: int | None, bin_path: Path, first: int) -> None:
    """Token ids must lie inside the model's vocabulary: the header can lie (a foreign or hand-edited
    file), and an id past the embedding would otherwise surface as "IndexError: index out of range in
    self" deep inside the model; int32 / int64 files can also hold negative ids, which would index
    the embedding from its end or crash. `first`: the file position of ids[0], for the message."""
    if not ids.numel():
        return
    if int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size):
        outside = (ids < 0) | (ids >= vocab_size) if vocab_size is not None else ids < 0
        k = int(outside.nonzero()[0])
        raise ConfigError(
            f"{bin_path}: token id {int(ids[k])} at token {first + k} is outside the model's vocabulary ({vocab_size})",
            hint="tokenize with the model's own tokenizer (gptoss prepare-data)",
        )


def _map_tokens(bin_path: Path, header: dict, num_tokens: int) -> torch.Tensor:
    # Memory-mapped, copy-on-write (shared=False): pages are read on demand, the file is never written.
    # The file is little-endian; every platform torch supports for training is too.
    return torch.from_file(str(bin_path), shared=False, size=num_tokens, dtype=TOKEN_DTYPES[header["dtype"]])


class TokenFileSource(_EpochOrder):
    """Windows of S+1 tokens from a memory-mapped version-1 token file (see the module docstring)."""

    def __init__(self, path: str | Path, seq_length: int, seed: int, vocab_size: int | None = None):
        bin_path, _, header, num_tokens = check_token_files(path, vocab_size)
        self.tokens = _map_tokens(bin_path, header, num_tokens)
        self.seq_length = seq_length
        self.seed = seed
        self.num_samples = (len(self.tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise ConfigError(
                f"{bin_path}: {len(self.tokens)} tokens are fewer than one sample of seq_length+1={seq_length + 1}",
                hint="use more text or a smaller training.seq_length",
            )
        self.bin_path, self.vocab_size = bin_path, vocab_size

    def sample(self, index: int) -> torch.Tensor:
        return self.window(self.sample_at(index))

    def window(self, j: int) -> torch.Tensor:
        """Window j of the file (not shuffled): tokens[j*S : j*S + S + 1]."""
        window = self.tokens[j * self.seq_length : j * self.seq_length + self.seq_length + 1].to(torch.int64)
        _check_ids(window, self.vocab_size, self.bin_path, j * self.seq_length)
        return window

    def window_token_index(self, js: list[int]) -> torch.Tensor:
        """[len(js), S] the trained-token index of each label of windows `js` (every label is trained)."""
        return torch.tensor(js, dtype=torch.int64)[:, None] * self.seq_length + torch.arange(self.seq_length)


@dataclass
class PackedRow:
    """One row of packed documents: inputs, labels (IGNORE_INDEX where untrained, at each document's
    last token and on the padding), the lengths of the documents it holds and their indices in the file,
    in order, each label's index among the file's trained tokens (see the module docstring; None where
    unknown), and per-position tensors [S] an objective's source adds (they become `Microbatch.extras`)."""

    tokens: torch.Tensor  # [S]
    labels: torch.Tensor  # [S]
    lengths: list[int]
    token_index: torch.Tensor | None = None  # [S] int64, -1 where the label is not trained
    documents: list[int] = field(default_factory=list)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


class PackedDocumentSource(_EpochOrder):
    """Rows of whole documents from a version-2 token file (see the module docstring).

    The packing (best-fit decreasing) is computed once over the whole file; epochs reshuffle the
    order of its rows. The label of a document's token t is its token t+1 where the loss mask marks
    that token trained (every token of a file without a mask), else IGNORE_INDEX. With `unit` > 1 the
    packing moves runs of `unit` consecutive documents as one (a preference pair's two sides,
    gptoss_cli/preference/data.py): a row holds whole runs, never part of one."""

    documents = True

    def __init__(self, path: str | Path, seq_length: int, seed: int, vocab_size: int | None = None, unit: int = 1):
        bin_path, _, header, num_tokens = check_token_files(path, vocab_size)
        if not has_documents(header):
            raise ConfigError(f"{bin_path}: a version-1 token file has no documents to pack")
        self.tokens = _map_tokens(bin_path, header, num_tokens)
        idx_path, mask_path = document_file_paths(path)
        self.offsets = read_document_offsets(idx_path)  # checked by check_token_files
        self.mask = (torch.from_file(str(mask_path), shared=False, size=num_tokens, dtype=torch.uint8)
                     if header.get("loss_mask") else None)
        self.lengths = np.diff(self.offsets).tolist()
        if len(self.lengths) % unit:
            raise ConfigError(f"{idx_path}: {len(self.lengths)} documents are not runs of {unit}",
                              hint="re-create the files with `gptoss prepare-data`")
        units = [sum(self.lengths[u:u + unit]) for u in range(0, len(self.lengths), unit)]
        if unit > 1 and units and max(units) > seq_length:
            u = units.index(max(units))
            raise ConfigError(f"{idx_path}: documents {u * unit} to {u * unit + unit - 1}, packed together, have "
                              f"{units[u]} tokens, more than a row of training.seq_length={seq_length} holds",
                              hint="raise training.seq_length, or re-create the file with a smaller --max-length")
        try:
            packed = pack_documents(units, seq_length)
        except ValueError as exc:
            raise ConfigError(f"{idx_path}: {exc} (training.seq_length={seq_length})",
                              hint="raise training.seq_length to the longest document, or re-create the file with "
                                   "a smaller --max-length") from None
        self.rows = [[u * unit + k for u in row for k in range(unit)] for row in packed]
        self.efficiency = packing_efficiency(units, packed, seq_length)
        # trained tokens before each document (D+1): what numbers a label among the file's trained tokens
        trained = (np.add.reduceat(np.asarray(self.mask.numpy()), self.offsets[:-1], dtype=np.int64)
                   if self.mask is not None else np.diff(self.offsets) - 1)  # mask[first token] is 0 (checked)
        self.trained_before = np.concatenate([[0], np.cumsum(trained, dtype=np.int64)])
        self.seq_length, self.seed = seq_length, seed
        self.num_samples = len(self.rows)
        self.bin_path, self.vocab_size = bin_path, vocab_size

    def row(self, j: int) -> PackedRow:
        """Row j of the packing (not shuffled)."""
        s = self.seq_length
        tokens = torch.zeros(s, dtype=torch.int64)  # padding: token 0, never a label
        labels = torch.full((s,), IGNORE_INDEX, dtype=torch.int64)
        index = torch.full((s,), -1, dtype=torch.int64)
        at, lengths = 0, []
        for d in self.rows[j]:
            a, b = int(self.offsets[d]), int(self.offsets[d + 1])
            doc = self.tokens[a:b].to(torch.int64)
            _check_ids(doc, self.vocab_size, self.bin_path, a)
            n = b - a
            tokens[at:at + n] = doc
            target = doc[1:]
            if self.mask is not None:
                target = torch.where(self.mask[a + 1:b].bool(), target, IGNORE_INDEX)
            labels[at:at + n - 1] = target
            trained = target != IGNORE_INDEX
            index[at:at + n - 1] = torch.where(trained, int(self.trained_before[d]) + trained.cumsum(0) - 1, -1)
            at += n
            lengths.append(n)
        return PackedRow(tokens, labels, lengths, index, list(self.rows[j]))

    def sample(self, index: int) -> PackedRow:
        return self.row(self.sample_at(index))


@dataclass
class Microbatch:
    tokens: torch.Tensor  # [mbs, S] inputs
    labels: torch.Tensor  # [mbs, S] next tokens (IGNORE_INDEX where not trained)
    # packed documents (None: one sequence per row): positions restarting at 0 per document, and
    # the document start offsets into the flattened [mbs*S] tokens (model/attention/backends.py)
    position_ids: torch.Tensor | None = None
    cu_seqlens: tuple[int, ...] | None = None
    # per-position tensors [mbs, S] a training objective attaches (advantages, old log-probs, ...:
    # train/objective.py, `prepare_step`); sliced with the labels under context parallel
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    # [mbs, S] int64: each label's index among the token file's trained tokens, -1 where not trained
    # (the module docstring); None for data without one (mock, blends, rollouts)
    token_index: torch.Tensor | None = None
    # expert ids per position and MoE layer the forward is handed (routing replay, model/routes.py);
    # sliced with the tokens under context parallel
    routes: ExpertRoutes | None = None

    def model_inputs(self) -> dict:
        """Keyword arguments of the model's forward (and schedule plan) besides the tokens."""
        out = {} if self.cu_seqlens is None and self.position_ids is None else {
            "position_ids": self.position_ids, "cu_seqlens": self.cu_seqlens}
        if self.routes is not None:
            out["routes"] = self.routes
        return out

    def context_slice(self, cp_size: int, cp_rank: int) -> "Microbatch":
        """CP rank `cp_rank`'s contiguous slice of every row: tokens, labels and positions (of the
        full rows) sliced; cu_seqlens stay those of the full rows (attention runs on full rows)."""
        if cp_size == 1:
            return self
        b, s = self.tokens.shape
        positions = self.position_ids
        if positions is None:
            positions = torch.arange(s, device=self.tokens.device).expand(b, -1)
        return Microbatch(tokens=slice_sequence(self.tokens, cp_size, cp_rank),
                          labels=slice_sequence(self.labels, cp_size, cp_rank),
                          position_ids=slice_sequence(positions, cp_size, cp_rank), cu_seqlens=self.cu_seqlens,
                          extras={k: slice_sequence(v, cp_size, cp_rank) for k, v in self.extras.items()},
                          token_index=(None if self.token_index is None
                                       else slice_sequence(self.token_index, cp_size, cp_rank)),
                          routes=None if self.routes is None else self.routes.context_slice(cp_size, cp_rank))


class DataLoaderState:
    """This rank's microbatches of each global batch; `consumed_samples` is the resumable position."""

    def __init__(self, source: Any, *, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0, device: torch.device | None = None, cp_size: int = 1, cp_rank: int = 0):
        if global_batch_size % (micro_batch_size * dp_size):
            raise ConfigError(
                f"training.global_batch_size={global_batch_size} is not a multiple of micro_batch_size x "
                f"data-parallel size = {micro_batch_size} x {dp_size}",
                hint="make global_batch_size a multiple of micro_batch_size x world size",
            )
        self.source = source
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)
        self.consumed_samples = consumed_samples
        self.device = device or torch.device("cpu")
        self.cp_size, self.cp_rank = cp_size, cp_rank

    def step_iterator(self) -> Iterator[Microbatch]:
        """The microbatches of the next global batch for this rank; advances the position."""
        base = self.consumed_samples + self.dp_rank * self.num_microbatches * self.micro_batch_size
        self.consumed_samples += self.global_batch_size
        return self._iter(base)

    def _iter(self, base: int) -> Iterator[Microbatch]:
        for mb in self._full_rows(base):
            yield mb.context_slice(self.cp_size, self.cp_rank)

    def _full_rows(self, base: int) -> Iterator[Microbatch]:
        for m in range(self.num_microbatches):
            samples = [base + m * self.micro_batch_size + j for j in range(self.micro_batch_size)]
            rows = [self.source.sample(i) for i in samples]
            if isinstance(rows[0], PackedRow):
                yield packed_microbatch(rows, self.device)
                continue
            batch = torch.stack(rows).to(self.device)
            index = None
            if isinstance(self.source, TokenFileSource):
                index = self.source.window_token_index([self.source.sample_at(i) for i in samples]).to(self.device)
            yield Microbatch(tokens=batch[:, :-1].contiguous(), labels=batch[:, 1:].contiguous(), token_index=index)

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}


def packed_microbatch(rows: list[PackedRow], device: torch.device) -> Microbatch:
    """The microbatch of packed rows: stacked, with their document boundaries and positions."""
    seq = rows[0].tokens.shape[0]
    cu = document_offsets([r.lengths for r in rows], seq)
    index = (torch.stack([r.token_index for r in rows]).to(device)
             if all(r.token_index is not None for r in rows) else None)
    return Microbatch(tokens=torch.stack([r.tokens for r in rows]).to(device),
                      labels=torch.stack([r.labels for r in rows]).to(device),
                      position_ids=document_positions(cu, len(rows), seq, device), cu_seqlens=cu, token_index=index,
                      extras={k: torch.stack([r.extras[k] for r in rows]).to(device) for k in rows[0].extras})


def file_rows(source: Any, js: list[int], device: torch.device) -> Microbatch:
    """The microbatch of rows `js` of a token-file source in file order (not shuffled): windows of a
    version-1 file, packed rows of a version-2 file. What `gptoss eval` and validation score."""
    if getattr(source, "documents", False):
        return packed_microbatch([source.row(j) for j in js], device)
    batch = torch.stack([source.window(j) for j in js]).to(device)
    return Microbatch(tokens=batch[:, :-1].contiguous(), labels=batch[:, 1:].contiguous(),
                      token_index=source.window_token_index(js).to(device))


def token_file_source(path: str | Path, seq_length: int, seed: int, vocab_size: int | None = None):
    """The source of a token file: packed documents for a version-2 file, windows for version 1."""
    cls = PackedDocumentSource if has_documents(read_token_header(path)) else TokenFileSource
    return cls(path, seq_length, seed, vocab_size)


def build_source(kind: str, *, path: str | None, seq_length: int, seed: int, vocab_size: int) -> Any:
    if kind == "mock":
        return MockSource(vocab_size, seq_length, seed)
    if kind == "tokens":
        if not path:
            raise ConfigError("data.kind=tokens needs data.path", hint="set data.path=<prefix from gptoss prepare-data>")
        return token_file_source(path, seq_length, seed, vocab_size)
    raise ConfigError(f"data.kind={kind!r} is not one of mock, tokens")


__all__ = ["MockSource", "TokenFileSource", "PackedDocumentSource", "PackedRow", "packed_microbatch", "file_rows",
           "token_file_source", "DataLoaderState", "Microbatch", "build_source", "TOKEN_DTYPES"]
