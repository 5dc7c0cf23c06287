"""The distributed optimizer's shard layout, asserted directly (an off-by-one boundary otherwise shows only as
a gloo size error inside a multi-process test): a bucket's shards tile it exactly, in equal aligned parts,
and every parameter element is owned by exactly one shard."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gptoss_cli.buckets import ALIGN
from gptoss_cli.parallel import grads
from gptoss_cli.parallel.grads import GradBuffer

SHARDS = 4


@pytest.fixture
def four_way(monkeypatch):
    """A stand-in group of 4 ranks (the buffer only asks its size and this rank's index)."""
    group = object()
    monkeypatch.setattr(grads, "group_size", lambda g: SHARDS if g is group else 1)
    monkeypatch.setattr(grads, "group_rank", lambda g: 0)
    return group


@pytest.mark.parametrize("bucket_size", [1, 100, 10_000])
def test_shards_tile_every_bucket_and_own_every_element_once(four_way, bucket_size):
    # odd sizes, so boundaries cut through parameters and buckets need padding
    shapes = [(7, 13), (5,), (3, 11, 2), (129,), (1,), (64, 3)]
    params = [(f"p{i}", nn.Parameter(torch.zeros(s))) for i, s in enumerate(shapes)]
    buf = GradBuffer(params, torch.device("cpu"), group=four_way, shard=True, bucket_size=bucket_size)
    assert buf.shards == SHARDS
    owner = torch.zeros(buf.numel, dtype=torch.long)
    end = 0
    for b in buf.buckets:
        assert b.start == end, f"bucket {b.index} starts at {b.start}, the previous one ended at {end}"
        bounds = [b.shard_bounds(r) for r in range(SHARDS)]
        assert bounds[0][0] == b.start and bounds[-1][1] == b.end, f"shards of bucket {b.index} {bounds} do not span it"
        for (lo, hi), (nlo, _) in zip(bounds, bounds[1:]):
            assert hi == nlo, f"shard boundary off: one shard ends at {hi}, the next starts at {nlo}"
        sizes = {hi - lo for lo, hi in bounds}
        assert len(sizes) == 1 and sizes.pop() % ALIGN == 0, f"unequal or unaligned shards {bounds}"
        for r, (lo, hi) in enumerate(bounds):
            owner[lo:hi] += 1
            assert b.local(buf.data, r).data_ptr() == buf.data[lo:hi].data_ptr()
        end = b.end
    assert end == buf.numel
    assert (owner == 1).all(), "an element is owned by no shard or by two"
    for i, (lo, hi) in enumerate(buf.offsets):
        assert hi - lo == buf.params[i].numel()
        bucket = buf.bucket_of[i]
        assert bucket.start <= lo and hi <= bucket.end, f"{buf.names[i]} crosses a bucket boundary"
