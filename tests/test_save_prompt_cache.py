"""`mlx_spec.save_prompt_cache`: a prompt cache mlx-spec used (its sliding-window layers are
`WindowKVCache`) saved in mlx-lm's format, read back by mlx-lm's `load_prompt_cache`, and
continued by mlx-lm or mlx-spec as if nothing had happened."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, load_prompt_cache, save_prompt_cache

import mlx_spec
import tiny
from mlx_spec.cache import CacheRollbackError, WindowKVCache
from mlx_spec.prompt_cache import _as_mlx_lm


def _keys(start: int, n: int) -> mx.array:
    """Keys whose first number is the position + 1 (0 would be a row holding no position)."""
    return mx.broadcast_to(mx.arange(start + 1, start + n + 1, dtype=mx.float32)[None, None, :, None], (1, 1, n, 2))


def _seen(cache, n: int, start: int) -> list[set]:
    """Write positions start..start+n-1; the positions each of their queries attends to."""
    mask = cache.make_mask(n, return_array=isinstance(cache, WindowKVCache))
    k, _ = cache.update_and_fetch(_keys(start, n), _keys(start, n))
    rows = np.array(k[0, 0, :, 0]).astype(int).tolist()
    if mask is None:
        mask = np.ones((n, len(rows)), bool)
    elif isinstance(mask, str):  # "causal": the queries are the last n rows
        mask = np.tril(np.ones((n, len(rows)), bool), len(rows) - n)
    mask = np.broadcast_to(np.array(mask), (n, len(rows)))
    return [{rows[j] - 1 for j in range(len(rows)) if mask[i, j]} for i in range(n)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keep=st.sampled_from([0, 2]), ops=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 7)), min_size=1,
                                                   max_size=10),
       then=st.lists(st.integers(1, 4), min_size=1, max_size=6))
@example(keep=0, ops=[(6, 0), (3, 0), (3, 6)], then=[1, 3, 1])  # rolled back to window - 1 rows
@example(keep=2, ops=[(6, 0), (3, 0), (3, 6)], then=[1, 1, 1])
def test_a_saved_window_layer_is_the_ring_mlx_lm_would_hold(monkeypatch, keep, ops, then):
    """Blocks written and rolled back (crossing compactions), then converted: every later query
    sees the same positions in the converted ring (mlx-lm's own code) as in the window layer.
    With sink positions (keep > 0) mlx-lm reads blocks of several tokens differently (its mask
    hides the sinks from most of a block): there the queries continue one token at a time."""
    monkeypatch.setattr(WindowKVCache, "step", 3)
    window = WindowKVCache(window=6, spare=3, keep=keep)
    for n, back in ops:
        _seen(window, n, window.offset)
        try:
            window.trim(back)
        except CacheRollbackError:
            pass
    ring = _as_mlx_lm(window)
    assert isinstance(ring, RotatingKVCache) and ring.offset == window.offset
    for n in then if keep == 0 else [1] * sum(then):
        start = window.offset
        assert _seen(ring, n, start) == _seen(window, n, start)


@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_a_saved_cache_continues_in_mlx_lm_and_mlx_spec(tmp_path, drafter):
    model, tok = tiny.gemma3_model(window=8), tiny.tokenizer()
    draft = mlx_spec.NGramDrafter(min_n=1) if drafter == "ngram" else mlx_spec.DraftModelDrafter(
        tiny.gemma3_model(seed=1, window=8), min_confidence=None)
    cache = mlx_spec.make_cache(model)
    first = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    out = list(mlx_spec.stream_generate(model, tok, first, draft, max_tokens=14, prompt_cache=cache,
                                        num_draft_tokens=4))
    assert out[-1].stats.drafted > out[-1].stats.accepted  # drafts were rolled back
    layers = [type(c).__name__ for c in cache]
    assert "WindowKVCache" in layers
    path = str(tmp_path / "cache.safetensors")
    mlx_spec.save_prompt_cache(path, cache, {"turns": "1"})
    assert [type(c).__name__ for c in cache] == layers  # the caller's cache is as it was
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"turns": "1"} and "RotatingKVCache" in {type(c).__name__ for c in loaded}

    second = [9, 8, 7, 6, 5]
    want = [r.token for r in mlx_spec.stream_generate(model, tok, second, max_tokens=20, prompt_cache=cache)]
    by_mlx_lm = [int(t) for t, _ in generate_step(mx.array(second), model, max_tokens=20, prompt_cache=loaded)]
    assert by_mlx_lm == want
    again = load_prompt_cache(path)  # and mlx-spec, drafting, from the file
    spec = mlx_spec.stream_generate(model, tok, second, mlx_spec.NGramDrafter(min_n=1), max_tokens=20,
                                    prompt_cache=again, num_draft_tokens=4)
    assert [r.token for r in spec] == want


def test_mlx_lm_cannot_write_the_layers_itself(tmp_path):
    """Why the function exists: mlx-lm's own writer or reader fails on a used cache."""
    model = tiny.gemma3_model(window=8)
    cache = mlx_spec.make_cache(model)
    model(mx.array([list(range(12))]), cache=cache)
    with pytest.raises((AttributeError, KeyError, ValueError, TypeError)):
        save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
        load_prompt_cache(str(tmp_path / "c.safetensors"))
