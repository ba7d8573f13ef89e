"""Taps on every kind of target we support: recorded states equal a manual forward; removal restores.

A "manual forward" calls the target's own embedding, decoder layers and final
norm one by one (with the masks the model would build), so it is independent
of the recorders; its logits are checked against the model's own call first.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import mixtral, qwen3, qwen3_moe
from mlx_lm.models.base import create_causal_mask

import tiny
from mlx_spec import NGramDrafter, make_cache, stream_generate
from mlx_spec.drafters.base import EMPTY
from mlx_spec.drafters.base import target_lm_head
from mlx_spec.request import Request
from mlx_spec.rows import Row
from mlx_spec.taps import EMBED, FINAL_NORM, Taps, _Recorder, decoder_stack


def qwen3_model(seed=0):
    mx.random.seed(seed)
    args = qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=tiny.VOCAB, num_key_value_heads=2,
        max_position_embeddings=512, head_dim=16, tie_word_embeddings=False, rope_theta=1e6,
    )
    model = qwen3.Model(args)
    mx.eval(model.parameters())
    return model


def qwen3_moe_model(seed=0):
    mx.random.seed(seed)
    args = qwen3_moe.ModelArgs(
        model_type="qwen3_moe", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        mlp_only_layers=[1], moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=tiny.VOCAB,
        num_key_value_heads=2, head_dim=16, rope_theta=1e6, tie_word_embeddings=False,
        max_position_embeddings=512, norm_topk_prob=True,
    )
    model = qwen3_moe.Model(args)
    mx.eval(model.parameters())
    return model


def mixtral_model(seed=0):
    mx.random.seed(seed)
    args = mixtral.ModelArgs(
        model_type="mixtral", vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2,
    )
    model = mixtral.Model(args)
    mx.eval(model.parameters())
    return model


T = 12  # longer than gemma3's 8-token window, so its sliding layers need their own mask


def _causal(i, layer):
    return "causal"


def _gemma3_mask(i, layer):
    return "causal" if i % 2 == 1 else create_causal_mask(T, window_size=8)  # pattern 2


def _hybrid_mask(i, layer):
    return None if layer.is_linear else "causal"  # recurrent layers take no mask here


ARCHS = {  # name -> (builder, embedding scale, mask for layer i)
    "llama": (lambda: tiny.llama_model(layers=3), None, _causal),
    "llama-tied": (lambda: tiny.llama_model(layers=2, tied=True), None, _causal),
    "qwen2": (lambda: tiny.qwen2_model(layers=3), None, _causal),
    "qwen3": (qwen3_model, None, _causal),
    "gemma3": (lambda: tiny.gemma3_model(layers=4), math.sqrt(64), _gemma3_mask),
    "qwen3_moe": (qwen3_moe_model, None, _causal),
    "mixtral": (mixtral_model, None, _causal),
    "qwen3_5": (lambda: tiny.qwen3_5_model(layers=4), None, _hybrid_mask),
}


def manual_forward(model, tokens, scale, mask_for):
    """(embedding output, [output of each layer], final-norm output), all [T, H]."""
    stack = decoder_stack(model)
    h = stack.embed_tokens(tokens[None])
    if scale is not None:
        h = h * mx.array(scale, mx.bfloat16).astype(h.dtype)  # gemma3 scales in bf16
    emb, outs = h, []
    for i, layer in enumerate(stack.layers):
        h = layer(h, mask_for(i, layer), None)
        outs.append(h)
    return emb[0], [o[0] for o in outs], stack.norm(h)[0]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_taps_equal_manual_forward_and_removal_restores(arch):
    build, scale, mask_for = ARCHS[arch]
    model = build()
    tokens = mx.array(np.random.default_rng(1).integers(0, tiny.VOCAB, T), mx.uint32)
    logits_before = model(tokens[None])[0]
    emb, outs, final = manual_forward(model, tokens, scale, mask_for)
    # the manual forward is the model's forward: same logits
    np.testing.assert_allclose(np.array(target_lm_head(model)(final)), np.array(logits_before), atol=1e-4)

    stack = decoder_stack(model)
    originals, norm = list(stack.layers), stack.norm
    params_before = [k for k, _ in tree_flatten(model.parameters())]
    n = len(originals)
    ids = (EMBED, 0, n // 2, n - 1, FINAL_NORM)
    taps = Taps(model, ids)
    assert sum(isinstance(layer, _Recorder) for layer in stack.layers) == len({0, n // 2, n - 1})
    logits = model(tokens[None])[0]
    got = taps.read()
    np.testing.assert_array_equal(np.array(logits), np.array(logits_before))  # recorders are transparent
    np.testing.assert_allclose(np.array(got[EMBED]), np.array(emb), atol=1e-5)
    for i in (0, n // 2, n - 1):
        np.testing.assert_allclose(np.array(got[i]), np.array(outs[i]), atol=1e-5, err_msg=f"layer {i}")
    np.testing.assert_allclose(np.array(got[FINAL_NORM]), np.array(final), atol=1e-5)

    taps.remove()
    assert all(a is b for a, b in zip(stack.layers, originals)) and stack.norm is norm
    assert [k for k, _ in tree_flatten(model.parameters())] == params_before
    np.testing.assert_array_equal(np.array(model(tokens[None])[0]), np.array(logits_before))


def test_layer_k_is_the_output_of_decoder_layer_k():
    """The one meaning of tap k: HF hidden_states[k + 1], the value layers[k] returns."""
    model = tiny.llama_model(layers=3)
    tokens = mx.array([3, 1, 4, 1, 5], mx.uint32)
    with Taps(model, (EMBED, 0, 1)) as taps:
        model(tokens[None])
        got = taps.read()
    emb, outs, _ = manual_forward(model, tokens, None, _causal)
    hidden_states = [emb] + outs  # HF indexing
    for k in (0, 1):
        np.testing.assert_allclose(np.array(got[k]), np.array(hidden_states[k + 1]), atol=1e-6)
        assert not np.allclose(np.array(got[k]), np.array(hidden_states[k]), atol=1e-3)
    np.testing.assert_allclose(np.array(got[EMBED]), np.array(hidden_states[0]), atol=1e-6)


def test_bad_tap_ids_are_refused_before_anything_is_installed():
    model = tiny.llama_model(layers=2)
    originals = list(model.model.layers)
    with pytest.raises(ValueError, match="out of range: this target has 2 decoder layers"):
        Taps(model, (0, 2))
    # nothing may be left wrapped, not even the valid id before the bad one
    assert all(a is b for a, b in zip(model.model.layers, originals))


class _Probe:
    """A drafter that records, at each proposal, whether the target's layers are wrapped."""

    max_draft = 16

    def __init__(self, taps=()):
        self.taps, self.seen, self.received = tuple(taps), [], []

    def bind(self, model, tokenizer):
        self.model = model

    def prefill(self, tokens, taps):
        self.received.append(taps)

    def propose(self, y, k, sampling):
        stack = decoder_stack(self.model)
        self.seen.append(any(isinstance(m, _Recorder) for m in [*stack.layers, stack.norm]))
        return EMPTY

    def commit(self, tokens, taps):
        self.received.append(taps)


def test_no_taps_installed_unless_a_drafter_asks():
    model, tok = tiny.llama_model(layers=2), tiny.tokenizer()
    probe = _Probe()
    list(stream_generate(model, tok, [1, 2, 3], probe, max_tokens=4, num_draft_tokens=2))
    assert probe.seen and not any(probe.seen)
    assert all(t is None for t in probe.received)
    assert tuple(NGramDrafter().taps) == ()  # the loop installs taps only for a drafter's ids
    assert Row(0, model, tok, Request(), NGramDrafter(), make_cache(model), None).taps is None

    asking = _Probe(taps=(1, FINAL_NORM))
    list(stream_generate(model, tok, [1, 2, 3], asking, max_tokens=4, num_draft_tokens=2))
    assert all(asking.seen)  # installed during generation...
    assert not any(isinstance(m, _Recorder) for m in [*model.model.layers, model.model.norm])  # ...and gone after
    prompt_taps, *step_taps = asking.received
    assert prompt_taps[1].shape == (3, 64) and prompt_taps[FINAL_NORM].shape == (3, 64)
    assert all(t[1].shape == (1, 64) for t in step_taps)  # k = 0 proposals: only y is kept


def test_embedding_scale_is_what_the_first_layer_gets_over_the_raw_rows():
    """Gemma 1-3 multiply by sqrt(H) inside their forward (Gemma 4 keeps it as `embed_scale`);
    a DFlash block is embedded as Hugging Face's embed_tokens returns it, so with that factor."""
    import tiny
    from mlx_spec.taps import EMBED, Taps, decoder_stack, embedding, embedding_scale

    for model, scaled in ((tiny.gemma3_model(), True), (tiny.llama_model(), False)):
        stack = decoder_stack(model)
        with Taps(model, [EMBED]) as taps:
            model(mx.array([[5, 6, 7]]))
            fed = taps.read()[EMBED]
        raw = embedding(stack)(mx.array([[5, 6, 7]]))
        assert mx.allclose(fed, raw * embedding_scale(stack), rtol=1e-5, atol=1e-6)
        assert (embedding_scale(stack) > 1) == scaled
