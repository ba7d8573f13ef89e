"""Draft trees: several candidate continuations verified in one target forward.

A tree draft is `Draft(tokens, parents=...)`: node j has token `tokens[j]` and
parent `parents[j]` (-1: the root, which is y, the next input), listed in
breadth-first order (parents before children, each depth in one run). The
verify forward feeds `[y, node 0 .. node N-1]`:

* every node attends to the cached context, to its ancestors and to itself
  (`TreeCache.make_mask`: the mask path every mlx-lm model already takes);
* every node sits at position `offset + depth` (`DepthRoPE` wraps the rope
  instances of the model for the one forward: the positions a chain through
  that node would give it);

so row j of the logits is exactly what a forward over the path to node j
would give. After acceptance the kept path's cache rows are gathered into
place and the rest dropped (`compact`). A chain is the tree whose parents are
-1, 0, 1, ...: it needs neither wrapper, and its compaction is a trim.

Acceptance (`walk`): at the current node u with children c_1 .. c_m, greedy moves to the
child equal to argmax p_u. Sampling is recursive rejection sampling (SpecInfer, Miao et al.
2023, arXiv 2305.09781; without replacement as in Jeon et al. 2024, arXiv 2402.14160): with
P = p_u, the children are tried in order; c_i was drawn from its Q_i (`Draft.q`; a point
mass on c_i when q is None) and is accepted with probability min(1, P(c_i) / Q_i(c_i));
when it is rejected, P becomes max(P - Q_i, 0) renormalised. When none is accepted the
next token is drawn from the last P, and a node without children draws the bonus from p_u.
Each step is a speculative-sampling step of P against Q_i, so the token emitted after u is
distributed exactly as p_u whenever every c_i is a draw from its Q_i given the tokens above
it and its earlier siblings: for a point mass, whatever the token is (a token repeated among
the children then has P = 0 and is never taken twice). So the output is the target's.
"""

from __future__ import annotations

import logging
from typing import Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

from .identity import IdentityMap
from .sampling import greedy_tokens

log = logging.getLogger("mlx_spec")


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (children of the root: 1)."""
    out: list[int] = []
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"tree node {j} has parent {p}: parents must come first (breadth-first order)")
        out.append(1 if p < 0 else out[p] + 1)
    if any(b < a for a, b in zip(out, out[1:])):
        raise ValueError("tree nodes must be listed depth by depth (breadth-first order)")
    return out


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == j - 1 for j, p in enumerate(parents))


def ancestry(parents: Sequence[int]) -> np.ndarray:
    """[N+1, N+1] booleans: row i may attend to column j (j is i or an ancestor; 0 is the root)."""
    n = len(parents) + 1
    mask = np.eye(n, dtype=bool)
    mask[:, 0] = True
    for j, p in enumerate(parents, 1):
        mask[j] |= mask[p + 1]
    return mask


def tree_capable(cache: list, model, batch: bool = False) -> bool:
    """Whether a tree can be verified on this cache: plain KV layers (gathered after
    acceptance), one row's or a batch's (`batch`: `BatchKVCache`, when the model's ropes take a
    position per row: `DepthRoPE`), of a model whose tree nodes its ropes can place."""
    if not cache or not places_nodes(model):
        return False
    if all(type(c) is KVCache for c in cache):
        return True
    return (batch and all(type(c) is BatchKVCache for c in cache)
            and all(type(m[k]) in _ARRAY_OFFSET_ROPES for m, k in _ropes(model)))


# Models whose forward reads positions outside their ropes (attention scaled by position:
# Llama 4's temperature tuning, Ministral 3 / Mistral 4's llama_4_scaling_beta), so a tree
# node would be scaled for its place in the block rather than its depth.
_POSITION_SCALED = ("llama4", "ministral3", "mistral4")
_PLACES = IdentityMap()  # model -> [whether ropes place its tree nodes, and nothing else reads positions]


def places_nodes(model) -> bool:
    """Whether `DepthRoPE` puts every tree node of `model` at its depth: the model has rope
    modules (no learned position embeddings) and no position terms outside them."""
    def judge():
        args = getattr(model, "args", None)
        scaled = getattr(args, "model_type", None) in _POSITION_SCALED or any(
            "llama_4_scaling_beta" in (getattr(a, "rope_parameters", None) or {})
            for a in (args, getattr(args, "text_config", None)) if a is not None and not isinstance(a, dict))
        if scaled:
            log.info("%s scales attention by position outside its ropes: its draft trees are verified "
                     "as chains", type(model).__module__)
        return [bool(_ropes(model)) and not scaled]

    return _PLACES.setdefault(model, judge)[0]


class LayerView:
    """A KV layer seen through a wrapper for one forward: what the wrapper does not change,
    read or written, is the layer's (mlx-lm's pipeline stages tie `keys` to their sends)."""

    def __init__(self, inner):
        object.__setattr__(self, "inner", inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)

    def update_and_fetch(self, keys, values):
        return self.inner.update_and_fetch(keys, values)


class TreeCache(LayerView):
    """A KV layer seen through a tree block: the model's mask is the tree's. `mask` is [N, W]
    for one row, or [B, N, W] for the rows of a batch cache (`BatchKVCache`: each row also
    never sees its own left padding)."""

    def __init__(self, inner: KVCache, mask: mx.array):
        super().__init__(inner)
        object.__setattr__(self, "_mask", mask)

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """The block's N rows see every cached position before the tree's own columns (the
        mask's last W: earlier tree rows already in the cache, then the block) in full."""
        if window_size is not None:
            raise ValueError("tree blocks do not support sliding-window layers")
        if self._mask.ndim == 3:  # a batch: [B, 1, N, columns]
            c = self.inner
            cols = mx.arange(c._idx + N - self._mask.shape[2])[None]
            before = mx.broadcast_to((cols >= c.left_padding[:, None])[:, None, :],
                                     (self._mask.shape[0], N, cols.shape[1]))
            return mx.concatenate([before, self._mask], axis=2)[:, None]
        before = mx.ones((N, self.inner.offset + N - self._mask.shape[1]), mx.bool_)
        return mx.concatenate([before, self._mask], axis=1)


class DepthPlan:
    """What every layer's `DepthRoPE` needs about a block's node depths, built once a forward:
    one list (one row), or a list per row of a batch."""

    def __init__(self, depths_: list):
        self.depths = mx.array(depths_, mx.int32)
        if self.depths.ndim == 2:  # a batch: ropes with a position per row only
            self.groups = self.order = self.unorder = None
            return
        order = sorted(range(len(depths_)), key=depths_.__getitem__)
        groups, start = [], 0
        for d in sorted(set(depths_)):
            end = start + depths_.count(d)
            groups.append((d, start, end))
            start = end
        self.groups = groups
        self.order, self.unorder = mx.array(order), mx.array(sorted(range(len(order)), key=order.__getitem__))


class DepthRoPE:
    """A rope instance applying position `offset + depth` to each node of a tree block: the
    nodes become a batch of one-token rows, rotated by one call with per-row offsets where
    the rope takes an array offset (MLX's own and mlx-lm's scaled ropes), else one call per
    depth."""

    def __init__(self, inner, plan: DepthPlan):
        self.inner, self.plan = inner, plan
        self.per_row = type(inner) in _ARRAY_OFFSET_ROPES

    def __call__(self, x, offset=0):
        B, H, n, D = x.shape
        plan = self.plan
        rows = x.transpose(2, 0, 1, 3).reshape(n * B, H, 1, D)  # node-major, then batch
        if plan.depths.ndim == 2:  # a batch ([B, n] depths, [B] offsets), node-major like `rows`
            out = self.inner(rows, offset=(plan.depths.T + offset).reshape(-1))
        elif self.per_row:
            out = self.inner(rows, offset=mx.repeat(plan.depths + offset, B))
        else:
            rows = rows.reshape(n, B, H, 1, D)[plan.order].reshape(n * B, H, 1, D)
            parts = [self.inner(rows[s * B : e * B], offset=offset + d) for d, s, e in plan.groups]
            out = mx.concatenate(parts).reshape(n, B, H, 1, D)[plan.unorder]
        return out.reshape(n, B, H, D).transpose(1, 2, 0, 3)


def _array_offset_ropes() -> tuple:
    import mlx.nn as nn
    from mlx_lm.models import rope_utils

    names = ("Llama3RoPE", "YarnRoPE", "SuScaledRoPE")
    return (nn.RoPE, *(getattr(rope_utils, n) for n in names if hasattr(rope_utils, n)))


_ARRAY_OFFSET_ROPES = _array_offset_ropes()


def _ropes(model) -> list[tuple[object, str]]:
    return [(m, "rope") for _, m in model.named_modules() if "rope" in m and callable(m["rope"])]


def forward(model, cache: list, inputs: mx.array, parents: Sequence[int]) -> mx.array:
    """Logits [N+1, V] of a tree block `inputs` = [y, nodes...] (lazy)."""
    return forward_block(model, cache, inputs, mx.array(ancestry(parents)), [0] + depths(parents))


def forward_block(model, cache: list, inputs: mx.array, mask: mx.array, shifts: list[int]) -> mx.array:
    """Logits [N, V] of N tokens appended to `cache` (lazy): row i attends to what `mask[i]`
    ([N, W] booleans, may be lazy) allows among the cache's last W positions (the block's
    included) and to everything before them, at position `offset + shifts[i]` (offset: the
    cache's length before the block). A whole tree at once is W = N, shifts the depths; a
    tree grown depth by depth (`mlx_spec.dynamic_tree`) appends one depth at a time."""
    return call_block(model, cache, mask, shifts, lambda wrapped: model(inputs[None], cache=wrapped)[0])


def forward_rows(model, cache: list, inputs: mx.array, parents: list) -> mx.array:
    """Logits [B, T, V] of a batch's blocks `inputs` [B, T] = [y, nodes..., padding] (lazy):
    row i's tree is `parents[i]`; padding nodes continue its last node (breadth-first order
    holds) and are never read."""
    T = inputs.shape[1]
    masks, shifts = [], []
    for par in parents:
        par = list(par) + list(range(len(par) - 1, T - 2))
        masks.append(ancestry(par))
        shifts.append([0] + depths(par))
    return call_block(model, cache, mx.array(np.stack(masks)), shifts,
                      lambda wrapped: model(inputs, cache=wrapped))


def call_block(module, cache: list, mask: mx.array, shifts: list, run):
    """`run(wrapped cache)` (a forward of `module` over N rows, e.g. a drafter head's) with
    `forward_block`'s mask and positions: the cache layers seen through `TreeCache`, the
    module's ropes through `DepthRoPE` for this one call."""
    ropes = _ropes(module)
    if not ropes:
        raise ValueError(f"{type(module).__name__} has no rope modules to place tree nodes")
    if mask.ndim == 3 and any(type(m[k]) not in _ARRAY_OFFSET_ROPES for m, k in ropes):
        raise ValueError("a batch of trees needs ropes that take a position per row (`tree_capable`)")
    wrapped = [TreeCache(c, mask) for c in cache]
    plan = DepthPlan(shifts)  # shared by every layer's rope
    originals = [(m, m[k]) for m, k in ropes]
    try:
        for m, k in ropes:
            m[k] = DepthRoPE(m[k], plan)
        return run(wrapped)
    finally:  # the graph is built: put the module back at once
        for m, original in originals:
            m["rope"] = original


def compact(cache: list, base: int, keep: list[int]) -> None:
    """Keep rows `keep` (block indices, root first) of the block appended at `base`."""
    idx = mx.array(keep, mx.int32)
    for c in cache:
        n = c.offset - base
        for name in ("keys", "values"):
            buf = getattr(c, name)
            block = buf[..., base : base + n, :]
            buf[..., base : base + len(keep), :] = mx.take(block, idx, axis=2)
        c.offset = base + len(keep)


def compact_rows(cache: list, T: int, keeps: list[list[int]]) -> None:
    """Each row i of a batch cache keeps rows `keeps[i]` (root first) of the T-row block just
    appended, moved to the block's first positions; the rest of every row's block is left
    for the checkpoint to trim (`BatchCheckpoint.keep` with len(keeps[i]) kept)."""
    width = max(len(k) for k in keeps)
    idx = mx.array([k + [0] * (width - len(k)) for k in keeps], mx.int32)[:, None, :, None]
    for c in cache:
        base = c._idx - T
        for name in ("keys", "values"):
            buf = getattr(c, name)
            block = buf[..., base : c._idx, :]
            buf[..., base : base + width, :] = mx.take_along_axis(block, idx, axis=2)


def children(parents: Sequence[int]) -> list[list[int]]:
    """Children of each block row (0: the root; j + 1: node j), in order."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for j, p in enumerate(parents):
        kids[p + 1].append(j)
    return kids


def draws(logits: mx.array, tokens: mx.array, parents: Sequence[int], sampling, q: mx.array | None = None,
          ) -> list[mx.array]:
    """What the walk reads, computed on device in the step's graph. Greedy: each row's argmax.
    Sampling (module docstring): per node its acceptance ratio P(c) / Q(c) and a uniform; per
    row a draw from the row, and a draw from what is left of it once all its children are
    rejected. `q` [N, V]: each node's draft distribution Q (None: every node a point mass)."""
    if sampling.greedy:
        return [greedy_tokens(logits).astype(mx.uint32)]
    p = sampling.probs(logits)  # [N+1, V]
    left = mx.array(p)  # each row's P, its children rejected so far (a copy: p is drawn from below)
    ratio = mx.zeros((len(parents),), mx.float32)
    kids, cols = children(parents), mx.arange(p.shape[-1])[None]
    for s in range(max(map(len, kids))):  # every row's s-th child at once
        rows = [r for r, ks in enumerate(kids) if len(ks) > s]
        nodes = mx.array([kids[r][s] for r in rows], mx.int32)
        at, tok = mx.array(rows, mx.int32), tokens[nodes].astype(mx.int32)
        P = left[at]
        if q is None:  # a point mass: accepted with P(c), then P without c
            Q_c, rest = 1.0, mx.where(cols == tok[:, None], 0.0, P)
        else:
            Q = q[nodes]
            Q_c, rest = mx.take_along_axis(Q, tok[:, None], axis=-1)[:, 0], mx.maximum(P - Q, 0.0)
        ratio[nodes] = mx.take_along_axis(P, tok[:, None], axis=-1)[:, 0] / Q_c
        mass = rest.sum(-1, keepdims=True)
        left[at] = mx.where(mass > 0, rest / mx.maximum(mass, 1e-30), P)  # (no mass: rounding only, P == Q)
    u = mx.random.uniform(shape=(len(parents),))
    full = mx.random.categorical(mx.log(p)).astype(mx.uint32)
    rest = mx.random.categorical(mx.log(left)).astype(mx.uint32)
    return [ratio, u, full, rest]


def walk(parents: Sequence[int], tokens: list[int], read: list[list], greedy: bool) -> tuple[list[int], int]:
    """(the accepted path as node indices, the next token) from `draws` read on the host."""
    kids = children(parents)
    path, row = [], 0
    while True:
        if greedy:
            best = read[0][row]
            nxt = next((j for j in kids[row] if tokens[j] == best), None)
            if nxt is None:
                return path, best
        else:
            ratio, u, full, rest = read
            nxt = next((j for j in kids[row] if u[j] < ratio[j]), None)  # accepted with min(1, P(c) / Q(c))
            if nxt is None:
                return path, (rest if kids[row] else full)[row]
        path.append(nxt)
        row = nxt + 1


def first_nodes(draft, n: int):
    """The tree's first `n` nodes (breadth-first, parents first: still a tree), as point masses:
    which drawn nodes fall among the first n can depend on what was drawn below them, so
    their q no longer says how they were chosen (point masses are lossless whatever)."""
    return type(draft)(draft.tokens[:n], parents=draft.parents[:n])


def as_chain(draft):
    """The tree's first branch (first child at every level) as a chain draft."""
    from .drafters.base import Draft

    kids, idx, row = children(draft.parents), [], 0
    while kids[row]:
        idx.append(kids[row][0])
        row = idx[-1] + 1
    if not idx:
        return Draft(draft.tokens[:0])
    at = mx.array(idx, mx.int32)
    return Draft(draft.tokens[at], None if draft.q is None else draft.q[at])


def trie(sequences: Sequence[Sequence[int]], budget: int) -> tuple[list[int], tuple[int, ...]]:
    """Token sequences (most promising first) merged on common prefixes into a tree of at most
    `budget` nodes, breadth-first; each node's children keep the order of the sequences."""
    nodes: dict[tuple[int, ...], int] = {}
    kids: dict[int, list[tuple[int, ...]]] = {-1: []}
    for seq in sequences:
        parent = -1
        for i, t in enumerate(seq):
            path = tuple(seq[: i + 1])
            if path not in nodes:
                nodes[path] = len(nodes)
                kids.setdefault(parent, []).append(path)
            parent = nodes[path]
    tokens: list[int] = []
    parents: list[int] = []
    queue = [(-1, p) for p in kids[-1]]  # (new parent index, path), breadth-first
    while queue and len(tokens) < budget:
        new_parent, path = queue.pop(0)
        tokens.append(path[-1])
        parents.append(new_parent)
        here = len(tokens) - 1
        queue += [(here, p) for p in kids.get(nodes[path], [])]
    return tokens, tuple(parents)
