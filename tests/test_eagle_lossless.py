"""EAGLE drafters keep decoding lossless where drafts are actually accepted, greedy and sampled.

Random heads are almost never right, so acceptance would go untested. Here the
target is made nearly a bigram model (its layers' residual writes scaled
down), and the heads are set by hand to compute "the target's next token after
x" from the embedding of x, so most drafts are accepted but not all. Sampled
output is compared with the exact law of the first five generated positions
(marginals and neighbouring pairs, chi-square over a thousand seeded runs on an
8-token vocabulary, 3-token drafts).
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import mlx_spec
import tiny
from converters.eagle import v1, v3
from eagle_fixtures import eagle1_checkpoint, eagle3_checkpoint, target_folder
from lossless import assert_deep, assert_lossless, exact_joint, sampled_runs

H = 64


def bigram_target(vocab=tiny.VOCAB, eps=0.1, seed=0, sharpen=8.0):
    """A llama whose next token depends (almost) only on the current one."""
    model = tiny.llama_model(seed=seed, layers=4, vocab=vocab, sharpen=sharpen)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * eps
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * eps
    mx.eval(model.parameters())
    return model


def eagle1_bigram(w):
    """g = embedding of the input token, so the target's head reads 'next after x'."""
    w["fc.weight"] = np.concatenate([np.eye(H), np.zeros((H, H))], 1).astype(np.float32)
    w["fc.bias"] = np.zeros(H, np.float32)
    w["layers.0.self_attn.o_proj.weight"] *= 0
    w["layers.0.mlp.down_proj.weight"] *= 0


def eagle3_bigram(lm_head):
    def tweak(w):
        # attention that mostly looks at its own row, copying the normed embedding half of [e ; g]
        pick = np.concatenate([np.eye(H), np.zeros((H, H))], 1).astype(np.float32)
        w["fc.weight"] *= 0
        w["midlayer.self_attn.q_proj.weight"] = 4 * pick
        w["midlayer.self_attn.k_proj.weight"] = pick.copy()
        w["midlayer.self_attn.v_proj.weight"] = pick.copy()
        w["midlayer.self_attn.o_proj.weight"] = np.eye(H, dtype=np.float32)
        w["midlayer.mlp.down_proj.weight"] *= 0
        for key in ("midlayer.input_layernorm.weight", "norm.weight"):
            w[key] = np.ones(H, np.float32)
        used = w["d2t"] + np.arange(len(w["d2t"])) if "d2t" in w else np.arange(len(lm_head))
        w["lm_head.weight"] = lm_head[used]  # the target's head, restricted to the draft vocabulary
    return tweak


def _head(tmp_path, model, kind, V, V_d=None):
    tgt = target_folder(tmp_path / "target", model)
    if kind == "eagle":
        eagle1_checkpoint(tmp_path / "src", H, V, tweak=eagle1_bigram)
        out = v1.convert(tmp_path / "src", tmp_path / "out", tgt)
    else:
        lm = np.array(model.lm_head.weight)
        eagle3_checkpoint(tmp_path / "src", H, V, V_d=V_d, heads=4, kv_heads=4, tweak=eagle3_bigram(lm))
        out = v3.convert(tmp_path / "src", tmp_path / "out", tgt)
    return out


@pytest.mark.parametrize("kind,V_d", [("eagle", None), ("eagle3", 80)])
def test_greedy_with_accepted_drafts(tmp_path, kind, V_d):
    model = bigram_target()
    drafter = mlx_spec.load_drafter(_head(tmp_path, model, kind, tiny.VOCAB, V_d), model)
    prompt = [7, 21, 3, 50, 11]
    want = [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model), range(40))]
    rs = list(mlx_spec.stream_generate(model, tiny.tokenizer(), prompt, drafter, max_tokens=40,
                                       num_draft_tokens=4))
    assert [r.token for r in rs] == want
    stats = rs[-1].stats
    assert stats.tau > 1.5, f"tau {stats.tau}"  # drafts are accepted...
    assert stats.accepted < stats.drafted  # ...and some rejected


V8 = 8
PROMPT = [1, 2, 3, 1, 2]
RUNS = 1000


@pytest.mark.slow
@pytest.mark.parametrize("kind,V_d,kw", [
    ("eagle", None, dict(temp=1.0)),
    ("eagle3", 5, dict(temp=0.7, top_p=0.9, top_k=5)),  # q is zero outside the 5-token draft vocabulary
], ids=["eagle-temp1", "eagle3-temp0.7-topp-topk"])
def test_sampled_positions_follow_the_target_distribution(tmp_path, kind, V_d, kw):
    """Chained q (each head step feeds back its own drafted token) at k = 3, max_tokens = 5:
    marginals of positions 1..4 and neighbouring pairs against np_sampler's exact law."""
    model = bigram_target(vocab=V8, seed=3, sharpen=2.0)  # flat enough that a wrong q would show
    out = _head(tmp_path, model, kind, V8, V_d)
    joint = exact_joint(model, PROMPT, 5, kw, vocab=V8)
    drafter = mlx_spec.load_drafter(out, model)  # bind() resets it for every run
    runs = sampled_runs(model, PROMPT, lambda: drafter, RUNS, max_tokens=5, k=3, vocab=V8, **kw)
    assert_deep(runs, events=40)
    assert_lossless(runs, joint)
