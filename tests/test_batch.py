"""Several requests decoded together: one verify forward for all rows, each row keeping
exactly its own accepted prefix (ragged), its own drafter, sampling and seed; rows join
and leave between steps; every row's output is its solo output."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

import lossless as L
import mlx_spec
import tiny
from mlx_spec import BatchDecoder, DraftModelDrafter, NGramDrafter
from mlx_spec.batch_cache import BatchCheckpoint, join, merge
from runs import counted, mlx_lm_greedy as reference

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 4], [9, 9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 9, 8],
           [40, 41, 40, 41, 40]]


def drain(decoder, collect=None):
    """Step until every row is done; returns {uid: tokens} and each step's row count."""
    out, widths = collect or {}, []
    decoder.last_stats = getattr(decoder, "last_stats", {})
    while decoder.busy:
        events = decoder.step()
        widths.append(decoder.width)
        for uid, block in events:
            out.setdefault(uid, []).extend(r.token for r in block)
            if block and block[-1].finish_reason is not None:
                decoder.last_stats[uid] = block[-1].stats
                decoder.release(uid)
    return out, widths


def run_blocks(model, solos, blocks, joiner, after, width: int):
    """Rows 0 and 1 of `solos` merged, row 2 joining before block `joiner`: each block of
    `width` random tokens a row verified at once and row i keeping the first keep[i] of them
    (`blocks`: (keep, seed) pairs); `after(block, keep)` each time. Returns (batch, rows)."""
    batch, rows = merge(solos[:2]), 2
    for j, (keep, seed) in enumerate(blocks):
        if j == joiner and rows == 2:
            join(batch, solos[2])
            rows = 3
        block = np.random.default_rng(seed).integers(0, tiny.VOCAB, (rows, width))
        ckpt = BatchCheckpoint(batch, model)
        model(mx.array(block), cache=batch)
        ckpt.keep([block[i, : keep[i]].tolist() for i in range(rows)], width)
        after(block, keep)
    return batch, rows


def batched_runs(model, cases, n: int, tokens: int = 5, vocab: int = 8, group: int = 20) -> list:
    """`n` seeded runs of `cases` ((prompt, sampling options, drafter maker) per row, all
    verified together at k = 3): each row's sampled tokens and traces, as `lossless.Runs`.

    `group` runs share one batch (rows of `len(cases) * group`): run r's rows have seed r,
    and rows never see each other, so the runs stay independent draws.
    """
    out_tokens, traces = [np.full((n, tokens), vocab) for _ in cases], [[] for _ in cases]
    for first in range(0, n, group):
        seeds = range(first, min(n, first + group))
        decoder = BatchDecoder(model, tiny.tokenizer(vocab=vocab), max_batch=len(cases) * len(seeds))
        uids = [[decoder.add(p, make(), max_tokens=tokens, num_draft_tokens=3, seed=seed, trace=True,
                             **kw) for p, kw, make in cases] for seed in seeds]
        out, widths = drain(decoder)
        assert max(widths) == len(cases) * len(seeds)  # the rows really were verified together
        for seed, row in zip(seeds, uids):
            for i, uid in enumerate(row):
                out_tokens[i][seed] = out[uid]
                traces[i].append(decoder.last_stats[uid].trace or [])
    return [L.Runs(t, tr, ["length"] * n, vocab) for t, tr in zip(out_tokens, traces)]


def test_every_row_gets_its_solo_greedy_output_with_ragged_acceptance():
    model = tiny.llama_model()
    draft = tiny.llama_model(seed=9, layers=1)
    drafters = [NGramDrafter(min_n=1), DraftModelDrafter(model), None, DraftModelDrafter(draft)]
    res = mlx_spec.batch_generate(model, tiny.tokenizer(), PROMPTS, iter(drafters).__next__,
                                  max_tokens=30, num_draft_tokens=4, trace=True)
    for prompt, got in zip(PROMPTS, res.tokens):
        assert got == reference(model, prompt, 30)
    assert max(max(s.batch_sizes) for s in res.stats) == 4
    # Ragged: in one step, rows of the batch kept different numbers of drafts.
    kept = [[t.accepted for t in s.trace] for s in res.stats]
    assert any(len({k[i] for k in kept if i < len(k)}) > 1 for i in range(10))
    assert res.stats[1].acceptance_rate == 1.0 and res.stats[2].drafted == 0


def test_rows_join_and_leave_between_steps_and_a_long_prompt_is_prefilled_in_chunks():
    model = tiny.llama_model()
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=3, prefill_chunk=8)
    a = decoder.add(PROMPTS[0], NGramDrafter(min_n=1), max_tokens=40, num_draft_tokens=3)
    out = {}
    for _ in range(3):
        for uid, block in decoder.step():
            out.setdefault(uid, []).extend(r.token for r in block)
    long = [int(t) for t in np.arange(60) % 50]
    b = decoder.add(long, DraftModelDrafter(model), max_tokens=10)  # 59 prompt tokens: 8 a step
    c = decoder.add(PROMPTS[1], None, max_tokens=5)
    out, widths = drain(decoder, out)
    assert out[a] == reference(model, PROMPTS[0], 40)
    assert out[b] == reference(model, long, 10) and out[c] == reference(model, PROMPTS[1], 5)
    assert 3 in widths and widths[-1] <= 1 and widths[:4] == [1, 1, 1, 1]
    assert not decoder.active and decoder.batch is None


def test_a_cancelled_or_stopped_row_leaves_the_others_untouched():
    model = tiny.llama_model()
    want = reference(model, PROMPTS[0], 40)
    tok = tiny.tokenizer(eos=want[12])  # row 0 stops at its 13th token
    decoder = BatchDecoder(model, tok, max_batch=4)
    uids = [decoder.add(p, NGramDrafter(min_n=1), max_tokens=40, num_draft_tokens=4) for p in PROMPTS]
    out = {}
    for _ in range(4):
        for uid, block in decoder.step():
            out.setdefault(uid, []).extend(r.token for r in block)
    decoder.release(uids[2], seen=1)  # the caller drops row 2 after one token of its last block
    out, _ = drain(decoder, out)
    assert out[uids[0]] == want[:13]
    for i in (1, 3):
        assert out[uids[i]] == reference(model, PROMPTS[i], 40)


def test_a_prompt_cache_row_in_a_batch_ends_holding_what_its_caller_saw():
    model = tiny.llama_model()
    cache = mlx_spec.make_cache(model)
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=2)
    a = decoder.add(PROMPTS[0], NGramDrafter(min_n=1), max_tokens=20, prompt_cache=cache)
    decoder.add(PROMPTS[1], NGramDrafter(min_n=1), max_tokens=30)
    out, widths = drain(decoder)
    assert max(widths) == 2 and type(cache[0]) is KVCache
    assert cache[0].offset == len(PROMPTS[0]) + 20
    got = [r.token for r in mlx_spec.stream_generate(model, tiny.tokenizer(), [3], max_tokens=8,
                                                      prompt_cache=cache)]
    assert got == reference(model, PROMPTS[0] + out[a] + [3], 8)


def test_a_seeded_row_samples_the_same_alone_or_in_a_batch():
    model = tiny.llama_model()
    kw = dict(max_tokens=25, num_draft_tokens=3, temp=0.9, seed=11)
    solo = [r.token for r in mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPTS[0],
                                                       DraftModelDrafter(model), **kw)]
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=4)
    uid = decoder.add(PROMPTS[0], DraftModelDrafter(model), **kw)
    decoder.add(PROMPTS[1], NGramDrafter(), max_tokens=25, temp=1.3)
    decoder.add(PROMPTS[2], None, max_tokens=25, temp=0.5, seed=2)
    out, widths = drain(decoder)
    assert out[uid] == solo and max(widths) == 3


@pytest.mark.slow
def test_sampled_rows_of_a_batch_have_the_targets_law():
    """Rows of different prompts, drafters and temperatures in one batch; each row's law
    (positions 1-4 and neighbouring pairs) is the target's. A wrong rule fails it."""
    model = L.v8_llama()
    near = DraftModelDrafter(L.v8_llama(4.0), min_confidence=None)  # chains as asked: deep blocks
    seen = counted(near.model)  # the two draft-model rows draft together (test_batch_draft.py)
    cases = [([1, 2, 3, 1, 2], dict(temp=1.0), lambda: near.fork()),
             ([4, 5, 6], dict(temp=0.7, top_p=0.9), lambda: near.fork()),
             ([4, 5, 4, 5, 4, 5], dict(temp=1.2), lambda: NGramDrafter(min_n=1))]
    joints = [L.exact_joint(model, p, 5, kw, vocab=8) for p, kw, _ in cases]

    def runs(n):
        return batched_runs(model, cases, n)

    for i, (r, joint) in enumerate(zip(runs(800), joints)):
        if i < 2:  # the draft-model rows draft 3 deep on most first steps
            L.assert_deep(r, share=0.8, events=30)
        L.assert_lossless(r, joint)
    # ... in forwards of several rows (both of a run's rows, 3 deep at least once a run)
    assert sum(n for n in seen if n >= 2) >= 800 * 2 * 3
    with pytest.MonkeyPatch.context() as mp:
        L.use_rule(mp, L.wrong_rule(residual="p"))
        L.assert_caught(runs(500)[0], joints[0])


# (kept positions per row per block, seed)
blocks = st.lists(st.tuples(st.lists(st.integers(0, 6), min_size=3, max_size=3), st.integers(0, 99)),
                  min_size=1, max_size=6)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=blocks)
def test_ragged_rollback_equals_each_rows_fresh_cache(blocks):
    model = tiny.llama_model()
    prompts = [[5, 6, 7], [8], [1, 2, 3, 4, 5, 6]]
    rows = []
    for p in prompts:
        c = [KVCache() for _ in model.layers]
        model(mx.array([p]), cache=c)
        rows.append(c)
    batch = merge(rows)
    committed = [list(p) for p in prompts]
    for keep, seed in blocks:
        block = np.random.default_rng(seed).integers(0, tiny.VOCAB, (3, 6))
        ckpt = BatchCheckpoint(batch)
        model(mx.array(block), cache=batch)
        ckpt.keep([k for k in keep], 6)
        for i, k in enumerate(keep):
            committed[i] += block[i, :k].tolist()
    probe = mx.array([[7], [7], [7]])
    got = np.array(model(probe, cache=batch)[:, -1])
    for i, c in enumerate(committed):
        want = np.array(model(mx.array([c + [7]]))[0, -1])
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4)


def test_the_batch_drafts_less_as_rows_grow_and_stops_when_it_no_longer_pays(monkeypatch):
    """Synthetic costs: a forward over w tokens costs 1 + 0.02 w up to about 4 tokens
    (latency-bound) and 0.25 w beyond (compute-bound). At 70% acceptance one row drafts
    3, two rows 1, eight rows nothing; when load drops again, drafting resumes."""
    from mlx_spec import batch_policy
    from mlx_spec.adaptive import AdaptiveK, CostModel
    from mlx_spec.batch_policy import choose_for_batch

    def cost(w):
        return max(1 + 0.02 * w, 0.25 * w)

    monkeypatch.setattr(batch_policy, "wide_verify_seconds", lambda model: [cost(w) for w in batch_policy.WIDE])
    policy = lambda: AdaptiveK(CostModel([cost(n) for n in range(1, 18)]), k_max=16)  # noqa: E731
    rows = [policy() for _ in range(8)]
    for p in rows:
        p.accept = [[0.7] * 16, [0.7] * 16]
        p.seen = [[5] * 16, [5] * 16]
    model = tiny.llama_model()
    alone = choose_for_batch(model, rows[:1])[0][0]
    two = choose_for_batch(model, rows[:2])[0][0]
    eight = choose_for_batch(model, rows)
    assert (alone, two) == (3, 1) and {k for k, _ in eight} == {0}
    again = choose_for_batch(model, rows[:2])[0][0]
    assert again == two  # load dropped: drafting resumes


@pytest.mark.parametrize("name", ["eagle", "dflash"])
def test_head_drafters_batch_with_a_fork_per_row(tmp_path, name):
    """Each row reads its own target hidden states from the batched forward."""
    import test_conversations as C

    model, make = C.drafter_case(tmp_path, name)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 4], [9, 9, 8, 7, 6, 5, 4, 3]]
    res = mlx_spec.batch_generate(model, tiny.tokenizer(), prompts, make(), max_tokens=24,
                                  num_draft_tokens=4)
    for p, got, s in zip(prompts, res.tokens, res.stats):
        assert got == reference(model, p, 24)
        assert max(s.batch_sizes) == 3 and s.accepted > 0


@pytest.mark.parametrize("name", ["llama", "hybrid"])
def test_a_pipelined_plain_row_lands_its_step_in_flight_when_another_joins(name):
    model = {"llama": tiny.llama_model, "hybrid": tiny.qwen3_5_model}[name]()
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=2)
    a = decoder.add(PROMPTS[0], None, max_tokens=30)
    out = {}
    for _ in range(4):
        for uid, block in decoder.step():
            out.setdefault(uid, []).extend(r.token for r in block)
    row = decoder.active[0]
    assert decoder.flight is not None and row.consumed == len(PROMPTS[0]) + len(out[a])
    b = decoder.add(PROMPTS[1], NGramDrafter(min_n=1), max_tokens=20)
    out, widths = drain(decoder, out)
    assert out[a] == reference(model, PROMPTS[0], 30) and out[b] == reference(model, PROMPTS[1], 20)
    assert max(widths) == 2


def test_batch_generate_takes_a_seed_per_prompt():
    model = tiny.llama_model(seed=3)
    prompt = PROMPTS[0]

    def run(seed):
        return mlx_spec.batch_generate(model, tiny.tokenizer(), [prompt] * 3, None, max_tokens=12,
                                       temp=1.0, seed=seed).tokens

    same, mixed = run(7), run([7, 8, 7])
    assert same[0] == same[1] == same[2]  # one seed for all: identical prompts sample alike
    assert mixed[0] == mixed[2] == same[0] and mixed[1] != mixed[0]
    with pytest.raises(ValueError, match="one per prompt"):
        run([1, 2])


def test_a_row_released_before_its_caller_saw_a_token_leaves_the_prompt_cache_as_it_was():
    """release(uid, 0) right after the first token: the caller saw nothing, so its prompt cache
    holds what it held before the request (nothing here), and the next request starts from it."""
    for model in (tiny.llama_model(), tiny.gemma3_model(window=4)):
        cache = mlx_spec.make_cache(model)
        decoder = mlx_spec.BatchDecoder(model, tiny.tokenizer())
        uid = decoder.add([5, 6, 7, 8], None, prompt_cache=cache, max_tokens=10)
        assert [len(block) for _, block in decoder.step()] == [1]
        decoder.release(uid, 0)
        assert {c.offset for c in cache} == {0}
        want = mlx_spec.generate(model, tiny.tokenizer(), [5, 6, 7, 8], None, max_tokens=6)
        assert mlx_spec.generate(model, tiny.tokenizer(), [5, 6, 7, 8], None, max_tokens=6, prompt_cache=cache) == want


def test_batch_generate_refuses_one_prompt_for_a_list_and_names_a_bad_prompt():
    """A single string was decoded as one prompt per character (and one list of token ids as a
    prompt per id); an empty prompt among several was refused without saying which."""
    model, tok = tiny.llama_model(), tiny.tokenizer()
    for one in ("w5 w6", [5, 6, 7]):
        with pytest.raises(TypeError, match="prompts must be a list of prompts"):
            mlx_spec.batch_generate(model, tok, one, None, max_tokens=2)
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        mlx_spec.batch_generate(model, tok, [[5, 6], []], None, max_tokens=2)
    assert mlx_spec.batch_generate(model, tok, [[5, 6]], None, max_tokens=2).tokens[0] == \
        mlx_spec.batch_generate(model, tok, [[5, 6], [7]], None, max_tokens=2).tokens[0]


def test_batch_generate_takes_drafter_classes_and_2d_arrays_and_names_a_list_it_cannot_take():
    """A drafter class is a function making a drafter (it was taken for a drafter, and its
    unbound fork() raised a TypeError); a 2-D mx.array is one prompt a row (it was refused as
    one prompt, while a NumPy array worked); temp=[...] failed in a comparison deep inside."""
    model, tok = tiny.llama_model(), tiny.tokenizer()
    prompts = [[5, 6, 5, 6, 5], [7, 8, 9, 7, 8]]
    want = [reference(model, p, 6) for p in prompts]
    assert mlx_spec.batch_generate(model, tok, prompts, NGramDrafter, max_tokens=6).tokens == want
    assert mlx_spec.batch_generate(model, tok, mx.array(prompts), None, max_tokens=6).tokens == want
    for name, value in (("temp", [0.5, 0.7]), ("num_draft_tokens", (2, 3))):
        with pytest.raises(ValueError, match=f"{name} takes one value for every prompt"):
            mlx_spec.batch_generate(model, tok, prompts, None, max_tokens=6, **{name: value})
    with pytest.raises(ValueError, match="temp must be a number, got"):
        mlx_spec.generate(model, tok, prompts[0], None, max_tokens=2, temp="0.5")


def test_batch_generate_takes_max_tokens_per_prompt():
    model, tok = tiny.llama_model(), tiny.tokenizer()
    res = mlx_spec.batch_generate(model, tok, [[5, 6], [7, 8, 9]], None, max_tokens=[3, 7])
    assert res.tokens == [reference(model, [5, 6], 3), reference(model, [7, 8, 9], 7)]
    with pytest.raises(ValueError, match="max_tokens is a list of 1 values for 2 prompts"):
        mlx_spec.batch_generate(model, tok, [[5, 6], [7]], None, max_tokens=[3])


def test_a_row_that_waited_for_room_reads_its_prompt_at_its_own_speed():
    """prompt_tps counts from when a row's prompt is read, not from when it was added: with
    room for one row at a time, the third row waited for two whole answers, and its prompt
    speed counted that wait (about 100x too slow)."""
    import time

    model, tok = tiny.llama_model(), tiny.tokenizer()
    prompts = [[5, 6, 7, 8, 9, 10]] * 3
    tic = time.perf_counter()
    out = mlx_spec.batch_generate(model, tok, prompts, max_batch=1, max_tokens=60)
    total = time.perf_counter() - tic
    reading = [len(p) / s.prompt_tps for p, s in zip(prompts, out.stats)]
    assert all(len(t) == 60 for t in out.tokens)
    assert max(reading) < total / 6, (reading, total)  # each answer took about a third
