"""Choices a sharded target's ranks must make alike, though each rank's timings differ: the
draft lengths, a request's random seed, a mixed drafter's source, the verify cost curve. Rank 0
decides and the others take its choice (small collectives); unsharded, each is a no-op."""

from __future__ import annotations

import secrets

import mlx.core as mx

from . import distributed


def broadcast_ints(group, values: list[int]) -> list[int]:
    """Rank 0's `values` on every rank (one small all_sum)."""
    mine = mx.array(values if group.rank() == 0 else [0] * len(values), mx.int32)
    return mx.distributed.all_sum(mine, group=group).tolist()


def agree_lengths(model, choices: list[tuple[int, float | None]]) -> list[tuple[int, float | None]]:
    """Rank 0's draft lengths for this step on every rank (a no-op unsharded)."""
    shard = distributed.shard_of(model)
    if shard is None:
        return choices
    ks = broadcast_ints(shard.group, [k for k, _ in choices])
    return [(k, gain) for k, (_, gain) in zip(ks, choices)]


def agree_seed(model) -> int | None:
    """On a sharded target, a random seed drawn by rank 0, the same on every rank (ranks that
    sampled with seeds of their own would each draw other tokens); None unsharded."""
    shard = distributed.shard_of(model)
    if shard is None:
        return None
    hi, lo = broadcast_ints(shard.group, [secrets.randbits(31), secrets.randbits(31)])
    return hi << 31 | lo


def agree_sources(model, drafters: list) -> None:
    """Rank 0's choice of source this step for each mixed drafter (`MixedDrafter.only`: prompt
    lookup or the draft model, weighed from each rank's own timings) on every rank, so every
    rank verifies the same draft (a no-op unsharded)."""
    shard = distributed.shard_of(model)
    mixed = [d for d in drafters if hasattr(d, "free_member")]  # (the same rows on every rank)
    if shard is None or not mixed:
        return
    names = (None, "free", "paid")
    for d, code in zip(mixed, broadcast_ints(shard.group, [names.index(d.only) for d in mixed])):
        d.only = names[code]


def agreed_curve(model, local: list[float] | None, measure) -> list[float] | None:
    """The verify cost curve every rank uses: measured by all ranks together when any
    lacks it (each measured forward involves every rank), then rank 0's."""
    shard = distributed.shard_of(model)
    if shard is None:
        return local if local is not None else measure()
    # A rank's own curve counts only when it has rank 0's length (another version's, say, does not).
    first = broadcast_ints(shard.group, [-1 if local is None else len(local)])[0]
    mine = local is not None and len(local) == first
    have = mx.distributed.all_sum(mx.array(int(mine)), group=shard.group).item()
    times = local if have == shard.size else measure()
    n = broadcast_ints(shard.group, [len(times)])[0]  # rank 0's length: every rank sums n numbers
    sent = mx.array(times if shard.rank == 0 else [0.0] * n, mx.float32)
    return mx.distributed.all_sum(sent, group=shard.group).tolist()
