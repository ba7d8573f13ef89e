"""DDTree-style draft trees for block drafters (`mlx_spec.drafters.block_tree`): the nodes are
the best prefixes of the factorised block distribution (against a NumPy brute force), greedy
output stays the target's, sampled output keeps its law with deep tree paths accepted, the
drafter's context holds only the accepted path, and bad budgets are refused."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

import dflash_synth as S
import lossless as L
import mlx_spec
from mlx_spec import tree
from mlx_spec.drafters import block_tree
from mlx_spec.heads import load_drafter
from runs import mlx_lm_greedy as greedy_reference, spec_run
from test_dflash import FLASH_PROMPT, PROMPT, V8, make_head, sampled_flash, target


# ---- the search against a brute force -------------------------------------------------------


def brute_force(logprobs: np.ndarray, budget: int) -> set[tuple[int, ...]]:
    """The `budget` token prefixes (depth 1..k, over the whole vocabulary) of highest
    sum_j logprobs[j, t_j], by enumerating every one of them."""
    k, V = logprobs.shape
    scored = []
    for d in range(1, k + 1):
        for seq in itertools.product(range(V), repeat=d):
            scored.append((logprobs[np.arange(d), seq].sum(), seq))
    scored.sort(key=lambda s: -s[0])
    return {seq for _, seq in scored[:budget]}


def node_paths(draft) -> list[tuple[int, ...]]:
    tokens, parents, out = draft.tokens.tolist(), draft.parents, []
    for j in range(len(tokens)):
        path, i = [], j
        while i >= 0:
            path.insert(0, tokens[i])
            i = parents[i]
        out.append(tuple(path))
    return out


def table(seed, k=4, V=6):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((k, V)) * rng.uniform(0.5, 3.0, (k, 1))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return logits.astype(np.float32), logp


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 2, 5, 9, 16])
def test_the_tree_holds_the_budget_most_likely_prefixes(seed, budget):
    logits, logp = table(seed)
    draft = block_tree.propose_tree(mx.array(logits), mlx_spec.Sampling(), budget)
    paths = node_paths(draft)
    assert set(paths) == brute_force(logp, budget) and len(paths) == budget
    depth = tree.depths(draft.parents)  # breadth-first, parents first (raises otherwise)
    assert depth == sorted(depth)
    for kids in tree.children(draft.parents):  # distinct siblings, the best child first
        toks = [paths[j][-1] for j in kids]
        assert len(set(toks)) == len(toks)
        d = len(paths[kids[0]]) - 1 if kids else 0
        assert [logp[d, t] for t in toks] == sorted((logp[d, t] for t in toks), reverse=True)
    chain = tree.as_chain(draft).tokens.tolist()  # the first branch is the argmax chain
    assert chain == np.argmax(logp, -1)[: len(chain)].tolist()


def test_the_brute_force_comparison_catches_a_wrong_score(monkeypatch):
    """Power: the same kind of tree (grown node by node from its frontier, so each node's
    parent is in it) scored by the mean log-probability per position instead of the sum
    picks other nodes, and the comparison sees it."""
    def wrong(values, budget):
        k, width = values.shape
        score = lambda p: np.mean([values[j, r] for j, r in enumerate(p)])  # noqa: E731
        chosen, frontier = [], [(r,) for r in range(width)]
        while frontier and len(chosen) < budget:
            best = max(frontier, key=score)
            frontier.remove(best)
            chosen.append(best)
            if len(best) < k:
                frontier += [best + (r,) for r in range(width)]
        return chosen

    monkeypatch.setattr(block_tree, "best_prefixes", wrong)
    missed = 0
    for seed in range(6):
        logits, logp = table(seed, k=3, V=4)
        draft = block_tree.propose_tree(mx.array(logits), mlx_spec.Sampling(), 6)
        missed += set(node_paths(draft)) != brute_force(logp, 6)
    assert missed >= 3


def test_a_filtered_distribution_never_puts_a_filtered_token_in_the_tree():
    logits, _ = table(0, k=3, V=6)
    sampling = mlx_spec.Sampling(temp=1.0, top_k=2)
    draft = block_tree.propose_tree(mx.array(logits), sampling, 16)
    allowed = [set(np.argsort(-logits[j])[:2].tolist()) for j in range(3)]
    for path in node_paths(draft):
        assert all(t in allowed[j] for j, t in enumerate(path))
    assert draft.size == 2 + 4 + 8  # every prefix over the 2 tokens kept at each position


def test_a_reduced_draft_vocabulary_maps_the_tree_to_target_ids():
    logits, _ = table(1, k=3, V=6)
    d2t = mx.array([10, 3, 7, 42, 0, 5], mx.uint32)  # draft id -> target id
    plain = block_tree.propose_tree(mx.array(logits), mlx_spec.Sampling(), 7)
    mapped = block_tree.propose_tree(mx.array(logits), mlx_spec.Sampling(), 7, to_target=lambda i: d2t[i])
    assert mapped.parents == plain.parents
    assert mapped.tokens.tolist() == [int(d2t[t].item()) for t in plain.tokens.tolist()]


@pytest.mark.parametrize("bad", [0, 17, -1, 2.5, True, "8"])
def test_bad_budgets_are_refused(tmp_path, bad):
    model, _ = target("qwen3")
    out, _, _ = make_head(tmp_path, "qwen3")
    with pytest.raises(ValueError, match="tree_budget must be an integer in 1..16"):
        load_drafter(out, model, tree_budget=bad)


# ---- through the decode loop ------------------------------------------------------------------


def tree_run(model, drafter, n, k, **kw):
    seen = []
    propose = drafter.propose

    def spy(y, kk, sampling):
        d = propose(y, kk, sampling)
        seen.append(d)
        return d

    drafter.propose = spy
    got, stats = spec_run(model, drafter, PROMPT, n, k, **kw)
    return got, stats, seen


@pytest.mark.parametrize("budget,k", [(4, 4), (8, 15), (16, 15)])
@pytest.mark.parametrize("tname,copy", [("qwen3", False), ("qwen3-echo", True)])
def test_greedy_through_block_trees_is_the_targets_own(tmp_path, tname, copy, budget, k):
    model, _ = target(tname)
    out, _, _ = make_head(tmp_path, tname, copy=copy)
    got, stats, drafts = tree_run(model, load_drafter(out, model, tree_budget=budget), 80, k)
    assert got == greedy_reference(model, PROMPT, 80)
    assert all(d.size <= budget for d in drafts)
    if tname == "qwen3" or budget > 8:  # the copy head is near-certain: a small budget is its chain
        assert stats.tree_steps > 0 and any(not tree.is_chain(d.parents) for d in drafts)
    assert stats.drafted > stats.accepted  # rejected branches were dropped


def test_the_head_keeps_only_the_accepted_path(tmp_path):
    """After a run through trees, the head's context equals one built from the taps of the
    output sequence alone: its next block's logits match the NumPy reference's."""
    model, _ = target("qwen3-echo")
    out, w, _ = make_head(tmp_path, "qwen3-echo", copy=True)
    d = load_drafter(out, model, tree_budget=8)
    got, stats, _ = tree_run(model, d, 40, 15)
    assert stats.tree_steps > 0 and stats.accepted > 0
    seq = PROMPT + got
    pos = d.context.length  # committed so far (the last block's commit waits for a next step)
    assert len(seq) - 16 <= pos < len(seq)
    ref = S.Reference(w, layers=2, windows=[None, None], causal=[False, False], block=16)
    E, head = (np.array(a, np.float64) for a in (model.model.embed_tokens.weight, model.lm_head.weight))
    taps = S.concat_taps(S.target_taps(model, seq, d.taps), d.taps)
    want = ref.dflash_logits(taps[:pos], seq[pos], E, head)
    np.testing.assert_allclose(np.array(d.logits(d.hidden(seq[pos])[1:])), want, atol=1e-4, rtol=1e-4)


def test_a_target_that_cannot_verify_trees_gets_chains(tmp_path):
    """A sliding-window target (muse_glimmer): the head drafts chains, output unchanged."""
    model, _ = target("muse-echo")
    out, _, _ = make_head(tmp_path, "muse-echo", layout="muse", copy=True)
    got, stats, drafts = tree_run(model, load_drafter(out, model, tree_budget=8), 60, 15)
    assert got == greedy_reference(model, PROMPT, 60)
    assert all(d.parents is None for d in drafts) and stats.tree_steps == 0 and stats.accepted > 0


def test_recurrent_targets_are_told_apart_from_plain_kv_ones():
    import tiny

    assert block_tree.tree_verifiable(target("qwen3")[0])
    assert not block_tree.tree_verifiable(tiny.qwen3_5_model())  # recurrent layers: chains


@pytest.mark.usefixtures("untimed_seeded_rows")  # seeded: choices from costs and tokens only
def test_auto_draft_length_with_a_tree_budget_stays_lossless(tmp_path, monkeypatch):
    """`auto` picks the depth (and per step the whole tree or its first branch) while the
    budget fixes the nodes: the same greedy output, and both shapes verified."""
    from mlx_spec import learned

    monkeypatch.setattr(learned, "verify_seconds",
                        lambda model, n_max=17, recalibrate=False: [1e-3 * (1 + 0.05 * n) for n in range(n_max)])
    model, _ = target("qwen3-echo")
    out, _, _ = make_head(tmp_path, "qwen3-echo", copy=True)
    got, stats = spec_run(model, load_drafter(out, model, tree_budget=16), PROMPT, 80, "auto", seed=0)
    assert got == greedy_reference(model, PROMPT, 80)
    assert stats.tree_steps > 0 and stats.accepted > 0


def deep_tree_steps(runs) -> tuple[int, int]:
    """Over sampled runs' non-chain tree steps: (steps accepting >= 2 drafts, steps accepting
    a first token off the tree's first branch)."""
    deep = off_first = 0
    for trace, drafts in zip(runs.traces, runs.proposals):
        for t, draft in zip(trace, drafts):
            if draft.parents is None or tree.is_chain(draft.parents):
                continue
            deep += t.accepted >= 2
            off_first += t.accepted >= 1 and t.proposed[:1] != tree.as_chain(draft).tokens.tolist()[:1]
    return deep, off_first


@pytest.mark.slow
def test_sampled_block_trees_keep_the_targets_law_with_deep_paths_accepted(tmp_path_factory):
    """The 8-token sampled setup of test_dflash (block of 3 drafts), as a tree of 6 nodes:
    marginals and neighbouring pairs against the exact law, and paths of depth >= 2 through
    non-chain trees are accepted (and not only along the first branch)."""
    model, head, joint = sampled_flash(tmp_path_factory)
    d = load_drafter(head, model, tree_budget=6)
    runs = L.sampled_runs(model, FLASH_PROMPT, lambda: d, 1200, max_tokens=5, k=3, vocab=V8,
                          temp=1.0, record_drafts=True)
    deep, off_first = deep_tree_steps(runs)
    print(f"tree steps accepting >= 2 drafts: {deep}; off the first branch: {off_first}")
    assert deep >= 100 and off_first >= 100, (deep, off_first)
    L.assert_lossless(runs, joint)


@pytest.mark.slow
def test_the_check_catches_a_wrong_walk_over_block_trees(tmp_path_factory, monkeypatch):
    """Power: the same setup with test_tree's deliberately wrong walk (a rejection redraws
    from the whole row, rejected children included) fails the check."""
    from test_tree import wrong_walk

    model, head, joint = sampled_flash(tmp_path_factory)
    d = load_drafter(head, model, tree_budget=6)
    monkeypatch.setattr(tree, "walk", wrong_walk)
    runs = L.sampled_runs(model, FLASH_PROMPT, lambda: d, 500, max_tokens=5, k=3, vocab=V8,
                          temp=1.0, seed0=10_000)
    L.assert_caught(runs, joint)


# ---- DSpark ---------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [None, 0.5, 1.0])
def test_dspark_without_a_markov_head_drafts_trees_and_keeps_greedy_output(tmp_path, threshold):
    """DeepSpec's "DFlash" layout (markov_rank 0): the same trees, cut to the confidence
    length when a threshold is set; output token for token the target's."""
    import test_dspark as T

    model, _, _ = T.echo_target()
    out, _ = T.make_head(tmp_path, rank=0, confidence_head_with_markov=False)
    d = load_drafter(out, model, tree_budget=8, confidence_threshold=threshold)
    seen, propose = [], d.propose
    d.propose = lambda y, k, s: seen.append(propose(y, k, s)) or seen[-1]
    got, stats = spec_run(model, d, T.PROMPT, 80, 7)
    assert got == greedy_reference(model, T.PROMPT, 80)
    assert all(x.size <= 8 for x in seen)
    if threshold == 1.0:  # no running confidence product reaches 1: the cut leaves nothing
        assert all(x.size == 0 for x in seen) and stats.drafted == 0
    else:
        assert stats.tree_steps > 0


def markov_best_paths(U, W1, W2, y, budget):
    """NumPy: the `budget` most likely paths of the chain s_j = U_j + W2 W1[x_(j-1)], found
    best-first over the whole vocabulary (a child never scores above its parent)."""
    import heapq

    def logp(j, prev):
        s = U[j] + W2 @ W1[prev]
        return s - s.max() - np.log(np.exp(s - s.max()).sum())

    heap, out = [(0.0, ())], []
    while heap and len(out) <= budget:
        neg, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < len(U):
            lp = logp(len(path), path[-1] if path else y)
            for t in range(len(lp)):
                heapq.heappush(heap, (neg - float(lp[t]), path + (t,)))
    return out[1:]  # without the root


def markov_drafter(tmp_path, budget, threshold=None):
    """A DSpark head with a random Markov head and confidences, bound and fed a prompt."""
    import test_dspark as T

    model, _, _ = T.echo_target()
    out, w = T.make_head(tmp_path, rank=16, trained=False)
    d = load_drafter(out, model, tree_budget=budget, confidence_threshold=threshold)
    d.bind(model, None)
    seq = T.PROMPT + [3, 9, 11, 4]
    d.prefill(seq, T.mx_taps(S.target_taps(model, seq, d.taps), 0, len(seq)))
    return d, w


@pytest.mark.parametrize("budget", [1, 5, 16])
def test_markov_trees_hold_the_budget_most_likely_paths_of_the_chain(tmp_path, budget):
    """With a Markov head each row depends on the token before it; the tree is the
    `budget` best paths under that chain, against a NumPy best-first search."""
    d, w = markov_drafter(tmp_path, budget)
    for y in (3, 17):
        U, h = d.step_logits(y, 4)
        draft = d._tree(U, h, y, mlx_spec.Sampling())
        want = markov_best_paths(np.array(U, np.float64), w["markov_head.markov_w1.weight"],
                                 w["markov_head.markov_w2.weight"], y, budget)
        assert sorted(node_paths(draft)) == sorted(want)
        first = tree.as_chain(draft).tokens.tolist()  # the first branch: the greedy chain
        assert first and first == np.array(d._chain(U, h, y, mlx_spec.Sampling())[0]).tolist()[: len(first)]
        if budget >= 5:
            assert not tree.is_chain(draft.parents)  # a real tree, not the chain


def test_the_markov_tree_keeps_the_nodes_whose_path_confidence_clears_the_cut(tmp_path):
    """Each node's confidence reads its depth's hidden row and its parent's token (W1);
    a node stays while its path's running product stays >= the threshold."""
    d, w = markov_drafter(tmp_path, 16)
    U, h = d.step_logits(3, 4)
    whole = node_paths(d._tree(U, h, 3, mlx_spec.Sampling()))
    W1, P, b = (w["markov_head.markov_w1.weight"], w["confidence_head.proj.weight"][0],
                w["confidence_head.proj.bias"][0])
    H = np.array(h, np.float64)

    def product(path):
        prev, out = 3, 1.0
        for j, t in enumerate(path):
            out *= 1 / (1 + np.exp(-(P @ np.concatenate([H[j], W1[prev]]) + b)))
            prev = t
        return out

    runs = sorted({round(product(p), 6) for p in whole})  # (siblings share theirs)
    threshold = (runs[len(runs) // 2 - 1] + runs[len(runs) // 2]) / 2  # between two, near the middle
    d.set_cut(threshold)
    kept = node_paths(d._tree(U, h, 3, mlx_spec.Sampling()))
    want = [p for p in whole if product(p) >= threshold]
    assert sorted(kept) == sorted(want) and 0 < len(kept) < len(whole)


@pytest.mark.parametrize("threshold", [None, 0.55])
def test_dspark_with_a_markov_head_drafts_trees_and_keeps_greedy_output(tmp_path, threshold):
    import test_dspark as T

    model, _, _ = T.echo_target()
    out, _ = T.make_head(tmp_path)
    d = load_drafter(out, model, tree_budget=8, confidence_threshold=threshold)
    got, stats = spec_run(model, d, T.PROMPT, 80, 7)
    assert got == greedy_reference(model, T.PROMPT, 80)
    assert stats.tree_steps > 0 and stats.tau > 1.3


@pytest.mark.slow
def test_sampled_markov_trees_keep_the_targets_law_with_deep_paths_accepted(tmp_path_factory):
    """test_dspark's sampled bigram setup (block of 3, confidence cut 0.6) drafting trees of
    5 nodes: marginals and neighbouring pairs against the exact law, with paths of depth
    >= 2 through non-chain trees accepted, off the first branch too."""
    import test_dspark as T

    model, head, joint = T.bigram_spark(tmp_path_factory)
    d = load_drafter(head, model, tree_budget=5, confidence_threshold=0.6)
    runs = L.sampled_runs(model, T.SPARK_PROMPT, lambda: d, 600, max_tokens=5, k=3, vocab=T.V8,
                          temp=1.0, record_drafts=True)
    deep, off_first = deep_tree_steps(runs)
    print(f"Markov tree steps accepting >= 2 drafts: {deep}; off the first branch: {off_first}")
    assert deep >= 50 and off_first >= 50, (deep, off_first)
    L.assert_lossless(runs, joint)


# ---- the command line -------------------------------------------------------------------------


def test_tree_budget_flag_reaches_block_drafters_and_is_refused_elsewhere(tmp_path):
    import argparse

    from mlx_spec import generate_cli

    model, _ = target("qwen3")
    out, _, _ = make_head(tmp_path, "qwen3")
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)

    def drafter(*argv):
        return generate_cli.make_drafter(parser.parse_args(list(argv)), model, "unused")

    assert drafter("--draft", str(out), "--tree-budget", "8").tree_budget == 8
    assert drafter("--draft", str(out)).tree_budget is None
    for argv, message in [(("--draft", str(out), "--tree-budget", "0"), "tree_budget must be an integer"),
                          (("--draft", "none", "--tree-budget", "4"), "not with --draft none"),
                          (("--tree-budget", "4"), "not with --draft ngram")]:
        with pytest.raises(ValueError, match=message):
            drafter(*argv)


def test_a_chain_only_head_names_the_option_it_does_not_take(tmp_path):
    from mlx_spec import heads

    with pytest.raises(ValueError, match="gemma4_assistant drafters take no tree_budget option"):
        heads._call("mlx_spec.drafters.gemma4_assistant:load", tmp_path, {}, None, tree_budget=4)
