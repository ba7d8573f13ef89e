"""Sampled output has exactly the target's distribution, whatever the drafter, at depth.

On an 8-token vocabulary the exact joint law of the first five generated tokens
is computed by enumeration with a NumPy re-implementation of mlx-lm's sampler
(`np_sampler`, independent of `mlx_spec.Sampling`). Seeded runs of speculative
sampling with k = 3 (max_tokens = 5, so the first verify step really drafts 3
tokens) must match it: per-position marginals of positions 1..4 and the joint
law of the neighbouring pairs (1,2), (2,3), (3,4) (position 4 is the bonus when
the first block is accepted whole), chi-square at 1e-4. Every run is traced and
the guards assert that drafts at depth >= 1 were accepted and rejected and that
whole blocks of >= 2 drafts were followed by a bonus, often.

Power: each case is rerun with a deliberately wrong `rejection_accept`
(`lossless.wrong_rule`) and the same check must fail; the rule chosen for a
case is one whose error that case exercises (listed in WRONG).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache

from lossless import (assert_caught, assert_deep, assert_lossless, depth, exact_joint, sampled_runs,
                      use_rule, v8_llama, v8_successor_llama, wrong_rule)
from mlx_spec import DraftModelDrafter, NGramDrafter, make_cache

V = 8
PROMPT = [1, 2, 3, 1, 2]
POSITIONS = 5  # max_tokens: y, then a first block of k = 3 drafts and its bonus or correction
SUCCESSOR_PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]  # prompt lookup continues it
FILTERED = dict(temp=0.7, top_p=0.9, top_k=6, min_p=0.05)


def quantized_cache(model):
    """4-bit KV layers (quantization groups of 32 need the 32-wide heads of heads=2)."""
    return lambda: [QuantizedKVCache(group_size=32, bits=4) for _ in model.layers]


@dataclass
class Case:
    target: Callable  # () -> model
    drafter: Callable  # model -> (() -> a fresh drafter)
    sampling: dict
    runs: int
    prompt: list = field(default_factory=lambda: PROMPT)
    eos: int | None = None
    cache: Callable | None = None  # model -> (() -> a prompt cache for one run)
    first_share: float = 0.9  # share of runs whose first step verifies 3 drafts
    events: int = 100  # deep accepts, deep rejections and whole deep blocks, each at least


def near_draft(sharpen=4.0, **kw):
    """The target's own network with its LM head doubled (the target at temperature 1/2):
    about 60% of its drafts are accepted at temperature 1."""
    draft = v8_llama(sharpen, **kw)
    return lambda model: (lambda: DraftModelDrafter(draft, min_confidence=None))  # chains as asked


CASES = {
    # q from the draft model's own sampling, chained (q_j depends on d_<j)
    "draft-model-temp1": Case(v8_llama, near_draft(), dict(temp=1.0), runs=1500),
    # p and q filtered by top-p, min-p and top-k: different supports
    "draft-model-filtered": Case(v8_llama, near_draft(), FILTERED, runs=1500),
    # point mass q = None (the residual is p without the drafted token)
    "ngram-min_p": Case(v8_successor_llama, lambda m: (lambda: NGramDrafter(min_n=1, max_n=2)),
                        dict(temp=0.9, min_p=0.1), runs=1500, prompt=SUCCESSOR_PROMPT,
                        first_share=0.6, events=60),
    # a bf16 target and draft (logits, p and q start out in bf16)
    "bf16": Case(lambda: v8_llama(dtype=mx.bfloat16), near_draft(dtype=mx.bfloat16),
                 dict(temp=1.0), runs=1200),
    # a 4-bit quantized KV cache given as prompt_cache; the reference runs with one too
    "quantized-kv": Case(lambda: v8_llama(heads=2, kv_heads=1), near_draft(heads=2, kv_heads=1),
                         dict(temp=1.0), runs=1200, cache=quantized_cache),
    # EOS = token 5 ends the text: as an accepted draft, a correction or a bonus
    "eos": Case(v8_llama, near_draft(), dict(temp=1.0), runs=1500, eos=5, first_share=0.7, events=60),
    # lookup-guided chains: prompt lookup's guesses kept with probability q(g), else a draw
    # from q without g (the draft: the successor target, sharper)
    "draft-model-guided": Case(v8_successor_llama, lambda m: guided_drafters, dict(temp=1.0), runs=1500,
                               prompt=SUCCESSOR_PROMPT, first_share=0.6, events=60),
    # the draft's LM head over ids 0..3 and the text's own tokens (`head_vocab`): q is zero on
    # the tokens the text has not shown yet
    "draft-model-short-head": Case(v8_llama, lambda m: short_head_drafters(), dict(temp=1.0), runs=1500),
    # chains that end after a draw q made unlikely (`min_confidence`): the next draft depends
    # on the one before, never a token on its own draw
    "draft-model-stops": Case(v8_llama, lambda m: stopping_drafters(), dict(temp=1.0), runs=1500,
                              first_share=0.3, events=60),
}
STOP_BELOW = 0.25  # the stopping case's min_confidence: a quarter of first steps end at 1 draft, a quarter at 2
GUIDED: list = []  # every drafter the guided case made (what their guesses did)
_GUIDED_DRAFT: list = []


def guided_drafters():
    if not _GUIDED_DRAFT:
        _GUIDED_DRAFT.append(v8_successor_llama(gain=0.6))
    GUIDED.append(DraftModelDrafter(_GUIDED_DRAFT[0], min_confidence=None))
    return GUIDED[-1]

def stopping_drafters():
    draft = v8_llama(4.0)
    return lambda: DraftModelDrafter(draft, lookup=False, min_confidence=STOP_BELOW)


def short_head_drafters():
    draft = v8_llama(4.0)
    return lambda: DraftModelDrafter(draft, head_vocab=4, min_confidence=None)


# The wrong rule each case is shown to catch, and why it matters there.
WRONG = {  # (case, rule): (wrong_rule arguments, runs)
    # residual = p: a rejected draft token is redrawn with its full probability
    ("draft-model-temp1", "residual-from-p"): (dict(residual="p"), 300),
    # the bonus after 3 accepted drafts from p_2 instead of p_3: seen in the pair (3, 4)
    ("draft-model-temp1", "bonus-from-wrong-row"): (dict(bonus_row=-1), 600),
    # q ignored: drafts that q over-proposes are over-accepted
    ("draft-model-filtered", "q-ignored"): (dict(use_q=False), 300),
    # point mass: the residual must drop the drafted token
    ("ngram-min_p", "residual-from-p"): (dict(residual="p"), 300),
    ("bf16", "residual-from-p"): (dict(residual="p"), 400),
    ("quantized-kv", "residual-from-p"): (dict(residual="p"), 300),
    # EOS drawn as a correction: with the residual from p it comes too often
    ("eos", "residual-from-p"): (dict(residual="p"), 500),
    # q zero where p is not: the residual must keep p's mass there
    ("draft-model-short-head", "residual-from-p"): (dict(residual="p"), 300),
}

_built: dict = {}


def build(name):
    """(case, target, make_drafter, make_cache, exact joint law) for a case, built once."""
    if name not in _built:
        case = CASES[name]
        model = case.target()
        cache = None if case.cache is None else case.cache(model)
        joint = exact_joint(model, case.prompt, POSITIONS, case.sampling, vocab=V, eos=case.eos,
                            make_cache=cache)
        _built[name] = (case, model, case.drafter(model), cache, joint)
    return _built[name]


def run(name, runs=None, seed0=0):
    case, model, make_drafter, cache, _ = build(name)
    return sampled_runs(model, case.prompt, make_drafter, runs or case.runs, max_tokens=POSITIONS,
                        k=3, vocab=V, eos=case.eos, make_cache=cache, seed0=seed0, **case.sampling)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if n not in ("eos", "draft-model-guided",
                                                                 "draft-model-short-head", "draft-model-stops")])
def test_sampled_law_at_depth_is_the_targets(name):
    case, *_, joint = build(name)
    runs = run(name)
    assert_deep(runs, share=case.first_share, events=case.events)
    assert_lossless(runs, joint)


@pytest.mark.slow
def test_eos_under_sampling_stops_and_keeps_the_targets_law():
    """EOS drawn as a correction, as a bonus and accepted as a draft: the text stops at
    the first EOS (finish "stop", nothing after it), the prompt cache holds what was
    emitted, EOS included (as mlx-lm's), and the law of the stopped sequences (symbol 8 = after
    the stop) is the target's."""
    case, model, make_drafter, _, joint = build("eos")
    caches = []

    def fresh_cache():
        caches.append(make_cache(model))
        return caches[-1]

    runs = sampled_runs(model, case.prompt, make_drafter, case.runs, max_tokens=POSITIONS, k=3,
                        vocab=V, eos=case.eos, make_cache=fresh_cache, **case.sampling)
    assert_deep(runs, share=case.first_share, events=case.events)
    roles = {"accepted draft": 0, "correction": 0, "bonus": 0}
    for toks, trace, finish, cache in zip(runs.tokens, runs.traces, runs.finish, caches):
        emitted = int((toks < V).sum())
        stops = np.flatnonzero(toks == case.eos)
        if stops.size:
            assert finish == "stop" and emitted == stops[0] + 1, toks
        else:
            assert finish == "length" and emitted == POSITIONS
        assert cache[0].offset == len(case.prompt) + emitted  # every token the caller saw
        pos = 1  # the block of each verify step: accepted drafts, then the target's token
        for t in trace:
            block = list(toks[pos : pos + t.accepted + 1])
            if case.eos in block:
                i = block.index(case.eos)
                roles["accepted draft" if i < t.accepted else
                      "correction" if t.accepted < len(t.proposed) else "bonus"] += 1
            pos += t.accepted + 1
    assert min(roles.values()) >= 40, roles
    assert runs.finish.count("stop") > 0.3 * case.runs
    assert_lossless(runs, joint)


@pytest.mark.slow
@pytest.mark.parametrize("name,rule", list(WRONG), ids=[f"{n}-{r}" for n, r in WRONG])
def test_the_same_check_catches_a_wrong_rule(monkeypatch, name, rule):
    joint = build(name)[-1]
    kw, runs = WRONG[(name, rule)]
    use_rule(monkeypatch, wrong_rule(**kw))
    assert_caught(run(name, runs, seed0=10_000), joint)


@pytest.mark.slow
def test_a_short_draft_head_keeps_the_targets_law():
    """Drafts from a subset of the vocabulary (ids 0..3, then the text's own tokens): the
    first step's drafts never leave the prompt's ids while the target's token does in many
    runs, and the output's law is the target's."""
    case, *_, joint = build("draft-model-short-head")
    runs = run("draft-model-short-head")
    assert_deep(runs, share=case.first_share, events=case.events)
    first = [t[0] for t in runs.traces]
    assert all(max(t.proposed) < 4 for t in first)
    assert sum(int(toks[1]) >= 4 for toks in runs.tokens) > 0.2 * case.runs
    assert_lossless(runs, joint)


@pytest.mark.slow
def test_chains_ending_on_an_unsure_draw_keep_the_targets_law(monkeypatch):
    """Sampled chains that end after a token drawn with q(d) < p: first steps verified 1, 2
    and 3 drafts, and the output's law is the target's. Leaving the unsure token itself out
    (its own draw deciding whether it is verified) is caught by the same check."""
    from mlx_spec.drafters import base, draft_model

    case, *_, joint = build("draft-model-stops")
    runs = run("draft-model-stops")
    assert_deep(runs, share=case.first_share, events=case.events)
    first = depth(runs).first
    assert min(first[1], first[2], first[3]) >= 0.1 * case.runs, dict(first)
    assert_lossless(runs, joint)

    def leaves_it_out(logits, k, sampling, step, choose=base.pick, min_confidence=None):
        tokens, qs = [], []
        for i in range(k):
            t, q = choose(logits, sampling)
            if i and base.confidence(logits, t, q).item() < min_confidence:
                break
            tokens.append(t)
            qs.append(q)
            if i < k - 1:
                logits = step(t.reshape(1).astype(mx.uint32))
        return base.Draft(mx.stack(tokens).astype(mx.uint32), mx.stack(qs))

    monkeypatch.setattr(draft_model, "chain", leaves_it_out)
    assert_caught(run("draft-model-stops", 1500, seed0=10_000), joint)


@pytest.mark.slow
def test_lookup_guided_sampled_chains_keep_the_targets_law(monkeypatch):
    """Sampled draft chains whose guesses came from prompt lookup: every draft token is still
    distributed as the q it reports, so the output is the target's; guesses were kept and
    refused often. Keeping a guess more often than q says (with probability sqrt(q(g))) is
    caught by the same check."""
    from mlx_spec.drafters import draft_model

    case, *_, joint = build("draft-model-guided")
    GUIDED.clear()
    runs = run("draft-model-guided")
    assert_deep(runs, share=case.first_share, events=case.events)
    assert_lossless(runs, joint)
    fed, kept = sum(d.guessed[0] for d in GUIDED), sum(d.guessed[1] for d in GUIDED)
    assert kept >= 300 and fed - kept >= 300, (fed, kept)
    monkeypatch.setattr(draft_model, "guess_kept", lambda u, p: u < mx.sqrt(p))
    assert_caught(run("draft-model-guided", 1500, seed0=10_000), joint)
