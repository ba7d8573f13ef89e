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
from mlx_spec.dynamic_tree import DrawnRates
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
    assert sum(d >= 2 and drawn for d, drawn in nodes) > 50  # (runner-ups are rarely needed by
    assert sum(not drawn for _, drawn in nodes) > 10  # this head: its draws are mostly kept)
    L.assert_lossless(runs, joint)


def test_a_draft_model_that_is_the_target_has_every_drawn_child_accepted(monkeypatch):
    """q == p: each drawn child is accepted with probability 1, so every step keeps the whole
    drawn path, and the request learns that draws are kept (`DrawnRates`), so its trees grow
    into the chain of k. As point masses the same trees keep a child only with probability p(c)."""
    model = tiny.llama_model(seed=2)
    steps = spy_paths(monkeypatch)
    d = mlx_spec.DraftModelDrafter(model, tree_budget=6, tree_width=2)
    runs = L.sampled_runs(model, [5, 6, 7, 8, 9], lambda: d, 4, max_tokens=24, k=4, vocab=tiny.VOCAB, temp=1.0)
    assert len(steps) >= 6
    for path in steps:
        assert path and all(drawn for _, drawn in path), path
    kept, examined = d._rates.drawn
    assert examined > 12 and kept == examined - DrawnRates.PRIOR * (1 - DrawnRates.DRAWN)  # every draw kept
    late = [t.accepted for tr in runs.traces for t in tr[2:-1]]  # past the first steps, before the end
    assert late and min(late) == 4  # the whole chain of k = 4


def test_drawn_rates_count_what_the_target_examined():
    """A drawn child counts when its parent was kept; a runner-up only when its drawn sibling
    was rejected (the target's token is not the draw), kept when it is the target's token."""
    r = DrawnRates()
    nodes = {(5,): (0.5, True), (6,): (0.3, False), (7,): (0.1, False),  # depth 1: draw 5, runner-ups 6, 7
             (6, 8): (0.4, True), (6, 9): (0.2, False), (5, 1): (0.9, True)}
    r.learn(nodes, [0, 6, 9, 3])  # the target: 6 (the draw 5 rejected), then 9 (the draw 8 rejected)
    prior = DrawnRates()
    assert r.drawn == [prior.drawn[0], prior.drawn[1] + 2]  # 5 and 8 examined, neither kept; (5, 1) never
    assert r.runner == [prior.runner[0] + 2, prior.runner[1] + 0.3 + 0.1 + 0.2]  # 6 and 9 kept, 7 tried
    r.learn({(4,): (0.6, True), (2,): (0.2, False)}, [0, 4, 1])  # the draw kept: its runner-up never tried
    assert r.drawn[0] == prior.drawn[0] + 1 and r.runner[1] == prior.runner[1] + 0.6


@pytest.mark.usefixtures("untimed_seeded_rows")
def test_a_seeded_sampled_request_repeats_whatever_the_drafter_learned_before():
    """Rates are learned within a request: the same seed through the same drafter object gives
    the same tokens, after a request that taught it other rates."""
    model, draft = tiny.llama_model(seed=2), tiny.llama_model(seed=3, layers=1)
    d = mlx_spec.DraftModelDrafter(draft, tree_budget=6, tree_width=2)

    def run(prompt, seed):
        return [r.token for r in mlx_spec.stream_generate(model, tiny.tokenizer(), prompt, d, max_tokens=20,
                                                          num_draft_tokens=4, temp=1.0, seed=seed)]

    first = run([5, 6, 7, 8, 9], 3)
    run([9, 1, 4, 1, 5, 9, 2, 6], 11)  # another text moves the rates
    assert d._rates.drawn != DrawnRates().drawn
    assert run([5, 6, 7, 8, 9], 3) == first


def test_a_cut_tree_becomes_point_masses_and_its_first_branch_keeps_q():
    """The first n nodes of a drawn tree can depend on what was drawn below them, so the cut
    drops q (point masses are lossless whatever they are); its first branch, the drawn path
    whose depth never turns on a drawn token, keeps each node's q for rejection sampling."""
    from mlx_spec.drafters.base import Draft

    q = mx.softmax(mx.random.normal((4, 8)), axis=-1)
    d = Draft(mx.array([3, 5, 1, 2], mx.uint32), q, parents=(-1, -1, 0, 2))
    cut = tree.first_nodes(d, 3)
    assert cut.q is None and cut.parents == (-1, -1, 0) and cut.tokens.tolist() == [3, 5, 1]
    chain = tree.as_chain(d)
    assert chain.tokens.tolist() == [3, 1, 2] and mx.array_equal(chain.q, q[mx.array([0, 2, 3])])
