"""Target and draft caches that can roll back the rejected part of a verified block.

A verify forward appends k+1 positions to every layer's cache; after acceptance
the last k-n of them must go. How depends on the layer's cache type:

* `KVCache`, `QuantizedKVCache`: move the offset back (`trim`).
* `RotatingKVCache` (sliding-window layers) cannot be trimmed once its ring has
  wrapped, so it is replaced by `WindowKVCache`: the same attention window, but
  the buffer keeps `spare` extra positions, so a rollback of up to `spare`
  tokens always works, however long the sequence gets. The `keep` sink
  positions of mlx-lm's `max_kv_size` caches stay visible, as in mlx-lm.
* `ArraysCache` (recurrent layers: GatedDeltaNet, Mamba, short convolutions)
  holds one state, not one entry per position, and DeepSeek-V4.1's `LayerCache`
  (mlx-lm `deepseek_v41`: a window that evicts rows, closed compressed groups,
  the rows of the open group) cannot give back what it evicted or pooled. A
  `Checkpoint` taken before a block keeps references to their state attributes
  (`SNAPSHOT_ATTRS`; MLX arrays are replaced, never mutated, by these layers);
  to keep a prefix of the block it restores them, drops the whole block from
  the attention layers and replays the kept tokens through the model. The
  replay is a second (lazy) forward over n+1 tokens on steps that rejected
  something.
* Anything else raises `CacheRollbackError` naming the layer and its type
  before any work starts. Never silent corruption.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

try:  # mlx-lm >= 0.32 (DeepSeek-V4.1); older versions simply lack the class
    from mlx_lm.models.deepseek_v41 import LayerCache
except ImportError:  # pragma: no cover
    LayerCache = None

MAX_DRAFT = 16  # the most drafted tokens one step verifies; the one definition of the limit
# A step can reject at most MAX_DRAFT of the MAX_DRAFT + 1 positions it appends.
SPARE = MAX_DRAFT + 1


# Caches restored from a snapshot of these attributes, then replayed. Each must
# only ever *reassign* them on update (checked for the mlx-lm versions we support),
# unless they are listed in SNAPSHOT_COPIED.
SNAPSHOT_ATTRS: dict[type, tuple[str, ...]] = {ArraysCache: ("cache",)}
if LayerCache is not None:
    SNAPSHOT_ATTRS[LayerCache] = (
        "window", "compress_kv", "index_k", "pending_kv", "pending_gate", "offset",
    )
# Snapshot attributes holding arrays their cache updates in place (slice assignment):
# copied when the snapshot is taken and again when it is restored.
SNAPSHOT_COPIED: dict[type, tuple[str, ...]] = {}
# Sliding-window caches with mlx-lm's RotatingKVCache fields (max_size, keep, keys,
# values, offset, _idx), taken over by a WindowKVCache.
ROTATING: list[type] = [RotatingKVCache]
# Per-layer containers whose `.caches` hold the caches of one layer.
CONTAINERS: list[type] = [CacheList]
# Caches whose `offset` counts something other than positions (pooled groups): they
# have `empty()`, and prompt-cache bookkeeping does not read their offset.
POSITIONLESS: list[type] = []


def register_cache_types(*, rotating=(), containers=(), snapshots=None, copied=None,
                         positionless=()) -> None:
    """Teach the rollback machinery another library's cache classes (a target module
    does this once, e.g. `mlx_spec.targets.deepseek_v4` for mlx-vlm's caches)."""
    ROTATING.extend(c for c in rotating if c not in ROTATING)
    CONTAINERS.extend(c for c in containers if c not in CONTAINERS)
    POSITIONLESS.extend(c for c in positionless if c not in POSITIONLESS)
    SNAPSHOT_ATTRS.update(snapshots or {})
    SNAPSHOT_COPIED.update(copied or {})
    _ROLES.clear()
    _ALL_TRIMMABLE.clear()


def positions(c: Any) -> int | None:
    """How many positions cache layer `c` has seen, when its `offset` says so."""
    if isinstance(c, tuple(POSITIONLESS)):
        return None
    offset = getattr(c, "offset", None)
    return offset if isinstance(offset, int) else None


# type(layer) -> (snapshot attrs or None, copied attrs, is a container): what the registries
# above say of a class, looked up once (a checkpoint is taken every step, for every layer).
_ROLES: dict[type, tuple[tuple[str, ...] | None, tuple[str, ...], bool]] = {}


def _role(c: Any) -> tuple[tuple[str, ...] | None, tuple[str, ...], bool]:
    role = _ROLES.get(type(c))
    if role is None:
        snap = next((attrs for cls, attrs in SNAPSHOT_ATTRS.items() if isinstance(c, cls)), None)
        copied = next((attrs for cls, attrs in SNAPSHOT_COPIED.items() if isinstance(c, cls)), ())
        role = _ROLES[type(c)] = (snap, copied, isinstance(c, tuple(CONTAINERS)))
    return role


# tuple of layer classes -> whether every one is a trimmable layer (no snapshot, no container)
_ALL_TRIMMABLE: dict[tuple, bool] = {}


def _all_trimmable(cache: list) -> bool:
    key = tuple(map(type, cache))
    plain = _ALL_TRIMMABLE.get(key)
    if plain is None:
        plain = _ALL_TRIMMABLE[key] = all(r[0] is None and not r[2] for r in map(_role, cache))
    return plain


def _snapshot_attrs(c: Any) -> tuple[str, ...] | None:
    return _role(c)[0]


def _copied_attrs(c: Any) -> tuple[str, ...]:
    return _role(c)[1]


def _is_container(c: Any) -> bool:
    return _role(c)[2]


class CacheRollbackError(ValueError):
    """A cache layer cannot undo the positions of rejected draft tokens."""


class WindowKVCache:
    """Sliding-window KV cache that can roll back `spare` tokens.

    Every query sees the `window` most recent positions ending at itself, as a
    `RotatingKVCache(max_size=window)` does; with `keep` > 0 (mlx-lm's
    `max_kv_size` caches keep 4 "sink" positions) the first `keep` positions stay
    visible to every query and the window of recent ones is `window - keep`.

    Rows are kept in temporal order: rows [0, keep) are positions [0, keep), the
    rest a contiguous tail ending at `offset`. Before new tokens are written the
    tail retains at least `window - keep - 1 + spare` of its most recent
    positions, and `make_mask` limits every query to what it may see.
    """

    step = 256

    def __init__(self, window: int, spare: int = SPARE, keep: int = 0):
        if not 0 <= keep < window:
            raise ValueError(f"keep must be in 0..{window - 1}, got {keep}")
        self.window, self.spare, self.keep = window, spare, keep
        self.keys = self.values = None
        self.offset = 0  # absolute number of positions seen
        self._len = 0  # rows held in the buffer

    @property
    def _span(self) -> int:  # recent positions each query sees, itself included
        return self.window - self.keep

    def _held_before(self, n_new: int) -> int:
        """Rows kept from the buffer when `n_new` more are written."""
        if self.keys is None:
            return 0
        if self._len + n_new > self.keys.shape[2]:
            sinks = min(self.keep, self._len)
            return sinks + min(self._len - sinks, self._span - 1 + self.spare)
        return self._len

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n_new = keys.shape[2]
        held = self._held_before(n_new)
        if self.keys is None or self._len + n_new > self.keys.shape[2]:
            # Compact: the sinks and the retained tail into a fresh buffer with room to grow.
            size = held + n_new + self.step
            B, H, _, Dk = keys.shape
            new_k = mx.zeros((B, H, size, Dk), keys.dtype)
            new_v = mx.zeros((B, H, size, values.shape[3]), values.dtype)
            sinks = min(self.keep, held)
            for dst, src in (((0, sinks), (0, sinks)), ((sinks, held), (self._len - held + sinks, self._len))):
                if dst[1] > dst[0]:
                    new_k[..., dst[0] : dst[1], :] = self.keys[..., src[0] : src[1], :]
                    new_v[..., dst[0] : dst[1], :] = self.values[..., src[0] : src[1], :]
            self.keys, self.values, self._len = new_k, new_v, held
        self.keys[..., self._len : self._len + n_new, :] = keys
        self.values[..., self._len : self._len + n_new, :] = values
        self._len += n_new
        self.offset += n_new
        return self.keys[..., : self._len, :], self.values[..., : self._len, :]

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if window_size is not None and window_size != self.window:
            raise ValueError(
                f"model asked for a {window_size}-token window from a cache built "
                f"for {self.window}"
            )
        rows = self._held_before(N) + N
        end = self.offset + N  # positions after the write
        sinks = min(self.keep, rows)
        first_tail = end - (rows - sinks)  # position of the oldest non-sink row
        if end - 1 - first_tail < self._span:  # every query sees every row before it
            if N == 1:
                return None
            return create_causal_mask(N, rows - N) if return_array else "causal"
        pos = mx.arange(rows)
        pos = mx.where(pos < sinks, pos, pos + (first_tail - sinks))[None]
        query = mx.arange(end - N, end)[:, None]
        return (pos <= query) & ((pos < self.keep) | (pos > query - self._span))

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        sinks = min(self.keep, self._len)
        gap = self._len < self.offset  # positions were evicted
        left = self.offset - n
        if left < sinks:
            ok = not gap
        else:
            ok = self._len - sinks - n >= min(left - sinks, self._span - 1)
        if not ok:
            raise CacheRollbackError(
                f"WindowKVCache can roll back at most {self.spare} positions "
                f"past its window, asked for {n}"
            )
        self._len -= n
        self.offset -= n
        return n

    def size(self) -> int:
        return min(self.offset, self.window)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        return self.keys[..., : self._len, :], self.values[..., : self._len, :]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    @classmethod
    def from_rotating(cls, c: RotatingKVCache, spare: int = SPARE) -> "WindowKVCache":
        """Take over a RotatingKVCache that may already hold a prompt."""
        new = cls(c.max_size, spare, keep=c.keep)
        if c.keys is not None and c.offset > 0:
            k, v = _temporal(c, c.keys), _temporal(c, c.values)
            new.update_and_fetch(k, v)
            new.offset = c.offset
        return new


def _temporal(c: RotatingKVCache, v: mx.array) -> mx.array:
    """A RotatingKVCache buffer in temporal order: its `keep` sinks, then oldest first."""
    if c._idx == v.shape[2]:
        return v
    if c._idx < c.offset:  # the ring has wrapped: [idx:] is older than [keep:idx]
        keep = c.keep
        return mx.concatenate([v[..., :keep, :], v[..., c._idx :, :], v[..., keep : c._idx, :]], axis=2)
    return v[..., : c._idx, :]


def _prepare_layer(c: Any, where: str) -> Any:
    if isinstance(c, tuple(ROTATING)):
        return WindowKVCache.from_rotating(c)
    if isinstance(c, (KVCache, QuantizedKVCache, WindowKVCache)) or _snapshot_attrs(c):
        return c
    if _is_container(c):
        c.caches = [_prepare_layer(x, f"{where}.{i}") for i, x in enumerate(c.caches)]
        return c
    raise CacheRollbackError(
        f"{where} uses {type(c).__name__}, which cannot roll back rejected draft "
        "tokens, so speculative decoding would corrupt its state. Supported: "
        "KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache, DeepSeek-V4.1 LayerCache."
    )


def prepare_cache(model, cache: list | None = None) -> list:
    """Return a cache for `model` whose every layer can roll back `SPARE` positions.

    `cache` (a prompt cache from the caller) is converted in place, so the
    caller's list keeps the committed state after generation.
    """
    if cache is None:
        cache = make_prompt_cache(model)
    for i, c in enumerate(cache):
        cache[i] = _prepare_layer(c, f"cache layer {i}")
    return cache


def make_cache(model) -> list:
    """A fresh prompt cache for `model` that speculative decoding can roll back."""
    return prepare_cache(model)


def _with_roles(cache: list):
    """Each cache layer (inside per-layer containers too) with its `_role`."""
    for c in cache:
        role = _role(c)
        if role[2]:
            yield from _with_roles(c.caches)
        else:
            yield c, role


def _layers(cache: list):
    for c, _ in _with_roles(cache):
        yield c


def rollback(cache: list, n: int) -> None:
    """Drop the last `n` positions from every trimmable layer.

    Recurrent and DeepSeek-V4.1 layers cannot drop positions: use a
    `Checkpoint` for caches that have them (`is_recurrent`).
    """
    if n > 0:
        for c in _layers(cache):
            if _snapshot_attrs(c) is None:
                c.trim(n)


def is_recurrent(cache: list) -> bool:
    """Whether rolling `cache` back needs a snapshot and a replay forward."""
    return any(_snapshot_attrs(c) is not None for c in _layers(cache))


class Checkpoint:
    """The state of `cache` before a block of tokens is fed to `model`.

    It records each trimmable layer's own offset (and the state of each
    snapshot layer), so `keep(kept)` leaves the cache as if only `kept` (a
    prefix of the tokens fed since) had been fed, whatever happened in between:
    also after a forward that failed half-way, when some layers appended the
    block and others did not (`keep([])` restores the state exactly).
    """

    def __init__(self, model, cache: list):
        self.model, self.cache = model, cache
        self.layers = list(cache)  # mlx-lm's KV quantization may replace list entries
        if _all_trimmable(cache):  # the common case, taken every step: offsets only
            self.offsets: list[tuple[Any, int]] = [(c, c.offset) for c in cache]
            self.states = []
            return
        layers = list(_with_roles(cache))
        self.offsets = [(c, c.offset) for c, (attrs, _, _) in layers if attrs is None]
        self.states = [(c, {a: _copy(getattr(c, a), a in copied) for a in attrs})
                       for c, (attrs, copied, _) in layers if attrs is not None]

    def restore(self) -> None:
        """The cache exactly as at the checkpoint (as `BatchCheckpoint.restore`)."""
        self.keep([])

    def keep(self, kept: Sequence[int], fed: int | None = None) -> None:
        """Keep `kept` of what was fed since the checkpoint (`fed` tokens, when known)."""
        if fed is not None and fed == len(kept):
            return
        if any(a is not b for a, b in zip(self.cache, self.layers)):
            if kept:
                raise RuntimeError("cache layers were replaced inside a checkpointed block")
            self.cache[:] = self.layers  # the originals, trimmed below to their recorded state
        replay = bool(self.states) and (fed is None or fed > len(kept))
        target = 0 if replay else len(kept)
        for c, offset in self.offsets:
            extra = c.offset - (offset + target)
            if extra > 0:
                c.trim(extra)
        if not replay:
            return
        for c, state in self.states:
            copied = _copied_attrs(c)
            for attr, value in state.items():
                setattr(c, attr, _copy(value, attr in copied))
        if kept:  # replay; stays lazy until the next evaluation
            self.model(mx.array(list(kept), mx.uint32)[None], cache=self.cache)


def _copy(value, deep: bool = False):
    """A shallow copy of a list (ArraysCache's slots); arrays and ints as they are, or
    (`deep`: updated in place by their cache) a copy the update cannot reach."""
    if deep and isinstance(value, mx.array):
        return mx.array(value)
    return list(value) if isinstance(value, list) else value
