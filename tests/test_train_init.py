"""A new head's output layer starts as the target's own, cut to the draft vocabulary: on any
hidden state, the fresh head's logits are the target's logits at the draft vocabulary's ids,
for tied and untied, float and quantized targets; a target whose final norm is not a plain
RMSNorm (Gemma's 1 + w) keeps the head's own norm."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import tiny
from mlx_spec.drafters.eagle import Eagle3Head
from mlx_spec.train.export import head_config
from mlx_spec.train.run import init_from_target

IDS = np.sort(np.random.default_rng(0).choice(tiny.VOCAB, 40, replace=False)).astype(np.int32)


def _target_logits(model, h):
    return model.model.norm(h) @ (model.model.embed_tokens.weight.T if model.args.tie_word_embeddings
                                  else model.lm_head.weight.T)


@pytest.mark.parametrize("kind", ["untied", "tied", "quantized"])
def test_fresh_head_scores_like_the_target_on_the_draft_vocabulary(kind):
    model = tiny.llama_model(layers=6, tied=kind == "tied")
    model.model.norm.weight = mx.random.uniform(0.5, 2.0, (64,), key=mx.random.key(2))  # not the default ones
    h = mx.random.normal((5, 64), key=mx.random.key(1))
    if kind == "quantized":
        nn.quantize(model, group_size=32, bits=8)
        want = model.lm_head(model.model.norm(h))  # the quantized matmul the target itself runs
    else:
        want = _target_logits(model, h)
    cfg = head_config(model, [1, 2, 4], len(IDS))
    head = Eagle3Head(cfg)
    before = np.array(head.lm_head(head.norm(h)))
    assert init_from_target(head, model, IDS) == ["lm_head", "norm"]
    got = np.array(head.lm_head(head.norm(h)))
    want = np.array(want)[:, IDS]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 if kind == "quantized" else 1e-4)
    assert not np.allclose(before, want, atol=1e-2)  # a random head does not score like that


def test_gemma_norm_is_not_a_plain_rmsnorm_and_stays_the_heads_own():
    model = tiny.gemma3_model()
    cfg = head_config(model, [1, 2, 3], len(IDS))
    head = Eagle3Head(cfg)
    assert init_from_target(head, model, IDS) == ["lm_head"]
    np.testing.assert_array_equal(np.array(head.lm_head.weight), np.array(model.lm_head.weight)[IDS])
    np.testing.assert_array_equal(np.array(head.norm.weight), np.ones(64, np.float32))
