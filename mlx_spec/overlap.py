"""Evaluate a forward in pieces while the rest of it is still being built.

Building a step's graph is host work: Python per layer, a few milliseconds for
a 30-layer model. A speculative step cannot be built before the last one's
result is read (its inputs and cache offsets depend on what was accepted), so
unlike plain decoding it cannot hide that work behind the previous step. It
can hide most of it behind itself: `overlapped(model)` wraps the decoder layers
of the model *instance* (each, by default) for one forward; each wrapper queues its
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
import weakref
from contextlib import contextmanager

import mlx.core as mx

from .taps import SeeThrough, decoder_stack

# Decoder layers per piece (0: build the whole forward, then evaluate). One layer is a few
# dozen operations, under the number MLX's CPU backend keeps queued before `async_eval`
# waits; in the GPU-like regime (scripts/overhead.py) a k = 4 n-gram step took 1.18x
# mlx-lm's plain step with a piece per layer, 1.36x with 8 pieces of 4 layers, 1.28x whole.
EVERY = 1


class Queued:
    at: float | None = None  # perf_counter() when the first piece was queued


class _Kick(SeeThrough):
    """Calls the wrapped layer and queues its output for evaluation."""

    def __init__(self, inner, clock: list):
        super().__init__(inner)
        self.clock = clock  # [the forward's Queued], shared by a stack's wrappers

    def __call__(self, x, *args, **kwargs):
        out = self.inner(x, *args, **kwargs)
        queued = self.clock[0]
        if queued.at is None:
            queued.at = time.perf_counter()
        # Returns at once unless MLX already has many operations queued: then it waits for
        # some to finish, which is time the evaluator was busy, not host time.
        mx.async_eval(out[0] if isinstance(out, tuple) else out)
        return out


# id(stack) -> (weak reference to it, every, the layers wrapped, the layer list with the
# wrappers in, their clock): one list swap per forward, reused step after step while the
# layers stay the same; the entry goes when the stack does (the weak reference's callback),
# so a dropped model takes its wrappers with it.
_kicks: dict[int, tuple] = {}


def _kicked(stack, layers: list, every: int, queued: Queued) -> list:
    key, entry = id(stack), _kicks.get(id(stack))
    if (entry is None or entry[0]() is not stack or entry[1] != every or len(entry[2]) != len(layers)
            or any(a is not b for a, b in zip(entry[2], layers))):
        first = {0, *range(every - 1, len(layers), every)}  # layer 0 too: the exposed build is small
        clock = [queued]
        entry = _kicks[key] = (weakref.ref(stack, lambda _, key=key: _kicks.pop(key, None)), every,
                               list(layers), [_Kick(m, clock) if i in first and m is not None else m
                                              for i, m in enumerate(layers)], clock)  # (None: another stage's)
    entry[4][0] = queued
    return entry[3]


_step: list[Queued | None] = [None]  # the step being built, when one is open


@contextmanager
def step_clock():
    """One decode step (a drafter's forwards and the verify): every `overlapped` forward
    inside reports to the same `Queued`, so `at` is when the step's first piece was queued."""
    _step[0] = Queued()
    try:
        yield _step[0]
    finally:
        _step[0] = None


@contextmanager
def overlapped(model, every: int | None = None):
    """For the forwards built inside: the first and every `every`-th decoder layer of `model`
    queue their output as soon as it is built. Models without a layer list run as they are."""
    queued, every = _step[0] or Queued(), EVERY if every is None else every
    if every < 1:
        yield queued
        return
    try:
        stack = decoder_stack(model)
        layers = stack.layers
    except ValueError:
        yield queued
        return
    if isinstance(getattr(type(stack), "layers", None), property):  # e.g. GPT-2's view of `model.h`
        yield queued
        return
    kicked = _kicked(stack, layers, every, queued)
    stack.layers = kicked  # the instance's list, for this forward
    try:
        yield queued
    finally:
        stack.layers = layers
