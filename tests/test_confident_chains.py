"""Draft chains that end after an unsure token (`DraftModelDrafter(min_confidence=p)`): the
chain stops after the first token the draft model gave less than probability p (kept, still
verified), so the forwards past it are not paid for; the output stays the target's."""

import argparse

import mlx.core as mx
import numpy as np
import pytest

import mlx_spec
import tiny
from mlx_spec import DraftModelDrafter, generate_cli, learned
from mlx_spec.drafters.draft_model import MIN_CONFIDENCE
from mlx_spec.sampling import Sampling
from runs import median_confidence, mlx_lm_greedy as reference


def noisy_copy(noise=0.3, seed=1):
    """The target (`tiny.llama_model(seed=4, layers=2)`) with noise on its output layer: a draft
    that mostly agrees with it."""
    draft = tiny.llama_model(seed=4, layers=2)
    mx.random.seed(seed)
    w = draft.lm_head.weight
    draft.lm_head.weight = w + noise * float(w.std()) * mx.random.normal(w.shape)
    return draft


def greedy_chain(draft, text, k, p):
    """The draft model's greedy chain after `text`, from full forwards (no cache), ended after
    the first of its first k - 1 tokens whose softmax maximum is below p."""
    out = []
    for i in range(k):
        logits = draft(mx.array(text + out)[None])[0, -1].astype(mx.float32)
        probs = np.array(mx.softmax(logits))
        out.append(int(probs.argmax()))
        if i < k - 1 and probs.max() < p:
            break
    return out


@pytest.mark.parametrize("lookup", [False, True])
def test_a_chain_ends_after_its_first_unsure_token(lookup):
    """Each greedy proposal is the draft's argmax chain up to and including its first token of
    probability below p (none of the first k - 1: k tokens); chains ended early and ran whole."""
    target = tiny.llama_model(seed=4, layers=2)
    draft = noisy_copy(noise=1.0)
    text = [5, 17, 3] + reference(target, [5, 17, 3], 40)
    p = median_confidence(draft, text)
    d = DraftModelDrafter(draft, lookup=lookup, min_confidence=p)
    d.bind(target, None)
    d.prefill(text[:10], None)
    pos, ends, rng = 10, [], np.random.default_rng(0)
    for _ in range(16):
        k = int(rng.integers(2, 8))
        got = d.propose(text[pos], k, Sampling()).tokens.tolist()
        want = greedy_chain(draft, text[: pos + 1], k, p)
        assert got == want
        ends.append(len(got) < k)
        block = [text[pos]] + got[: int(rng.integers(0, len(got) + 1))]  # a prefix kept
        d.commit(block, None)
        committed = text[:pos] + block
        text, pos = committed + reference(target, committed, 10), len(committed)
    assert 0 < sum(ends) < len(ends), ends
    assert not lookup or d.guessed[0] > 0


def test_a_sampled_chain_ends_after_a_draw_its_q_made_unlikely():
    """Sampled: every token but the last was drawn with q(d) >= p; a chain shorter than k ends
    on a token with q(d) < p."""
    target = tiny.llama_model(seed=4, layers=2)
    draft = noisy_copy()
    p, seen = 0.5, {"short": 0, "whole": 0}
    d = DraftModelDrafter(draft, lookup=False, min_confidence=p)
    d.bind(target, None)
    d.prefill([5, 17, 3], None)
    mx.random.seed(3)
    for step in range(30):
        k = 5
        draft_ = d.propose(7 + step % 5, k, Sampling(temp=0.6))
        toks, q = draft_.tokens.tolist(), np.array(draft_.q)
        sure = [q[i, t] for i, t in enumerate(toks)]
        assert all(s >= p for s in sure[:-1])
        if len(toks) < k:
            assert sure[-1] < p
        seen["short" if len(toks) < k else "whole"] += 1
        d.commit([7 + step % 5] + toks[:1], None)
    assert min(seen.values()) >= 3, seen


def test_greedy_output_is_the_targets_and_chains_end_early():
    target = tiny.llama_model(seed=4, layers=2)
    draft = noisy_copy(noise=0.2)
    prompt = [5, 17, 3] + reference(target, [5, 17, 3], 20)
    p = median_confidence(draft, prompt)
    out = list(mlx_spec.stream_generate(target, tiny.tokenizer(), prompt, DraftModelDrafter(draft, min_confidence=p),
                                        max_tokens=48, num_draft_tokens=6, trace=True))
    assert [r.token for r in out] == reference(target, prompt, 48)
    trace = out[-1].stats.trace
    short = [t for t in trace if 0 < len(t.proposed) < t.k]
    assert len(short) >= 3 and any(len(t.proposed) == t.k for t in trace)
    assert sum(t.accepted for t in trace) >= 20  # the draft mostly agrees: chains were kept


def test_batch_rows_with_stops_give_each_rows_own_output():
    target = tiny.llama_model(seed=4, layers=2)
    draft = noisy_copy(noise=1.0)
    prompts = [[5, 17, 3, 9], [40, 41, 40], [2, 3, 4, 5, 6, 2, 3]]
    p = median_confidence(draft, prompts[0] + reference(target, prompts[0], 20))
    base = DraftModelDrafter(draft, min_confidence=p)
    res = mlx_spec.batch_generate(target, tiny.tokenizer(), prompts, base.fork, max_tokens=24, num_draft_tokens=5)
    for prompt, got in zip(prompts, res.tokens):
        assert got == reference(target, prompt, 24)


@pytest.mark.parametrize("bad", [0, 0.0, 1.5, -0.1, True, "0.5"])
def test_min_confidence_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="min_confidence must be a probability"):
        DraftModelDrafter(tiny.llama_model(), min_confidence=bad)


def test_the_cli_sets_min_confidence_and_policies_learn_apart(tmp_path):
    """--draft-min-confidence P (0: off) reaches the drafter; a drafter stopping elsewhere than
    the default keeps what `auto` learned in a policy file of its own."""
    model = tiny.llama_model()
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    args = parser.parse_args(["--draft-min-confidence", "0.3"])
    assert generate_cli.draft_model_options(args) == {"min_confidence": 0.3}
    assert generate_cli.draft_model_options(parser.parse_args(["--draft-min-confidence", "0"])) == {"min_confidence": None}
    assert generate_cli.draft_model_options(parser.parse_args([])) == {}
    with pytest.raises(ValueError, match="--draft-min-confidence must be a probability"):
        generate_cli.draft_model_options(parser.parse_args(["--draft-min-confidence", "1.5"]))
    for flags, message in ((["--draft-min-confidence", "0.3"], "give --draft-model PATH"),
                           (["--draft-head-vocab", "0"], "give --draft-model PATH"),
                           (["--draft-model", "d", "--draft-min-confidence", "0.3", "--tree-budget", "8"],
                            "trees .* are drafted whole")):
        with pytest.raises(ValueError, match=message):  # refused before any model is loaded
            generate_cli.make_drafter(parser.parse_args(flags), model, "target")
    names = {p: learned.policy_file(model, DraftModelDrafter(model, min_confidence=p), None).name
             for p in (MIN_CONFIDENCE, None, 0.3)}
    assert len(set(names.values())) == 3
    assert "-nostop-" in names[None] and "-stop0.3-" in names[0.3] and "stop" not in names[MIN_CONFIDENCE]
