"""Sliding-window targets (Gemma 3: global KV layers and window layers) decode in a batch:
rows of different lengths share one verify forward, each keeps exactly its own accepted
prefix, and each row's window is the one its solo run sees, far past the window edge."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache, make_prompt_cache

import lossless as L
import mlx_spec
import tiny
from mlx_spec import BatchDecoder, DraftModelDrafter, NGramDrafter
from mlx_spec.batch_cache import BatchCheckpoint, extract, merge
from mlx_spec.batch_window import BatchWindowKVCache
from mlx_spec.cache import Checkpoint, WindowKVCache, prepare_cache
from runs import mlx_lm_greedy as reference
from test_batch import batched_runs, drain, run_blocks

WINDOW = 8
# 2, 8 and 13 prompt tokens: one row starts past the window, one far inside it.
PROMPTS = [[3, 4], [5, 6, 7, 8, 9, 5, 6, 7], [9, 9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 9, 8]]
_model = {}


def gemma(window=WINDOW):
    if window not in _model:
        _model[window] = tiny.gemma3_model(window=window)
    return _model[window]


@pytest.fixture
def small_buffers(monkeypatch):
    """Compact every few columns, so blocks are verified and rolled back across compactions."""
    monkeypatch.setattr(BatchWindowKVCache, "step", 4)
    monkeypatch.setattr(WindowKVCache, "step", 3)


def test_the_window_changes_the_output_so_the_tests_can_fail():
    model = gemma()
    long = reference(model, PROMPTS[1], 40)
    wide = tiny.gemma3_model(window=4096)  # same weights (seed 0), a window never reached
    assert reference(wide, PROMPTS[1], 40) != long


@pytest.mark.parametrize("k", [1, 4])
def test_every_row_gets_its_solo_greedy_output_far_past_the_window(k, small_buffers):
    model = gemma()
    makers = [lambda: NGramDrafter(min_n=1), lambda: None, lambda: DraftModelDrafter(model, min_confidence=None)]
    res = mlx_spec.batch_generate(model, tiny.tokenizer(), PROMPTS, iter([m() for m in makers]).__next__,
                                  max_tokens=48, num_draft_tokens=k, trace=True)
    for prompt, got in zip(PROMPTS, res.tokens):
        assert got == reference(model, prompt, 48)
    for s in res.stats:
        assert max(s.batch_sizes) == 3  # verified together, not served one at a time
    assert res.stats[2].acceptance_rate == 1.0 and res.stats[1].drafted == 0
    if k > 1:  # ragged: in some step the rows kept different numbers of drafts
        kept = [[t.accepted for t in s.trace] for s in res.stats]
        assert any(len({r[i] for r in kept if i < len(r)}) > 1 for i in range(20))


def test_rows_join_and_leave_mid_batch(small_buffers):
    model = gemma()
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=3, prefill_chunk=5)
    a = decoder.add(PROMPTS[1], NGramDrafter(min_n=1), max_tokens=50, num_draft_tokens=3)
    out = {}
    for _ in range(6):
        for uid, block in decoder.step():
            out.setdefault(uid, []).extend(r.token for r in block)
    long = [int(t) for t in np.arange(23) * 7 % 90]  # prefilled 5 tokens a step, in turn
    b = decoder.add(long, DraftModelDrafter(model, min_confidence=None), max_tokens=12)
    c = decoder.add(PROMPTS[0], None, max_tokens=30)
    widths = []
    for _ in range(8):
        for uid, block in decoder.step():
            out.setdefault(uid, []).extend(r.token for r in block)
        widths.append(decoder.width)
    assert 3 in widths
    decoder.release(c, seen=1)  # the caller drops row c mid-block
    out, rest = drain(decoder, out)
    assert out[a] == reference(model, PROMPTS[1], 50)
    assert out[b] == reference(model, long, 12)
    assert 0 < len(out[c]) < 30 and out[c] == reference(model, PROMPTS[0], 30)[: len(out[c])]
    assert not decoder.active and decoder.batch is None


def test_a_row_leaving_the_batch_keeps_its_window_in_its_prompt_cache(small_buffers):
    model = gemma()
    cache = mlx_spec.make_cache(model)
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=2)
    a = decoder.add(PROMPTS[1], NGramDrafter(min_n=1), max_tokens=30, prompt_cache=cache)
    decoder.add(PROMPTS[2], DraftModelDrafter(model, min_confidence=None), max_tokens=40)
    out, widths = drain(decoder)
    assert max(widths) == 2 and type(cache[0]) is WindowKVCache and type(cache[1]) is KVCache
    assert cache[0].offset == cache[1].offset == len(PROMPTS[1]) + 30
    got = [r.token for r in mlx_spec.stream_generate(model, tiny.tokenizer(), [3], max_tokens=20,
                                                      prompt_cache=cache)]
    assert got == reference(model, PROMPTS[1] + out[a] + [3], 20)


def sink_model():
    if "sinks" not in _model:
        _model["sinks"] = tiny.qwen2_model()
    return _model["sinks"]


def test_rows_with_sink_windows_get_mlx_lms_own_output_in_one_batch(small_buffers):
    """`max_kv_size=12`: mlx-lm's window of 12 whose first 4 positions stay visible; every
    row runs far past it, verified together, and decodes what mlx-lm decodes alone."""
    from mlx_lm.generate import generate_step

    model = sink_model()

    def mlx_lm(p, **kw):
        return [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=40, **kw)]

    makers = [lambda: NGramDrafter(min_n=1), lambda: None, lambda: DraftModelDrafter(model, min_confidence=None)]
    res = mlx_spec.batch_generate(model, tiny.tokenizer(), PROMPTS, iter([m() for m in makers]).__next__,
                                  max_tokens=40, num_draft_tokens=4, max_kv_size=12)
    want = [mlx_lm(p, max_kv_size=12) for p in PROMPTS]
    assert res.tokens == want and any(w != mlx_lm(p) for w, p in zip(want, PROMPTS))
    assert all(max(s.batch_sizes) == 3 for s in res.stats) and res.stats[0].accepted > 0


def test_rows_of_other_window_sizes_are_served_one_at_a_time():
    decoder = BatchDecoder(sink_model(), tiny.tokenizer(), max_batch=3)
    for p, size in zip(PROMPTS, (12, 12, 16)):
        decoder.add(p, NGramDrafter(min_n=1), max_tokens=8, max_kv_size=size)
    _, widths = drain(decoder)
    assert max(widths) == 2 and widths[-1] == 1  # the two rows of 12, then the row of 16


def test_rows_pass_a_row_that_cannot_join_but_only_max_batch_of_them():
    """A row of another window size waits for the batch; rows behind it that can join start
    before it (no head-of-line blocking), but at most `max_batch` of them: then the batch
    drains and it starts (no starvation). Every row still gets mlx-lm's own output."""
    from mlx_lm.generate import generate_step

    model, sizes, lengths = sink_model(), (12, 16, 12, 12, 12), (4, 8, 40, 8, 8)  # row 2 outlives row 0
    prompts = [PROMPTS[i % 3] for i in range(len(sizes))]
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=2)
    uids = [decoder.add(p, NGramDrafter(min_n=1), max_tokens=n, max_kv_size=size)
            for p, size, n in zip(prompts, sizes, lengths)]
    starts = []
    out, _ = drain(decoder, collect=_Starts(starts))
    assert starts == [uids[i] for i in (0, 2, 3, 1, 4)]
    for u, p, size, n in zip(uids, prompts, sizes, lengths):
        assert out[u] == [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=n, max_kv_size=size)]


class _Starts(dict):
    """`drain`'s collector that records the order in which rows emit their first token."""

    def __init__(self, starts: list):
        super().__init__()
        self.starts = starts

    def __bool__(self):  # (drain takes an empty collector for none)
        return True

    def setdefault(self, uid, default):
        if uid not in self:
            self.starts.append(uid)
        return super().setdefault(uid, default)


# (kept positions per row per block, seed); blocks of 6 and 6 of them: 36 positions > window 8
blocks = st.lists(st.tuples(st.lists(st.integers(0, 6), min_size=3, max_size=3), st.integers(0, 99)),
                  min_size=1, max_size=6)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(blocks=blocks, lengths=st.lists(st.integers(1, 14), min_size=3, max_size=3),
       joiner=st.integers(0, 5))
def test_ragged_window_rollback_equals_each_rows_fresh_cache(blocks, lengths, joiner, small_buffers):
    """After any verify/keep blocks (a row joining after `joiner` of them), each row of the
    batch, and each row taken out of it, is mlx-lm's own fresh window cache of its tokens."""
    model = gemma()
    rng = np.random.default_rng(sum(lengths))
    committed = [rng.integers(0, tiny.VOCAB, n).tolist() for n in lengths]
    solos = []
    for p in committed:
        c = prepare_cache(model, make_prompt_cache(model))
        model(mx.array([p]), cache=c)
        solos.append(c)

    def fed(block, keep):
        for i in range(len(block)):
            committed[i] += block[i, : keep[i]].tolist()

    batch, rows = run_blocks(model, solos, blocks, joiner, fed, width=6)
    probe = mx.array([[7]] * rows)
    outs = [extract(batch, i) for i in range(rows)]
    got = np.array(model(probe, cache=batch)[:, -1])
    for i in range(rows):
        fresh = make_prompt_cache(model)  # mlx-lm's RotatingKVCache
        want = np.array(model(mx.array([committed[i] + [7]]), cache=fresh)[0, -1])
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4)
        alone = np.array(model(mx.array([[7]]), cache=outs[i])[0, -1])
        np.testing.assert_allclose(alone, want, rtol=1e-4, atol=1e-4)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(blocks=blocks, lengths=st.lists(st.integers(1, 14), min_size=3, max_size=3),
       joiner=st.integers(0, 5))
def test_ragged_sink_window_rollback_equals_each_rows_solo_cache(blocks, lengths, joiner, small_buffers):
    """Windows of 12 keeping 4 sinks (`max_kv_size=12`), compacted every few columns: after
    any verify/keep blocks, each row of the batch (and each row taken out of it) is its own
    solo cache given the same blocks."""
    model = sink_model()
    rng = np.random.default_rng(sum(lengths))
    solos = []
    for n in lengths:
        c = prepare_cache(model, make_prompt_cache(model, max_kv_size=12))
        model(mx.array([rng.integers(0, tiny.VOCAB, n).tolist()]), cache=c)
        solos.append(c)

    def alone(block, keep):  # each row's own cache, given the same block
        for i in range(len(block)):
            ckpt = Checkpoint(model, solos[i])
            model(mx.array(block[i : i + 1]), cache=solos[i])
            ckpt.keep(block[i, : keep[i]].tolist(), 6)

    batch, rows = run_blocks(model, solos, blocks, joiner, alone, width=6)
    assert batch[0].keep == 4
    outs = [extract(batch, i) for i in range(rows)]
    got = np.array(model(mx.array([[7]] * rows), cache=batch)[:, -1])
    for i in range(rows):
        want = np.array(model(mx.array([[7]]), cache=solos[i])[0, -1])
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4)
        taken = np.array(model(mx.array([[7]]), cache=outs[i])[0, -1])
        np.testing.assert_allclose(taken, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sinks", [False, True])
def test_the_batch_window_cache_stays_bounded(sinks):
    model = sink_model() if sinks else gemma()
    caches = [prepare_cache(model, make_prompt_cache(model, 12 if sinks else None)) for _ in range(2)]
    for c, p in zip(caches, PROMPTS[1:]):
        model(mx.array([p]), cache=c)
    batch = merge(caches)
    for _ in range(120):
        ckpt = BatchCheckpoint(batch)
        model(mx.array([[1, 2, 3, 4]] * 2), cache=batch)
        ckpt.keep([3, 4], 4)
    win = batch[0]
    assert isinstance(win, BatchWindowKVCache) and win.offset.tolist() == [8 + 360, 13 + 480]
    assert win.keep == (4 if sinks else 0)
    assert win._idx <= win.keep + win.retain + win.step + 4


@pytest.mark.slow
def test_sampled_rows_of_a_window_batch_have_the_targets_law():
    """Rows of a window-4 target (5 sampled positions after prompts of 3 to 6 tokens: every
    row crosses the window) in one batch keep the target's law; a wrong rule fails it."""
    model = tiny.gemma3_model(seed=3, window=4, vocab=8)
    draft = tiny.gemma3_model(seed=4, window=4, vocab=8)  # another network: it is often wrong
    cases = [([1, 2, 3, 1, 2, 3], dict(temp=1.0), lambda: DraftModelDrafter(draft, min_confidence=None)),
             ([4, 5, 6], dict(temp=0.8, top_p=0.9), lambda: NGramDrafter(min_n=1)),
             ([4, 5, 4, 5], dict(temp=1.2), lambda: NGramDrafter(min_n=1))]
    joints = [L.exact_joint(model, p, 5, kw, vocab=8) for p, kw, _ in cases]

    def runs(n):
        return batched_runs(model, cases, n, group=1)  # rows prefill one by one: wider is slower

    for r, joint in zip(runs(400), joints):
        L.assert_lossless(r, joint)
    with pytest.MonkeyPatch.context() as mp:  # (the first two rows: only the first is checked)
        L.use_rule(mp, L.wrong_rule(residual="p"))
        L.assert_caught(batched_runs(model, cases[:2], 200, group=1)[0], joints[0])  # p < 1e-14 from 200 runs


@pytest.mark.download
@pytest.mark.slow
def test_real_gemma3_rows_get_their_solo_greedy_output_past_a_shortened_window():
    """gemma-3-270m's real weights with its 512-token window cut to 12 (the model's own
    mask and mlx-lm's cache both follow `sliding_window`), so 24 tokens cross it."""
    from mlx_lm.generate import generate_step

    from mlx_spec import zoo

    model, tok = mlx_spec.load(str(zoo.fetch("gemma-3-270m", dtype="float32")))
    model.args.sliding_window = model.model.window_size = 12
    texts = ["Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox.",
             "Hi", "Write a Python function that returns the squares of a list of numbers."]
    ids = [tok.encode(t) for t in texts]
    want = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=24)] for p in ids]
    res = mlx_spec.batch_generate(model, tok, ids, lambda: NGramDrafter(), max_tokens=24,
                                  num_draft_tokens=4)
    assert res.tokens == want
    assert all(max(s.batch_sizes) == 3 for s in res.stats) and res.stats[0].accepted > 0
