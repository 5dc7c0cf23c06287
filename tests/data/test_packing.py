"""Packing whole documents into rows: every document exactly once, no row overflows, best-fit, >= 97% full."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gptoss_cli.data.packing import pack_documents, packing_efficiency


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64).flatmap(lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), max_size=80))))
def test_every_document_lands_in_exactly_one_row_and_no_row_overflows(case):
    capacity, lengths = case
    rows = pack_documents(lengths, capacity)
    placed = sorted(i for row in rows for i in row)
    assert placed == list(range(len(lengths)))
    assert all(row and sum(lengths[i] for i in row) <= capacity for row in rows)
    assert all(row == sorted(row) for row in rows)
    # any-fit: a row is opened only when the document fits in no open row, and rows never close, so
    # no two rows could be merged (one document per row would fail this)
    loads = sorted(sum(lengths[i] for i in row) for row in rows)
    assert len(loads) < 2 or loads[0] + loads[1] > capacity
    assert pack_documents(list(lengths), capacity) == rows  # deterministic


def test_best_fit_puts_a_document_in_the_tightest_row():
    # 5 -> row0 (1 free); 4 -> row1 (2 free); 3 -> row2 (3 free); 2 -> row1 (the tightest that fits,
    # not row2, which first fit after sorting by free space descending would pick); 1 -> row0
    assert pack_documents([3, 5, 2, 4, 1], 6) == [[1, 4], [2, 3], [0]]


def plain_best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """The textbook algorithm, quadratic and obvious: documents longest first (lower index on ties), each
    into the open row with the least free space that holds it (the earliest opened on ties), else a new row."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [r for r in range(len(rows)) if free[r] >= lengths[i]]
        if fits:
            r = min(fits, key=lambda r: (free[r], r))
        else:
            r = len(rows)
            rows.append([])
            free.append(capacity)
        rows[r].append(i)
        free[r] -= lengths[i]
    return [sorted(row) for row in rows]


@pytest.mark.parametrize("tree", [True, False], ids=["counters", "sorted-list"])
def test_best_fit_matches_a_plain_best_fit_reference_over_random_lengths(tree, monkeypatch):
    """Random lengths hit inexact fits, ties between rows of the same free space and searches that climb the
    counters' tree; both structures (counters up to TREE_CAPACITY_LIMIT, a sorted list above) must agree."""
    import gptoss_cli.data.packing as packing

    if not tree:
        monkeypatch.setattr(packing, "TREE_CAPACITY_LIMIT", 0)
    r = random.Random(40)
    for _ in range(300):
        capacity = r.choice([1, 2, 7, 16, 33, 100, 257])
        lengths = [r.randint(1, capacity) if r.random() < 0.5 else r.randint(1, max(1, capacity // 3))
                   for _ in range(r.randint(0, 60))]
        assert pack_documents(lengths, capacity) == plain_best_fit_decreasing(lengths, capacity), (capacity, lengths)


def test_a_row_of_two_billion_tokens_costs_memory_by_documents_not_by_capacity():
    """Training's documented seq_length bound (2**31 - 1) with three conversations: counters per free-space
    value would take 34 GB; the rows must come back at once with a few KiB."""
    import tracemalloc

    tracemalloc.start()
    rows = pack_documents([5, 3, 900], (1 << 31) - 1)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert rows == [[0, 1, 2]]
    assert peak < 1 << 20, peak


def test_ties_are_broken_by_document_index_and_row_age():
    assert pack_documents([2, 2, 2, 2], 4) == [[0, 1], [2, 3]]
    assert pack_documents([], 4) == []


@pytest.mark.parametrize("lengths, capacity, message", [
    ([3, 9, 2], 8, "document 1 has 9 tokens, more than a row of 8 holds"),
    ([3, 0], 8, "document 1 has length 0"),
    ([3, 2.5], 8, "document 1 has length 2.5"),
    ([3], 0, "row capacity 0 must be a positive number"),
])
def test_bad_lengths_name_the_document(lengths, capacity, message):
    with pytest.raises(ValueError, match=message):
        pack_documents(lengths, capacity)


def realistic_sft_lengths(n: int, seed: int = 0) -> list[int]:
    """A conversation-length mix like public SFT sets: log-normal around a median of ~600 tokens
    (sigma 1.0, so a tenth are under 170 and a tenth over 2,200 tokens), clipped to [32, 4096]."""
    r = random.Random(seed)
    return [min(4096, max(32, round(r.lognormvariate(6.4, 1.0)))) for _ in range(n)]


def test_packing_efficiency_is_at_least_97_percent_on_a_realistic_mix():
    lengths = realistic_sft_lengths(5000)
    rows = pack_documents(lengths, 4096)
    efficiency = packing_efficiency(lengths, rows, 4096)
    assert efficiency == sum(lengths) / (len(rows) * 4096)
    assert efficiency >= 0.97, efficiency


def test_efficiency_counts_real_tokens_over_row_positions():
    assert packing_efficiency([3, 5, 2, 4, 1], [[1, 4], [2, 3], [0]], 6) == 15 / 18
    assert packing_efficiency([], [], 6) == 0.0


def test_packing_the_renderer_the_token_format_and_prepare_data_do_not_need_torch():
    """The launch rule and prepare-data's report use them on machines without the trainer's stack."""
    import subprocess
    import sys

    code = ("import sys, gptoss_cli.data.packing, gptoss_cli.data.harmony, gptoss_cli.data.token_format, "
            "gptoss_cli.data.prepare.text, gptoss_cli.data.prepare.conversations, gptoss_cli.data.prepare.formats; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
