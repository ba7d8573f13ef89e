"""Forwards evaluated in pieces while the rest is built (`mlx_spec.overlap`)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx.utils import tree_flatten

import mlx_spec
from mlx_spec import overlap
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


def test_speculative_steps_queue_their_pieces(monkeypatch):
    """The verify forward (and a draft model's forwards) are queued in pieces, and the
    output is still plain decoding's."""
    model, tok = llama_model(layers=8), tokenizer()
    prompt = [5, 6, 7, 8] * 4
    want = mlx_spec.generate(model, tok, prompt, None, max_tokens=24)
    calls = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (calls.append(1), real(*a))[1])
    for drafter in (mlx_spec.NGramDrafter(), mlx_spec.DraftModelDrafter(llama_model(seed=1, layers=4))):
        calls.clear()
        got = []
        for r in mlx_spec.stream_generate(model, tok, prompt, drafter, max_tokens=24, num_draft_tokens=3):
            got.append(r.text)
        assert "".join(got) == want
        steps = r.stats.target_forwards
        assert len(calls) >= steps * 8  # 8 layers, a piece each


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
