"""The training forward (training-time test) is the drafter's inference forward, and its loss
and gradients are right: checked against the drafter itself, an independent float64 NumPy
recomputation of every unrolled step from scratch, and finite differences."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import KVCache

import tiny
from eagle_fixtures import ref_eagle3
from mlx_spec.drafters.eagle import EagleDrafter, Eagle3Head
from mlx_spec.sampling import Sampling
from mlx_spec.taps import Taps
from mlx_spec.train.export import head_config
from mlx_spec.train.ttt import STEP_DECAY, draft_index, loss_fn, loss_terms, target_batch, unroll

TAPS = [0, 1, 2]
STEPS = 3


@pytest.fixture(scope="module")
def setup():
    model = tiny.llama_model(layers=4)
    model.freeze()
    d2t = mx.array(np.sort(np.random.default_rng(1).choice(tiny.VOCAB, 64, replace=False)).astype(np.int32))
    cfg = head_config(model, TAPS, 64)
    mx.random.seed(3)
    head = Eagle3Head(cfg)
    mx.eval(head.parameters())
    return model, head, cfg, d2t


def _batch(model, d2t, tokens, prompt_len=0):
    taps = Taps(model, TAPS)
    try:
        return target_batch(model, taps, tokens, prompt_len, d2t, draft_index(d2t, tiny.VOCAB))
    finally:
        taps.remove()


def _embed(model):
    return model.model.embed_tokens


def test_each_unrolled_step_equals_the_cached_inference_chain(setup):
    model, head, cfg, d2t = setup
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, tiny.VOCAB, 14)]
    b = _batch(model, d2t, tokens)
    got = [np.array(x) for x in unroll(head, _embed(model), b, TAPS, STEPS)]
    feats = head.features(b.taps, TAPS)
    emb = lambda ids: _embed(model)(mx.array(ids, mx.uint32)[None])
    for t in (0, 4, 9):
        cache = [KVCache() for _ in head.layers]
        g, h = head(emb(tokens[1 : t + 2]), feats[None, : t + 1], cache)  # what prefill + propose feed
        want = [head.lm_head(h[0, -1])]
        g = g[:, -1:]
        for i in range(1, STEPS):
            g, h = head(emb([tokens[t + i + 1]]), g, cache)  # chained: own feature, kept token
            want.append(head.lm_head(h[0, -1]))
        for i in range(STEPS):
            np.testing.assert_allclose(got[i][t], np.array(want[i]), rtol=1e-4, atol=1e-4,
                                       err_msg=f"step {i} at base {t}")


def test_unrolled_steps_reproduce_the_drafters_greedy_proposal(setup):
    model, head, cfg, d2t = setup
    drafter = EagleDrafter(head, TAPS, cfg, draft_to_target=d2t)
    drafter.bind(model, tiny.tokenizer())
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, tiny.VOCAB, 9)]
    taps = Taps(model, TAPS)
    model(mx.array(prompt, mx.uint32)[None])
    drafter.prefill(prompt, taps.read())
    taps.remove()
    y = 7
    draft = [int(t) for t in np.array(drafter.propose(y, STEPS, Sampling()).tokens)]
    seq = prompt + [y] + draft[:-1]  # the tokens a fully accepted chain feeds back
    b = _batch(model, d2t, seq)
    got = unroll(head, _embed(model), b, TAPS, STEPS)
    base = len(prompt) - 1
    mine = [int(d2t[mx.argmax(got[i][base])]) for i in range(STEPS)]
    assert mine == draft


def _numpy_loss(head, cfg, model, b, d2t, prompt_len):
    """Every (step, base) recomputed from scratch with the float64 reference head."""
    w = {k: np.array(v, np.float64) for k, v in tree_flatten(head.parameters())}
    E = np.array(_embed(model).weight, np.float64)
    taps = np.concatenate([np.array(b.taps[t], np.float64) for t in TAPS], -1)
    x = np.array(b.tokens)
    tl = np.array(b.target_logits, np.float64)
    top = np.array(b.target_top)
    T = len(x)
    total, ces = 0.0, []
    for i in range(STEPS):
        terms = []
        for t in range(T - 1):
            pos = t + i + 1
            if pos + 1 >= T or pos + 1 < prompt_len or top[pos] < 0:
                continue
            hid = ref_eagle3(w, cfg, E, x[1 : t + 2], taps[: t + 1], chain_tokens=x[t + 2 : t + i + 2])[-1]
            lg = hid @ w["lm_head.weight"].T
            logp = lg - lg.max() - np.log(np.exp(lg - lg.max()).sum())
            p = np.exp(tl[pos] - tl[pos].max())
            p /= p.sum()
            terms.append(-(p * logp).sum())
        ces.append(np.mean(terms))
        total += STEP_DECAY**i * ces[-1]
    return total, ces


def test_loss_equals_independent_numpy_computation(setup):
    model, head, cfg, d2t = setup
    tokens = [int(t) for t in np.random.default_rng(2).integers(0, tiny.VOCAB, 12)]
    b = _batch(model, d2t, tokens, prompt_len=4)
    total, ces, _, counts = loss_terms(head, _embed(model), b, TAPS, STEPS)
    want_total, want_ces = _numpy_loss(head, cfg, model, b, d2t, prompt_len=4)
    assert [int(c) for c in counts] and min(int(c) for c in counts) > 0
    np.testing.assert_allclose([float(c) for c in ces], want_ces, rtol=2e-4)
    np.testing.assert_allclose(float(total), want_total, rtol=2e-4)


def test_gradients_match_finite_differences(setup):
    model, head, cfg, d2t = setup
    tokens = [int(t) for t in np.random.default_rng(4).integers(0, tiny.VOCAB, 12)]
    b = _batch(model, d2t, tokens, prompt_len=2)
    f = lambda: loss_fn(head, _embed(model), b, TAPS, STEPS)
    (loss, _), grads = nn.value_and_grad(head, lambda batch: loss_fn(head, _embed(model), batch, TAPS, STEPS))(b)
    theta = head.parameters()
    rng = np.random.default_rng(0)
    direction = tree_map(lambda p: mx.array(rng.normal(size=p.shape).astype(np.float32)), theta)
    analytic = sum(float((g * d).sum()) for (_, g), (_, d) in zip(tree_flatten(grads), tree_flatten(direction)))
    eps = 1e-2
    vals = []
    for sgn in (1, -1):
        head.update(tree_map(lambda p, d: p + sgn * eps * d, theta, direction))
        vals.append(float(f()[0]))
    head.update(theta)
    numeric = (vals[0] - vals[1]) / (2 * eps)
    assert abs(analytic) > 1e-2
    assert abs(numeric - analytic) <= 2e-2 * abs(analytic), (numeric, analytic)
    # each parameter group gets a gradient (the unrolled steps reach every tensor)
    assert all(float(mx.abs(g).sum()) > 0 for _, g in tree_flatten(grads))
