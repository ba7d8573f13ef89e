"""How much of a draft tree a step verifies: the whole tree, a part of it, or its first branch.

`shaped(model, draft, row, cache, width)` is what the batch loop calls on every row's draft:
a tree is verified as one when this step can (plain KV layers, ropes that place a position
per row in a batch, no logits processors), cut to the shape `auto` picked (`ShapeChoice`,
kept with the row's draft-length policy); otherwise its first branch is, as a chain.
"""

from __future__ import annotations

import logging

from . import tree
from .adaptive import AdaptiveK

log = logging.getLogger("mlx_spec")
_said_chains: list = []  # the chains-instead-of-trees note is given once a process


def shaped(model, draft, row, cache: list, width: int):
    """The part of `draft` that this step verifies (module docstring)."""
    if draft.parents is None or tree.is_chain(draft.parents):
        return draft if draft.parents is None else tree.as_chain(draft)
    if verifies_trees(model, row, cache, width):
        if not isinstance(row.lengths, AdaptiveK) or row.shape_pick is not None:
            return draft  # a fixed k: the shape asked for; or auto's, drafted as picked
        shape = pick(model, row)  # (makes the policy's ShapeChoice on first use)
        return row.lengths.shapes.apply(draft, shape)
    if not _said_chains:
        _said_chains.append(True)
        log.info("draft trees need a target with plain KV caches, ropes that alone place positions "
                 "(in a batch, a position per row) and no logits processors; verifying their "
                 "first branch as a chain instead")
    return tree.as_chain(draft)


def verifies_trees(model, row, cache: list, width: int) -> bool:
    """Whether this step can verify a tree for `row` in a batch of `width` rows."""
    return tree.tree_capable(cache, model, batch=width > 1) and not row.req.logits_processors


def pick(model, row) -> int:
    """auto: how much of the tree, by what each shape has paid (on a sharded target every
    rank takes rank 0's pick: timed choices may differ between ranks). Kept as
    `row.shape_pick` until the step's outcome is observed."""
    from .agreed import agree_lengths

    policy = row.lengths  # (its ShapeChoice carries over to the next request, as its tables do)
    policy.shapes = policy.shapes or ShapeChoice()
    row.shape_pick = agree_lengths(model, [(policy.shapes.pick(), None)])[0][0]
    return row.shape_pick


class ShapeChoice:
    """Per draft-length policy: how much of a drafter's tree to verify: all of it, its first half or
    quarter of nodes (breadth-first, parents first: still a tree), or only its first branch
    (a chain), whichever has given more tokens per second of step: for a request decoded alone
    with a timed policy, the step's wall time, its drafting included (a tree's draft forwards
    run over several rows, and a drafter that plans its trees, `PlansTrees`, drafts only the
    shape picked); otherwise the draft-length policy's predicted cost (seeded runs repeat).
    Each shape is tried once first, then every `EXPLORE`-th step one of the others, in turn,
    so a change in what pays is noticed. What the shapes gave is kept with the policy
    (`learned`): the next request, and the next process, start from it."""

    SHAPES = (1, 2, 4, 0)  # verify the first 1/s of the tree's nodes; 0: its first branch
    EXPLORE, EMA = 8, 0.2

    def __init__(self):
        self.rate: dict[int, float | None] = dict.fromkeys(self.SHAPES)
        self.picks = 0

    @classmethod
    def known(cls, rates: dict[int, float]) -> ShapeChoice:
        """One that starts from the rates an earlier process measured (unknown shapes: untried)."""
        new = cls()
        new.rate.update({s: r for s, r in rates.items() if s in new.rate and r > 0})
        return new

    def pick(self) -> int:
        self.picks += 1
        untried = [s for s in self.SHAPES if self.rate[s] is None]
        if untried:
            return untried[0]
        ranked = sorted(self.SHAPES, key=lambda s: -self.rate[s])  # ties: the wider first
        if self.picks % self.EXPLORE:
            return ranked[0]
        return ranked[1 + self.picks // self.EXPLORE % (len(ranked) - 1)]

    @staticmethod
    def apply(draft, shape: int):
        """The part of tree `draft` that `shape` verifies."""
        if shape > 1:
            draft = tree.first_nodes(draft, -(-draft.size // shape))
        return draft if shape and not tree.is_chain(draft.parents) else tree.as_chain(draft)

    def observe(self, shape: int, tokens: int, seconds: float) -> None:
        r, old = tokens / max(seconds, 1e-12), self.rate[shape]
        self.rate[shape] = r if old is None else old + self.EMA * (r - old)
