"""Draft trees from a block drafter's per-position distributions (DDTree-style).

A block drafter (DFlash, DSpark without a Markov head) gives, in one forward, a
distribution q_j for each of the next k positions, each independent of the tokens
drafted before it. Under that factorised block distribution a prefix
(t_1 .. t_d) has log-probability  s(t_1 .. t_d) = sum_{j <= d} log q_j(t_j).
DDTree (Ringel & Romano 2026, "Accelerating Speculative Decoding with Block
Diffusion Draft Trees", arXiv 2604.12989) verifies the `budget` most likely
prefixes as one tree. Since every log q_j <= 0, a prefix never scores above its
own parent, so those prefixes form a tree (each one's parent is among them).

How it is found here:

* on device: the top-B tokens of each row and their log-probabilities,
  B = min(budget, V) (a node of the best `budget` never uses a token ranked
  below `budget` at its position: the prefixes that swap it for a better one
  all score higher);
* one host read of that [k, B] table (`mx.eval` in `best_prefixes`'s caller):
  the step's extra host sync, on top of the verify's own;
* on the host: a best-first enumeration. Prefixes are rank tuples; the best
  one is (0,); popping a prefix pushes its next sibling (last rank + 1) and
  its first child (rank 0 one position deeper). Each prefix is pushed once,
  by one parent, and never scores above the prefix that pushed it, so the
  pops come out in order of score and the first `budget` pops are the answer.

The tree is laid out in `mlx_spec.tree`'s format: breadth-first, a node's
children in rank order (so its first branch is the block's argmax chain, as far
as the budget reaches), distinct sibling tokens (distinct ranks of one row).
Its nodes are point masses to the verifier (`Draft.q` is None): the walk
(SpecInfer's multi-candidate rule) is lossless whatever the tokens are.
"""

from __future__ import annotations

import heapq
import logging
import math

import mlx.core as mx
import numpy as np

from .. import tree
from ..cache import MAX_DRAFT, make_cache
from ..request import whole
from ..sampling import Sampling
from .base import Draft


def check_budget(tree_budget) -> int | None:
    """`tree_budget` as given (None: chains), or a ValueError saying what is allowed."""
    if tree_budget is None:
        return None
    if not whole(tree_budget) or not 1 <= tree_budget <= MAX_DRAFT:
        raise ValueError(f"tree_budget must be an integer in 1..{MAX_DRAFT} (the tree's nodes, "
                         f"verified in one forward) or None for chains, got {tree_budget!r}")
    return tree_budget


log = logging.getLogger("mlx_spec")
_said_chains: list = []  # the chains-instead-of-trees note is given once a process


def tree_verifiable(model) -> bool:
    """Whether the target can verify a draft tree in one forward (`tree.tree_capable`). When it
    cannot (recurrent or sliding-window layers, positions outside the ropes) the block drafter drafts chains,
    said once a process."""
    if tree.tree_capable(make_cache(model), model):
        return True
    if not _said_chains:
        _said_chains.append(True)
        log.info("this target cannot verify draft trees (recurrent or sliding-window layers, or "
                 "positions its ropes do not alone place); the block drafter drafts chains instead")
    return False


def block_logprobs(logits: mx.array, sampling: Sampling) -> mx.array:
    """[k, V] scores: greedy, the block's own log-softmax; sampling, the log of the
    tempered, filtered distribution the target is sampled from (-inf where filtered out)."""
    if sampling.greedy:
        logits = logits.astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.log(sampling.probs(logits))


def top_table(logprobs: mx.array, width: int) -> tuple[mx.array, mx.array]:
    """(values, token ids), [k, width] each, best first per row; lazy, on device."""
    width = min(width, logprobs.shape[-1])
    idx = mx.argpartition(-logprobs, kth=width - 1, axis=-1)[:, :width]
    vals = mx.take_along_axis(logprobs, idx, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(vals, order, axis=-1), mx.take_along_axis(idx, order, axis=-1)


def best_prefixes(values: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """The `budget` best rank prefixes of a [k, B] table (rows sorted best first), best first.

    A prefix (r_1 .. r_d) scores sum_j values[j - 1, r_j]; -inf entries are never taken.
    """
    k, width = values.shape
    out: list[tuple[int, ...]] = []
    if k == 0 or width == 0 or not math.isfinite(values[0, 0]):
        return out
    heap = [(-float(values[0, 0]), (0,))]  # ties: the lexicographically smaller ranks first
    while heap and len(out) < budget:
        neg, ranks = heapq.heappop(heap)
        out.append(ranks)
        d, r = len(ranks), ranks[-1]
        base = neg + float(values[d - 1, r])  # minus the parent's score
        if r + 1 < width and math.isfinite(values[d - 1, r + 1]):
            heapq.heappush(heap, (base - float(values[d - 1, r + 1]), ranks[:-1] + (r + 1,)))
        if d < k and math.isfinite(values[d, 0]):
            heapq.heappush(heap, (neg - float(values[d, 0]), ranks + (0,)))
    return out


def layout(prefixes: list[tuple[int, ...]], ids: np.ndarray) -> tuple[list[int], tuple[int, ...]]:
    """Rank prefixes (closed under taking parents) -> (tokens, parents), breadth-first,
    each node's children in rank order; `ids[j, r]` is the token of rank r at position j."""
    ordered = sorted(prefixes, key=lambda p: (len(p), p))  # by depth, then parent, then rank
    index: dict[tuple[int, ...], int] = {}
    tokens, parents = [], []
    for p in ordered:
        index[p] = len(tokens)
        tokens.append(int(ids[len(p) - 1, p[-1]]))
        parents.append(-1 if len(p) == 1 else index[p[:-1]])
    return tokens, tuple(parents)


def propose_tree(logits: mx.array, sampling: Sampling, budget: int, depth: int | None = None,
                 to_target=None) -> Draft:
    """A DDTree draft of at most `budget` nodes from block logits [k, V] (row j: position j + 1).

    `depth` (a lazy scalar, e.g. a confidence cut) caps the tree's depth; it is read in the
    same host sync as the table. `to_target` maps drafted ids to target ids (a reduced draft
    vocabulary). The one host sync is the `mx.eval` below.
    """
    vals, ids = top_table(block_logprobs(logits, sampling), budget)
    if to_target is not None:
        ids = to_target(ids)
    read = [vals, ids] + ([] if depth is None else [depth])
    mx.eval(*read)  # the step's extra host sync: a [k, B] table (and the cut)
    values, ids_np = np.array(vals, np.float64), np.array(ids)
    if depth is not None:
        values = values[: int(depth.item())]
    tokens, parents = layout(best_prefixes(values, budget), ids_np)
    if not tokens:
        return Draft(mx.array([], mx.uint32))
    return Draft(mx.array(tokens, mx.uint32), parents=parents)
