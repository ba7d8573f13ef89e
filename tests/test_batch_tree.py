"""Draft trees in a batch: one target forward verifies every row's tree (or chain) with a
per-row tree mask and per-row node positions, each row keeps its own accepted path, and
every row's output is its solo output (greedy) or has the target's law (sampled)."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

import lossless as L
import mlx_spec
import tiny
from mlx_spec import BatchDecoder, DraftModelDrafter, NGramDrafter, learned, tree
from mlx_spec.batch_cache import BatchCheckpoint, merge
from runs import mlx_lm_greedy as reference
from test_batch import batched_runs, drain
from test_tree import Forks, SampledForks, trees, wrong_walk

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 3, 5, 6, 7, 2, 5, 6], [3, 4], [9, 9, 8, 7, 6, 5, 4, 3, 9, 9, 8]]


@pytest.fixture
def batched_tree_forwards(monkeypatch):
    calls = []
    inner = tree.forward_rows

    def spy(model, cache, inputs, parents):
        calls.append(sum(not tree.is_chain(p) for p in parents))
        return inner(model, cache, inputs, parents)

    monkeypatch.setattr(tree, "forward_rows", spy)
    return calls


def test_rows_verify_their_trees_together_and_each_gets_its_solo_greedy_output(batched_tree_forwards):
    model = tiny.llama_model(seed=2)
    noisy = tiny.llama_model(seed=2)
    noisy.lm_head.weight = noisy.lm_head.weight + 2.0 * mx.random.normal(noisy.lm_head.weight.shape,
                                                                         key=mx.random.key(3))
    drafters = [NGramDrafter(min_n=1, branches=3), DraftModelDrafter(noisy, branches=2),
                Forks(model, PROMPTS[2], 30), NGramDrafter(min_n=1), None]
    prompts = PROMPTS + [PROMPTS[0][:6], [40, 41]]
    res = mlx_spec.batch_generate(model, tiny.tokenizer(), prompts, iter(drafters).__next__,
                                  max_tokens=30, num_draft_tokens=6)
    for p, got in zip(prompts, res.tokens):
        assert got == reference(model, p, 30)
    assert all(max(s.batch_sizes) == 5 for s in res.stats)
    assert all(s.tree_steps > 0 and s.accepted > 0 for s in res.stats[1:3])  # (n-gram: trees when matches differ)
    assert res.stats[3].tree_steps == 0  # a chain row among trees
    assert max(batched_tree_forwards) >= 2  # steps where several rows' trees shared the forward


def _fed(model, prompts):
    rows = []
    for p in prompts:
        c = [KVCache() for _ in model.layers]
        model(mx.array([p]), cache=c)
        rows.append(c)
    return rows


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=st.lists(st.tuples(trees(max_nodes=8), trees(max_nodes=8), st.integers(0, 999)),
                       min_size=1, max_size=3))
def test_ragged_tree_blocks_keep_exactly_each_rows_path(shapes):
    """Blocks of two rows' trees (and a third row's chain), each row keeping a random path:
    every row's cache then equals a fresh cache fed its kept tokens."""
    model = tiny.llama_model(seed=2)
    prompts = [[5, 6, 7], [8], [1, 2, 3, 4, 5, 6]]
    batch = merge(_fed(model, prompts))
    committed = [list(p) for p in prompts]
    for a, b, seed in shapes:
        rng = np.random.default_rng(seed)
        parents = [tuple(a), tuple(b), tuple(range(-1, 4))]
        T = 1 + max(len(p) for p in parents)
        inputs = rng.integers(0, tiny.VOCAB, (3, T))
        paths = []
        for par in parents:
            leaf, path = int(rng.integers(0, len(par) + 1)), []
            j = leaf - 1
            while j >= 0:
                path.insert(0, j)
                j = par[j]
            paths.append(path)
        ckpt = BatchCheckpoint(batch)
        tree.forward_rows(model, batch, mx.array(inputs, mx.uint32), parents)
        keeps = [[0] + [j + 1 for j in path] for path in paths]
        tree.compact_rows(batch, T, keeps)
        ckpt.keep([len(k) for k in keeps], T)
        for i, k in enumerate(keeps):
            committed[i] += inputs[i, k].tolist()
    got = np.array(model(mx.array([[7]] * 3), cache=batch)[:, -1])
    for i, c in enumerate(committed):
        want = np.array(model(mx.array([c + [7]]))[0, -1])
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_sampled_rows_verifying_trees_together_keep_the_targets_law(monkeypatch, batched_tree_forwards):
    """Two rows proposing point-mass trees and one a chain, sampled at different temperatures
    in one batch: each row's law is the target's; the wrong walk (the next token drawn with
    rejected children put back) is caught."""
    model = L.v8_llama()
    cases = [([1, 2, 3, 1, 2], dict(temp=1.0), SampledForks),
             ([4, 5, 6], dict(temp=0.8), SampledForks),
             ([4, 5, 4, 5, 4, 5], dict(temp=1.2), lambda: NGramDrafter(min_n=1))]
    joints = [L.exact_joint(model, p, 5, kw, vocab=8) for p, kw, _ in cases]
    runs = batched_runs(model, cases, 400)
    assert sum(n for n in batched_tree_forwards if n >= 2) >= 800  # trees verified together, often
    for r, joint in zip(runs, joints):
        L.assert_lossless(r, joint)
    monkeypatch.setattr(tree, "walk", wrong_walk)
    L.assert_caught(batched_runs(model, cases, 200)[0], joints[0])


def test_a_window_target_in_a_batch_verifies_first_branches():
    """Sliding-window layers cannot take a tree's mask: the first branch is verified instead,
    and the output is still the target's."""
    model = tiny.gemma3_model()
    decoder = BatchDecoder(model, tiny.tokenizer(), max_batch=2)
    uids = [decoder.add(p, Forks(model, p, 20), max_tokens=20, num_draft_tokens=6) for p in PROMPTS[:2]]
    out, widths = drain(decoder)
    assert max(widths) == 2 and all(out[u] == reference(model, p, 20) for u, p in zip(uids, PROMPTS))
    assert all(decoder.last_stats[u].tree_steps == 0 for u in uids)


def test_auto_rows_in_a_batch_plan_their_dynamic_trees_before_drafting(monkeypatch):
    """In a batch too, `auto` picks each row's tree shape before the row's draft model drafts
    it (a chain pick drafts a chain, a smaller shape a smaller tree), and every row's greedy
    output is its solo output."""
    from test_dynamic_tree import Planned, noisy_draft

    monkeypatch.setattr(learned, "verify_seconds", lambda model, n_max=17, recalibrate=False:  # deep drafts pay
                        [1e-5] if n_max == 1 else [1e-3 * (1 + 0.02 * n) for n in range(n_max)])
    model, made = tiny.llama_model(seed=2), []

    def drafter():
        made.append(Planned(noisy_draft(), tree_budget=8, tree_width=4))
        return made[-1]

    res = mlx_spec.batch_generate(model, tiny.tokenizer(), PROMPTS, drafter, max_tokens=60,
                                  num_draft_tokens="auto")
    for p, got in zip(PROMPTS, res.tokens):
        assert got == reference(model, p, 60)
    assert all(max(s.batch_sizes) == 3 for s in res.stats) and sum(s.tree_steps for s in res.stats) > 0
    steps = [step for d in made for step in d.made]
    assert {plan for plan, _, _ in steps} == {0, 1, 2, 4}, steps
    for plan, draft, rows in steps:
        assert (draft.parents is None and rows == 0) if plan == 0 else draft.size <= -(-8 // plan)
