"""Several rows' target caches as one batch, and per-row (ragged) roll-back.

Rows decode in one forward when every layer of their caches is a plain
`KVCache`, a `QuantizedKVCache`, a sliding-window `WindowKVCache` (with or without
sink positions), or a recurrent `ArraysCache` (GatedDeltaNet, Mamba, short
convolutions), and the rows' layers are of one kind (`kind`): KV layers merge into
mlx-lm's `BatchKVCache` (left-padded, one write index, a position offset per row),
window layers into `BatchWindowKVCache` (`mlx_spec.batch_window`: the same layout,
a windowed mask), recurrent layers into one `ArraysCache` whose state arrays have a
row per request.

A verify step appends T = 1 + the longest draft to every row; row i keeps
`kept[i]` of them. `BatchCheckpoint.keep` trims what every row rejected and
rolls each row's remaining rejected tail off its end (mlx-lm's right-padding
`prepare` and `finalize`), so every row ends at the shared write index again,
its dropped positions now masked left padding. A recurrent state cannot drop
positions: the checkpoint holds each layer's state from before the block, and
the rows that rejected part of their block (only those) are replayed from it
over their kept tokens in one forward of their own (right-padded, each row's
recurrent update stopped at its own length by `ArraysCache.lengths`, their KV
layers a copy of those rows before the block); their new states are written
into the batch. Their KV layers keep the block's own entries for the kept
positions (a recurrent layer is causal: what it passed up at a kept position
did not depend on the rejected ones). Rows that kept everything need nothing.

Quantized KV layers (`kv_bits`) merge into `BatchQuantizedKVCache`
(`mlx_spec.batch_quantized`) once a row's cache is quantized, with rows of the same
bits and group size; a row can only join a batch while its cache kind is settled
(`kind`).
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, QuantizedKVCache

from .batch_quantized import BatchQuantizedKVCache
from .batch_window import BatchWindowKVCache
from .cache import Checkpoint, WindowKVCache


def _layer_kind(c):
    """What a layer must share with the same layer of another row to merge (None: cannot)."""
    if type(c) in (KVCache, ArraysCache):
        return type(c).__name__
    if type(c) is QuantizedKVCache:
        return ("quantized", c.bits, c.group_size)
    if type(c) is WindowKVCache:
        return ("window", c.window, c.keep)
    return None


def settled(req, cache: list, ahead: int = 0, emitted: int = 0) -> bool:
    """Whether no `kv_bits` conversion is still to come: a request's KV layers become
    quantized once the cache holds `quantized_kv_start` positions (mlx-lm's rule, checked
    before each step). `ahead`: prompt tokens still to go in; `emitted`: tokens so far."""
    if req.kv_bits is None:
        return True
    plain = [c for c in cache if type(c) is KVCache]
    return not plain or (req.max_tokens is not None and
                         plain[0].offset + ahead + req.max_tokens - emitted < req.quantized_kv_start)


def kind(cache: list, req=None, ahead: int = 0, emitted: int = 0):
    """Rows of one kind merge into one batch; None: this cache cannot. With `req`, the kind
    the cache has from its first decoding step on (its prompt in, `quantize` applied) for
    the rest of the request, or None while a later `kv_bits` conversion could change it."""
    if req is not None and not settled(req, cache, ahead, emitted):
        if next(c for c in cache if type(c) is KVCache).offset + ahead < req.quantized_kv_start:
            return None  # quantized later, in the middle of decoding
        cache = [QuantizedKVCache(req.kv_group_size, req.kv_bits) if type(c) is KVCache else c
                 for c in cache]
    kinds = tuple(_layer_kind(c) for c in cache)
    return kinds if cache and None not in kinds else None


def _merge_layer(layer: list):
    if isinstance(layer[0], QuantizedKVCache):
        return BatchQuantizedKVCache.merge(layer)
    if isinstance(layer[0], WindowKVCache):
        return BatchWindowKVCache.merge(layer)
    if isinstance(layer[0], ArraysCache):
        return ArraysCache.merge(layer)
    return BatchKVCache.merge(layer)


def merge(caches: list[list]) -> list:
    """Per-layer batch caches holding the rows' caches (copied), in order."""
    return [_merge_layer(list(layer)) for layer in zip(*caches)]


def join(batch: list, cache: list) -> None:
    """Append one row's cache (copied) to the batch."""
    for b, c in zip(batch, cache):
        b.extend(_merge_layer([c]))


def extract(batch: list, i: int) -> list:
    """Row i's cache as solo layers (`KVCache`, `WindowKVCache`, `ArraysCache`; a copy)."""
    return [b.extract(i) for b in batch]


def remove(batch: list, i: int, rows: int) -> None:
    """Drop row i of `rows` from the batch."""
    keep = [j for j in range(rows) if j != i]
    for b in batch:
        b.filter(keep)


def checkpoint(model, cache: list, rows: int):
    """The checkpoint of a block fed to `rows` rows: a lone row's own cache (any kind) or the
    batch cache. Both `restore()`; `keep` takes a row's kept tokens, or a list of them."""
    return Checkpoint(model, cache) if rows == 1 else BatchCheckpoint(cache, model)


class BatchCheckpoint:
    """The batch cache before a verify block: restore it, or keep a prefix per row.
    `model` replays the rows that rejected something when the batch has recurrent layers."""

    def __init__(self, cache: list, model=None):
        for c in cache:
            if isinstance(c, BatchWindowKVCache):
                c.compact()  # between steps, never inside a block
        self.cache, self.model = cache, model
        self.saved = {j: (c._idx, c.offset, c.left_padding) for j, c in enumerate(cache)
                      if not isinstance(c, ArraysCache)}
        self.states = {j: list(c.cache) for j, c in enumerate(cache) if isinstance(c, ArraysCache)}
        if self.states and model is None:
            raise ValueError("a batch with recurrent layers needs the model to replay rows")

    def restore(self) -> None:
        for j, (idx, offset, left) in self.saved.items():
            c = self.cache[j]
            c._idx, c.offset, c.left_padding = idx, offset, left
        for j, state in self.states.items():
            self.cache[j].cache = list(state)

    def keep(self, kept: list, fed: int) -> None:
        """Row i keeps the first kept[i] of the `fed` positions appended since: a count, or
        (needed with recurrent layers) the kept tokens themselves."""
        lengths = [k if isinstance(k, int) else len(k) for k in kept]
        replay = [i for i, n in enumerate(lengths) if n < fed]
        if self.states and replay:
            self._replay(replay, [list(kept[i]) for i in replay])
        drop = [fed - k for k in lengths]
        common = min(drop)
        tail = [d - common for d in drop]
        for j in self.saved:
            c = self.cache[j]
            if common:
                c.trim(common)
            if any(tail):
                c.prepare(right_padding=tail)
                c.finalize()

    def _replay(self, rows: list[int], tokens: list[list[int]]) -> None:
        """Recompute the recurrent states of `rows` from before the block over their kept
        tokens, in one forward of those rows alone; write them into the batch."""
        pick = mx.array(rows)
        sub = []
        for j, c in enumerate(self.cache):
            if j in self.states:
                s = ArraysCache(len(c.cache))
                s.cache = [None if a is None else a[pick] for a in self.states[j]]
                s.lengths = mx.array([len(t) for t in tokens])  # stop each row at its own end
            else:
                idx, offset, left = self.saved[j]
                s = copy.copy(c)  # same class and settings (a window's size, bits)
                s.keys, s.values = (None if t is None else _rows(t, pick, idx) for t in (c.keys, c.values))
                s._idx, s.offset, s.left_padding, s._right_padding = idx, offset[pick], left[pick], None
            sub.append(s)
        width = max(len(t) for t in tokens)
        if width:  # rows that kept nothing (never in a verify step) just get their old state
            padded = [t + [0] * (width - len(t)) for t in tokens]
            self.model(mx.array(padded, mx.uint32), cache=sub)
        for j in self.states:
            c, new = self.cache[j], sub[j].cache
            for e, a in enumerate(new):
                whole = c.cache[e]
                whole[pick] = a.astype(whole.dtype)
                c.cache[e] = whole

    def for_row(self, i: int, row) -> "RowCheckpoint | None":
        """Row i's step as a solo checkpoint (None without recurrent layers: its layers trim)."""
        return RowCheckpoint(self, i, row) if self.states else None


def _rows(held, pick, width):
    """Rows `pick` of a layer's keys or values (an array, or a quantized triple), `width` columns."""
    if isinstance(held, tuple):
        return tuple(a[pick, :, :width] for a in held)
    return held[pick, :, :width]


class RowCheckpoint:
    """One row's part of a batch step, applied to that row's own cache after it left the
    batch (the caller stopped inside the block it kept): its recurrent states from before
    the block come back, its KV layers drop the block, and the kept prefix is replayed."""

    def __init__(self, batch: BatchCheckpoint, i: int, row):
        self.states = batch.states  # the layers' states before the block, a row per request
        self.i, self.row = i, row  # the row's cache: its own once it has left the batch

    def keep(self, kept) -> None:
        i, cache = self.i, self.row.cache
        fed = len(self.row.last[1])  # the step's kept tokens: what the cache holds since
        for j, c in enumerate(cache):
            if j in self.states:
                c.cache = [None if a is None else a[i : i + 1] for a in self.states[j]]
            else:
                c.trim(fed)
        if kept:
            self.row.model(mx.array(list(kept), mx.uint32)[None], cache=cache)
