"""Lookup-guided draft chains: prompt lookup's continuation is fed as a guess in the draft
model's first forward, and the chain is the draft model's own argmax chain all the same
(`DraftModelDrafter(lookup=True)`, the default)."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_spec
import tiny
from mlx_spec import DraftModelDrafter
from mlx_spec.sampling import Sampling
from runs import assert_same_draft_state, median_confidence, mlx_lm_greedy as reference, together_as_alone


def models():
    """A target and a draft model (random, tiny) whose greedy text falls into loops."""
    return tiny.llama_model(), tiny.llama_model(seed=4, layers=2)


def loop_text(draft, n: int = 60) -> list[int]:
    """The draft model's own greedy text from a short start: random tiny models fall into
    loops, so prompt lookup finds earlier occurrences whose continuation the model repeats."""
    return [5, 17, 3] + reference(draft, [5, 17, 3], n)


def pair(target, draft, min_confidence=None):
    out = []
    for lookup in (True, False):
        d = DraftModelDrafter(draft, lookup=lookup, min_confidence=min_confidence)
        d.bind(target, None)
        out.append(d)
    return out


@pytest.mark.parametrize("stops", [False, True])
def test_guided_chains_are_the_draft_models_own_chains(stops):
    """Every proposal of a guided drafter equals the unguided one's, over steps whose guesses
    were partly kept, wholly kept and not kept at all; after each commit the draft caches hold
    the same rows. `stops`: both end their chains after an unsure token (`min_confidence`, set
    so that some chains end early and others not), the guided one where the guess it checked
    holds an unsure token too."""
    target, draft = models()
    text = loop_text(draft)
    guided, plain = pair(target, draft, median_confidence(draft, text) if stops else None)
    sizes = []
    for d in (guided, plain):
        d.prefill(text[:12], None)
    pos, outcomes = 12, set()
    rng = np.random.default_rng(0)
    while pos < len(text) - 8:
        y, k = text[pos], int(rng.integers(2, 8))
        before = list(guided.guessed)
        got, want = guided.propose(y, k, Sampling()), plain.propose(y, k, Sampling())
        assert got.tokens.tolist() == want.tokens.tolist() and got.size == want.size
        assert got.size == k or stops and got.size < k
        sizes.append(got.size < k)
        fed, kept = guided.guessed[0] - before[0], guided.guessed[1] - before[1]
        if fed:
            outcomes.add("none" if kept == 0 else "all" if kept == fed else "part")
        n = int(rng.integers(0, k + 1))  # the target keeps a prefix of the draft
        block = [y] + got.tokens.tolist()[:n]
        for d in (guided, plain):
            d.commit(block, None)
        assert_same_draft_state(guided, plain, atol=1e-4)
        pos += len(block)
    assert plain.guessed == [0, 0] and guided.guessed[0] > 0
    assert {"all", "part", "none"} <= outcomes  # the guess held wholly, and was cut where it stopped
    assert not stops or 0 < sum(sizes) < len(sizes)  # chains ended early, and not always


def test_guesses_are_left_alone_where_the_chain_cannot_take_them():
    """k = 1 (nothing to guess), trees and unguided drafters feed no guess; sampled chains do."""
    target, draft = models()
    text = loop_text(draft)
    guided, plain = pair(target, draft)
    tree = DraftModelDrafter(draft, branches=2)
    tree.bind(target, None)
    for d in (guided, plain, tree):
        d.prefill(text[:20], None)
        d.propose(text[20], 1, Sampling())
        d.commit([text[20]], None)
        d.propose(text[21], 4, Sampling())
        d.commit([text[21]], None)
    assert plain.guessed == tree.guessed == [0, 0] and guided.guessed[0] == 3
    mx.random.seed(0)
    guided.propose(text[22], 4, Sampling(temp=0.8))
    assert guided.guessed[0] == 6


@pytest.mark.parametrize("k", [3, 8])
def test_guided_drafting_is_lossless_and_guesses(k):
    """Greedy output with the default (guided) draft-model drafter is the target's own, on a
    prompt that repeats itself; along the way guesses were fed, some kept and some not (the
    draft is the target with noise on its output layer: it mostly, not always, agrees)."""
    target, draft = tiny.llama_model(seed=4, layers=2), tiny.llama_model(seed=4, layers=2)
    mx.random.seed(1)
    w = draft.lm_head.weight
    draft.lm_head.weight = w + 0.3 * float(w.std()) * mx.random.normal(w.shape)
    prompt = loop_text(target, 30)
    want = reference(target, prompt, 40)
    drafter = DraftModelDrafter(draft)
    got = [r.token for r in mlx_spec.stream_generate(target, tiny.tokenizer(), prompt, drafter,
                                                      max_tokens=40, num_draft_tokens=k)]
    assert got == want
    assert 0 < drafter.guessed[1] < drafter.guessed[0]


@pytest.mark.parametrize("stops", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
def test_rows_drafting_together_follow_their_guesses_as_alone(sampled, stops):
    """In a batch, draft-model rows drafting together (`propose_together`) feed their guesses
    in the one first forward: each row's draft (and q), guesses kept and draft cache after
    commit equal its own guided proposal's, with keys split per draw as alone."""
    target, draft = models()
    text = loop_text(draft, 90)
    starts = [12, 17, 22]
    sure = median_confidence(draft, text) if stops else None  # some rows' chains end early

    def rows():
        base, out = DraftModelDrafter(draft, min_confidence=sure), []
        for s in starts:
            d = base.fork()
            d.bind(target, None)
            d.prefill(text[:s], None)
            out.append(d)
        return out

    together, alone = rows(), rows()
    samplings = [Sampling(temp=0.8) if sampled and i != 1 else Sampling() for i in range(3)]
    pos, rng, short = list(starts), np.random.default_rng(1), 0
    for step in range(6):
        ys, ks = [text[p] for p in pos], [int(k) for k in rng.integers(2, 7, 3)]
        got = together_as_alone(together, alone, ys, ks, samplings, [10 * step + i for i in range(3)])
        assert all(d.size == k or stops and d.size < k for d, k in zip(got, ks))
        short += sum(d.size < k for d, k in zip(got, ks))
        assert together[0].guessed == alone[0].guessed  # (forks of one drafter share the count)
        for i, (a, b) in enumerate(zip(together, alone)):
            block = [ys[i]] + got[i].tokens.tolist()[: int(rng.integers(0, ks[i] + 1))]
            a.commit(block, None)
            b.commit(block, None)
            assert_same_draft_state(a, b, atol=1e-4)
            pos[i] += len(block)
    fed, kept = together[0].guessed
    assert fed > 0 and 0 < kept < fed  # guesses were fed together, some kept, some refused
    assert not stops or 0 < short < 18  # some rows' chains ended early, not all
