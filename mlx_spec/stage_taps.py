"""Taps across pipeline stages: every rank gets the hidden states of layers held by others.

On a pipeline split each decoder layer runs on exactly one rank, but a head drafter
(EAGLE, DFlash, DSpark, some MTP) is replicated on every rank and must read the same
tap tensors everywhere to propose the same tokens. `StageTaps` (one per sharded
model, `Shard.taps`) keeps the layer taps that live `Taps` read, in the order they
were asked for (the same on every rank: the drafters are replicated). In each
forward every rank contributes the rows of the taps it holds and zeros for the
others, concatenated along the feature axis, to one `all_sum` (exact: x + 0 = x):

* with mlx-spec's stage wrappers the taps ride on the `all_sum` that already brings
  the last stage's hidden state to every rank (`ride`): no extra message, only a
  wider one ([B, T, H * (1 + taps)]);
* with mlx-lm's own `pipeline()` (whose last message is its `all_gather`) a wrapper
  on the final norm adds one `all_sum` after it (`GatherAtNorm`), ordered after the
  norm's input so that every rank runs its collectives in the same order.

The whole block's rows travel: which rows the verify keeps is known only after
acceptance, which needs the logits of this very forward.
"""

from __future__ import annotations

import mlx.core as mx

from .taps import SeeThrough


class StageTaps:
    def __init__(self, group, stats):
        self.group, self.stats = group, stats
        self.entries: list[list] = []  # [tap id, users, (recorder, slot) on the owning rank or None]
        self.values: dict = {}  # tap id -> [B, T, H] of the last forward, on every rank

    def add(self, tid, source) -> None:
        for entry in self.entries:
            if entry[0] == tid:
                entry[1] += 1
                return
        self.entries.append([tid, 1, source])

    def drop(self, tid) -> None:
        for entry in self.entries:
            if entry[0] == tid:
                entry[1] -= 1
                if not entry[1]:
                    self.entries.remove(entry)
                    self.values.pop(tid, None)
                return

    def _parts(self, like: mx.array) -> list:
        return [getattr(src[0].seen, src[1]) if src else mx.zeros_like(like)
                for _, _, src in self.entries]

    def _keep(self, summed: mx.array, width: int, skip: int) -> None:
        self.values = {tid: summed[..., (i + skip) * width:(i + skip + 1) * width]
                       for i, (tid, _, _) in enumerate(self.entries)}

    def ride(self, mine: mx.array) -> mx.array:
        """The `all_sum` of `mine` over the ranks, with this forward's taps alongside."""
        self.stats.message()
        if not self.entries:
            return mx.distributed.all_sum(mine, group=self.group)
        width = mine.shape[-1]
        summed = mx.distributed.all_sum(mx.concatenate([mine, *self._parts(mine)], axis=-1),
                                        group=self.group)
        self._keep(summed, width, 1)
        return summed[..., :width]

    def gather_after(self, h: mx.array) -> mx.array | None:
        """One `all_sum` of the taps, ordered after `h` (the final norm's input); None
        when no tap is read."""
        if not self.entries:
            return None
        self.stats.message()
        mine = mx.depends(mx.concatenate(self._parts(h), axis=-1), h)
        summed = mx.distributed.all_sum(mine, group=self.group)
        self._keep(summed, h.shape[-1], 0)
        return summed


class GatherAtNorm(SeeThrough):
    """The final norm of a target split by mlx-lm's `pipeline()`: gathers the layer taps
    right after the forward's own last message, within the forward (the logits depend
    on it, so every rank evaluates it at the same point)."""

    def __init__(self, inner, taps: StageTaps):
        super().__init__(inner)
        self._taps = taps

    def __call__(self, h, *args, **kwargs):
        out = self.inner(h, *args, **kwargs)
        summed = self._taps.gather_after(h)
        return out if summed is None else mx.depends(out, summed)
