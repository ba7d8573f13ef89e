"""Several rows' target caches as one batch, and per-row (ragged) roll-back.

Rows decode in one forward when every layer of their caches is a plain
`KVCache` or a sliding-window `WindowKVCache` without sink positions: the rows'
caches are merged into mlx-lm's `BatchKVCache` layers (left-padded, one write
index, a position offset per row), window layers into `BatchWindowKVCache`
(`mlx_spec.batch_window`: the same layout, a windowed mask). A verify step
appends T = 1 + the longest draft to every row; row i keeps `kept[i]` of them.
`BatchCheckpoint.keep` trims what every row rejected and rolls each row's
remaining rejected tail off its end (mlx-lm's right-padding `prepare` and
`finalize`), so every row ends at the shared write index again, its dropped
positions now masked left padding. Other cache kinds (recurrent state,
quantized KV, windows with sinks from `max_kv_size`) decode one row at a time.
"""

from __future__ import annotations

from mlx_lm.models.cache import BatchKVCache, KVCache

from .batch_window import BatchWindowKVCache
from .cache import WindowKVCache


def _mergeable(c) -> bool:
    return type(c) is KVCache or (type(c) is WindowKVCache and c.keep == 0)


def batchable(cache: list) -> bool:
    """Whether rows with this cache can be merged into a batch."""
    return bool(cache) and all(_mergeable(c) for c in cache)


def _merge_layer(layer: list):
    if isinstance(layer[0], WindowKVCache):
        return BatchWindowKVCache.merge(layer)
    return BatchKVCache.merge(layer)


def merge(caches: list[list]) -> list:
    """Per-layer batch caches holding the rows' caches (copied), in order."""
    return [_merge_layer(list(layer)) for layer in zip(*caches)]


def join(batch: list, cache: list) -> None:
    """Append one row's cache (copied) to the batch."""
    for b, c in zip(batch, cache):
        b.extend(_merge_layer([c]))


def extract(batch: list, i: int) -> list:
    """Row i's cache as solo layers (`KVCache`, `WindowKVCache`; a copy)."""
    return [b.extract(i) for b in batch]


def remove(batch: list, i: int, rows: int) -> None:
    """Drop row i of `rows` from the batch."""
    keep = [j for j in range(rows) if j != i]
    for b in batch:
        b.filter(keep)


class BatchCheckpoint:
    """The batch cache before a verify block: restore it, or keep a prefix per row."""

    def __init__(self, cache: list):
        for c in cache:
            if isinstance(c, BatchWindowKVCache):
                c.compact()  # between steps, never inside a block
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
