"""The draft model's LM head over part of the vocabulary (`DraftModelDrafter(head_vocab=n)`,
`mlx_spec.drafters.short_head`): its logits are the model's own at the subset's ids (the
first n ids and the text's own tokens), -inf elsewhere; drafts come from the subset only;
the output is the target's, greedy and sampled, alone and in batches."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama

import mlx_spec
import tiny
from mlx_spec import DraftModelDrafter
from mlx_spec.drafters.short_head import ShortHead, short_head
from mlx_spec.sampling import Sampling
from runs import assert_same_draft_state, mlx_lm_greedy, spec_run, together_as_alone

N = 24  # the subset's base: ids 0..23 of the tiny models' 96


def quantized_llama():
    model = tiny.llama_model(seed=2, tied=True)
    nn.quantize(model, group_size=32, bits=4)
    return model


MODELS = {
    "untied": lambda: tiny.llama_model(seed=1),
    "tied": lambda: tiny.llama_model(seed=2, tied=True),
    "qwen2": lambda: tiny.qwen2_model(seed=3),
    "quantized": quantized_llama,
}


@pytest.mark.parametrize("name", list(MODELS))
def test_subset_logits_are_the_models_own(name):
    """The subset head's logits are the model's at the base ids and the extras; laid out,
    every other id is -inf; a batch row's layout keeps its own extras only."""
    model = MODELS[name]()
    head = short_head(model, N, tiny.VOCAB)
    assert isinstance(head, ShortHead)
    x = mx.array([[5, 40, 7, 90, 3]], mx.uint32)
    full = np.array(model(x)[0])
    extra = (30, 57, 90)
    got = np.array(head(x, None, extra)[0])
    ids = list(range(N)) + list(extra)
    assert got.shape == (5, N + 3)
    assert np.allclose(got, full[:, ids], atol=1e-4 * np.abs(full).max())
    placed = np.array(head.layout(head(x, None, extra, last=2), extra)[0])
    assert placed.shape == (2, tiny.VOCAB)
    assert np.allclose(placed[:, ids], full[-2:, ids], atol=1e-4 * np.abs(full).max())
    assert np.isneginf(np.delete(placed, ids, axis=1)).all()
    own = np.array(head.layout(head(x, None, extra)[0], extra, own=(57,)))
    assert np.isfinite(own[:, 57]).all() and np.isneginf(own[:, [30, 90]]).all()
    assert np.allclose(own[:, :N], full[:, :N], atol=1e-4 * np.abs(full).max())
    assert head.extras([3, 30, 95, 57, 200]) == (30, 57, 95)  # ids past the vocabulary never
    assert head.extras([30, 95], known=(30, 95)) == (30, 95)


class _Scaled(llama.Model):
    """A model whose logits are not its LM head's (as a final soft-cap or scale makes them)."""

    def __call__(self, inputs, cache=None):
        return 2.0 * super().__call__(inputs, cache=cache)


def test_a_forward_other_than_stack_then_head_keeps_the_whole_head():
    model = tiny.llama_model(seed=5)
    scaled = _Scaled(model.args)
    scaled.update(model.parameters())
    assert short_head(scaled, N, tiny.VOCAB) is None
    assert short_head(model, N, tiny.VOCAB) is not None
    assert short_head(model, None, tiny.VOCAB) is None and short_head(model, tiny.VOCAB, tiny.VOCAB) is None
    target = tiny.llama_model()
    d = DraftModelDrafter(scaled, head_vocab=N)
    got, _ = spec_run(target, d, [5, 17, 3], 20, 4)
    assert d._head is None and got == mlx_lm_greedy(target, [5, 17, 3], 20)


def test_head_vocab_is_checked():
    for bad in (0, -3, 2.5, "all", True):
        with pytest.raises(ValueError, match="head_vocab"):
            DraftModelDrafter(tiny.llama_model(), head_vocab=bad)


def allowed_argmax(model, text: list[int], allowed: set[int]) -> tuple[int, int]:
    """The model's argmax after `text` over the allowed ids, and over all of them."""
    logits = np.array(model(mx.array(text, mx.uint32)[None])[0, -1])
    masked = np.where(np.isin(np.arange(logits.size), sorted(allowed)), logits, -np.inf)
    return int(masked.argmax()), int(logits.argmax())


def test_proposals_come_from_the_base_and_the_texts_tokens():
    """Along a text, each one-token proposal is the draft's argmax over the first N ids and
    the tokens committed so far (the prompt's and every commit's), found when the
    unrestricted argmax lies outside them too; a fork and a restored state see their own text."""
    draft = tiny.llama_model(seed=4)
    target = tiny.llama_model()
    text = [5, 17, 3, 60, 2] + mlx_lm_greedy(draft, [5, 17, 3, 60, 2], 40)
    d = DraftModelDrafter(draft, head_vocab=N, lookup=False)
    d.bind(target, None)
    d.prefill(text[:4], None)
    pos, outside = 4, 0
    state = None
    while pos < len(text) - 1:
        y = text[pos]
        got = d.propose(y, 1, Sampling()).tokens.tolist()[0]
        want, free = allowed_argmax(draft, text[: pos + 1], set(range(N)) | set(text[:pos]))
        assert got == want
        outside += free != want
        d.commit([y], None)
        pos += 1
        if pos == 20:
            state = d.save_state()
    assert outside >= 3  # the subset bound the draft's choice at some steps
    d.restore_state(state)  # back at position 20: tokens committed later are not in its subset
    y = text[20]
    got = d.propose(y, 1, Sampling()).tokens.tolist()[0]
    assert got == allowed_argmax(draft, text[:21], set(range(N)) | set(text[:20]))[0]


CHAINS = {
    "guided": dict(),
    "unguided": dict(lookup=False),
    "dynamic-tree": dict(tree_budget=6),
    "branches": dict(branches=2),
}


@pytest.mark.parametrize("shape", list(CHAINS))
def test_greedy_output_is_the_targets(shape):
    """The draft is the target itself, so its drafts are accepted except where the subset
    keeps it from the target's token: the output is the target's, and acceptance is below
    the whole head's."""
    target = tiny.llama_model()
    prompt = [5, 17, 3, 60, 2]
    want = mlx_lm_greedy(target, prompt, 48)
    assert sum(t >= N and t not in prompt for t in want) >= 3  # tokens the subset lacks at first
    taus = {}
    for hv in (N, None):
        d = DraftModelDrafter(target, head_vocab=hv, **CHAINS[shape])
        got, stats = spec_run(target, d, prompt, 48, 4)
        assert got == want
        assert (d._head is not None) == (hv is not None)
        taus[hv] = stats.tau
    assert taus[N] < taus[None]


def test_batch_output_is_each_rows_own():
    target = tiny.llama_model()
    draft = tiny.llama_model(seed=4, layers=1)
    prompts = [[5, 17, 3, 60, 2], [70, 8, 33], [1, 2, 88, 91, 40, 40]]
    want = [mlx_lm_greedy(target, p, 24) for p in prompts]
    got = mlx_spec.batch_generate(target, tiny.tokenizer(), prompts, DraftModelDrafter(draft, head_vocab=N),
                                  max_tokens=24, num_draft_tokens=3)
    assert got.tokens == want


@pytest.mark.parametrize("greedy", [True, False])
def test_rows_drafting_together_keep_their_own_subsets(greedy):
    """Rows whose texts hold different tokens outside the base draft together (one forward
    over every row's extras) and each row's draft, q and cache equal its own proposal's."""
    target, draft = tiny.llama_model(), tiny.llama_model(seed=4, layers=2)
    texts = [[5, 17, 3, 60, 2, 60], [70, 8, 33, 91], [1, 2, 3]]
    together, alone = [], []
    for text in texts:
        pair = []
        for _ in range(2):
            d = DraftModelDrafter(draft, head_vocab=N, min_confidence=None)  # chains as long as asked
            d.bind(target, None)
            d.prefill(text, None)
            pair.append(d)
        together.append(pair[0])
        alone.append(pair[1])
    assert len({d._extras() for d in together}) == 3
    sampling = Sampling() if greedy else Sampling(temp=1.0)
    ys, ks = [40, 9, 77], [3, 4, 2]
    got = together_as_alone(together, alone, ys, ks, [sampling] * 3, seeds=[1, 2, 3])
    for a, b, g, y in zip(together, alone, got, ys):
        a.commit([y] + g.tokens.tolist()[:1], None)
        b.commit([y] + g.tokens.tolist()[:1], None)
        assert_same_draft_state(a, b, atol=1e-4)
    if not greedy:
        for g, d in zip(got, alone):  # q is zero outside the row's subset
            q = np.array(g.q)
            allowed = sorted(set(range(N)) | set(d._extras()))
            assert np.allclose(q.sum(-1), 1.0, atol=1e-4)
            assert np.abs(np.delete(q, allowed, axis=1)).max() == 0.0
