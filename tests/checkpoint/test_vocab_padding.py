"""Megatron's vocabulary padding against Megatron-LM's own rule, above all when the vocabulary already divides.

Megatron-LM pads `vocab_size` in `_vocab_size_with_padding` (megatron/training/tokenizer/tokenizer.py;
megatron-core 0.16.1 does not ship that module): `multiple = make_vocab_size_divisible_by * TP`, then
`while after % multiple != 0: after += 1`. A vocabulary that is already a multiple gets no padding: the real
201,088 = 128 x 1571 keeps its 201,088 rows at TP=1. The reference below is that loop, transcribed, not our
ceiling division.
"""

from __future__ import annotations

import dataclasses

import pytest

from gptoss_cli.checkpoint.mapping import is_vocab_padding
from gptoss_cli.checkpoint.formats.megatron.names import DEFAULT_VOCAB_MULTIPLE, padded_vocab
from gptoss_cli.model.config import preset


def megatron_lm_vocab_size_with_padding(orig_vocab_size: int, make_vocab_size_divisible_by: int,
                                        tensor_model_parallel_size: int = 1) -> int:
    after = orig_vocab_size
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    while (after % multiple) != 0:
        after += 1
    return after


VOCABS = [1, 127, 128, 129, 1003, 1024, 1100, 201_088, 201_089, 200_000]


@pytest.mark.parametrize("multiple", [1, 2, 64, DEFAULT_VOCAB_MULTIPLE, 256, 1000])
def test_padded_vocab_is_megatron_lms_rule(multiple):
    for vocab in VOCABS:
        assert padded_vocab(vocab, multiple) == megatron_lm_vocab_size_with_padding(vocab, multiple), vocab


def test_the_real_vocabulary_already_divides_and_gets_no_padding():
    assert padded_vocab(201_088, DEFAULT_VOCAB_MULTIPLE) == 201_088 == megatron_lm_vocab_size_with_padding(201_088, 128)


@pytest.mark.parametrize("name, vocab", [("gpt_oss_20b", 201_088), ("tiny", 1024), ("tiny", 1003), ("tiny", 1280)])
def test_stored_rows_count_as_padding_exactly_when_megatron_lm_would_pad_to_them(name, vocab):
    """Readers accept extra rows only as Megatron-LM's padding at 128 x TP for a TP dividing the heads."""
    arch = dataclasses.replace(preset(name), vocab_size=vocab)
    heads = arch.num_attention_heads
    allowed = {megatron_lm_vocab_size_with_padding(vocab, 128, tp) for tp in range(1, heads + 1) if heads % tp == 0}
    for rows in range(vocab - 3, vocab + 128 * heads + 130):
        assert is_vocab_padding(rows, arch) == (rows == vocab or rows in allowed), rows
