"""Sampled dynamic trees whose first child at every node is drawn from the drafter's q
(`dynamic_tree.grow`), verified by recursive rejection sampling (`tree.draws`, `tree.walk`).

The output keeps the target's law (chi-square against the exact joint), both kinds of node
are accepted deep in the tree (drawn children at depth >= 2, point-mass runner-ups), and a
rule that accepts a drawn child as if it were a point mass is caught. A draft model that is
the target itself has every drawn child accepted, which point masses could never give."""

import mlx.core as mx
import pytest

import lossless as L
import mlx_spec
import tiny
from mlx_spec import tree
from test_eagle_lossless import V8, _head, bigram_target

PROMPT = [1, 2, 3, 1, 2]


def spy_paths(monkeypatch) -> list[list[tuple[int, bool]]]:
    """Records each tree step's accepted path as (depth, drawn?) per node (drawn: its q row
    is not a point mass)."""
    steps, qs = [], []
    draws, walk = tree.draws, tree.walk

    def spy_draws(logits, tokens, parents, sampling, q=None):
        qs.append(q)
        return draws(logits, tokens, parents, sampling, q)

    def spy_walk(parents, tokens, read, greedy):
        path, nxt = walk(parents, tokens, read, greedy)
        q = qs.pop()
        drawn = [False] * len(parents) if q is None else (mx.max(q, axis=-1) < 1).tolist()
        steps.append([(tree.depths(parents)[j], drawn[j]) for j in path])
        return path, nxt

    monkeypatch.setattr(tree, "draws", spy_draws)
    monkeypatch.setattr(tree, "walk", spy_walk)
    return steps


def accepted_drawn_charge(monkeypatch) -> None:
    """Wrong: a drawn child accepted with probability P(c), as a point mass would be, while
    its rejection still leaves max(P - Q, 0)."""
    draws = tree.draws

    def wrong(logits, tokens, parents, sampling, q=None):
        out = draws(logits, tokens, parents, sampling, q)
        if q is not None:
            out[0] = out[0] * mx.take_along_axis(q, tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
        return out

    monkeypatch.setattr(tree, "draws", wrong)


@pytest.mark.slow
def test_sampled_dynamic_trees_keep_the_targets_law_with_drawn_and_point_nodes_accepted(monkeypatch):
    model, draft = L.v8_llama(), L.v8_llama(sharpen=1.0)
    joint = L.exact_joint(model, PROMPT, 5, dict(temp=1.0), vocab=8)

    def runs(n):
        return L.sampled_runs(model, PROMPT, lambda: mlx_spec.DraftModelDrafter(draft, tree_budget=6, tree_width=2),
                              n, max_tokens=5, k=4, vocab=8, temp=1.0)

    with monkeypatch.context() as mp:
        steps = spy_paths(mp)
        right = runs(800)
    nodes = [n for path in steps for n in path]
    assert sum(d >= 2 and drawn for d, drawn in nodes) > 100  # drawn children deep in the tree
    assert sum(not drawn for _, drawn in nodes) > 100  # and runner-ups (point masses) accepted
    L.assert_lossless(right, joint)
    accepted_drawn_charge(monkeypatch)
    L.assert_caught(runs(400), joint)


@pytest.mark.slow
def test_sampled_eagle3_trees_over_the_heads_own_vocabulary_keep_the_targets_law(tmp_path, monkeypatch):
    """The head drafts over 5 of the 8 tokens (`d2t`): a drawn child's q is scattered into
    the target's vocabulary (zero outside the head's), filtered as the target's p is."""
    kw = dict(temp=0.7, top_p=0.9, top_k=5)
    model = bigram_target(vocab=V8, seed=3, sharpen=2.0)
    drafter = mlx_spec.load_drafter(_head(tmp_path, model, "eagle3", V8, 5), model, tree_budget=5, tree_width=2)
    joint = L.exact_joint(model, PROMPT, 5, kw, vocab=V8)
    steps = spy_paths(monkeypatch)
    runs = L.sampled_runs(model, PROMPT, lambda: drafter, 700, max_tokens=5, k=3, vocab=V8, **kw)
    nodes = [n for path in steps for n in path]
    assert sum(d >= 2 and drawn for d, drawn in nodes) > 50 and sum(not drawn for _, drawn in nodes) > 50
    L.assert_lossless(runs, joint)


def test_a_draft_model_that_is_the_target_has_every_drawn_child_accepted(monkeypatch):
    """q == p: each drawn child is accepted with probability 1, so every step keeps the whole
    drawn path. As point masses the same trees keep a child only with probability p(c)."""
    model = tiny.llama_model(seed=2)
    steps = spy_paths(monkeypatch)
    make = lambda: mlx_spec.DraftModelDrafter(model, tree_budget=6, tree_width=2)  # noqa: E731
    runs = L.sampled_runs(model, [5, 6, 7, 8, 9], make, 4, max_tokens=24, k=4, vocab=tiny.VOCAB, temp=1.0)
    assert len(steps) >= 8
    for path in steps:
        assert path and all(drawn for _, drawn in path), path
    assert sum(t.accepted for tr in runs.traces for t in tr) >= 2.5 * len(steps)
