"""Per-object bookkeeping without writing attributes onto users' objects.

`IdentityMap` keys a value by an object's identity and forgets it when the
object dies, so a recycled `id()` never finds a stale entry. Models are
`dict` subclasses (unhashable), which rules out `weakref.WeakKeyDictionary`.

`Claims` marks an object (a drafter, a prompt cache) as used by one live
generator, so a second generator refuses to start on it instead of silently
resetting or interleaving its state.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable


class IdentityMap:
    """A mapping from live objects (by identity) to values."""

    def __init__(self):
        self._entries: dict[int, tuple[Any, Any]] = {}

    def get(self, obj, default=None):
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return default
        return entry[1]

    def setdefault(self, obj, make: Callable[[], Any]):
        """The value for `obj`, made by `make()` the first time (kept while `obj` lives)."""
        value = self.get(obj, _MISSING)
        if value is not _MISSING:
            return value
        value = make()
        key = id(obj)
        try:
            ref = weakref.ref(obj, lambda r, key=key: self._forget(key, r))
        except TypeError:  # not weak-referenceable: nothing can be remembered for it
            return value
        self._entries[key] = (ref, value)
        return value

    def _forget(self, key: int, ref) -> None:
        if self._entries.get(key, (None,))[0] is ref:
            del self._entries[key]


_MISSING = object()


class InUseError(RuntimeError):
    """An object is already used by another live generator."""


class Claims:
    """Which live generator uses which object."""

    def __init__(self):
        self._owners: dict[int, Any] = {}  # id(obj) -> weakref to the owning generator

    def check(self, obj, what: str) -> None:
        """Raise `InUseError` if a live, unfinished generator owns `obj`."""
        ref = self._owners.get(id(obj))
        owner = ref() if ref is not None else None
        if owner is None:
            return
        if not _alive(owner):
            del self._owners[id(obj)]
            return
        raise InUseError(
            f"this {what} is in use by another generator that has not finished; "
            f"finish or close() that one first, or give each generator its own {what}"
        )

    def take(self, obj, owner) -> None:
        """`owner` (a generator, or anything with a `settled` flag) uses `obj` until it
        finishes, is closed (settled) or dies.

        The owner keeps `obj` alive, so its id cannot be reused while the claim
        stands; the claim goes with the owner.
        """
        key = id(obj)
        self._owners[key] = weakref.ref(owner, lambda r, key=key: self._forget(key, r))

    def _forget(self, key: int, ref) -> None:
        if self._owners.get(key) is ref:
            del self._owners[key]


def _alive(owner) -> bool:
    if inspect.isgenerator(owner):
        return inspect.getgeneratorstate(owner) != inspect.GEN_CLOSED
    return not getattr(owner, "settled", False)
