"""FlexAttention's block mask of a packed batch is one mask per row (model/attention/sink_flex.py, `block_mask`).

A packed batch's rows hold different document layouts. The compiled kernel visits, for each query
block, only the key blocks the BlockMask lists for that row, and skips `mask_mod` on the blocks it
lists as full; a mask built for one row (B = 1, or from row 0's documents) is broadcast to every row,
so row 1 would attend across its documents or miss keys of its own. On the CPU the unfused reference
evaluates `mask_mod` on every score and ignores the block structure, so the outputs cannot show it:
this test reads the mask the way the kernel does instead.

The attention a row gets is the union of (a) the blocks listed as partial, token by token through
`mask_mod(b, h, q, k)` with the row's own index b, and (b) the blocks listed as full, whole; the
block lists are the row's own when the mask has one per row, row 0's when it is broadcast. The
reference is the rule itself, from the document lengths: causal, within `window`, same document.
Exact (booleans): no tolerance.
"""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.model.attention import sink_flex

pytestmark = pytest.mark.skipif(not sink_flex.available(), reason="FlexAttention is not in this torch")

SEQ = 384  # three key blocks of FlexAttention's default 128
ONE_DOCUMENT = [384]
SEVERAL = [100, 200, 84]  # boundaries inside blocks
ALIGNED = [128, 128, 128]  # boundaries on blocks: no off-diagonal block is listed at all


def expected(lengths: list[int], window: int | None) -> torch.Tensor:
    """[S, S] bool: key k visible to query q in a row of documents `lengths` (the rule, from the lengths)."""
    doc = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)])
    q, k = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    visible = (k <= q) & (doc[:, None] == doc[None, :])
    return visible & (q - k < window) if window is not None else visible


def as_kernel_reads(mask, row: int) -> torch.Tensor:
    """[S, S] bool: what the kernel lets row `row` attend to under `mask` (see the module docstring)."""
    structure = row if mask.kv_num_blocks.shape[0] > 1 else 0  # a B = 1 mask is broadcast to every row
    bq, bk = mask.BLOCK_SIZE
    q, k = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    tokens = mask.mask_mod(torch.tensor(row), torch.tensor(0), q, k).expand(SEQ, SEQ)
    out = torch.zeros(SEQ, SEQ, dtype=torch.bool)
    lists = [(mask.kv_num_blocks, mask.kv_indices, False)]
    if mask.full_kv_num_blocks is not None:
        lists.append((mask.full_kv_num_blocks, mask.full_kv_indices, True))
    for counts, indices, full in lists:
        for qb in range(SEQ // bq):
            for kb in indices[structure, 0, qb, : int(counts[structure, 0, qb])].tolist():
                rows, cols = slice(qb * bq, (qb + 1) * bq), slice(kb * bk, (kb + 1) * bk)
                out[rows, cols] = True if full else tokens[rows, cols]
    return out


@pytest.mark.parametrize("window", [None, 128], ids=["full", "window128"])
@pytest.mark.parametrize("layouts", [(ONE_DOCUMENT, SEVERAL), (SEVERAL, ONE_DOCUMENT), (ALIGNED, ONE_DOCUMENT),
                                     (ONE_DOCUMENT, ALIGNED)], ids=["one-several", "several-one", "aligned-one",
                                                                    "one-aligned"])
def test_each_row_of_a_packed_batch_gets_its_own_documents(layouts, window):
    offsets = [0]
    for lengths in layouts:
        assert sum(lengths) == SEQ
        for n in lengths:
            offsets.append(offsets[-1] + n)
    sink_flex.block_mask.cache_clear()
    mask = sink_flex.block_mask(len(layouts), SEQ, window, tuple(offsets), torch.device("cpu"))
    for row, lengths in enumerate(layouts):
        got, want = as_kernel_reads(mask, row), expected(lengths, window)
        wrong = (got != want).nonzero()
        assert wrong.numel() == 0, (f"row {row} ({lengths}): {len(wrong)} (query, key) pairs wrong, "
                                    f"first {wrong[:3].tolist()}")
    assert mask.shape[0] == len(layouts), f"one block mask for {len(layouts)} rows: shape {mask.shape}"
