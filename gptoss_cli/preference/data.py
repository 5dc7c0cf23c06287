"""Preference pairs as training reads them: a `prepare-data --format preference` token file packed pair by pair.

The file is a version-2 token file whose header says `"kind": "preference"` (data/prepare_preference.py):
documents 2i (the chosen side) and 2i+1 (the rejected side) are pair i. The packing moves a pair as one
unit (train/data.py, `PackedDocumentSource` with unit=2), so both sides of a pair are in the same row,
hence the same microbatch on the same data-parallel rank; pipeline stages read the same microbatches, and
context-parallel ranks hold slices of the same rows (the objective adds their sums, preference/objective.py).

Each row carries two per-position tensors (Microbatch.extras): `pair_side`, at every trained position (a
label that is not IGNORE_INDEX) 2k + s, where k counts the pairs of the row from 0 and s is 0 on the
chosen side and 1 on the rejected side, -1 elsewhere (the objective sums a side's log-probabilities by
it); and `pair_first`, 1 at the first trained position of each pair's chosen side, else 0, so that a
pair is counted once by whichever context-parallel rank holds that position.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gptoss_cli.data.preference import check_preference_file
from gptoss_cli.model.loss import IGNORE_INDEX
from gptoss_cli.train.data import PackedDocumentSource, PackedRow

PAIR_SIDE = "pair_side"
PAIR_FIRST = "pair_first"


def pair_sides(row: PackedRow) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's `pair_side` and `pair_first` (module docstring), from its documents' order and labels."""
    side = torch.full_like(row.labels, -1)
    first = torch.zeros_like(row.labels)
    at = 0
    for k, (doc, n) in enumerate(zip(row.documents, row.lengths)):
        trained = row.labels[at:at + n] != IGNORE_INDEX
        side[at:at + n] = torch.where(trained, 2 * (k // 2) + doc % 2, -1)
        if doc % 2 == 0 and bool(trained.any()):
            first[at + int(trained.nonzero()[0])] = 1
        at += n
    return side, first


class PairSource:
    """Rows of whole pairs from a preference token file; the sample order and resumable position are
    PackedDocumentSource's."""

    documents = True

    def __init__(self, path: str | Path, seq_length: int, seed: int, vocab_size: int | None = None):
        check_preference_file(path)
        self.inner = PackedDocumentSource(path, seq_length, seed, vocab_size, unit=2)
        self.seq_length, self.num_samples, self.efficiency = seq_length, self.inner.num_samples, self.inner.efficiency
        self.num_pairs = len(self.inner.lengths) // 2

    def row(self, j: int) -> PackedRow:
        """Row j of the packing (not shuffled), with its `pair_side`."""
        row = self.inner.row(j)
        row.extras[PAIR_SIDE], row.extras[PAIR_FIRST] = pair_sides(row)
        return row

    def sample(self, index: int) -> PackedRow:
        return self.row(self.inner.sample_at(index))


__all__ = ["PairSource", "pair_sides", "PAIR_SIDE", "PAIR_FIRST"]
