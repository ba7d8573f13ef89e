"""Helpers the drafter tests share: mlx-lm's own greedy output, a traced speculative run,
a NumPy replay of greedy block drafting (DFlash / DSpark style), a count of a model's
forwards by batch size, and two draft-model drafters' states compared."""

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

import mlx_spec
import tiny
from mlx_spec.taps import SeeThrough, decoder_stack


def mlx_lm_greedy(model, prompt, n) -> list[int]:
    """Plain greedy decoding by mlx-lm itself: what every drafter must reproduce."""
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


class _RowCount(SeeThrough):
    """Records the batch size of every forward through the layer it wraps."""

    def __call__(self, x, *args, **kwargs):
        self.seen.append(x.shape[0])
        return self.inner(x, *args, **kwargs)


def counted(model) -> list[int]:
    """Wrap `model`'s first decoder layer (the instance's) and return its list of batch sizes."""
    stack = decoder_stack(model)
    stack.layers[0] = _RowCount(stack.layers[0])
    stack.layers[0].seen = []
    return stack.layers[0].seen


def spec_run(model, drafter, prompt, n, k, **kw):
    """(tokens, stats) of mlx-spec's traced run with `drafter` at draft length k."""
    out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), prompt, drafter, max_tokens=n,
                                        num_draft_tokens=k, trace=True, **kw))
    return [r.token for r in out], out[-1].stats


def target_arrays(model):
    """The target's embedding and LM head as float64 NumPy arrays."""
    return (np.array(model.model.embed_tokens.weight, np.float64),
            np.array(model.lm_head.weight, np.float64))


def replay_greedy_blocks(seq, start, k, block, chain, threshold=None):
    """Replay a greedy run over `seq` (prompt + output) from committed length `start`.

    `chain(pos)` returns the reference's (tokens, confidences) for a block anchored at
    seq[pos]. Per step: (proposal, accepted, running confidence product, cut).
    """
    pos, steps = start, []
    while pos < len(seq) - 1:
        kk = min(k, len(seq) - pos - 2)
        toks, conf = chain(pos)
        a, cut = np.cumprod(conf), block
        if threshold is not None and (a < threshold).any():
            cut = int(np.argmin(a >= threshold))
        toks = toks[: min(kk, cut)]
        n = 0
        while n < len(toks) and toks[n] == seq[pos + 1 + n]:
            n += 1
        steps.append((toks, n, a, cut))
        pos += n + 1
    return steps


def assert_same_draft_state(a, b, atol: float = 1e-5) -> None:
    """Two draft-model drafters hold the same queued tokens and the same cache rows."""
    assert a._pending == b._pending and a.cache[0].offset == b.cache[0].offset
    for ca, cb in zip(a.cache, b.cache):
        n = ca.offset
        for x, y in ((ca.keys, cb.keys), (ca.values, cb.values)):
            assert np.allclose(np.array(x[..., :n, :]), np.array(y[..., :n, :]), atol=atol)


def median_confidence(draft, tokens) -> float:
    """The median over `tokens`' positions of the draft model's largest softmax probability: a
    `min_confidence` that ends some of its greedy chains early and not others."""
    logits = draft(mx.array(tokens)[None])[0].astype(mx.float32)
    top = mx.exp(mx.max(logits, axis=-1) - mx.logsumexp(logits, axis=-1))
    return float(np.median(np.array(top)))


def together_as_alone(together: list, alone: list, ys, ks, samplings, seeds) -> list:
    """Draft-model rows' proposals made together (`propose_together`, a seeded key per sampled
    row) equal each row's own proposal made alone (MLX's global stream seeded the same):
    tokens and q. Returns the drafts made together."""
    from mlx_spec import DraftModelDrafter

    keys = [None if s.greedy else mx.random.key(seed) for s, seed in zip(samplings, seeds)]
    got = DraftModelDrafter.propose_together(together, ys, ks, samplings, keys)
    for i, d in enumerate(alone):
        mx.random.seed(seeds[i])
        want = d.propose(ys[i], ks[i], samplings[i])
        assert got[i].tokens.tolist() == want.tokens.tolist() and got[i].size == want.size
        assert (got[i].q is None) == (want.q is None) == samplings[i].greedy
        if want.q is not None:
            assert np.allclose(np.array(got[i].q), np.array(want.q), atol=1e-5)
    return got
