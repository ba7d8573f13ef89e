"""EAGLE-2 dynamic draft trees: grown where the drafter is sure, widened where it is not.

The rule is EAGLE-2's (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees", arXiv 2406.16858). A node's value is its path's cumulative draft
probability, the product of the drafter's probabilities along the path (summed logs here).

* Expand: the root's `width` most probable tokens are depth 1. At every further depth the
  `width` nodes of the last depth with the highest values (the frontier) are fed to the
  drafter in one batched forward, each seeing only its own ancestors (`step`), and each
  gets its `width` most probable tokens as children: width * width candidates.
* Rerank: of every node generated, the `budget` with the highest values are kept (ties go
  to the shallower node, so a node's ancestors, whose values are never lower, always come
  before it), listed breadth-first, siblings by value (the first branch is the drafter's
  best path: `tree.as_chain`).

Everything up to the rerank is lazy (one graph for all depths); the rerank reads the
candidates' values and tokens on the host (one sync per proposal), because the verify
forward needs the tree's shape as host indices. Siblings are always distinct tokens, which
the tree walk needs. With `width` 1 the tree is the drafter's chain.

Greedy, every candidate is a point mass (`Draft.q` is None): the walk is lossless whatever
they are, so how they are chosen only changes speed. Sampling, point masses throw away what
a good drafter knows: a child c is kept with probability p(c), where a chain drawn from q
keeps its token with probability min(1, p / q), 1 when q = p. So when sampling each node's
first child is drawn from q (filtered and tempered as the target's p), its other w - 1 are
the most probable other tokens as point masses, and the draft carries every node's q (the
drawn child's row, or a point mass); the walk is then recursive rejection sampling
(`mlx_spec.tree`). That stays lossless only if whether a drawn child is verified never
depends on the child itself or on anything drawn below it. Values see to it: a drawn
child is worth its parent's value times the rate at which the target kept drawn children
earlier in the request (`DrawnRates`), whatever was drawn; a runner-up, reached only after
the draw is rejected, its calibrated q times the rate draws were rejected at, capped below
its drawn sibling's; and a node's descendants are never worth more than it. So which nodes the
rerank keeps, and whether a frontier node is expanded, never turns on a drawn child's
token; a cut of the tree to its first nodes (`tree.first_nodes`) could, and drops q.

`grow` returns, with the draft, the tree rows the drafter was fed (node path -> row in the
block appended to its cache), so it can keep exactly the accepted path's rows.
"""

from __future__ import annotations

import math
from typing import Callable

import mlx.core as mx
import numpy as np

from .drafters.base import Draft
from .request import whole
from .sampling import Sampling

# step(tokens [w], slots, mask [w, W], shift) -> logits [w, V]: feed one depth's frontier,
# where row i is a child of row slots[i] of the depth fed before (slots: lazy [w] indices;
# None for depth 1, the root's children), sees the W tree rows fed so far (this depth's
# included) that mask[i] allows, and sits at position (cache length before the depth) + shift.
Step = Callable[[mx.array, "mx.array | None", mx.array, int], mx.array]


def check_settings(tree_budget, tree_width) -> None:
    """A drafter's `tree_budget` / `tree_width` arguments, refused with a clear error."""
    from .cache import MAX_DRAFT

    if tree_budget is not None and not (whole(tree_budget) and 1 <= tree_budget <= MAX_DRAFT):
        raise ValueError(f"tree_budget must be an integer in 1..{MAX_DRAFT} (nodes verified a step) "
                         f"or None (no dynamic tree), got {tree_budget!r}")
    if not (whole(tree_width) and 1 <= tree_width <= 8):
        raise ValueError(f"tree_width must be an integer in 1..8, got {tree_width!r}")


def scores(logits: mx.array, sampling: Sampling) -> mx.array:
    """Log-probabilities a node's children are ranked by: the drafter's own distribution,
    filtered and tempered as the target's when sampling (filtered-out tokens: -inf)."""
    if sampling.greedy:
        x = logits.astype(mx.float32)
        return x - mx.logsumexp(x, axis=-1, keepdims=True)
    return mx.log(sampling.probs(logits))


class Calibration:
    """What a drafter's probabilities are worth as odds that the target keeps a node. EAGLE-2
    ranks nodes by the product of the drafter's probabilities along their paths, as if those
    were the odds; a small draft model is often underconfident (on the Qwen2.5-Coder pair the
    target kept 80-100% of the 0.5B draft's top tokens given probability 0.5-0.7). So, per bin
    of the drafter's probability p, and apart for a parent's most probable child and for its
    runner-ups, the rate at which the target kept such nodes over the p it was given is learned
    from every node verified (its parent kept), starting at 1 (`PRIOR` pseudo-observations at
    the bin's middle); a node's value is the product of min(1, p * factor) along its path."""

    BINS, PRIOR, CARRIED = 10, 4.0, 32.0

    def __init__(self):
        self.kept = np.tile(self._mid() * self.PRIOR, (2, 1))  # [best child, runner-up][bin]: kept nodes
        self.offered = self.kept.copy()  # the same nodes' summed drafter probabilities
        self.learned = 0  # nodes learned from in this process
        self._log: mx.array | None = None

    @classmethod
    def _mid(cls) -> np.ndarray:
        return (np.arange(cls.BINS) + 0.5) / cls.BINS

    def state(self) -> dict:
        """What was learned, for the next process (`restore`)."""
        return {"kept": self.kept.tolist(), "offered": self.offered.tolist()}

    def restore(self, data: dict) -> None:
        """Start from an earlier process's `state`, worth at most `CARRIED` nodes a bin (about:
        offered mass over the bin's middle) so that this process's text still moves it; a
        damaged state raises ValueError (KeyError, TypeError) and leaves this one as it was."""
        kept, offered = (np.array(data[name], dtype=np.float64) for name in ("kept", "offered"))
        if kept.shape != self.kept.shape or offered.shape != self.kept.shape or not (
                np.isfinite(kept).all() and np.isfinite(offered).all() and (kept >= 0).all() and (offered > 0).all()):
            raise ValueError("not a calibration's counts")
        scale = np.minimum(1.0, self.CARRIED * self._mid() / offered)
        self.kept, self.offered, self._log = kept * scale, offered * scale, None

    def log_factors(self) -> mx.array:
        """[2 * BINS] log(kept / offered): row 0 for best children, row 1 for runner-ups."""
        if self._log is None:
            self._log = mx.array(np.log(self.kept / self.offered).reshape(-1), mx.float32)
        return self._log

    def values(self, lq: mx.array) -> mx.array:
        """Calibrated log-values of children [..., w] with log-probabilities `lq`, best first."""
        bins = mx.clip(mx.floor(mx.exp(lq) * self.BINS), 0, self.BINS - 1).astype(mx.int32)
        runner_up = (mx.arange(lq.shape[-1]) > 0).astype(mx.int32)
        return mx.minimum(lq + self.log_factors()[runner_up * self.BINS + bins], 0.0)

    def learn(self, nodes: dict, tokens) -> None:
        """`nodes`: each verified node's path -> (p, best child?); `tokens`: the step's anchor,
        then the tokens the target kept and its own next one (a node at depth d was examined
        when its parent was kept, and kept when it is the target's token there)."""
        tokens = list(tokens)
        for path, (p, best) in nodes.items():
            d = len(path)
            if d < len(tokens) and list(path[:-1]) == tokens[1:d]:
                r, b = 1 - int(best), min(int(p * self.BINS), self.BINS - 1)
                self.kept[r, b] += path[-1] == tokens[d]
                self.offered[r, b] += p
                self.learned += 1
                self._log = None


class DrawnRates:
    """What a sampled tree's nodes are worth, learned within one request (a seeded request's
    tree must not depend on earlier ones): how often the target kept a drawn child when it
    examined it (its parent kept), and how often a runner-up over the q it was given when it
    examined it (its parent kept, the drawn sibling rejected: the target's token there is
    not the drawn one, since a rejected draw has no mass left in the residual). Each starts
    from `PRIOR` pseudo-observations: drawn children kept at `DRAWN`, runner-ups at their q."""

    PRIOR, DRAWN = 4.0, 0.75

    def __init__(self):
        self.drawn = [self.DRAWN * self.PRIOR, self.PRIOR]  # kept, examined
        self.runner = [self.PRIOR / 10, self.PRIOR / 10]  # kept, summed q (factor 1)

    def log_values(self) -> tuple[float, float, float]:
        """log(drawn kept), log(1 - drawn kept), log(runner-up factor)."""
        rho = min(max(self.drawn[0] / self.drawn[1], 1e-3), 1 - 1e-3)
        return math.log(rho), math.log1p(-rho), math.log(self.runner[0] / self.runner[1])

    def learn(self, nodes: dict, tokens) -> None:
        """As `Calibration.learn`, with each node's (q, drawn?)."""
        tokens = list(tokens)
        drawn_at = {path[:-1]: path[-1] for path, (_, drawn) in nodes.items() if drawn}
        for path, (q, drawn) in nodes.items():
            d = len(path)
            if d >= len(tokens) or list(path[:-1]) != tokens[1:d]:
                continue  # its parent was not kept: never examined
            if drawn:
                self.drawn[0] += path[-1] == tokens[d]
                self.drawn[1] += 1
            elif drawn_at.get(path[:-1]) != tokens[d]:  # the draw was rejected: tried
                self.runner[0] += path[-1] == tokens[d]
                self.runner[1] += q


def _top(x: mx.array, w: int) -> mx.array:
    """Indices of the w largest entries of each row, largest first."""
    idx = mx.argpartition(-x, kth=w - 1, axis=-1)[..., :w]
    order = mx.argsort(-mx.take_along_axis(x, idx, axis=-1), axis=-1)
    return mx.take_along_axis(idx, order, axis=-1)


def grow(root_logits: mx.array, step: Step, *, depth: int, width: int, budget: int,
         sampling: Sampling, token_ids: mx.array | None = None, calibration: Calibration | None = None,
         nodes: dict | None = None, vocab: int | None = None, drawn: bool = True,
         rates: DrawnRates | None = None) -> tuple[Draft, dict[tuple[int, ...], int]]:
    """A dynamic tree of at most `budget` nodes and `depth` levels below the root whose
    next-token logits are `root_logits` [V]; (the draft, {node path: fed row}). `token_ids`
    maps the logits' index to a target token id (a head's own smaller vocabulary of a target
    one of `vocab` tokens). With a `calibration`, nodes are valued by it, and `nodes` gets
    each kept node's path -> (drafter probability, best child?) for `Calibration.learn`.
    Sampling with `drawn`, each node's first child is drawn from the drafter's q and the
    draft carries q (module docstring), nodes valued by `rates` (None: its priors);
    otherwise every node is a point mass."""
    w = max(1, min(width, budget, root_logits.shape[-1]))
    value = (lambda lq: lq) if calibration is None else calibration.values  # noqa: E731
    drawn = drawn and not sampling.greedy
    if drawn:
        kept_drawn, rejected_drawn, runner_factor = (rates or DrawnRates()).log_values()

    def ids(i: mx.array) -> mx.array:
        return (i if token_ids is None else token_ids[i]).astype(mx.uint32)

    def expand(logits: mx.array, front_val: mx.array):
        """Children of rows with `logits` [r, V]: (their indices [r, w], log-probabilities,
        values, the rows' distributions when drawn)."""
        q = sampling.probs(logits) if drawn else None
        lq = scores(logits, sampling) if q is None else mx.log(q)
        if not drawn:
            kids = _top(lq, w)
            raw = mx.take_along_axis(lq, kids, axis=-1)
            return kids, raw, value(raw) + front_val[:, None], None
        kids = mx.random.categorical(lq)[:, None]  # one draw from q a row, tried first
        if w > 1:  # then the most probable other tokens, as point masses
            others = mx.where(mx.arange(lq.shape[-1]) == kids, -mx.inf, lq)
            kids = mx.concatenate([kids, _top(others, w - 1)], axis=-1)
        raw = mx.take_along_axis(lq, kids, axis=-1)
        # A draw is worth the rate draws were kept at, whatever was drawn; a runner-up, reached
        # only when the draw is rejected, its calibrated q times the rate draws were rejected
        # at: always less than its drawn sibling (module docstring).
        later = mx.minimum(mx.minimum(raw[:, 1:] + runner_factor, 0.0) + rejected_drawn, kept_drawn - 1e-3)
        top = mx.full((raw.shape[0], 1), kept_drawn, mx.float32)
        return kids, raw, mx.concatenate([top, later], axis=-1) + front_val[:, None], q

    top, raw, val, q = expand(root_logits[None], mx.zeros((1,)))
    tok, raw, val = ids(top[0]), raw[0], val[0]  # depth 1: the root's w children, all frontier
    slots = sel = None
    levels = [(tok, val, raw)]  # per depth: every candidate's token, value, log-probability
    dists = [q]  # per depth: the rows its candidates were drawn from (drawn only)
    fronts = []  # per depth < `depth`: the frontier's candidate indices (depth 1: all, in order)
    anc = mx.eye(w, dtype=mx.bool_)  # the frontier's ancestry over the tree rows fed so far
    front_tok, front_val = tok, val
    for d in range(2, depth + 1):
        fronts.append(mx.arange(w) if d == 2 else sel)
        # the depth d - 1 frontier sits at position base + d - 2; the cache holds (d - 2) * w tree rows
        kids, c_raw, c_val, q = expand(step(front_tok, slots, anc, (d - 2) * (1 - w)), front_val)  # [w, w]
        c_val, c_tok = c_val.reshape(-1), ids(kids.reshape(-1))
        levels.append((c_tok, c_val, c_raw.reshape(-1)))
        dists.append(q)
        if d < depth:
            sel = _top(c_val, w)  # the next frontier: the depth's w best candidates
            slots = sel // w
            anc = mx.concatenate([anc[slots], mx.eye(w, dtype=mx.bool_)], axis=1)
            front_tok, front_val = c_tok[sel], c_val[sel]
    mx.eval(levels, fronts)  # the one sync: the tree's shape is needed on the host
    probs = None if nodes is None else [np.exp(np.array(r)).tolist() for _, _, r in levels]
    kept: list[tuple[int, int]] = []
    draft, fed = select([(t.tolist(), v.tolist()) for t, v, _ in levels], [f.tolist() for f in fronts], w,
                        budget, probs, nodes, kept)
    if drawn and kept:
        draft = Draft(draft.tokens, _node_q(draft.tokens, kept, dists, w, token_ids, vocab),
                      parents=draft.parents)
    return draft, fed


def _node_q(tokens: mx.array, kept: list[tuple[int, int]], dists: list[mx.array], w: int,
            token_ids: mx.array | None, vocab: int | None) -> mx.array:
    """Each kept node's q over the target's vocabulary: its parent's row for a drawn child
    (candidate c % w == 0), a point mass on its token for the others."""
    rows = mx.concatenate(dists)  # depth 1's one row, then w rows a depth
    at = mx.array([0 if d == 1 else 1 + (d - 2) * w + c // w for d, c in kept], mx.int32)
    q = rows[at]
    V = q.shape[-1] if token_ids is None else vocab
    if token_ids is not None:  # a head's own vocabulary, scattered into the target's
        q = mx.zeros((len(kept), V), q.dtype).at[:, token_ids].add(q)
    point = (mx.arange(V)[None] == tokens[:, None]).astype(q.dtype)
    was_drawn = mx.array([c % w == 0 for _, c in kept])[:, None]
    return mx.where(was_drawn, q, point)


def best_paths(row: Callable[[int, mx.array], mx.array], y: int, *, depth: int, budget: int,
               sampling: Sampling, token_ids: mx.array | None = None) -> Draft:
    """The `budget` most likely paths, at most `depth` deep, of a chain whose row j depends
    only on the token before it: `row(j, prev [n])` -> logits [n, V] (prev: target ids, the
    first row's is the anchor `y`). A dynamic tree as wide as the budget, so no path of the
    best `budget` is pruned on the way: exactly the best `budget` prefixes."""
    depths = iter(range(1, depth))  # grow asks for depths 2, 3, ... in order
    step = lambda tokens, slots, mask, shift: row(next(depths), tokens)  # noqa: E731
    root = row(0, mx.array([y], mx.uint32))[0]
    draft, _ = grow(root, step, depth=min(depth, budget), width=budget, budget=budget,
                    sampling=sampling, token_ids=token_ids, drawn=False)
    return draft


def select(levels: list[tuple[list[int], list[float]]], fronts: list[list[int]], w: int, budget: int,
           probs: list[list[float]] | None = None, nodes: dict | None = None, kept: list | None = None,
           ) -> tuple[Draft, dict[tuple[int, ...], int]]:
    """The host half of `grow`: rerank every candidate, keep the best `budget`, list them
    breadth-first. Candidate c of depth d >= 2 is child c % w of frontier slot c // w of
    depth d - 1, i.e. of candidate fronts[d - 2][c // w] of that depth (so it is its parent's
    best child when c % w == 0). `nodes` gets each kept node's path -> (probs entry, best?),
    `kept` each kept node's (depth, candidate), in the draft's order."""
    cands = []  # (-value, depth, index) of every finite candidate
    for d, (_, vals) in enumerate(levels, 1):
        cands += [(-v, d, c) for c, v in enumerate(vals) if np.isfinite(v)]
    chosen = sorted(cands)[:budget]  # by value, ties to the shallower node

    def parent(d: int, c: int):
        return None if d == 1 else (d - 1, fronts[d - 2][c // w])

    def path(d: int, c: int) -> tuple[int, ...]:
        out = []
        node = (d, c)
        while node is not None:
            out.append(levels[node[0] - 1][0][node[1]])
            node = parent(*node)
        return tuple(reversed(out))

    index: dict[tuple[int, int], int] = {}
    tokens, parents = [], []
    for d in range(1, len(levels) + 1):
        here = [(index.get(parent(d, c), -1), v, c) for v, dd, c in chosen if dd == d]
        for p, _, c in sorted(here):  # parents' order, then by value
            if d > 1 and parent(d, c) not in index:
                raise AssertionError("a kept node's parent was not kept")  # values are monotone
            index[(d, c)] = len(tokens)
            tokens.append(levels[d - 1][0][c])
            parents.append(p)
            if nodes is not None:
                nodes[path(d, c)] = (probs[d - 1][c], c % w == 0)
            if kept is not None:
                kept.append((d, c))
    fed = {path(d + 1, c): d * w + s for d, front in enumerate(fronts) for s, c in enumerate(front)}
    return Draft(mx.array(tokens, mx.uint32), parents=tuple(parents)), fed
