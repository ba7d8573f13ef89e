"""Forwards evaluated in pieces while the rest is built (`mlx_spec.overlap`)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx.utils import tree_flatten

import mlx_spec
from mlx_spec import overlap, verify
from mlx_spec.taps import decoder_stack

from tiny import llama_model, qwen3_5_model, tokenizer


def _keys(model):
    return [k for k, _ in tree_flatten(model.parameters())]


@pytest.mark.parametrize("make", [lambda: llama_model(layers=6), lambda: qwen3_5_model(layers=4)])
def test_same_logits_and_the_model_is_put_back(make):
    model = make()
    stack = decoder_stack(model)
    layers, keys = list(stack.layers), _keys(model)
    x = mx.array([[3, 1, 4, 1, 5]], mx.uint32)
    want = model(x, cache=make_prompt_cache(model))
    with overlapped_spy(model, every=2) as (queued, kicked):
        got = model(x, cache=make_prompt_cache(model))
    assert kicked == ([0, 1, 3, 5] if len(layers) == 6 else [0, 1, 3])
    assert queued.at is not None
    assert mx.array_equal(got, want)
    assert len(stack.layers) == len(layers) and all(a is b for a, b in zip(stack.layers, layers))
    assert _keys(model) == keys


def test_put_back_when_the_forward_fails():
    model = llama_model(layers=4)
    layers = list(model.model.layers)
    with pytest.raises(RuntimeError, match="boom"):
        with overlap.overlapped(model, every=2):
            assert any(isinstance(m, overlap._Kick) for m in model.model.layers)
            raise RuntimeError("boom")
    assert all(a is b for a, b in zip(model.model.layers, layers))


def test_no_layer_list_runs_as_is():
    class Bare:
        pass

    with overlap.overlapped(Bare()) as queued:
        pass
    assert queued.at is None


def test_a_layers_property_runs_as_is():
    """GPT-2's `layers` is a read-only view of `model.h`: it decodes as it is (it used to fail at
    every step, plain decoding included); no ropes, so draft trees are verified as chains."""
    from mlx_lm.models import gpt2

    from runs import mlx_lm_greedy

    mx.random.seed(0)
    model = gpt2.Model(gpt2.ModelArgs(model_type="gpt2", n_ctx=256, n_embd=64, n_head=4, n_layer=2,
                                      n_positions=256, layer_norm_epsilon=1e-5, vocab_size=96))
    mx.eval(model.parameters())
    prompt = [5, 6, 7, 8, 9, 5, 6, 3, 5, 6, 2, 5, 6]
    want = mlx_lm_greedy(model, prompt, 20)
    for drafter in (None, mlx_spec.NGramDrafter(min_n=1, branches=3)):
        out = list(mlx_spec.stream_generate(model, tokenizer(), prompt, drafter, max_tokens=20, num_draft_tokens=6))
        assert [r.token for r in out] == want and out[-1].stats.tree_steps == 0


def test_speculative_steps_queue_their_pieces(monkeypatch):
    """The verify forward (and a draft model's forwards) are queued in pieces, and the
    output is still plain decoding's."""
    model, tok = llama_model(layers=8), tokenizer()
    prompt = [5, 6, 7, 8] * 4
    want = mlx_spec.generate(model, tok, prompt, None, max_tokens=24)
    calls, verifies = [], []
    real, real_verify = mx.async_eval, verify.verify
    monkeypatch.setattr(mx, "async_eval", lambda *a: (calls.append(1), real(*a))[1])
    monkeypatch.setattr(verify, "verify", lambda *a: verifies.append(1) or real_verify(*a))
    for drafter in (mlx_spec.NGramDrafter(), mlx_spec.DraftModelDrafter(llama_model(seed=1, layers=4))):
        calls.clear()
        verifies.clear()
        got = []
        for r in mlx_spec.stream_generate(model, tok, prompt, drafter, max_tokens=24, num_draft_tokens=3):
            got.append(r.text)
        assert "".join(got) == want
        assert len(verifies) >= 3  # steps that verified drafts (an n-gram miss is a plain step)
        assert len(calls) >= r.stats.target_forwards * 8  # 8 layers, a piece each, plain steps too


class overlapped_spy:
    """`overlap.overlapped` that also reports which layers were wrapped."""

    def __init__(self, model, every):
        self.model, self.every = model, every

    def __enter__(self):
        self.ctx = overlap.overlapped(self.model, self.every)
        queued = self.ctx.__enter__()
        layers = decoder_stack(self.model).layers
        kicked = [i for i, m in enumerate(layers) if isinstance(m, overlap._Kick)]
        return queued, kicked

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


def test_a_dropped_model_takes_its_wrappers_with_it():
    import gc

    model = llama_model(layers=4)
    with overlap.overlapped(model, every=2):
        pass
    key = id(decoder_stack(model))
    assert key in overlap._kicks
    del model
    gc.collect()
    assert key not in overlap._kicks


@pytest.mark.parametrize("kind", ["kv", "quantized", "window", "gemma3"])
def test_chain_forwards_share_one_array_mask_and_give_the_same_logits(kind, monkeypatch):
    """A chain block's forward asks its KV layers for an array mask (built once, shared by
    every layer) instead of "causal" (rebuilt in every layer on the CPU): same logits."""
    from mlx_lm.models import base

    from mlx_spec.cache import make_cache
    from mlx_spec.verify import Chain, _masked

    from tiny import gemma3_model

    model = gemma3_model(window=8) if kind == "gemma3" else llama_model(layers=3, hidden=128)
    prompt = mx.array([list(range(3, 19))], mx.uint32)

    def cache():
        c = make_cache(model) if kind in ("window", "gemma3") else make_prompt_cache(model)
        if kind == "window":
            from mlx_spec.cache import WindowKVCache

            c = [WindowKVCache(64, keep=2) for _ in c]
        model(prompt, cache=c)
        if kind == "quantized":
            c = [layer.to_quantized(group_size=32, bits=8) for layer in c]
        return c

    masks = []
    sdpa = base.scaled_dot_product_attention
    for family in ("llama", "gemma3_text"):  # each imported the function by name
        monkeypatch.setattr(f"mlx_lm.models.{family}.scaled_dot_product_attention",
                            lambda *a, mask=None, **k: masks.append(mask) or sdpa(*a, mask=mask, **k))
    block = mx.array([[5, 9, 2, 7, 1]], mx.uint32)
    mine, theirs = cache(), cache()
    masks.clear()
    want = model(block, cache=theirs)
    plain_masks = list(masks)
    masks.clear()
    got = Chain().forward(model, mine, block)
    assert mx.array_equal(got, want)
    assert all(isinstance(m, mx.array) for m in masks), [type(m) for m in masks]
    assert any(isinstance(m, str) for m in plain_masks)  # what the model asks for by itself
    assert all(type(a) is not type(b) for a, b in zip(_masked(cache()), cache()))
