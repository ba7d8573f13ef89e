"""DSpark's sequential stage, shared by every DSpark drafter (`dspark`, `dspark_v4`).

A parallel stage (DeepSpec's DFlash-style block, or DeepSeek-V4's in-checkpoint
stages) gives base logits U [k, V] and hidden rows h [k, H] for the anchor y;
`SparkChain` turns them into a draft:

    s_j = U_j + W2 W1[x_{j-1}]                  # Markov bias, x_{-1} = y, x_j = d_j
    d_j = argmax s_j (greedy)  |  d_j ~ q_j = probs(s_j) (sampling)
    c_j = sigmoid(w . [h_j ; W1[x_{j-1}]] + b)  # P(d_j survives | d_<j survived)
    L   = #{leading j : c_0 c_1 ... c_j >= threshold}

c_j reads h_j and d_{j-1}, never d_j, so the cut is non-anticipating and
lossless (see the `Drafter` protocol in `base`). Sources: the DSpark paper
(`DSpark_paper.pdf`, section 3) and DeepSpec's `deepspec/modeling/dspark/markov_head.py`
and `deepspec/eval/dspark/draft_ops.py` (github.com/deepseek-ai/DeepSpec); parameter names
as in DeepSpec checkpoints (`markov_head.markov_w1`, `confidence_head.proj`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .. import dynamic_tree, tree
from ..sampling import Sampling
from .base import Draft, pick_block
from .block_tree import check_budget, propose_tree

CUTS = ("mask", "sync")


@dataclass(frozen=True)
class SparkConfig:
    vocab_size: int
    markov_rank: int = 0
    confidence_head: bool = False
    confidence_with_markov: bool = False
    confidence_bias: bool = True
    own_embeddings: bool = False
    own_lm_head: bool = False
    draft_vocab_size: int | None = None  # a reduced draft vocabulary (its ids map by draft_to_target)
    sample_from_anchor: bool = True  # False: speculators' slot 0 is the anchor only, drafts from row 1

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_dict(cls, d: dict) -> "SparkConfig":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


class MarkovHead(nn.Module):
    """Bigram bias B(prev, .) = W2 W1[prev]: W1 [V, r] is a lookup by the previous (target)
    token, W2 [V_d, r] a Linear r -> V_d over the draft vocabulary (V_d = V unless reduced)."""

    def __init__(self, vocab: int, rank: int, draft_vocab: int | None = None):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab or vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, dims: int, bias: bool):
        super().__init__()
        self.proj = nn.Linear(dims, 1, bias=bias)


def confidence_length(conf: mx.array, threshold: float) -> mx.array:
    """conf [k] step confidences -> L = leading positions whose running product >= threshold."""
    return mx.cumprod(mx.cumprod(conf) >= threshold).sum()


class SparkChain:
    """DSpark's sequential stage, shared by every DSpark drafter (`dspark` and `dspark_v4`).

    A subclass sets `spark` (SparkConfig), `heads` (a module holding `markov_head`
    and/or `confidence_head`), `sample_drafts`, `max_draft`, calls `set_cut`, and
    implements `step_logits(y, k) -> (U [k, V], h [k, H])`.
    """

    spark: SparkConfig
    heads: nn.Module
    sample_drafts: bool
    max_draft: int
    draft_to_target: mx.array | None = None  # [V_d] target ids of a reduced draft vocabulary
    tree_budget: int | None = None  # DDTree-style trees of this many nodes (`set_tree`)
    trees = False  # the subclass's bind: a tree_budget and a target that can verify trees

    def set_tree(self, tree_budget: int | None) -> None:
        """Draft trees of `tree_budget` nodes instead of chains, cut by the confidences when a
        threshold is set. Without a Markov head the block's rows are a factorised distribution
        and the tree is DDTree's (`block_tree`); with one, each row depends on the token
        drafted before it, and the tree is grown depth by depth over that chain (`_markov_tree`)."""
        self.tree_budget = check_budget(tree_budget)

    def set_cut(self, confidence_threshold: float | None, cut: str = "sync") -> None:
        """Verify only the prefix whose running confidence product stays >= the threshold.

        None verifies the whole block. `cut="sync"` (the default) reads the length on
        the host, so the verify forward really shrinks; `cut="mask"` keeps propose lazy
        but verifies the whole block and only masks acceptance with `Draft.length`: it
        saves no work and can only lower tau, so it is there to study the cut.
        """
        if cut not in CUTS:
            raise ValueError(f"cut must be one of {CUTS}, got {cut!r}")
        if confidence_threshold is not None and not self.spark.confidence_head:
            raise ValueError("confidence_threshold needs a head with a confidence head; "
                             "this checkpoint has none")
        if confidence_threshold is not None and not 0.0 <= confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1], got {confidence_threshold}")
        self.threshold, self.cut = confidence_threshold, cut

    def step_logits(self, y: int, k: int) -> tuple[mx.array, mx.array]:
        raise NotImplementedError

    def _to_target(self, tokens: mx.array, q: mx.array | None):
        """Draft-vocabulary ids (and q over them) -> target ids (and q over the target's)."""
        d2t = self.draft_to_target
        if d2t is None:
            return tokens, q
        if q is not None:  # zero outside the draft vocabulary: rejection sampling stays exact
            q = mx.zeros((*q.shape[:-1], self.spark.vocab_size), q.dtype).at[..., d2t].add(q)
        return d2t[tokens], q

    def _chain(self, U, h, y, sampling) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """Sequential stage: Markov-corrected tokens, their q, and step confidences [k]."""
        heads, sample = self.heads, self.sample_drafts and not sampling.greedy
        conf_head = heads.confidence_head.proj if "confidence_head" in heads else None
        if "markov_head" not in heads:  # DeepSpec "DFlash" layout: positions independent
            d = pick_block(U, sampling, self.sample_drafts)
            conf = None if conf_head is None else mx.sigmoid(conf_head(h)[:, 0])
            tokens, q = self._to_target(d.tokens, d.q)
            return tokens.astype(mx.uint32), q, conf
        w1, w2 = heads.markov_head.markov_w1, heads.markov_head.markov_w2
        prev, tokens, qs, confs = mx.array([y], dtype=mx.uint32), [], [], []
        for j in range(U.shape[0]):
            e = w1(prev)[0]  # [r]; W1 is indexed by target ids
            s = U[j] + w2(e)  # [V_d]
            if sample:
                q = sampling.probs(s)
                t, q = self._to_target(mx.random.categorical(mx.log(q)), q)
                qs.append(q)
            else:
                t, _ = self._to_target(mx.argmax(s), None)
            if conf_head is not None:
                feats = mx.concatenate([h[j], e.astype(h.dtype)]) if self.spark.confidence_with_markov else h[j]
                confs.append(mx.sigmoid(conf_head(feats)[0]))
            tokens.append(t)
            prev = t.reshape(1).astype(mx.uint32)
        return (mx.stack(tokens).astype(mx.uint32), mx.stack(qs) if qs else None,
                mx.stack(confs) if confs else None)

    def _tree(self, U, h, y, sampling) -> Draft:
        """A DDTree draft (no Markov head); its depth capped by the confidence cut, whose
        length is read in the tree's one host sync whatever `cut` says."""
        if "markov_head" in self.heads:
            return self._markov_tree(U, h, y, sampling)
        length = None
        if self.threshold is not None:
            conf = mx.sigmoid(self.heads.confidence_head.proj(h)[:, 0]).astype(mx.float32)
            length = confidence_length(conf, self.threshold)
        d2t = self.draft_to_target
        return propose_tree(U, sampling, self.tree_budget, length,
                            None if d2t is None else (lambda ids: d2t[ids]))

    def _markov_tree(self, U, h, y, sampling) -> Draft:
        """The `tree_budget` most likely paths of the Markov chain s_j = U_j + W2 W1[x_(j-1)]
        (`dynamic_tree.best_paths`: a depth's "forward" is the Markov term of each frontier
        token, all lazy, one host sync): exactly the `budget` best prefixes under the chain's
        own distribution. With a
        threshold, a node is kept only while its path's confidence product stays >= it
        (`_cut_tree`): the chain's cut, per path."""
        w1, w2 = self.heads.markov_head.markov_w1, self.heads.markov_head.markov_w2
        draft = dynamic_tree.best_paths(lambda j, prev: U[j][None] + w2(w1(prev)), y,
                                        depth=U.shape[0], budget=self.tree_budget, sampling=sampling,
                                        token_ids=self.draft_to_target)
        return draft if self.threshold is None or draft.size == 0 else self._cut_tree(draft, h, y)

    def _cut_tree(self, draft: Draft, h, y: int) -> Draft:
        """The nodes whose path's running confidence product stays >= the threshold (a node's
        confidence reads its depth's hidden row and, with `confidence_with_markov`, its
        parent's token, never its own: non-anticipating, as the chain's cut). Products only
        fall along a path, so what is kept is still a tree."""
        parents, tokens = draft.parents, draft.tokens.tolist()
        depth = tree.depths(parents)
        prev = mx.array([y if p < 0 else tokens[p] for p in parents], mx.uint32)
        feats = h[mx.array([d - 1 for d in depth])]
        if self.spark.confidence_with_markov:
            e = self.heads.markov_head.markov_w1(prev)
            feats = mx.concatenate([feats, e.astype(feats.dtype)], axis=-1)
        conf = mx.sigmoid(self.heads.confidence_head.proj(feats)[:, 0]).astype(mx.float32).tolist()
        run: list[float] = []
        for p, c in zip(parents, conf):  # breadth-first: a parent's product comes first
            run.append(c * (1.0 if p < 0 else run[p]))
        keep = [i for i, r in enumerate(run) if r >= self.threshold]
        where = {old: new for new, old in enumerate(keep)}
        return Draft(draft.tokens[mx.array(keep, mx.int32)] if keep else draft.tokens[:0],
                     parents=tuple(-1 if parents[i] < 0 else where[parents[i]] for i in keep) if keep else None)

    def propose(self, y: int, k: int, sampling: Sampling) -> Draft:
        k = min(k, self.max_draft)
        if self.trees:
            return self._tree(*self.step_logits(y, k), y, sampling)
        tokens, q, conf = self._chain(*self.step_logits(y, k), y, sampling)
        if self.threshold is None:
            return Draft(tokens, q)
        length = confidence_length(conf.astype(mx.float32), self.threshold)
        if self.cut == "mask":
            return Draft(tokens, q, length)
        n = int(length.item())  # cut="sync": the one extra host sync, by request
        return Draft(tokens[:n], None if q is None else q[:n])
