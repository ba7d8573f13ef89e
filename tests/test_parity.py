"""mlx-lm users' habits work, or fail with a message that says what to do instead."""

import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import mlx_spec
import tiny
from mlx_spec import DraftModelDrafter, NGramDrafter
from runs import mlx_lm_greedy as reference

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7]


def run(model, prompt=PROMPT, drafter=None, tok=None, **kw):
    return list(mlx_spec.stream_generate(model, tok or tiny.tokenizer(), prompt, drafter, **kw))


def test_mistakes_carried_over_from_mlx_lm_get_clear_errors():
    model = tiny.llama_model()
    with pytest.raises(TypeError, match="max_tokens= by keyword"):
        run(model, drafter=100)
    with pytest.raises(TypeError, match="draft_model="):
        run(model, drafter=tiny.llama_model(seed=2))
    with pytest.raises(TypeError, match="temp=, top_p="):
        run(model, sampler=make_sampler(temp=0.7))
    with pytest.raises(TypeError, match="supported: .*logits_processors"):
        run(model, xtc_probability=0.5)
    with pytest.raises(ValueError, match="-1 for no limit"):
        run(model, max_tokens=0)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        run(model, prompt=[5, tiny.VOCAB])
    with pytest.raises(ValueError, match="either a drafter or draft_model"):
        run(model, drafter=NGramDrafter(), draft_model=model)


def test_draft_model_keyword_and_array_prompts_work_as_in_mlx_lm():
    model, draft = tiny.llama_model(), tiny.llama_model(seed=9, layers=1)
    want = reference(model, PROMPT, 20)
    assert [r.token for r in run(model, draft_model=draft, max_tokens=20)] == want
    assert [r.token for r in run(model, prompt=mx.array([PROMPT]), max_tokens=20)] == want
    assert [r.token for r in run(model, prompt=np.array(PROMPT), max_tokens=20)] == want
    # The same draft model twice keeps its drafter (and what auto k learned about it).
    first = mlx_spec.request._DRAFTERS_OF_MODELS.get(draft)
    run(model, draft_model=draft, max_tokens=3)
    assert first is not None and mlx_spec.request._DRAFTERS_OF_MODELS.get(draft) is first


def test_top_p_zero_is_off_and_minus_one_tokens_is_no_limit():
    model = tiny.llama_model()
    seeded = dict(temp=1.0, seed=4, max_tokens=30)
    assert [r.token for r in run(model, top_p=0.0, **seeded)] == [r.token for r in run(model, **seeded)]
    want = reference(model, PROMPT, 80)
    eos = next(t for t in want[40:] if t not in want[:40])  # first appears after 40 tokens
    out = run(model, drafter=NGramDrafter(min_n=1), tok=tiny.tokenizer(eos=eos), max_tokens=-1)
    assert [r.token for r in out] == want[: want.index(eos) + 1] and out[-1].finish_reason == "stop"


def test_every_response_carries_mlx_lm_fields_and_the_targets_logprobs():
    model = tiny.llama_model()
    out = run(model, drafter=DraftModelDrafter(model, min_confidence=None), max_tokens=12, num_draft_tokens=3)
    want = list(generate_step(mx.array(PROMPT), model, max_tokens=12))
    assert [r.token for r in out] == [int(t) for t, _ in want]
    assert any(r.from_draft for r in out) and not all(r.from_draft for r in out)
    for i, (r, (_, lp)) in enumerate(zip(out, want)):
        assert r.prompt_tokens == len(PROMPT) and r.generation_tokens == i + 1
        assert r.prompt_tps > 0 and r.generation_tps > 0 and r.peak_memory > 0
        np.testing.assert_allclose(np.array(r.logprobs), np.array(lp), rtol=1e-4, atol=1e-4)
    assert all(r.stats is out[-1].stats for r in out) and out[-1].stats.generation_tokens == 12


def test_logits_processors_see_each_rows_own_history_so_output_stays_the_targets():
    model = tiny.llama_model()
    procs = make_logits_processors(repetition_penalty=1.8, logit_bias={5: 3.0})
    want = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=40,
                                              logits_processors=procs)]
    assert want != reference(model, PROMPT, 40)  # the processors change this model's output
    for drafter in (NGramDrafter(min_n=1), DraftModelDrafter(model, min_confidence=None), Oracle(want)):
        out = run(model, drafter=drafter, max_tokens=40, logits_processors=procs, num_draft_tokens=4)
        assert [r.token for r in out] == want
    # Drafting the right answer: every row must see its own history for all 4 to be kept.
    assert out[-1].stats.acceptance_rate == 1.0 and out[-1].stats.accepted >= 30


class Oracle(NGramDrafter):
    """Proposes the given continuation (point masses) from wherever the output stands."""

    def __init__(self, tokens):
        super().__init__()
        self.tokens = tokens

    def bind(self, model, tokenizer):
        self.done = 0

    def prefill(self, tokens, taps):
        self.done = 1  # y, the first generated token, is known

    def propose(self, y, k, sampling):
        return mlx_spec.Draft(mx.array(self.tokens[self.done : self.done + k], mx.uint32))

    def commit(self, tokens, taps):
        self.done += len(tokens)


def test_prompt_progress_is_reported_like_mlx_lm():
    model = tiny.llama_model()
    calls = []
    run(model, prompt=list(range(10)), max_tokens=2, prefill_step_size=4,
        prompt_progress_callback=lambda done, total: calls.append((done, total)))
    theirs = []
    list(generate_step(mx.array(list(range(10))), model, max_tokens=2, prefill_step_size=4,
                       prompt_progress_callback=lambda done, total: theirs.append((done, total))))
    assert calls == theirs == [(0, 10), (4, 10), (8, 10), (9, 10), (10, 10)]


def test_prefill_runs_the_lm_head_on_the_last_position_only():
    """A 1200-token prompt with a 40k vocabulary: all logits would take 192 MB."""
    model = tiny.llama_model(vocab=40_000, sharpen=1.0)
    prompt = (np.arange(1200) * 7919 % 40_000).tolist()
    run(model, prompt=prompt[:8], max_tokens=1)  # warm up
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    run(model, prompt=prompt, max_tokens=1)
    assert mx.get_peak_memory() - base < 60e6


def test_kv_bits_quantize_the_cache_as_mlx_lm_does_and_stay_lossless():
    model = tiny.llama_model(hidden=128, heads=4, kv_heads=2)
    kw = dict(max_tokens=30, kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    plain = [r.token for r in run(model, **kw)]
    want = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, **kw)]
    assert plain == want
    cache = mlx_spec.make_cache(model)
    out = run(model, drafter=DraftModelDrafter(model, min_confidence=None), prompt_cache=cache, num_draft_tokens=4, **kw)
    assert [r.token for r in out] == plain and out[-1].stats.accepted > 10
    assert all(isinstance(c, QuantizedKVCache) for c in cache)


def test_the_prompt_cache_holds_every_token_the_caller_saw_like_mlx_lms():
    model = tiny.llama_model()
    want = reference(model, PROMPT, 40)
    eos = want[9]
    tok = tiny.tokenizer(eos=eos)
    ours, theirs = mlx_spec.make_cache(model), make_prompt_cache(model)
    got = [r.token for r in run(model, drafter=DraftModelDrafter(model, min_confidence=None), tok=tok, max_tokens=40,
                                prompt_cache=ours)]
    for token, _ in generate_step(mx.array(PROMPT), model, max_tokens=40, prompt_cache=theirs):
        if token == eos:
            break
    assert got[-1] == eos and ours[0].offset == theirs[0].offset == len(PROMPT) + len(got)


@pytest.mark.parametrize("start", [13, 21])
@pytest.mark.parametrize("trees", [False, True])
def test_blocks_never_cross_quantized_kv_start_unquantized(start, trees):
    """mlx-lm quantizes the cache after each step once it holds quantized_kv_start tokens, so
    the tokens past it see quantized keys; a verified block stops short of that point, and a
    draft tree (verified only over plain KV layers) is not verified on a cache due for it."""
    model = tiny.llama_model(hidden=128, heads=4, kv_heads=2)
    kw = dict(max_tokens=40, kv_bits=2, kv_group_size=32, quantized_kv_start=start)
    want = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, **kw)]
    drafter = DraftModelDrafter(model, min_confidence=None, **(dict(tree_budget=8) if trees else {}))
    out = run(model, drafter=drafter, num_draft_tokens=8, **kw)
    assert [r.token for r in out] == want and out[-1].stats.accepted > 10
    assert (out[-1].stats.tree_steps > 0) == (trees and start > len(PROMPT) + 1)  # trees until it


def test_bfloat16_greedy_picks_mlx_lms_token_where_rounding_ties_two():
    """mlx-lm's greedy token is the argmax of bfloat16 log-probabilities, whose rounding can tie
    tokens the raw logits tell apart (it then takes the lower id); a wide, flat vocabulary
    makes such ties common."""
    for seed in range(2):
        model = tiny.llama_model(seed=seed, vocab=32000, sharpen=1.0)
        model.set_dtype(mx.bfloat16)
        want = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=40)]
        tok = tiny.tokenizer(vocab=32000)
        assert [r.token for r in run(model, tok=tok, max_tokens=40)] == want
        assert [r.token for r in run(model, drafter=NGramDrafter(), tok=tok, max_tokens=40)] == want


def test_stats_count_the_drafts_the_caller_got_when_eos_cuts_a_block():
    model = tiny.llama_model()
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    eos = reference(model, prompt, 40)[6]  # inside a block the self-draft gets right whole
    out = run(model, prompt=prompt, drafter=DraftModelDrafter(model, min_confidence=None), tok=tiny.tokenizer(eos=eos),
              max_tokens=40, num_draft_tokens=8)
    s = out[-1].stats
    assert out[-1].finish_reason == "stop" and s.acceptance_rate == 1.0  # a self-draft: every draft kept
    assert s.accepted == sum(r.from_draft for r in out) == sum(s.accepted_at_position) == s.drafted
    # tau counts the tokens of each verify step: the first came from the prefill, and the last
    # step, ended by its drafted EOS, has no bonus token after it
    assert s.tau * s.target_forwards == pytest.approx(len(out) - 1)


def test_the_prompt_clock_starts_at_the_first_read_as_mlx_lms():
    gen = mlx_spec.stream_generate(tiny.llama_model(), tiny.tokenizer(), PROMPT, None, max_tokens=2)
    time.sleep(0.5)  # a caller that builds the generator and reads it later
    first = next(gen)
    assert first.prompt_tps > 100  # 8 prompt tokens: under 16 tokens/s if the pause counted
    gen.close()


def test_a_failed_long_prompt_read_on_a_window_cache_raises_the_callers_error_and_empties_the_cache():
    """Past its window a sliding-window cache cannot go back to what it held before the call:
    the caller gets its own exception (not a rollback error) and an empty cache, never a
    half-read prompt."""
    model = tiny.gemma3_model(window=8)
    cache = mlx_spec.make_cache(model)

    class Stop(Exception):
        pass

    def progress(done, total):
        if done >= 560:
            raise Stop

    with pytest.raises(Stop):
        run(model, prompt=[3 + i % 90 for i in range(600)], max_tokens=5, prefill_step_size=16,
            prompt_progress_callback=progress, prompt_cache=cache)
    assert {c.offset for c in cache} == {0}
    assert [r.token for r in run(model, max_tokens=6, prompt_cache=cache)] == [r.token for r in run(model, max_tokens=6)]
