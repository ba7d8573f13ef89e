"""End-to-end decoding on tiny targets: greedy losslessness, stops, prompt caches, bad input."""

import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_spec
import tiny
from runs import mlx_lm_greedy as reference
from mlx_spec import DraftModelDrafter, NGramDrafter

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
TARGETS = {
    "llama-gqa": lambda: tiny.llama_model(),
    "llama-tied": lambda: tiny.llama_model(seed=1, tied=True, kv_heads=4),
    "qwen2": lambda: tiny.qwen2_model(),
    "gemma3-window": lambda: tiny.gemma3_model(window=8),  # 60 tokens: far past the window
    "qwen3_5-hybrid": lambda: tiny.qwen3_5_model(),
}
_cache = {}


def target(name):
    if name not in _cache:
        _cache[name] = TARGETS[name]()
    return _cache[name]




def drafters(model):
    return {
        "none": None,
        "ngram": NGramDrafter(min_n=1, max_n=3),
        "self": DraftModelDrafter(model),
        "poor-draft": DraftModelDrafter(tiny.llama_model(seed=11, layers=1)),
    }


def run(model, drafter, prompt=PROMPT, **kw):
    out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), prompt, drafter, **kw))
    return [r.token for r in out], out


@pytest.mark.parametrize("name", list(TARGETS))
@pytest.mark.parametrize("k", [3, 16])
def test_greedy_output_is_the_targets_own(name, k):
    model = target(name)
    want = reference(model, PROMPT, 60)
    for dname, drafter in drafters(model).items():
        got, out = run(model, drafter, max_tokens=60, num_draft_tokens=k)
        assert got == want, f"{name} with {dname} drafter diverged"
        assert out[-1].finish_reason == "length"


def test_self_draft_accepts_every_token():
    model = target("llama-gqa")
    _, out = run(model, DraftModelDrafter(model, min_confidence=None), max_tokens=41, num_draft_tokens=4)
    s = out[-1].stats
    assert s.acceptance_rate == 1.0 and s.tau == 5.0
    assert [r.from_draft for r in out[1:11]] == [True] * 4 + [False] + [True] * 4 + [False]


def test_the_prompts_token_is_yielded_before_the_first_draft():
    """Time to first token is the prefill's: the first draft (a draft model's read of the
    prompt, its proposals, the verify) comes after the caller has the prompt's token."""
    model = target("llama-gqa")

    class Counting(DraftModelDrafter):
        proposals = 0

        def propose(self, *args, **kwargs):
            Counting.proposals += 1
            return super().propose(*args, **kwargs)

    gen = mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, Counting(model, min_confidence=None),
                                   max_tokens=12, num_draft_tokens=4)
    first = next(gen)
    assert not first.from_draft and Counting.proposals == 0
    rest = list(gen)
    assert Counting.proposals >= 1 and [r.from_draft for r in rest[:5]] == [True] * 4 + [False]
    assert [first.token] + [r.token for r in rest] == reference(model, PROMPT, 12)


def test_stats_and_trace_describe_each_step():
    model = target("qwen2")
    _, out = run(model, NGramDrafter(min_n=1), max_tokens=30, num_draft_tokens=4, trace=True)
    s = out[-1].stats
    assert len(s.trace) == s.target_forwards
    assert sum(len(t.proposed) for t in s.trace) == s.drafted
    assert sum(t.accepted for t in s.trace) == s.accepted
    assert s.generation_tokens == 30
    # tokens = 1 from the prefill + (n + 1) per verify step
    assert 1 + s.accepted + s.target_forwards == 30
    per_pos = s.accepted_per_position
    assert all(0 <= a <= 1 for a in per_pos) and len(per_pos) <= 4


def test_max_tokens_is_never_exceeded_mid_block():
    model = target("llama-gqa")
    for max_tokens in (1, 2, 3, 7):
        got, out = run(model, DraftModelDrafter(model), max_tokens=max_tokens, num_draft_tokens=4)
        assert len(got) == max_tokens and out[-1].finish_reason == "length"


def test_eos_inside_an_accepted_block_ends_the_output_there():
    model = target("llama-gqa")
    want = reference(model, PROMPT, 40)
    eos = want[6]  # emitted in the middle of a fully accepted 5-token block
    tok = tiny.tokenizer(eos=eos)
    out = list(mlx_spec.stream_generate(model, tok, PROMPT, DraftModelDrafter(model), max_tokens=40))
    assert [r.token for r in out] == want[: want.index(eos) + 1]
    assert out[-1].finish_reason == "stop" and out[-1].token == eos
    assert out[-1].stats.generation_tokens == len(out)


def test_text_streams_like_the_tokenizer_decodes():
    model = target("qwen2")
    tok = tiny.tokenizer()
    out = list(mlx_spec.stream_generate(model, tok, "w5 w6 w7", NGramDrafter(), max_tokens=12))
    assert "".join(r.text for r in out) == tok.decode([r.token for r in out])
    assert mlx_spec.generate(model, tok, "w5 w6 w7", NGramDrafter(), max_tokens=12) == "".join(
        r.text for r in out
    )


@pytest.mark.parametrize("name", ["llama-gqa", "gemma3-window", "qwen3_5-hybrid"])
def test_prompt_cache_holds_exactly_the_committed_tokens(name):
    model = target(name)
    cache = make_prompt_cache(model)
    got, _ = run(model, DraftModelDrafter(model), max_tokens=20, prompt_cache=cache)
    # A second turn continues from the cache: same as decoding the whole history at once.
    turn2 = [3, 4]
    got2, _ = run(model, NGramDrafter(), prompt=turn2, max_tokens=15, prompt_cache=cache)
    history = PROMPT + got + turn2  # every token the caller saw, as mlx-lm's cache holds
    assert got2 == reference(model, history, 15)


def test_prompt_cache_is_consistent_when_the_caller_stops_early():
    model = target("qwen3_5-hybrid")
    cache = make_prompt_cache(model)
    gen = mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, DraftModelDrafter(model),
                                   max_tokens=50, prompt_cache=cache)
    seen = [next(gen).token for _ in range(7)]  # stop in the middle of a block
    gen.close()
    got2, _ = run(model, None, prompt=[3], max_tokens=10, prompt_cache=cache)
    assert got2 == reference(model, PROMPT + seen + [3], 10)


def test_bad_input_is_refused_before_any_work():
    model, tok = target("llama-gqa"), tiny.tokenizer()
    gen = lambda **kw: mlx_spec.stream_generate(model, tok, kw.pop("prompt", PROMPT), **kw)  # noqa: E731
    with pytest.raises(ValueError, match="empty"):
        gen(prompt=[])
    with pytest.raises(ValueError, match="empty"):
        gen(prompt="")
    with pytest.raises(ValueError, match="max_tokens"):
        gen(max_tokens=0)
    for bad in ("max_tokens", "seed", "kv_bits", "prefill_step_size"):  # True is an int to Python
        with pytest.raises(ValueError, match=bad):
            gen(**{bad: True})
    for k in (0, 17, 2.5, True):
        with pytest.raises(ValueError, match="num_draft_tokens"):
            gen(drafter=NGramDrafter(), num_draft_tokens=k)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        gen(drafter=DraftModelDrafter(tiny.llama_model(vocab=128)))
    with pytest.raises(ValueError, match="top_p"):
        gen(temp=1.0, top_p=1.5)


def test_vocabularies_are_compared_token_by_token_when_tokenizers_are_given():
    model = target("llama-gqa")
    other = tiny.tokenizer(vocab=tiny.VOCAB)
    other._tokenizer.add_tokens(["extra-token"])
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT,
                                 DraftModelDrafter(tiny.llama_model(seed=2), other))


def test_padded_draft_vocabulary_is_fitted_to_the_target():
    # Same tokenizer, but the draft's embedding has padding rows (like Qwen 0.5B vs 7B).
    model = target("llama-gqa")
    draft = tiny.llama_model(seed=5, vocab=tiny.VOCAB + 32)
    drafter = DraftModelDrafter(draft, tiny.tokenizer())
    got, _ = run(model, drafter, max_tokens=30)
    assert got == reference(model, PROMPT, 30)
    got, _ = run(model, drafter, max_tokens=30, temp=1.0, seed=1)
    assert max(got) < tiny.VOCAB


class _Scripted:
    """A user's own drafter: proposes `tokens` (and `q`) every step, whatever the text."""

    taps, max_draft = (), 16

    def __init__(self, tokens, q=None):
        self.tokens, self.q = tokens, q

    def bind(self, model, tokenizer):
        pass

    def prefill(self, tokens, taps):
        pass

    def propose(self, y, k, sampling):
        import mlx.core as mx

        return mlx_spec.Draft(mx.array(self.tokens), None if self.q is None else mx.array(self.q))

    def commit(self, tokens, taps):
        pass


@pytest.mark.parametrize("ids", [[5, tiny.VOCAB + 3], [-1, 5], [2 ** 31, 6]])
@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_a_drafter_proposing_ids_outside_the_vocabulary_is_refused(ids, temp):
    """An id past the target's embedding table is never fed to it (MLX reads past the end
    unchecked: a crash or garbage), and the request ends with an error naming the drafter."""
    import numpy as np

    model = target("llama-gqa")
    q = None if temp == 0 else np.full((len(ids), tiny.VOCAB), 1 / tiny.VOCAB, np.float32)
    with pytest.raises(ValueError, match=rf"proposed token id {ids[-1] if ids[0] == 5 else ids[0]}, outside the "
                                         rf"target's vocabulary \(0..{tiny.VOCAB - 1}\)"):
        run(model, _Scripted(ids, q), max_tokens=8, num_draft_tokens=2, temp=temp, seed=1 if temp else None)
    got, _ = run(model, _Scripted([5, 6]), max_tokens=8, num_draft_tokens=2)  # in range: decodes as ever
    assert got == reference(model, PROMPT, 8)


def test_a_drafters_q_over_another_vocabulary_is_refused():
    import numpy as np

    q = np.full((2, tiny.VOCAB + 1), 1 / (tiny.VOCAB + 1), np.float32)
    with pytest.raises(ValueError, match=f"q has {tiny.VOCAB + 1} probabilities a token, the target's vocabulary "
                                         f"{tiny.VOCAB}"):
        run(target("llama-gqa"), _Scripted([5, 6], q), max_tokens=8, num_draft_tokens=2, temp=1.0, seed=1)
