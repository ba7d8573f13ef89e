"""Rollback property: after any sequence of verify/keep steps, the cache is as if only
the committed tokens had ever been fed."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import (
    ArraysCache,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    make_prompt_cache,
)

import mlx_spec
import tiny
from mlx_lm.generate import generate_step
from mlx_spec.cache import (
    CacheRollbackError,
    Checkpoint,
    WindowKVCache,
    is_recurrent,
    make_cache,
    prepare_cache,
)


def quantized(model):
    return [c.to_quantized(group_size=32, bits=8) for c in make_prompt_cache(model)]


MODELS = {
    "kv": (lambda: tiny.llama_model(), make_prompt_cache),
    "quantized": (lambda: tiny.llama_model(hidden=128, heads=4, kv_heads=2), quantized),
    "window": (lambda: tiny.gemma3_model(window=8), make_prompt_cache),
    # mlx-lm's max_kv_size cache: a 10-position window whose first 4 positions stay visible.
    # (qwen2: mlx-lm's llama builds its own cache and ignores max_kv_size)
    "sinks": (lambda: tiny.qwen2_model(), lambda m: prepare_cache(m, make_prompt_cache(m, 10))),
    "recurrent": (lambda: tiny.qwen3_5_model(), make_prompt_cache),
    # window 8 and a layer pooling groups of 4: blocks cross evictions and group closings.
    # Its KV is rounded through FP8/FP4, so BLAS noise that depends on how the tokens were
    # chunked can flip a rounding (~4e-3 in the logits with OpenBLAS): tolerance as quantized.
    "deepseek_v41": (lambda: tiny.deepseek_v41_model(window=8), make_prompt_cache),
}
_built = {}


def model_for(name):
    if name not in _built:
        _built[name] = MODELS[name][0]()
    return _built[name]


def next_logits(model, cache, token):
    return np.array(model(mx.array([[token]]), cache=cache)[0, -1])


# (block length, tokens kept, seed, fed one token at a time like a draft model's chain)
steps = st.lists(
    st.tuples(st.integers(1, 17), st.integers(0, 17), st.integers(0, 2**31 - 1), st.booleans()),
    min_size=1, max_size=8,
)


@pytest.fixture
def small_window_buffers(monkeypatch):
    # Compact the window buffer every few tokens so rollbacks cross compactions.
    monkeypatch.setattr(WindowKVCache, "step", 3)


@pytest.mark.parametrize("name", list(MODELS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(steps=steps, prompt_len=st.integers(1, 12))
@example(steps=[(1, 1, 0, False), (2, 2, 0, False), (5, 5, 252215, False), (4, 4, 2732, True), (12, 12, 231, False)],
         prompt_len=2)  # a chunking DeepSeek-V4.1's pooled layers compute differently from one pass
def test_rollback_equals_fresh_cache(name, steps, prompt_len, small_window_buffers):
    model = model_for(name)
    make_ref = MODELS[name][1]
    rng = np.random.default_rng(prompt_len)
    committed = rng.integers(0, tiny.VOCAB, prompt_len).tolist()
    cache = prepare_cache(model, make_ref(model))
    model(mx.array([committed]), cache=cache)
    # The reference is fed the kept tokens in the chunks the kept cache saw them in: a block
    # kept whole as it was fed, a cut block's kept prefix at once (what a replay feeds). Some
    # targets' arithmetic depends on the chunking itself (DeepSeek-V4.1's pooled layers: 0.14
    # on a logit for 1+2+5+4+12 tokens vs 24 at once, nothing rolled back), which is not what
    # this test is about.
    chunks = [list(committed)]
    for block_len, keep, seed, chained in steps:
        block = np.random.default_rng(seed).integers(0, tiny.VOCAB, block_len).tolist()
        keep = min(keep, block_len)
        ckpt = Checkpoint(model, cache)
        fed = [[t] for t in block] if chained else [block]
        for chunk in fed:
            model(mx.array([chunk]), cache=cache)
            mx.eval([c.state for c in cache])
        ckpt.keep(block[:keep], block_len)
        committed += block[:keep]
        chunks += fed if keep == block_len else [block[:keep]] if keep else []
    fresh = make_ref(model)
    for chunk in chunks:
        model(mx.array([chunk]), cache=fresh)
    got, want = next_logits(model, cache, 7), next_logits(model, fresh, 7)
    # A recurrent layer fed 5 + 10 tokens vs 15 at once sums its chunked recurrence in another
    # float32 order (seen: 1.6e-4 on a logit, with nothing rolled back); a wrong rollback moves
    # logits by O(1).
    tol = 2e-2 if name in ("quantized", "deepseek_v41") else 5e-4 if name == "recurrent" else 1e-4
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_window_cache_holds_only_what_rollback_needs():
    model = model_for("window")
    cache = make_cache(model)
    assert any(isinstance(c, WindowKVCache) for c in cache)
    for _ in range(40):
        model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    win = next(c for c in cache if isinstance(c, WindowKVCache))
    assert win.offset == 200
    assert win._len <= win.window - 1 + win.spare + 5 + win.step


def test_window_cache_refuses_a_rollback_past_its_spare():
    c = WindowKVCache(window=4, spare=2)
    c.update_and_fetch(mx.zeros((1, 1, 300, 2)), mx.zeros((1, 1, 300, 2)))
    # This write overflows the buffer: only window - 1 + spare = 5 old positions stay.
    c.update_and_fetch(mx.zeros((1, 1, 257, 2)), mx.zeros((1, 1, 257, 2)))
    assert c._len == 5 + 257
    with pytest.raises(CacheRollbackError):
        c.trim(257 + 3)  # would leave 2 < window - 1 positions for the next query
    assert c.trim(257 + 2) == 259 and c.offset == 300 - 2


def test_filled_rotating_prompt_cache_is_taken_over():
    model = model_for("window")
    rotating = make_prompt_cache(model)
    model(mx.array([list(range(20))]), cache=rotating)
    for i in range(5):  # single-token steps wrap the ring
        model(mx.array([[i]]), cache=rotating)
    reference = make_prompt_cache(model)
    model(mx.array([list(range(20)) + list(range(5))]), cache=reference)
    converted = prepare_cache(model, rotating)
    assert rotating is converted and isinstance(converted[0], WindowKVCache)
    np.testing.assert_allclose(
        next_logits(model, converted, 3), next_logits(model, reference, 3), rtol=1e-4, atol=1e-4
    )


def test_unsupported_caches_are_refused_by_name():
    with pytest.raises(CacheRollbackError, match="ChunkedKVCache"):
        prepare_cache(None, [KVCache(), ChunkedKVCache(8)])


def test_sink_window_sees_the_first_positions_and_the_recent_ones():
    c = WindowKVCache(window=6, spare=2, keep=2)
    c.update_and_fetch(mx.zeros((1, 1, 10, 2)), mx.zeros((1, 1, 10, 2)))
    mask = np.array(c.make_mask(3, return_array=True))  # queries at positions 10, 11, 12
    # Rows are positions 0..9 then the 3 new ones; each query sees 0, 1 and its last 4.
    want = [[p <= q and (p < 2 or p > q - 4) for p in range(13)] for q in (10, 11, 12)]
    assert mask.tolist() == want


def test_max_kv_size_decodes_like_mlx_lm_far_past_the_window():
    """mlx-lm's RotatingKVCache(keep=4) in single-token steps = mlx-spec's window with sinks,
    with drafted blocks or without."""
    model = model_for("sinks")
    assert {c.keep for c in prepare_cache(model, make_prompt_cache(model, 12))} == {4}
    prompt = [5, 6, 7, 8, 9, 5]
    want = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=40, max_kv_size=12)]
    unlimited = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=40)]
    assert want != unlimited  # the window changes this model's output
    for drafter in (None, mlx_spec.NGramDrafter(min_n=1), mlx_spec.DraftModelDrafter(model, min_confidence=None)):
        out = mlx_spec.stream_generate(model, tiny.tokenizer(), prompt, drafter, max_tokens=40,
                                       max_kv_size=12, num_draft_tokens=4)
        assert [r.token for r in out] == want


def test_deepseek_v41_layer_cache_rolls_back_far_past_its_window():
    """Snapshot + replay over 90 positions (window 8, groups of 4), vs one fresh forward."""
    model = model_for("deepseek_v41")
    cache = make_cache(model)
    assert is_recurrent(cache)  # LayerCache: restored and replayed, never trimmed
    rng = np.random.default_rng(0)
    committed = rng.integers(0, tiny.VOCAB, 5).tolist()
    model(mx.array([committed]), cache=cache)
    while len(committed) < 90:
        block = rng.integers(0, tiny.VOCAB, int(rng.integers(1, 8))).tolist()
        keep = int(rng.integers(0, len(block) + 1))
        ckpt = Checkpoint(model, cache)
        model(mx.array([block]), cache=cache)
        ckpt.keep(block[:keep], len(block))
        committed += block[:keep]
    assert cache[1].offset == len(committed) and cache[1].compress_kv.shape[1] == len(committed) // 4
    fresh = make_prompt_cache(model)
    model(mx.array([committed]), cache=fresh)
    np.testing.assert_allclose(next_logits(model, cache, 7), next_logits(model, fresh, 7),
                               rtol=2e-2, atol=2e-2)  # FP8/FP4 rounding flips, see MODELS


def test_supported_layers_pass_through():
    caches = [KVCache(), QuantizedKVCache(), ArraysCache(2)]
    assert prepare_cache(None, list(caches)) == caches


def test_checkpoint_follows_cache_types_registered_after_use():
    """Checkpoints look a layer class's role up once; registering the class later (a target
    module does, on import) must still make the next checkpoint snapshot it."""
    from mlx_spec.cache import register_cache_types

    class LateState:  # one state array, reassigned on update (a recurrent layer's way)
        def __init__(self):
            self.state, self.offset = mx.zeros((2,)), 0

    layer = LateState()
    Checkpoint(None, [layer, KVCache()])  # unregistered: taken for a trimmable layer
    register_cache_types(snapshots={LateState: ("state",)})
    before = layer.state
    ckpt = Checkpoint(None, [layer, KVCache()])
    layer.state = mx.ones((2,))
    ckpt.restore()
    assert layer.state is before
