"""Several rows' target caches as one batch, and per-row (ragged) roll-back.

Rows decode in one forward when every layer of their caches is a plain
`KVCache`: the rows' caches are merged into mlx-lm's `BatchKVCache` layers
(left-padded, one write index, a position offset per row). A verify step
appends T = 1 + the longest draft to every row; row i keeps `kept[i]` of them.
`BatchCheckpoint.keep` trims what every row rejected and rolls each row's
remaining rejected tail off its end (mlx-lm's right-padding `prepare` and
`finalize`), so every row ends at the shared write index again, its dropped
positions now masked left padding. Other cache kinds (sliding windows,
recurrent state, quantized KV) decode one row at a time.
"""

from __future__ import annotations

from mlx_lm.models.cache import BatchKVCache, KVCache


def batchable(cache: list) -> bool:
    """Whether rows with this cache can be merged into a batch."""
    return bool(cache) and all(type(c) is KVCache for c in cache)


def merge(caches: list[list]) -> list:
    """Per-layer `BatchKVCache`s holding the rows' caches (copied), in order."""
    return [BatchKVCache.merge(list(layer)) for layer in zip(*caches)]


def join(batch: list, cache: list) -> None:
    """Append one row's cache (copied) to the batch."""
    for b, c in zip(batch, cache):
        b.extend(BatchKVCache.merge([c]))


def extract(batch: list, i: int) -> list:
    """Row i's cache as plain `KVCache` layers (a copy)."""
    return [b.extract(i) for b in batch]


def remove(batch: list, i: int, rows: int) -> None:
    """Drop row i of `rows` from the batch."""
    keep = [j for j in range(rows) if j != i]
    for b in batch:
        b.filter(keep)


class BatchCheckpoint:
    """The batch cache before a verify block: restore it, or keep a prefix per row."""

    def __init__(self, cache: list):
        self.saved = [(c, c._idx, c.offset, c.left_padding) for c in cache]

    def restore(self) -> None:
        for c, idx, offset, left in self.saved:
            c._idx, c.offset, c.left_padding = idx, offset, left

    def keep(self, kept: list[int], fed: int) -> None:
        """Row i keeps the first kept[i] of the `fed` positions appended since."""
        drop = [fed - k for k in kept]
        common = min(drop)
        tail = [d - common for d in drop]
        for c, *_ in self.saved:
            if common:
                c.trim(common)
            if any(tail):
                c.prepare(right_padding=tail)
                c.finalize()
