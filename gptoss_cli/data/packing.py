"""Packing whole documents into fixed-length rows: best-fit decreasing, deterministic (no torch here).

A row of capacity S (training.seq_length) holds documents laid end to end; a document of L tokens
takes L positions. Documents are never split: one longer than S is an error. Used by training on
version-2 token files (gptoss_cli/data/token_format.py) and by prepare-data's packing report.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from typing import Sequence

# Above this row capacity the open rows are kept in a sorted list instead of a counter per free-space value:
# the counters cost 16 to 32 bytes per token of capacity (a 2**31-token row would need 34 GB), while a row count is
# at most 2 * tokens / capacity + 1 (no two rows could be merged), so the list stays short when rows are long.
TREE_CAPACITY_LIMIT = 1 << 20


class _FreeSpace:
    """Open rows keyed by their free space 0..capacity: the tightest row with at least L free, in O(log S)."""

    def __init__(self, capacity: int):
        self.size = 1 << max(1, capacity).bit_length()  # leaves 0..size-1 >= capacity + 1
        self.count = [0] * (2 * self.size)  # a segment tree of how many rows have each free space
        self.rows: dict[int, list[int]] = {}  # free space -> open rows, a heap (the earliest opened first)

    def add(self, free: int, row: int) -> None:
        heapq.heappush(self.rows.setdefault(free, []), row)
        i = free + self.size
        while i:
            self.count[i] += 1
            i >>= 1

    def take_at_least(self, need: int) -> tuple[int, int] | None:
        """(free space, row) of the open row with the least free space >= need (the earliest opened such), removed."""
        count, i = self.count, need + self.size
        if not count[i]:
            while True:  # climb to the first ancestor whose right sibling has rows, then go down its leftmost path
                if i == 1:
                    return None
                if not i & 1 and count[i + 1]:
                    i += 1
                    break
                i >>= 1
            while i < self.size:
                i = 2 * i if count[2 * i] else 2 * i + 1
        free = i - self.size
        rows = self.rows[free]
        row = heapq.heappop(rows)
        if not rows:
            del self.rows[free]
        while i:
            count[i] -= 1
            i >>= 1
        return free, row


class _SortedFreeSpace:
    """The same answers as _FreeSpace from a sorted list of (free space, row): memory by rows, not by capacity."""

    def __init__(self, capacity: int):
        self.keys: list[tuple[int, int]] = []

    def add(self, free: int, row: int) -> None:
        insort(self.keys, (free, row))

    def take_at_least(self, need: int) -> tuple[int, int] | None:
        at = bisect_left(self.keys, (need, -1))
        return self.keys.pop(at) if at < len(self.keys) else None


def pack_documents(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of document indices (ascending within a row) whose lengths sum to at most `capacity`.

    Best-fit decreasing: documents longest first (ties: lower index first), each into the open row
    with the least free space that still holds it (the earliest opened on a tie), else a new row; rows
    in the order they were opened. Memory grows with the documents, not with `capacity`.
    Deterministic: the same lengths always give the same rows. ValueError for a capacity below 1 and
    for a document longer than `capacity` or shorter than 1 token, naming its index.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"row capacity {capacity!r} must be a positive number of tokens")
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or int(n) != n or n < 1:
            raise ValueError(f"document {i} has length {n!r}; documents need at least 1 token")
        if n > capacity:
            raise ValueError(f"document {i} has {int(n)} tokens, more than a row of {capacity} holds")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    free_space = (_FreeSpace if capacity <= TREE_CAPACITY_LIMIT else _SortedFreeSpace)(capacity)
    for i in order:
        n = int(lengths[i])
        found = free_space.take_at_least(n)
        if found is None:
            free, row = capacity, len(rows)
            rows.append([])
        else:
            free, row = found
        rows[row].append(i)
        if free - n:
            free_space.add(free - n, row)
    for row in rows:
        row.sort()
    return rows


def packing_efficiency(lengths: Sequence[int], rows: Sequence[Sequence[int]], capacity: int) -> float:
    """Real tokens / row positions: sum of the packed documents' lengths / (len(rows) * capacity)."""
    if not rows:
        return 0.0
    return sum(int(lengths[i]) for row in rows for i in row) / (len(rows) * capacity)


__all__ = ["pack_documents", "packing_efficiency"]
