"""Preference token files as training reads them: a pair is packed whole, both sides in one row (hence one
microbatch on one data-parallel rank), its positions marked per side, counted once under context parallelism,
and numbered among the file's trained tokens as `gptoss score` numbers them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.loss import IGNORE_INDEX
from gptoss_cli.preference.data import PAIR_FIRST, PAIR_SIDE, PairSource
from gptoss_cli.train.data import DataLoaderState
from tests.preference.pairs import random_pairs, write_pair_file
from tests.train.sft_files import sft_documents, write_sft_file

VOCAB, SEQ = 1003, 40


@pytest.fixture
def pair_file(tmp_path):
    pairs = random_pairs(23, VOCAB, seed=2, prompt=(3, 9), completion=(1, 8))
    return write_pair_file(tmp_path / "pairs", pairs, VOCAB), pairs


def test_every_row_holds_whole_pairs_with_their_sides_marked(pair_file):
    prefix, pairs = pair_file
    source = PairSource(prefix, SEQ, 0, VOCAB)
    seen = []
    for j in range(source.num_samples):
        row = source.row(j)
        docs = row.documents
        assert docs[0::2] == [d - 1 for d in docs[1::2]] and all(d % 2 == 0 for d in docs[0::2])  # (2i, 2i+1)
        side, first = row.extras[PAIR_SIDE], row.extras[PAIR_FIRST]
        for k, d in enumerate(docs[0::2]):
            prompt, chosen, rejected = pairs[d // 2]
            for s, reply in ((0, chosen), (1, rejected)):
                at = (side == 2 * k + s).nonzero().flatten()
                # the reply's tokens are the labels there: the side's trained positions, nothing else
                assert row.labels[at].tolist() == reply and len(at) == len(reply)
            assert int(first[(side == 2 * k)].sum()) == 1 and int(first.sum()) == len(docs) // 2
        assert ((side >= 0) == (row.labels != IGNORE_INDEX)).all()
        seen += [d // 2 for d in docs[0::2]]
    assert sorted(seen) == list(range(len(pairs)))  # every pair once


def test_data_parallel_ranks_each_get_whole_pairs_and_context_slices_count_each_once(pair_file):
    prefix, pairs = pair_file
    source = PairSource(prefix, SEQ, 0, VOCAB)
    rows = source.num_samples - source.num_samples % 4
    per_rank = []
    for rank in range(2):
        data = DataLoaderState(source, global_batch_size=rows, micro_batch_size=2, dp_rank=rank, dp_size=2)
        per_rank.append(list(data.step_iterator()))
    for mbs in per_rank:
        for mb in mbs:
            sides = mb.extras[PAIR_SIDE]
            for r in range(sides.shape[0]):  # both sides of each pair of a row, in the same microbatch
                ids = set(sides[r][sides[r] >= 0].tolist())
                assert ids == {i ^ 1 for i in ids}
            halves = [mb.context_slice(2, c) for c in range(2)]
            assert sum(int(h.extras[PAIR_FIRST].sum()) for h in halves) == int(mb.extras[PAIR_FIRST].sum())
            assert torch.equal(torch.cat([h.extras[PAIR_SIDE] for h in halves], 1).sort(1).values,
                               mb.extras[PAIR_SIDE].sort(1).values)
    total = sum(int(mb.extras[PAIR_FIRST].sum()) for mbs in per_rank for mb in mbs)
    assert total == sum(len(source.row(j).documents) // 2 for j in range(source.num_samples)
                        if j in {int(source.inner.sample_at(i)) for i in range(rows)})


def test_labels_are_numbered_among_the_files_trained_tokens(pair_file):
    prefix, pairs = pair_file
    source = PairSource(prefix, SEQ, 0, VOCAB)
    trained = [t for p, c, r in pairs for t in c + r]  # the file's trained tokens, in file order
    for j in range(source.num_samples):
        row = source.row(j)
        at = row.token_index >= 0
        assert row.labels[at].tolist() == [trained[i] for i in row.token_index[at].tolist()]


def test_a_token_file_that_is_not_pairs_is_refused_naming_it(tmp_path):
    docs, masks = sft_documents([6, 7, 8], VOCAB)
    prefix = write_sft_file(tmp_path / "sft", docs, masks, VOCAB)
    with pytest.raises(ConfigError, match=r"sft: a token file of kind 'harmony' with 3 documents, not preference pairs"):
        PairSource(prefix, SEQ, 0, VOCAB)
    long_pair = [(list(range(30)), [1, 2], [3, 4, 5])]
    prefix = write_pair_file(tmp_path / "long", long_pair, VOCAB)
    with pytest.raises(ConfigError, match=r"documents 0 to 1, packed together, have 65 tokens, more than a row of "
                                          r"training.seq_length=40"):
        PairSource(prefix, SEQ, 0, VOCAB)
    assert np.fromfile(tmp_path / "long.idx", dtype="<i8").tolist() == [0, 32, 65]
