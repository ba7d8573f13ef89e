"""Evaluate a forward in pieces while the rest of it is still being built.

Building a step's graph is host work: Python per layer, a few milliseconds for
a 30-layer model. A speculative step cannot be built before the last one's
result is read (its inputs and cache offsets depend on what was accepted), so
unlike plain decoding it cannot hide that work behind the previous step. It
can hide most of it behind itself: `overlapped(model)` wraps every few decoder
layers of the model *instance* for one forward, and each wrapper queues its
output for evaluation (`mx.async_eval`) as soon as it is built, so MLX
evaluates layers 0..j while Python builds layer j+1 onwards. The values are
untouched (the same operations in the same order; random draws are fixed when
the graph is built, not when it is evaluated); only when they run changes.

The wrappers are removed as soon as the graph is built, so the model's
parameter tree is never seen with them. The context yields a `Queued` whose
`at` says when the first piece was queued: from then on MLX had this step's
work to do (`stats.host_ms_per_step`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import mlx.core as mx

from .taps import SeeThrough, decoder_stack

PIECES = 8  # pieces per forward: more hides more building, each costs one async_eval


class Queued:
    at: float | None = None  # perf_counter() when the first piece was queued


class _Kick(SeeThrough):
    """Calls the wrapped layer and queues its output for evaluation."""

    def __init__(self, inner, queued: Queued):
        super().__init__(inner)
        self.queued = queued  # a plain object: not a parameter

    def __call__(self, x, *args, **kwargs):
        out = self.inner(x, *args, **kwargs)
        mx.async_eval(out[0] if isinstance(out, tuple) else out)
        if self.queued.at is None:
            self.queued.at = time.perf_counter()
        return out


@contextmanager
def overlapped(model, pieces: int | None = None):
    """For the forwards built inside: every ceil(layers / pieces)-th decoder layer of `model`
    queues its output as soon as it is built. Models without a layer list run as they are."""
    queued, pieces = Queued(), PIECES if pieces is None else pieces
    if pieces < 1:
        yield queued
        return
    try:
        layers = decoder_stack(model).layers
    except ValueError:
        yield queued
        return
    every = max(1, -(-len(layers) // pieces))
    saved = [(i, layers[i]) for i in range(every - 1, len(layers), every)]
    try:
        for i, layer in saved:
            layers[i] = _Kick(layer, queued)
        yield queued
    finally:
        for i, layer in saved:
            layers[i] = layer
