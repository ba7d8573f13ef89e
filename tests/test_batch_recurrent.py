"""Recurrent targets (Qwen3.5-style GatedDeltaNet + attention) decode in a batch: one verify
forward for all rows; the rows that rejected part of their block (only those) get their
recurrent state back from before the block and replay their kept tokens together."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

import lossless as L
import mlx_spec
import tiny
from mlx_spec import BatchDecoder, DraftModelDrafter, NGramDrafter
from mlx_spec.batch_cache import BatchCheckpoint, extract, merge
from runs import mlx_lm_greedy as reference
from test_batch import batched_runs, drain, run_blocks

PROMPTS = [[3, 4], [5, 6, 7, 8, 9, 5, 6, 7], [9, 9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 9, 8]]
_model = {}


def hybrid():
    if "m" not in _model:
        _model["m"] = tiny.qwen3_5_model()
    return _model["m"]


def near(scale=0.2, **kw):
    """The target with a noisy LM head: a draft model that is right about half the time."""
    d = tiny.qwen3_5_model(**kw)
    head = d.language_model.lm_head
    mx.random.seed(7)
    head.weight = head.weight + scale * mx.random.normal(head.weight.shape)
    mx.eval(d.parameters())
    return d


class Counting:
    """The model, counting the rows and tokens of each forward."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, tokens, cache=None):
        self.calls.append(tokens.shape)
        return self.model(tokens, cache=cache)


@pytest.mark.parametrize("k", [2, 4])
def test_every_row_gets_its_solo_greedy_output(k):
    model = hybrid()
    other = near()
    makers = [lambda: DraftModelDrafter(other, min_confidence=None), lambda: None, lambda: DraftModelDrafter(model, min_confidence=None)]
    res = mlx_spec.batch_generate(model, tiny.tokenizer(), PROMPTS, iter([m() for m in makers]).__next__,
                                  max_tokens=30, num_draft_tokens=k, trace=True)
    for prompt, got in zip(PROMPTS, res.tokens):
        assert got == reference(model, prompt, 30)
    assert all(max(s.batch_sizes) == 3 for s in res.stats)
    assert res.stats[2].acceptance_rate == 1.0 and 0 < res.stats[0].acceptance_rate < 1.0


def test_only_the_rows_that_rejected_something_are_replayed():
    model = hybrid()
    counting = Counting(model)
    caches = []
    for p in PROMPTS:
        c = mlx_spec.make_cache(model)
        model(mx.array([p]), cache=c)
        caches.append(c)
    batch = merge(caches)
    ckpt = BatchCheckpoint(batch, counting)
    model(mx.array([[1, 2, 3, 4]] * 3), cache=batch)
    ckpt.keep([[1, 2, 3, 4], [1, 2], [1, 2, 3, 4]], 4)
    assert counting.calls == [(1, 2)]  # row 1 alone, over its 2 kept tokens
    ckpt = BatchCheckpoint(batch, counting)
    model(mx.array([[5, 6, 7]] * 3), cache=batch)
    ckpt.keep([[5, 6, 7]] * 3, 3)
    assert counting.calls == [(1, 2)]  # everyone kept everything: no replay
    committed = [p + t for p, t in zip(PROMPTS, [[1, 2, 3, 4, 5, 6, 7], [1, 2, 5, 6, 7],
                                                  [1, 2, 3, 4, 5, 6, 7]])]
    got = np.array(model(mx.array([[7]] * 3), cache=batch)[:, -1])
    for i, c in enumerate(committed):
        want = np.array(model(mx.array([c + [7]]))[0, -1])
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4)


def test_rows_join_leave_and_stop_mid_block():
    model = hybrid()
    want = reference(model, PROMPTS[1], 40)
    tok = tiny.tokenizer(eos=want[14])  # row a stops at its 15th token, inside a kept block
    decoder = BatchDecoder(model, tok, max_batch=3, prefill_chunk=5)
    a = decoder.add(PROMPTS[1], DraftModelDrafter(model, min_confidence=None), max_tokens=40, num_draft_tokens=4)
    out = {}
    for _ in range(2):
        for uid, block in decoder.step():
            out.setdefault(uid, []).extend(r.token for r in block)
    long = [int(t) for t in np.arange(17) * 7 % 90]
    b = decoder.add(long, DraftModelDrafter(near(), min_confidence=None), max_tokens=25)
    c = decoder.add(PROMPTS[0], NGramDrafter(min_n=1), max_tokens=30)
    for _ in range(6):
        for uid, block in decoder.step():
            out.setdefault(uid, []).extend(r.token for r in block)
    decoder.release(c, seen=1)  # the caller drops row c mid-block
    out, widths = drain(decoder, out)
    assert out[a] == want[:15]
    assert out[b] == reference(model, long, 25)
    assert 0 < len(out[c]) < 30 and out[c] == reference(model, PROMPTS[0], 30)[: len(out[c])]
    assert not decoder.active and decoder.batch is None


@pytest.mark.parametrize("drafter", ["self", "other"])
def test_a_row_leaving_mid_block_leaves_its_prompt_cache_as_the_caller_saw_it(drafter):
    """Its batch step is undone on its own cache: states from before the block, then the
    tokens the caller saw replayed."""
    model = hybrid()
    d = DraftModelDrafter(model if drafter == "self" else near(), min_confidence=None)
    cache = mlx_spec.make_cache(model)
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=2)
    a = decoder.add(PROMPTS[1], d, max_tokens=40, num_draft_tokens=4, prompt_cache=cache)
    decoder.add(PROMPTS[2], DraftModelDrafter(model, min_confidence=None), max_tokens=40)
    out, last = {}, 0
    while last < 2 or len(out[a]) < 6:  # until a's last block is a kept draft and more
        for uid, block in decoder.step():
            out.setdefault(uid, []).extend(r.token for r in block)
            last = len(block) if uid == a else last
    assert decoder.width == 2
    decoder.release(a, seen=1)  # saw one token of its last block
    seen = out[a][: len(out[a]) - last + 1]
    assert any(isinstance(c, ArraysCache) for c in cache)
    got = [r.token for r in mlx_spec.stream_generate(model, tiny.tokenizer(), [3], max_tokens=10,
                                                      prompt_cache=cache)]
    assert got == reference(model, PROMPTS[1] + seen + [3], 10)


# (kept positions per row per block, seed)
blocks = st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=3, max_size=3), st.integers(0, 99)),
                  min_size=1, max_size=5)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=blocks, lengths=st.lists(st.integers(1, 9), min_size=3, max_size=3),
       joiner=st.integers(0, 4))
def test_ragged_recurrent_rollback_equals_each_rows_fresh_cache(blocks, lengths, joiner):
    """After any verify/keep blocks (a row joining after `joiner` of them), each row of the
    batch, and each row taken out of it, is a fresh cache of its committed tokens."""
    model = hybrid()
    rng = np.random.default_rng(sum(lengths))
    committed = [rng.integers(0, tiny.VOCAB, n).tolist() for n in lengths]
    solos = []
    for p in committed:
        c = mlx_spec.make_cache(model)
        model(mx.array([p]), cache=c)
        solos.append(c)

    def fed(block, keep):
        for i in range(len(block)):
            committed[i] += block[i, : keep[i]].tolist()

    batch, rows = run_blocks(model, solos, blocks, joiner, fed, width=5)
    outs = [extract(batch, i) for i in range(rows)]
    got = np.array(model(mx.array([[7]] * rows), cache=batch)[:, -1])
    # float32 recurrences summed in another order (blocks, replays) against one forward: up to
    # ~2e-4 apart on logits of size 1-10 (blocks=[([0, 3, 0], 88), ([0, 4, 0], 44)], lengths
    # [7, 5, 4], joiner 2); a wrong state is off by whole units.
    tol = dict(rtol=1e-3, atol=1e-3)
    for i in range(rows):
        want = np.array(model(mx.array([committed[i] + [7]]), cache=make_prompt_cache(model))[0, -1])
        np.testing.assert_allclose(got[i], want, **tol)
        alone = np.array(model(mx.array([[7]]), cache=outs[i])[0, -1])
        np.testing.assert_allclose(alone, want, **tol)


def test_seeded_rows_sample_the_same_alone_or_in_the_batch():
    """Sampled rows that reject and replay: each seeded row's tokens are its solo run's."""
    model = hybrid()
    cases = [(PROMPTS[0], dict(temp=1.0), lambda: DraftModelDrafter(near(), min_confidence=None)),
             (PROMPTS[1], dict(temp=0.7, top_p=0.9), lambda: NGramDrafter(min_n=1)),
             (PROMPTS[2], dict(temp=1.3), lambda: DraftModelDrafter(model, min_confidence=None))]
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=3)
    uids = [decoder.add(p, make(), max_tokens=20, num_draft_tokens=3, seed=5, **kw)
            for p, kw, make in cases]
    out, widths = drain(decoder)
    assert max(widths) == 3
    for (p, kw, make), uid in zip(cases, uids):
        solo = mlx_spec.stream_generate(model, tiny.tokenizer(), p, make(), max_tokens=20,
                                        num_draft_tokens=3, seed=5, **kw)
        assert out[uid] == [r.token for r in solo]
    assert 0 < decoder.last_stats[uids[0]].acceptance_rate < 1


@pytest.mark.slow
def test_sampled_rows_of_a_recurrent_batch_have_the_targets_law():
    """Rows of a hybrid target with different drafters and temperatures in one batch keep
    the target's law; a wrong rule fails it."""
    model = tiny.qwen3_5_model(seed=3, vocab=8)
    draft = near(1.0, seed=3, vocab=8)  # ~70% of its drafts accepted: rejections matter
    cases = [([1, 2, 3, 1, 2, 3], dict(temp=1.0), lambda: DraftModelDrafter(draft, min_confidence=None)),
             ([4, 5, 6], dict(temp=0.8, top_p=0.9), lambda: DraftModelDrafter(draft, min_confidence=None)),
             ([4, 5, 4, 5], dict(temp=1.2), lambda: NGramDrafter(min_n=1))]
    joints = [L.exact_joint(model, p, 5, kw, vocab=8) for p, kw, _ in cases]

    def runs(n):
        return batched_runs(model, cases, n, group=1)  # rows prefill one by one: wider is slower

    for r, joint in zip(runs(400), joints):
        L.assert_lossless(r, joint)
    with pytest.MonkeyPatch.context() as mp:  # (the first two rows: only the first is checked)
        L.use_rule(mp, L.wrong_rule(residual="p"))
        L.assert_caught(batched_runs(model, cases[:2], 200, group=1)[0], joints[0])  # p < 1e-14 from 200 runs
