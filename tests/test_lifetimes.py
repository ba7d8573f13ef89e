"""Drafters, taps and caches are safe to use from several generators: refused when they
would corrupt each other, correct when they can share, and restored on failure."""

import gc

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_spec
import tiny
from mlx_spec import DraftModelDrafter, NGramDrafter
from mlx_spec.cache import Checkpoint, make_cache
from mlx_spec.identity import InUseError
from mlx_spec.taps import FINAL_NORM, Taps, _Recorder
from runs import mlx_lm_greedy as reference

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7]


def tokens(gen):
    return [r.token for r in gen]


def test_a_drafter_in_use_by_a_live_generator_is_refused():
    model = tiny.llama_model()
    drafter = DraftModelDrafter(tiny.llama_model(seed=3, layers=1))
    first = mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, drafter, max_tokens=20)
    next(first)
    with pytest.raises(InUseError, match="drafter is in use"):
        mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, drafter, max_tokens=5)
    # The refused call changed nothing: the first generator still gives the target's output.
    assert [next(first).token] + tokens(first) == reference(model, PROMPT, 20)[1:]
    # Finished: the drafter is free again.
    assert tokens(mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, drafter, max_tokens=5)) \
        == reference(model, PROMPT, 5)


def test_a_closed_or_dropped_generator_frees_its_drafter_and_cache():
    model = tiny.llama_model()
    drafter, cache = NGramDrafter(), make_cache(model)
    gen = mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, drafter, max_tokens=20,
                                   prompt_cache=cache)
    with pytest.raises(InUseError, match="prompt cache"):
        mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, max_tokens=5, prompt_cache=cache)
    next(gen)
    gen.close()
    list(mlx_spec.stream_generate(model, tiny.tokenizer(), [3], drafter, max_tokens=2, prompt_cache=cache))
    unstarted = mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, drafter, max_tokens=5)
    del unstarted
    gc.collect()
    assert len(tokens(mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, drafter, max_tokens=5))) == 5


def test_interleaved_generators_on_one_model_share_its_taps_correctly():
    """Two heads' generators step in turns on one target: each gets its own target's
    hidden states, and the model is unwrapped only when the last one ends."""
    model = tiny.llama_model(layers=3)
    a, b = _TapEcho((1,)), _TapEcho((1, FINAL_NORM))
    ga = mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, a, max_tokens=12, num_draft_tokens=2)
    gb = mlx_spec.stream_generate(model, tiny.tokenizer(), [9, 8, 7], b, max_tokens=12, num_draft_tokens=2)
    got_a, got_b = [next(ga).token], [next(gb).token]
    for _ in range(11):
        got_a.append(next(ga).token)
        got_b.append(next(gb).token)
    assert got_a == reference(model, PROMPT, 12) and got_b == reference(model, [9, 8, 7], 12)
    # Every step's taps are the rows of that generator's own tokens: a fresh forward agrees.
    for echo, prompt, got in ((a, PROMPT, got_a), (b, [9, 8, 7], got_b)):
        with Taps(model, echo.taps) as taps:
            model(mx.array([prompt + got])[:, :-1])
            full = taps.read()
        seen = {t: mx.concatenate([r[t] for r in echo.received]) for t in echo.taps}
        for t in echo.taps:
            np.testing.assert_allclose(np.array(seen[t]), np.array(full[t][: seen[t].shape[0]]),
                                       rtol=1e-4, atol=1e-4)
    ga.close()
    assert isinstance(model.model.layers[1], _Recorder)  # b still reads layer 1
    gb.close()
    assert not any(isinstance(m, _Recorder) for m in [*model.model.layers, model.model.norm])


class _TapEcho:
    """Proposes nothing useful (a fixed token) and keeps the taps it is given."""

    max_draft = 4

    def __init__(self, taps):
        self.taps, self.received = taps, []

    def bind(self, model, tokenizer):
        self.received = []

    def prefill(self, tokens, taps):
        self.received.append(taps)

    def propose(self, y, k, sampling):
        return mlx_spec.Draft(mx.array([3] * k, mx.uint32))

    def commit(self, tokens, taps):
        self.received.append(taps)


@pytest.mark.parametrize("name", ["kv", "window", "hybrid"])
def test_a_forward_that_fails_half_way_leaves_every_layer_as_it_was(name):
    model = {"kv": lambda: tiny.llama_model(layers=4), "window": lambda: tiny.gemma3_model(window=8),
             "hybrid": lambda: tiny.qwen3_5_model()}[name]()
    cache = make_cache(model)
    model(mx.array([list(range(20))]), cache=cache)
    layers = model.model.layers if hasattr(model, "model") else model.language_model.model.layers
    broken = layers[2]

    class Boom(Exception):
        pass

    class Exploding:  # looks like the layer to the model, raises when called
        def __getattr__(self, key):
            return getattr(broken, key)

        def __call__(self, *a, **k):
            raise Boom

    ckpt = Checkpoint(model, cache)
    layers[2] = Exploding()  # layers 0 and 1 append the block, 2 and 3 never do
    with pytest.raises(Boom):
        model(mx.array([[1, 2, 3]]), cache=cache)
    layers[2] = broken
    ckpt.keep([])
    fresh = make_prompt_cache(model)
    model(mx.array([list(range(20))]), cache=fresh)
    got = np.array(model(mx.array([[4]]), cache=cache))
    want = np.array(model(mx.array([[4]]), cache=fresh))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_drafter_that_fails_leaves_the_prompt_cache_as_the_caller_saw_it():
    model = tiny.llama_model()
    cache = make_cache(model)

    class Flaky(NGramDrafter):
        calls = 0

        def propose(self, y, k, sampling):
            Flaky.calls += 1
            if Flaky.calls == 3:
                raise RuntimeError("drafter broke")
            return super().propose(y, k, sampling)

    seen = []
    with pytest.raises(RuntimeError, match="drafter broke"):
        for r in mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, Flaky(min_n=1),
                                          max_tokens=30, prompt_cache=cache, num_draft_tokens=3):
            seen.append(r.token)
    assert seen and cache[0].offset == len(PROMPT) + len(seen)
    after = tokens(mlx_spec.stream_generate(model, tiny.tokenizer(), [3], max_tokens=8, prompt_cache=cache))
    assert after == reference(model, PROMPT + seen + [3], 8)


def test_a_failed_prefill_leaves_the_prompt_cache_untouched():
    model = tiny.llama_model()
    cache = make_cache(model)
    list(mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, max_tokens=3, prompt_cache=cache))
    before = cache[0].offset

    class BadPrefill(NGramDrafter):
        def prefill(self, tokens, taps):
            raise RuntimeError("prefill broke")

    with pytest.raises(RuntimeError, match="prefill broke"):
        list(mlx_spec.stream_generate(model, tiny.tokenizer(), [1, 2, 3, 4], BadPrefill(),
                                      max_tokens=3, prompt_cache=cache, prefill_step_size=2))
    assert all(c.offset == before for c in cache)
