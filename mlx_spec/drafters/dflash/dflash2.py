"""What DFlash2 (z-lab `DFlash2DraftModel`) adds to the DFlash block: grouped dynamic
convolutions inside each layer and a candidate selector that drafts a path.

From vLLM's `vllm/model_executor/models/qwen3_dflash2.py` (the DFlash2 model, its grouped
convolution and the selector's edge scores) and its DFlash2 proposers (the greedy walk):

    layer:  u = input_layernorm(x);  c = attention_conv.kernel_projection(u) -> [B, 2, taps, G]
            x = x + conv(attn(conv(u, c[:, 0], base[0])), c[:, 1], base[1])
            the same around the MLP with post_attention_layernorm and mlp_conv
    conv(h, c, base)[t] = sum_{o < taps, o <= t} (base[o] + c[t, o]) * h[t - o]
            (c[t, o] is shared by the g channels of a group; t is the row inside the block,
             so the convolution never reaches the context)

    selector, block rows h_1 .. h_k (after the final norm), logits l_j (x output_multiplier,
    softcap): the top_k candidates C_j of l_j and their unary scores l_j[C_j];
            score_j(c | prev) = l_j[c] + sum_r P[prev]_r * (W h_j)_r * S[c]_r
    greedy: d_j = argmax_c score_j(c | d_{j-1}), d_{-1} = y (the anchor);
    sampling: d_j ~ q_j = probs(score_j(. | d_{j-1})) over C_j, zero elsewhere.

q_j depends only on the block and on d_<j, so it is the distribution d_j is drawn from:
rejection sampling with it stays exact.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...sampling import Sampling
from ..base import Draft


def grouped_conv(h: mx.array, coef: mx.array, base: mx.array, group: int) -> mx.array:
    """h [1, B, H], coef [1, B, taps, G], base [taps, H] -> [1, B, H], causal inside the block."""
    _, B, H = h.shape
    taps, G = base.shape[0], H // group
    blocks = h.reshape(1, B, G, group)
    out = mx.zeros_like(blocks)
    for o in range(min(taps, B)):
        shifted = blocks if o == 0 else mx.concatenate(
            [mx.zeros_like(blocks[:, :o]), blocks[:, : B - o]], axis=1)
        weight = base[o].reshape(1, 1, G, group) + coef[:, :, o, :, None]
        out = out + weight.astype(h.dtype) * shifted
    return out.reshape(1, B, H)


class GroupedConv(nn.Module):
    """One `attention_conv` / `mlp_conv`: a fixed kernel plus a per-row dynamic one."""

    def __init__(self, hidden: int, taps: int, group: int):
        super().__init__()
        if hidden % group:
            raise ValueError(f"conv_group_size {group} does not divide hidden_size {hidden}")
        self.taps, self.group = taps, group
        self.base_kernel = mx.zeros((2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * (hidden // group), bias=False)

    def prepare(self, u: mx.array) -> tuple[mx.array, mx.array]:
        """(the convolved input, the coefficients `finish` uses)."""
        coef = self.kernel_projection(u).reshape(*u.shape[:2], 2, self.taps, -1)
        return grouped_conv(u, coef[:, :, 0], self.base_kernel[0], self.group), coef[:, :, 1]

    def finish(self, out: mx.array, coef: mx.array) -> mx.array:
        return grouped_conv(out, coef, self.base_kernel[1], self.group)


class CandidateSelector(nn.Module):
    """Picks each draft among its row's top-k tokens, scored with the previous pick."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def _candidates(self, h: mx.array, logits: mx.array):
        """Each row's top-k tokens [k, top], their unary scores, W h [k, r] and S[C] [k, top, r]."""
        top = min(self.top_k, logits.shape[-1])
        cands = mx.argpartition(-logits, kth=top - 1, axis=-1)[:, :top]  # [k, top]
        unary = mx.take_along_axis(logits, cands, axis=-1).astype(mx.float32)
        return cands, unary, self.hidden_projection(h), self.successor_codebook(cands)

    def choose(self, h: mx.array, logits: mx.array, y: int, sampling: Sampling,
               sample_drafts: bool) -> Draft:
        """h [k, H] block rows after the final norm, logits [k, V] -> the drafted path (lazy)."""
        k, V = logits.shape
        cands, unary, hp, succ = self._candidates(h, logits)
        sample = sample_drafts and not sampling.greedy
        prev, tokens, qs = mx.array([y], dtype=mx.uint32), [], []
        for j in range(k):
            edges = ((self.predecessor_codebook(prev) * hp[j]) * succ[j]).sum(-1)  # [top]
            scores = unary[j] + edges.astype(mx.float32)
            if sample:  # a full-vocabulary row: the candidates' scores, -inf elsewhere
                row = mx.full((V,), -mx.inf, mx.float32)
                row[cands[j]] = scores
                q = sampling.probs(row)
                t = mx.random.categorical(mx.log(q))
                qs.append(q)
            else:
                t = cands[j][mx.argmax(scores)]
            tokens.append(t)
            prev = t.reshape(1).astype(mx.uint32)
        return Draft(mx.stack(tokens).astype(mx.uint32), mx.stack(qs) if qs else None)

    def tree(self, h: mx.array, logits: mx.array, y: int, sampling: Sampling, budget: int) -> Draft:
        """The `budget` most likely paths of the selector's chain, whose row j scores its
        candidates given the token before it (`dynamic_tree.best_paths`: all lazy, one host
        sync). A path's value is the sum of its rows' log-probabilities over their
        candidates (tempered and filtered as the target's when sampling)."""
        from ...dynamic_tree import best_paths

        k, V = logits.shape
        cands, unary, hp, succ = self._candidates(h, logits)

        def row(j: int, prev: mx.array) -> mx.array:  # prev [n] -> scores [n, V], -inf off C_j
            edges = (self.predecessor_codebook(prev) * hp[j]) @ succ[j].T  # [n, top]
            scores = unary[j] + edges.astype(mx.float32)
            full = mx.full((prev.shape[0], V), -mx.inf, mx.float32)
            return mx.put_along_axis(full, mx.broadcast_to(cands[j], scores.shape), scores, axis=-1)

        return best_paths(row, y, depth=k, budget=budget, sampling=sampling)
