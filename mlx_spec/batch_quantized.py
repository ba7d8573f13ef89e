"""Quantized KV layers (`kv_bits`) of several rows as one batch cache.

mlx-lm has no batch form of `QuantizedKVCache`. `BatchQuantizedKVCache` keeps the
layout of mlx-lm's `BatchKVCache` (left-padded rows, one write index, a RoPE offset
and a left padding per row), with keys and values each held as the (packed, scales,
biases) triple `mx.quantize` returns, so the models' attention takes the same
quantized path it takes for a solo row (`bits` and `group_size` are read from the
cache). Quantization groups run along the head dimension, so every position is
quantized on its own: merging rows copies their triples unchanged, and a row's
numbers in the batch are bit for bit its solo cache's. Roll-back is `BatchKVCache`'s
(`trim`, `prepare(right_padding=...)`, `finalize`), applied to every array of the
triples.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache, dynamic_roll


def _each(triple, fn):
    return None if triple is None else tuple(fn(a) for a in triple)


def _zeros(like: tuple, rows: int, width: int) -> tuple:
    """An empty triple shaped as `like` ([_, H, _, d] arrays), `rows` x `width` positions."""
    return tuple(mx.zeros((rows, a.shape[1], width, a.shape[3]), a.dtype) for a in like)


class BatchQuantizedKVCache(BatchKVCache):
    """Rows of `QuantizedKVCache(group_size, bits)` layers, left-padded into one buffer."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev, n = self._idx, keys.shape[2]
        qk, qv = (mx.quantize(x, group_size=self.group_size, bits=self.bits) for x in (keys, values))
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            grow = (self.step + n - 1) // self.step * self.step
            new_k, new_v = _zeros(qk, keys.shape[0], grow), _zeros(qv, keys.shape[0], grow)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys, self.values = (
                    tuple(mx.concatenate([a[..., :prev, :], b], axis=2) for a, b in zip(old, new))
                    for old, new in ((self.keys, new_k), (self.values, new_v)))
        for held, q in ((self.keys, qk), (self.values, qv)):
            for a, b in zip(held, q):
                a[..., prev : prev + n, :] = b
        self.offset = self.offset + n
        self._idx += n
        return self.keys_and_values()

    def keys_and_values(self):
        idx = self._idx
        return _each(self.keys, lambda a: a[..., :idx, :]), _each(self.values, lambda a: a[..., :idx, :])

    def finalize(self) -> None:
        if self._right_padding is not None:
            shift = self._right_padding[:, None]
            self.keys = _each(self.keys, lambda a: dynamic_roll(a, shift, axis=2))
            self.values = _each(self.values, lambda a: dynamic_roll(a, shift, axis=2))
            self.offset = self.offset - self._right_padding
            self.left_padding = self.left_padding + self._right_padding
            self._right_padding = None

    def filter(self, batch_indices) -> None:
        self.keys = _each(self.keys, lambda a: a[batch_indices])
        self.values = _each(self.values, lambda a: a[batch_indices])
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:  # drop the padding every row has
            self.keys = _each(self.keys, lambda a: a[..., shift:, :])
            self.values = _each(self.values, lambda a: a[..., shift:, :])
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: "BatchQuantizedKVCache") -> None:
        """Append `other`'s rows, both right-aligned at the longer write index."""
        self._check(other)
        ref = self if self.keys is not None else other
        if ref.keys is None:  # nothing written in either
            self.offset = mx.concatenate([self.offset, other.offset])
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            return
        width = max(self._idx, other._idx)

        def aligned(c):  # (a cache with nothing written has _idx 0: every column is padding)
            rows, left = c.offset.shape[0], width - c._idx
            pad = [(0, 0), (0, 0), (left, 0), (0, 0)]
            k, v = c.keys_and_values() if c.keys is not None else (
                _zeros(ref.keys, rows, 0), _zeros(ref.values, rows, 0))
            return (*(_each(t, lambda a: mx.pad(a, pad)) for t in (k, v)), c.left_padding + left)

        (ka, va, la), (kb, vb, lb) = aligned(self), aligned(other)
        self.keys = tuple(mx.concatenate(p, axis=0) for p in zip(ka, kb))
        self.values = tuple(mx.concatenate(p, axis=0) for p in zip(va, vb))
        self.left_padding = mx.concatenate([la, lb])
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = width

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row `idx` as a solo `QuantizedKVCache` (a copy)."""
        c = QuantizedKVCache(self.group_size, self.bits)
        if self.keys is None:
            return c
        first = int(self.left_padding[idx].item())
        c.keys = _each(self.keys, lambda a: mx.contiguous(a[idx : idx + 1, :, first : self._idx]))
        c.values = _each(self.values, lambda a: mx.contiguous(a[idx : idx + 1, :, first : self._idx]))
        c.offset = self._idx - first
        return c

    def _check(self, other) -> None:
        if (other.group_size, other.bits) != (self.group_size, self.bits):
            raise ValueError(f"quantized KV caches of {other.bits} bits (groups of {other.group_size}) "
                             f"and {self.bits} bits (groups of {self.group_size}) cannot share a batch")

    @classmethod
    def merge(cls, caches: list[QuantizedKVCache]) -> "BatchQuantizedKVCache":
        """The rows' quantized caches (copied), left-padded to the longest."""
        batch = cls([0] * len(caches), caches[0].group_size, caches[0].bits)
        for c in caches:
            batch._check(c)
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        width = max(lengths)
        batch.left_padding = mx.array([width - n for n in lengths])
        batch.offset = mx.array(lengths)
        if width == 0:
            return batch
        full = next(c for c in caches if c.keys is not None)
        batch.keys, batch.values = (_zeros(t, len(caches), width) for t in (full.keys, full.values))
        for i, (c, n) in enumerate(zip(caches, lengths)):
            for held, own in ((batch.keys, c.keys), (batch.values, c.values)):
                for a, b in zip(held, own or ()):
                    a[i : i + 1, :, width - n :] = b[..., :n, :]
        batch._idx = width
        return batch

    def size(self) -> int:
        return self._idx

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else sum(a.nbytes for a in (*self.keys, *self.values))


def unquantized_room(row) -> int:
    """Drafts a `kv_bits` row's block may hold before its cache reaches `quantized_kv_start`:
    mlx-lm quantizes the cache after every step once it holds that many tokens, so the tokens
    past that point must see it quantized, and a block verified over the plain cache may not
    cross it (no limit once quantized)."""
    from .cache import MAX_DRAFT

    at = next((c.offset for c in row.cache if hasattr(c, "to_quantized")), None)
    start = row.req.quantized_kv_start
    return MAX_DRAFT if at is None or at >= start else max(0, start - at - 1)
