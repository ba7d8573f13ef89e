"""Sliding-window layers of several rows as one batch cache that rolls back per row.

mlx-lm's `BatchRotatingKVCache` keeps a ring of exactly `max_size` slots per row, so
once a row's ring has wrapped the positions a rejected block overwrote are gone: it
cannot give a row back its own accepted prefix. `BatchWindowKVCache` keeps the layout
of `BatchKVCache` instead (left-padded rows, one write index, each row's positions
contiguous and ending at that index, a RoPE offset per row) and only differs in two
ways:

* its mask limits every query to the `window` most recent columns of its own row (and
  never reads a row's left padding), which is the window its solo `WindowKVCache`
  gives it, because each row's columns are its positions in order;
* between steps (`compact`, called when a `BatchCheckpoint` is taken) it drops the
  columns older than the `window - 1 + spare` most recent ones, so memory stays
  bounded however long the rows get, and a row that leaves the batch right after a
  step can still roll that step back (`spare` positions) as a solo window cache.

A verify block appends T columns; `BatchCheckpoint.keep` trims what every row
rejected and rolls each row's remaining rejected tail off its end (mlx-lm's
`prepare(right_padding=...)` / `finalize`), exactly as for plain KV layers: the
rolled-off columns become left padding, masked like any other.

Windows with `keep` sink positions (mlx-lm's `max_kv_size` caches keep the first 4
visible to every query) keep each row as [left padding][its first `keep` positions]
[its most recent positions]: compaction gathers every row's sinks and recent tail, so
a row's positions may skip a gap after its sinks. The mask reads positions, not
columns: the `keep` columns after a row's padding are positions 0..keep-1, and every
later column c is position `offset - _idx + c` (the row's tail ends at the write
index), which stays true through trims, roll-backs and joins.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache

from .cache import SPARE, WindowKVCache


class BatchWindowKVCache(BatchKVCache):
    """Rows of `WindowKVCache(window, keep=...)` layers, left-padded into one buffer."""

    def __init__(self, window: int, left_padding: list[int], spare: int = SPARE, keep: int = 0):
        super().__init__(left_padding)
        self.window, self.spare, self.keep = window, spare, keep

    @property
    def retain(self) -> int:
        """Recent columns a row needs before a block: its window, and a block's worth to roll back."""
        return self.window - self.keep - 1 + self.spare

    def compact(self) -> None:
        """Drop columns no row can see again (amortised: at least `step` at a time)."""
        width = self.keep + self.retain
        drop = self._idx - width
        if self.keys is None or drop < self.step:
            return
        # Each row: its sinks and its `retain` most recent columns, right-aligned at `width`
        # (a row holding no more than `width` columns keeps them all, in place; without
        # sinks this is the last `width` columns of every row).
        lp = mx.maximum(self.left_padding, 0)[:, None]
        held = self._idx - lp  # [B, 1] columns each row holds
        j = mx.arange(width)[None]
        src = mx.where((held > width) & (j < self.keep), lp + j, self._idx - width + j)
        src = mx.maximum(src, 0)[:, None, :, None]  # (negative: padding, masked)
        self.keys = mx.take_along_axis(self.keys[..., : self._idx, :], src, axis=2)
        self.values = mx.take_along_axis(self.values[..., : self._idx, :], src, axis=2)
        self.left_padding = mx.maximum(width - held[:, 0], 0)
        self._idx = width

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kw):
        if window_size is not None and window_size != self.window:
            raise ValueError(f"model asked for a {window_size}-token window from a batch cache "
                             f"built for {self.window}")
        if not self.keep:
            return create_causal_mask(N, offset=self._idx, window_size=self.window,
                                      left_padding=self.left_padding)
        cols = mx.arange(self._idx + N)[None]  # after this block is written
        rel = cols - self.left_padding[:, None]
        pos = mx.where(rel < self.keep, rel, self.offset[:, None] - self._idx + cols)[:, None, :]
        query = (self.offset[:, None] + mx.arange(N)[None])[:, :, None]
        seen = (rel >= 0)[:, None, :] & (pos <= query) & (
            (pos < self.keep) | (pos > query - (self.window - self.keep)))
        return seen[:, None]  # [B, 1, N, columns]

    def extract(self, idx: int) -> WindowKVCache:
        """Row `idx` as a solo `WindowKVCache` (a copy) holding all of its columns."""
        c = WindowKVCache(self.window, self.spare, self.keep)
        c.offset = int(self.offset[idx].item())
        if self.keys is None:
            return c
        first = max(0, int(self.left_padding[idx].item()))
        c.keys = mx.contiguous(self.keys[idx : idx + 1, :, first : self._idx])
        c.values = mx.contiguous(self.values[idx : idx + 1, :, first : self._idx])
        c._len = self._idx - first
        return c

    @classmethod
    def merge(cls, caches: list[WindowKVCache]) -> "BatchWindowKVCache":
        """The rows' window caches (copied), left-padded to the longest buffer."""
        window, keep, spare = caches[0].window, caches[0].keep, max(c.spare for c in caches)
        if any(c.window != window or c.keep != keep for c in caches):
            raise ValueError("only window caches of one size and one number of sink positions merge")
        lengths = [0 if c.keys is None else c._len for c in caches]
        width = max(lengths)
        batch = cls(window, [width - n for n in lengths], spare, keep)
        batch.offset = mx.array([c.offset for c in caches])
        if width == 0:
            return batch
        ref = next(c for c in caches if c.keys is not None)
        _, H, _, Dk = ref.keys.shape
        keys = mx.zeros((len(caches), H, width, Dk), ref.keys.dtype)
        values = mx.zeros((len(caches), H, width, ref.values.shape[3]), ref.values.dtype)
        for i, (c, n) in enumerate(zip(caches, lengths)):
            if n:
                keys[i : i + 1, :, width - n :] = c.keys[..., :n, :]
                values[i : i + 1, :, width - n :] = c.values[..., :n, :]
        batch.keys, batch.values, batch._idx = keys, values, width
        return batch
