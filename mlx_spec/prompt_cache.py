"""Prompt caches across calls: what a cache holds, and a store of them bounded in bytes.

`stream_generate(..., prompt_cache=cache)` records on the side (never on the
list itself) which tokens `cache` holds afterwards and, when the drafter can
save its state, the drafter's state over exactly those tokens (`History`). The
next call with that cache then gives the drafter the whole conversation: it
restores the saved state and reads only the new prompt, or, for a drafter
without saved state that needs no target hidden states (n-gram, draft model),
reads the whole history again.

`PromptCacheStore` keeps finished caches (a server's conversations) and hands
out a private copy of the one sharing the longest prefix with a new prompt,
trimmed back where the cache allows it; the least recently used go first
when the store is over its byte budget.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from .cache import POSITIONLESS, CacheRollbackError, _layers, _snapshot_attrs, positions, prepare_cache
from .identity import IdentityMap


@dataclass(frozen=True)
class History:
    """The tokens a prompt cache holds, and a drafter's saved state over them."""

    tokens: tuple[int, ...]
    drafter: Any = None  # weak reference to the drafter whose state is saved
    state: Any = None  # that drafter's `save_state()` over `tokens`, or None

    def state_for(self, drafter):
        """The saved state if it is `drafter`'s (or a fork of the same drafter's), else None."""
        if self.state is None or drafter is None or self.drafter is None:
            return None
        return self.state if self.drafter() is origin(drafter) else None


def origin(drafter):
    """The drafter a fork was made from (itself when it is not a fork): forks share state."""
    parent = getattr(drafter, "forked_from", None)
    return (parent() if parent is not None else None) or drafter


# A prompt cache's first layer -> [History]. Keyed by the layer because a plain list
# cannot be weakly referenced; a cache whose layers were replaced simply has no history.
_HISTORIES = IdentityMap()


def history(cache: list) -> History | None:
    """What mlx-spec recorded about `cache` (None: filled elsewhere, or never used)."""
    box = _HISTORIES.get(cache[0]) if cache else None
    return box[0] if box else None


def record(cache: list, value: History | None) -> None:
    if cache:
        _HISTORIES.setdefault(cache[0], lambda: [None])[0] = value


def history_of(cache: list) -> History | None:
    """What `cache` holds now: its recorded history if its layers still agree with it, an
    empty history for an empty cache, None when unknown (filled by other code)."""
    offsets = [n for n in map(positions, _layers(cache)) if n is not None]
    hold = history(cache)
    if hold is not None and all(o == len(hold.tokens) for o in offsets):
        return hold
    return History(()) if _empty(cache) else None


def _empty(cache: list) -> bool:
    for c in _layers(cache):
        if positions(c) is not None:
            if c.offset:
                return False
        elif isinstance(c, ArraysCache) and any(x is not None for x in c.cache):
            return False
        elif isinstance(c, tuple(POSITIONLESS)) and not c.empty():
            return False
    return True


def prefill_drafter(drafter, hist: History | None, prompt, taps) -> None:
    """The drafter reads the prompt, continuing the conversation `hist` where it can."""
    state = hist.state_for(drafter) if hist is not None else None
    if state is not None:
        drafter.restore_state(state)
        drafter.prefill(prompt, taps)
    elif hist is not None and hist.tokens and not drafter.taps:
        drafter.prefill(hist.tokens + tuple(prompt), None)  # the whole conversation, once more
    else:
        drafter.prefill(prompt, taps)


def settle(cache: list, held, drafter, later, seen: int, last: int, taps) -> None:
    """Record what `cache` holds after a generation (`held`, None if unknown) and, when it
    can save its state, the drafter's state over exactly those tokens.

    `later` is the last step's kept (tokens, taps) not yet committed to the drafter,
    `seen` how many tokens of that step's block the caller saw, `last` the last one,
    with `taps` its target hidden states when the cache fed it only now.
    """
    if held is None:
        record(cache, None)
        return
    state = None
    if drafter is not None and hasattr(drafter, "save_state"):
        try:
            done = False
            if later is not None:
                tokens, rows = later
                m = min(seen, len(tokens) - 1) + 1  # [y] + the drafts the caller saw
                drafter.commit(tokens[:m], None if rows is None else {i: h[:m] for i, h in rows.items()})
                done = seen <= len(tokens) - 1  # the last seen token was a kept draft
            if not done:
                drafter.commit([last], taps)
            state = drafter.save_state()
        except Exception:  # a drafter that failed mid-generation: keep no state
            state = None
    record(cache, History(tuple(held), weakref.ref(origin(drafter)) if state is not None else None, state))


def cache_nbytes(cache: list) -> int:
    """Bytes the layers hold: their buffers where they say (a window layer's `state` is its rows in
    use, half its buffer or less), else their state's arrays."""
    total = 0
    for c in _layers(cache):
        try:
            total += int(c.nbytes)
        except (AttributeError, NotImplementedError, TypeError):
            total += sum(getattr(a, "nbytes", 0) for _, a in tree_flatten(c.state))
    return total


def trim_to(cache: list, n: int) -> bool:
    """Drop positions so `cache` holds its first `n`; False when a layer cannot."""
    hold = history(cache)
    extra = len(hold.tokens) - n if hold else 0
    if extra <= 0:
        return extra == 0
    if any(_snapshot_attrs(c) is not None for c in _layers(cache)):
        return False  # recurrent state cannot give positions back
    try:
        for c in _layers(cache):
            if c.trim(extra) != extra:
                return False
    except CacheRollbackError:
        return False
    record(cache, History(hold.tokens[:n]))  # a drafter's state was for the longer history
    return True


def copy_cache(cache: list) -> list:
    """An independent copy of `cache` and of what was recorded about it."""
    new = copy.deepcopy(cache)
    hold = history(cache)
    if hold is not None:
        record(new, hold)  # History and saved states are never modified in place
    return new


class PromptCacheStore:
    """Finished prompt caches for `model`, fetched by longest common prefix, LRU by bytes."""

    def __init__(self, model, max_bytes: int = 1 << 30, max_kv_size: int | None = None):
        self.model, self.max_bytes, self.max_kv_size = model, max_bytes, max_kv_size
        self._entries: list[tuple[tuple[int, ...], list, int]] = []  # most recently used last

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e[2] for e in self._entries)

    def fetch(self, tokens: Sequence[int], limit: int | None = None) -> tuple[list, int]:
        """(cache, n): a private cache holding `tokens[:n]`, n < len(tokens) (0: a fresh cache),
        and n <= `limit` when given.

        Feed `tokens[n:]` as the prompt with this cache. The entry sharing the
        longest prefix is copied and trimmed back to the shared part; an entry
        that cannot be trimmed that far (recurrent layers, a window's spare) is
        passed over for the next best.
        """
        tokens = tuple(tokens)
        ranked = sorted(((_common(e[0], tokens), i) for i, e in enumerate(self._entries)), reverse=True)
        for shared, i in ranked:
            n = min(shared, len(tokens) - 1, len(tokens) if limit is None else limit)
            if n <= 0:
                break
            held, cache, _ = self._entries[i]
            if n < len(held) and any(_snapshot_attrs(c) is not None for c in _layers(cache)):
                continue
            copy_ = copy_cache(cache)
            if trim_to(copy_, n):
                self._entries.append(self._entries.pop(i))
                return copy_, n
        return prepare_cache(self.model, make_prompt_cache(self.model, self.max_kv_size)), 0

    def put(self, cache: list) -> None:
        """Keep `cache` (the store owns it from now on) under the tokens it holds."""
        hold = history(cache)
        if hold is None or not hold.tokens:
            return
        size = cache_nbytes(cache)
        # An entry whose tokens the new one extends says nothing the new one does not.
        self._entries = [e for e in self._entries if hold.tokens[: len(e[0])] != e[0]]
        self._entries.append((hold.tokens, cache, size))
        while self._entries and self.nbytes > self.max_bytes:
            self._entries.pop(0)

    def clear(self) -> None:
        self._entries.clear()


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def save_prompt_cache(file_name: str, cache: list, metadata: dict[str, str] | None = None) -> None:
    """mlx-lm's `save_prompt_cache` for a prompt cache mlx-spec has used.

    Speculative decoding keeps sliding-window layers as `WindowKVCache` (it can roll back
    rejected drafts), a class mlx-lm's loader does not know; they are written as the
    `RotatingKVCache` layers they stand for, so `mlx_lm.models.cache.load_prompt_cache`
    reads the file, and mlx-lm and mlx-spec both continue from it. `cache` is not changed.
    """
    from mlx_lm.models.cache import save_prompt_cache as save

    save(file_name, [_as_mlx_lm(c) for c in cache], metadata)


def _as_mlx_lm(c: Any) -> Any:
    from mlx_lm.models.cache import RotatingKVCache

    from .cache import WindowKVCache, _is_container

    if _is_container(c):
        parts = [_as_mlx_lm(x) for x in c.caches]
        if all(a is b for a, b in zip(parts, c.caches)):
            return c
        out = copy.copy(c)
        out.caches = parts
        return out
    if not isinstance(c, WindowKVCache):
        return c
    ring = RotatingKVCache(c.window, keep=c.keep)
    if c.empty() or c.offset == 0:
        return ring
    keys, values = c.state  # the sinks, then the most recent positions, oldest first
    rows = keys.shape[2]
    if c.offset > rows and rows < c.window:
        # A rollback left window - 1 rows; mlx-lm's ring holds `window` once full, and its next
        # write replaces the oldest row after the sinks: a row no query sees.
        sinks, pad = min(c.keep, rows), c.window - rows
        keys, values = (mx.concatenate([v[..., :sinks, :], mx.zeros((*v.shape[:2], pad, v.shape[3]), v.dtype),
                                        v[..., sinks:, :]], axis=2) for v in (keys, values))
    ring.keys, ring.values, ring.offset = keys, values, c.offset
    ring._idx = keys.shape[2]  # in temporal order, as mlx-lm's own prompt read leaves it
    return ring
