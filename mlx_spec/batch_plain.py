"""Plain steps, pipelined as mlx-lm's `generate_step` and batch generator do.

When no row drafts this step (no drafter, or every row's policy parked drafting),
the step is one token per row. Such a step is built on the previous one's lazy
tokens and queued (`mx.async_eval`) before those tokens are read, so Python
builds step n+1 while MLX evaluates step n. A single row is the batch of one
(its own cache, any kind). The step in flight is used by the next `step` call
when the rows are unchanged and still plain; anything else first takes it back
(`land`: its checkpoint restores every layer, recurrent states included).

Rows qualify when nothing per step needs the host between their tokens: no
logits processors, no quantized cache, and a drafter that reads no target
hidden states (the n-gram drafter is told its tokens afterwards, as usual).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from .batch_cache import BatchCheckpoint, checkpoint, settled
from .cache import Checkpoint
from .overlap import overlapped
from .sampling import greedy_tokens
from .verify import Verdict, log_softmax


@dataclass
class Flight:
    """A batched plain step in flight."""

    uids: tuple  # the rows it was built for, in batch order
    tokens: mx.array  # [B] lazy: each row's next token
    logits: mx.array  # [B, V]
    ckpt: BatchCheckpoint | Checkpoint  # the cache before it (a single row's: Checkpoint)
    queued: float  # when MLX had it (perf_counter)


def eligible(row) -> bool:
    """Whether `row`'s plain steps can be queued ahead: no processors reading its tokens, no
    taps, and no `kv_bits` quantization still to come (`batch_cache.settled`: a row alone is
    checked before each step; rows merged into a batch are settled)."""
    drafter = row.drafter
    return (not row.req.logits_processors and (drafter is None or not drafter.taps)
            and (row.cache is None or settled(row.req, row.cache, 0, len(row.out))))


def launch(model, cache: list, rows: list, inputs: mx.array, later: int) -> Flight:
    """Queue one plain step of every row on `inputs` [B] (lazy or not): the row's step
    `steps + later` (its random stream is that step's, as a verify step's would be)."""
    ckpt = checkpoint(model, cache, len(rows))
    # Nothing in flight (later = 0): MLX is idle, so it evaluates the forward in pieces while
    # the rest is built; queued behind a step in flight, it is built whole (measured faster).
    queued = None
    if later == 0:
        with overlapped(model) as pieces:
            logits = model(inputs.reshape(-1, 1), cache=cache)[:, -1]  # [B, V]
        queued = pieces.at
    else:
        logits = model(inputs.reshape(-1, 1), cache=cache)[:, -1]
    if all(r.req.sampling.greedy for r in rows):
        tokens = greedy_tokens(logits)  # uint32
    else:
        draws = []
        for i, row in enumerate(rows):
            row.seed_rng(1, row.steps + later)
            draws.append(row.req.sampling.sample(logits[i]).astype(mx.uint32).reshape(()))
        tokens = mx.stack(draws)
    queued = queued or time.perf_counter()  # MLX had it from then on
    mx.async_eval(tokens)
    for row in rows:
        row.consumed += 1
    return Flight(tuple(r.uid for r in rows), tokens, logits, ckpt, queued)


def step(model, cache: list, rows: list, flight: Flight | None, ahead: bool) -> tuple[list, Flight | None, bool]:
    """This step's verdicts (one token per row), when `ahead` the next step in flight, and
    whether its time is a plain step's cost: only a step that launched one forward (its own,
    or the next while its own was in flight) is. One that launched two, or none, is not
    timed: where a launch's time goes depends on the backend (on MLX's CPU backend queueing
    a forward waits for the one queued before it; on a GPU it is only the graph's build)."""
    start, launched = time.perf_counter(), 0
    if flight is None or flight.uids != tuple(r.uid for r in rows):
        if flight is not None:
            land(flight, rows)
        flight = launch(model, cache, rows, mx.array([r.y for r in rows], mx.uint32), 0)
        launched += 1
    room = all(r.req.max_tokens is None or r.req.max_tokens - len(r.out) > 1 for r in rows)
    nxt = launch(model, cache, rows, flight.tokens, 1) if ahead and room else None
    launched += nxt is not None
    tic = max(start, flight.queued)
    tokens = flight.tokens.tolist()  # the one sync
    wait = time.perf_counter() - tic
    verdicts = []
    for i, row in enumerate(rows):
        row.sync_seconds += wait
        row.last = None  # a one-token block: nothing of it is ever taken back
        verdicts.append(Verdict([], 0, tokens[i], None, log_softmax(flight.logits[i : i + 1]), 0))
    return verdicts, nxt, launched == 1


def land(flight: Flight | None, rows: list) -> None:
    """Take a step in flight back out of the cache (before the batch changes or a row drafts)."""
    if flight is None:
        return
    flight.ckpt.restore()
    for row in rows:
        if row.uid in flight.uids:
            row.consumed -= 1


def plain_next_step(model, rows: list) -> bool:
    """Whether the next step will be plain too (so it can be queued now): no row drafts, or
    drafting is parked with no probe due by then (a lone row's own policy; a batch's is
    `batch_policy`'s). A wrong guess costs the step queued (taken back), never a token.
    On a sharded target an adaptive row never queues ahead: the guess rests on each rank's own
    timings, and a step queued on one rank and taken back would be a forward (with its
    collectives) the other ranks never ran."""
    from .adaptive import AdaptiveK
    from .batch_policy import plain_next
    from .distributed import shard_of

    if shard_of(model) is not None and any(isinstance(r.lengths, AdaptiveK) for r in rows):
        return False
    if len(rows) > 1:
        return plain_next(model, [r.lengths for r in rows])
    return all(not isinstance(r.lengths, AdaptiveK) or r.lengths.parked_next() for r in rows)
