"""A sharded server's ranks in lockstep: rank 0 decides, every rank does the same.

Every rank of a sharded target must run the same forwards in the same order. On
a server, what runs next depends on things only rank 0 sees (requests arriving,
clients leaving, stop strings in the text it sends). So before each step of its
engine loop, rank 0 sends its *plan*, the decisions the step depends on, and
every rank (rank 0 included) applies the plan it received, then steps:

* which rows end, with how many tokens of their last block the client saw (the
  prompt cache keeps exactly those);
* which requests join: prompt ids, sampling options (logits processors as the
  keywords that made them), whether the drafter runs, and the seed of their
  random stream (rank 0 draws it for unseeded requests);
* whether the server is closing (every rank then leaves its loop and exits).

The plan travels as JSON bytes in two `all_sum`s to which the other ranks add
zeros: its length (every step, one int32), then the bytes (only when there is
something to say). An idle rank 0 sends an empty plan every `HEARTBEAT` seconds,
so a waiting rank can tell a quiet server from a dead one (the watchdog).

Prompt caches are fetched on every rank, and each rank's store holds its own
layers' caches, so stores can differ (bytes per rank differ, hence evictions);
`agree_fetch` makes every rank continue from the same number of cached tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from .. import watchdog

HEARTBEAT = 1.0  # seconds between empty plans while the server is idle
ROUNDS = 8  # fetch agreements tried before every rank starts from an empty cache


@dataclass
class Plan:
    """What happens before a step: rows that end (uid, reason, error, seen), requests that join
    (job, prompt, options, use_drafter, seed), and whether the server closes. Sharded, rank 0
    sends it (`wire`) and the other ranks apply what they receive (server/link.py)."""

    ends: list = field(default_factory=list)
    admits: list = field(default_factory=list)
    closing: bool = False
    messages: list = field(default_factory=list)  # the admits as sent to the other ranks

    def wire(self) -> dict | None:
        if not (self.ends or self.admits or self.closing):
            return None
        return {"e": [[uid, -1 if seen is None else seen] for uid, _, _, seen in self.ends],
                "a": self.messages, "c": int(self.closing)}

    @classmethod
    def from_wire(cls, wire: dict) -> Plan:
        ends = [(uid, None, None, None if seen < 0 else seen) for uid, seen in wire.get("e", ())]
        return cls(ends, [(None, *admitted(m)) for m in wire.get("a", ())], bool(wire.get("c")))


class Link:
    def __init__(self, group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.steps = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def exchange(self, plan: dict | None) -> dict:
        """Rank 0's `plan` on every rank ({} when it has nothing to say)."""
        import mlx.core as mx

        self.steps += 1
        watchdog.beat(f"server step {self.steps}")
        data = json.dumps(plan, separators=(",", ":")).encode() if self.leader and plan else b""
        n = int(mx.distributed.all_sum(mx.array([len(data)], mx.int32), group=self.group).item())
        if n == 0:
            return {}
        mine = np.frombuffer(data, np.uint8).astype(np.int32) if self.leader else np.zeros(n, np.int32)
        got = mx.distributed.all_sum(mx.array(mine), group=self.group)
        return json.loads(np.array(got).astype(np.uint8).tobytes())

    def agree_fetch(self, store, prompt: list[int]) -> tuple[list, int]:
        """(cache, n) from `store` with the same n on every rank: the smallest any rank has."""
        import mlx.core as mx

        cache, n = store.fetch(prompt)
        for _ in range(ROUNDS):
            got = mx.distributed.all_gather(mx.array([n], mx.int32), group=self.group).tolist()
            low = min(got)
            if low == max(got):
                return cache, n
            if n != low:  # a private copy: dropped; another one trimmed to the agreed length
                cache, n = store.fetch(prompt, limit=low)
        return store.fetch(prompt, limit=0)


def admit_message(job, seed: int) -> dict:
    """What the other ranks need to start `job` as rank 0 does."""
    options = dict(job.options)
    procs = options.pop("logits_processors", None)
    if procs:
        recipe = getattr(procs, "recipe", None)
        if recipe is None:
            raise ValueError("a sharded server can only send logits processors it made itself "
                             "(logit_bias and the penalties)")
        options["logits_processors"] = {k: ({str(t): b for t, b in v.items()} if k == "logit_bias" and v
                                             else v) for k, v in recipe.items()}
    return {"p": list(job.prompt), "o": options, "d": bool(job.use_drafter), "s": seed}


def admitted(message: dict) -> tuple[list[int], dict, bool, int]:
    """(prompt, options, use_drafter, seed) of an `admit_message`."""
    options = dict(message["o"])
    recipe = options.pop("logits_processors", None)
    if recipe:
        from mlx_lm.sample_utils import make_logits_processors

        if recipe.get("logit_bias"):
            recipe["logit_bias"] = {int(t): b for t, b in recipe["logit_bias"].items()}
        options["logits_processors"] = make_logits_processors(**recipe)
    return message["p"], options, message["d"], message["s"]
