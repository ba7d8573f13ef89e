"""Draft trees: one forward verifies every node as if its path had been fed alone; the cache
keeps exactly the accepted path; the output is the target's, greedy and sampled."""

import time

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

import lossless as L
import mlx_spec
from mlx_spec import learned
import tiny
from mlx_spec import tree, tree_shape
from mlx_spec.drafters.base import Draft, PlansTrees
from runs import mlx_lm_greedy as reference

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7]


@st.composite
def trees(draw, max_nodes=12):
    n = draw(st.integers(1, max_nodes))
    parents, depth = [], []
    for j in range(n):
        # a parent among the nodes of the last or current depth keeps breadth-first order
        choices = [-1] + [i for i in range(j) if depth[i] >= (depth[-1] if depth else 0) - 1]
        p = draw(st.sampled_from(choices if j == 0 or depth[-1] == 1 else choices[1:] or [-1]))
        d = 1 if p < 0 else depth[p] + 1
        if depth and d < depth[-1]:
            p, d = j - 1, depth[-1] + 1
        parents.append(p)
        depth.append(d)
    return parents


def prefilled(model, prompt=PROMPT):
    cache = [KVCache() for _ in model.layers]
    model(mx.array([prompt]), cache=cache)
    return cache


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parents=trees(), seed=st.integers(0, 999))
def test_every_node_sees_exactly_its_path(parents, seed):
    check_node_logits(parents, seed)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parents=trees(), seed=st.integers(0, 999))
def test_ropes_without_array_offsets_rotate_each_depth_apart(parents, seed):
    with pytest.MonkeyPatch.context() as mp:  # e.g. mlx-lm's DynamicNTKScalingRoPE
        mp.setattr(tree, "_ARRAY_OFFSET_ROPES", ())
        check_node_logits(parents, seed)


def check_node_logits(parents, seed):
    model = tiny.llama_model(seed=2)
    tree.depths(parents)  # valid breadth-first order
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, tiny.VOCAB, len(parents)).tolist()
    y = 11
    logits = np.array(tree.forward(model, prefilled(model), mx.array([y] + tokens, mx.uint32), parents))
    for row in range(len(parents) + 1):
        path, j = [], row - 1
        while j >= 0:
            path.insert(0, tokens[j])
            j = parents[j]
        want = np.array(model(mx.array([PROMPT + [y] + path]))[0, -1])
        np.testing.assert_allclose(logits[row], want, rtol=1e-4, atol=1e-4)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parents=trees(), seed=st.integers(0, 999))
def test_the_cache_keeps_exactly_the_accepted_path(parents, seed):
    model = tiny.llama_model(seed=2)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, tiny.VOCAB, len(parents)).tolist()
    leaf = int(rng.integers(0, len(parents) + 1))  # a path from the root to a node (0: none)
    path, j = [], leaf - 1
    while j >= 0:
        path.insert(0, j)
        j = parents[j]
    cache = prefilled(model)
    base = cache[0].offset
    tree.forward(model, cache, mx.array([11] + tokens, mx.uint32), parents)
    tree.compact(cache, base, [0] + [j + 1 for j in path])
    got = np.array(model(mx.array([[7]]), cache=cache)[0, -1])
    want = np.array(model(mx.array([PROMPT + [11] + [tokens[j] for j in path] + [7]]))[0, -1])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


class Forks(mlx_spec.NGramDrafter):
    """A tree at every step: at each depth two children, the target's greedy token (when known)
    and another, the greedy one first or second at random; the second child a leaf."""

    def __init__(self, model, prompt, n, depth=3, seed=0):
        super().__init__()
        self.want = reference(model, prompt, n + depth + 1)
        self.depth, self.rng = depth, np.random.default_rng(seed)

    def bind(self, model, tokenizer):
        self.done = 0

    def prefill(self, tokens, taps):
        self.done = 1

    def propose(self, y, k, sampling):
        tokens, parents, spine = [], [], -1
        for d in range(min(self.depth, max(k // 2, 1))):
            right = self.want[self.done + d] if self.done + d < len(self.want) else 0
            wrong = (right + 1 + int(self.rng.integers(0, 5))) % tiny.VOCAB
            pair = [right, wrong] if self.rng.random() < 0.5 else [wrong, right]
            tokens += pair
            parents += [spine, spine]
            spine = len(tokens) - 2 + pair.index(right)
        # breadth-first: the two children of each depth follow the spine node of the depth before
        return Draft(mx.array(tokens, mx.uint32), parents=tuple(parents))

    def commit(self, tokens, taps):
        self.done += len(tokens)


def test_greedy_through_trees_is_the_targets_own_and_takes_either_child():
    model = tiny.llama_model(seed=2)
    drafter = Forks(model, PROMPT, 30)
    out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, drafter, max_tokens=30,
                                        num_draft_tokens=6, trace=True))
    assert [r.token for r in out] == reference(model, PROMPT, 30)
    s = out[-1].stats
    assert s.accepted >= 15 and s.tau > 2.5  # deep paths through the forks were kept


class RightFirst(Forks):
    """The same trees, the target's token always the first child: the chain is as good."""

    def propose(self, y, k, sampling):
        self.rng = Always()
        return super().propose(y, k, sampling)


class Always:
    def random(self):
        return 0.0  # < 0.5: the right child first

    def integers(self, lo, hi):
        return lo


@pytest.mark.usefixtures("untimed_seeded_rows")  # shapes weighed by the calibrated costs below
@pytest.mark.parametrize("drafter, trees_pay", [(Forks, True), (RightFirst, False)])
def test_auto_verifies_trees_only_where_they_pay(drafter, trees_pay, monkeypatch):
    """auto picks per step between the whole tree and its first branch by tokens per
    predicted second: trees where the target's token is often the second child, chains
    (cheaper, as good) where it is always the first; the other shape is still tried."""
    monkeypatch.setattr(learned, "verify_seconds",
                        lambda model, n_max=17, recalibrate=False: [1e-3 * (1 + 0.1 * n) for n in range(n_max)])
    model = tiny.llama_model(seed=2)
    out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, drafter(model, PROMPT, 60),
                                        max_tokens=60, num_draft_tokens="auto", seed=0))
    assert [r.token for r in out] == reference(model, PROMPT, 60)
    s = out[-1].stats
    steps = s.target_forwards
    drafting = sum(1 for k in s.chosen_k if k >= 1)  # every drafting step offers a tree
    assert drafting >= 10, s.chosen_k
    assert 0 < s.tree_steps < drafting  # both shapes ran
    assert (s.tree_steps > drafting / 2) == trees_pay, (s.tree_steps, drafting, steps)


class Deep(Forks):
    """Forks four levels deep (8 nodes) whatever k: the whole tree always keeps 4 drafts, its
    first half (two levels) 2, its first quarter 1, its first branch 4 only by luck."""

    def propose(self, y, k, sampling):
        return super().propose(y, 8, sampling)

    def __init__(self, model, prompt, n):
        super().__init__(model, prompt, n, depth=4)


@pytest.mark.usefixtures("untimed_seeded_rows")  # shapes weighed by the calibrated costs below
@pytest.mark.parametrize("wide, want", [("cheap", 1), ("dear", 2)])
def test_auto_trims_trees_to_the_budget_that_pays(wide, want, monkeypatch):
    """auto also verifies a tree's first half or quarter of nodes: with cheap wide verifies the
    deep tree is verified whole; where verifying more than 4 rows is dear, its first half."""
    steep = 0.0 if wide == "cheap" else 1.0
    monkeypatch.setattr(learned, "verify_seconds", lambda model, n_max=17, recalibrate=False:
                        [1e-3 * (1 + 0.05 * n + steep * max(n - 4, 0)) for n in range(n_max)])
    picks = spy_picks(monkeypatch)
    model = tiny.llama_model(seed=2)
    out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, Deep(model, PROMPT, 120),
                                        max_tokens=120, num_draft_tokens="auto", seed=0))
    assert [r.token for r in out] == reference(model, PROMPT, 120)
    assert len(picks) >= 20 and set(picks) == set(tree_shape.ShapeChoice.SHAPES), picks  # all tried
    settled = picks[len(tree_shape.ShapeChoice.SHAPES):]  # after each shape's first try
    assert settled.count(want) > 0.75 * len(settled), picks



def spy_picks(monkeypatch) -> list[int]:
    """Every shape `auto` picks, in order."""
    picks = []

    class Spy(tree_shape.ShapeChoice):
        def pick(self):
            picks.append(super().pick())
            return picks[-1]

    monkeypatch.setattr(tree_shape, "ShapeChoice", Spy)
    return picks


class DearForks(Forks, PlansTrees):
    """Forks whose trees are planned before drafting and take `slow` seconds to draft; a chain
    (planned shape 0) costs nothing and is always wrong at its first token."""

    tree_budget = 8

    def __init__(self, model, prompt, n, slow):
        super().__init__(model, prompt, n)
        self.slow, self.made = slow, []

    def propose(self, y, k, sampling):
        shape = self.step_tree()
        if shape is None:
            self.made.append(0)
            return Draft(mx.array([(self.want[self.done] + 1) % tiny.VOCAB], mx.uint32))
        self.made.append(shape[0])
        time.sleep(self.slow)
        return super().propose(y, k, sampling)


@pytest.mark.parametrize("slow, want", [(0.0, "tree"), (0.2, "chain")])
def test_a_lone_rows_tree_shape_is_weighed_with_its_drafting_time(slow, want, monkeypatch):
    """Timed: the shapes are compared by tokens per second of the whole step, drafting included,
    and drafted as planned. Trees keep tokens here and the chain never does, so by the verify's
    cost alone the tree always wins; when drafting a tree takes 200 ms, the chain does (50 ms
    was too close to a tiny forward's time on a loaded 2-core machine)."""
    picks = spy_picks(monkeypatch)
    model = tiny.llama_model(seed=2)
    drafter = DearForks(model, PROMPT, 120, slow)
    out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, drafter, max_tokens=120,
                                        num_draft_tokens="auto"))
    assert [r.token for r in out] == reference(model, PROMPT, 120)
    assert drafter.made == [8 // s if s else 0 for s in picks]  # each drafted as planned
    settled = picks[len(tree_shape.ShapeChoice.SHAPES):]
    chains = settled.count(0)
    assert len(settled) >= 10, picks
    assert chains > 0.75 * len(settled) if want == "chain" else chains < 0.25 * len(settled), picks
    if want == "tree":
        return
    assert len(list(learned.policy_dir().glob("*-DearForks-tree8-greedy.json"))) == 1  # apart from chains
    # what paid carries over to the next request, and to the next process (a new drafter object
    # starts from the policy file): no whole tree is tried again first
    for again in (drafter, DearForks(model, PROMPT, 120, slow)):
        del picks[:]
        out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, again, max_tokens=60,
                                            num_draft_tokens="auto"))
        assert [r.token for r in out] == reference(model, PROMPT, 60)
        assert len(picks) >= 5 and picks[:3] != [1, 2, 4] and picks.count(0) > 0.75 * len(picks), picks

def test_a_recurrent_target_verifies_the_first_branch_as_a_chain():
    model = tiny.qwen3_5_model()
    out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, Forks(model, PROMPT, 20),
                                        max_tokens=20, num_draft_tokens=6))
    assert [r.token for r in out] == reference(model, PROMPT, 20)


class SampledForks(mlx_spec.NGramDrafter):
    """Point-mass trees on an 8-token vocabulary: two children at the root, each with one child."""

    def bind(self, model, tokenizer):
        self.rng = np.random.default_rng(0)

    def prefill(self, tokens, taps):
        pass

    def commit(self, tokens, taps):
        pass

    def propose(self, y, k, sampling):
        a, b = self.rng.choice(8, 2, replace=False).tolist()
        return Draft(mx.array([a, b, (a + 1) % 8, (b + 3) % 8], mx.uint32), parents=(-1, -1, 0, 1))


def wrong_walk(parents, tokens, read, greedy):
    """Wrong: when every child is rejected the next token is drawn from the parent's whole row,
    rejected children included, instead of from the residual without them."""
    path, nxt = tree_walk(parents, tokens, read, greedy)
    p_node, u, full, rest = read
    row = path[-1] + 1 if path else 0
    return path, (full[row] if nxt == rest[row] and tree.children(parents)[row] else nxt)


tree_walk = tree.walk


@pytest.mark.slow
def test_sampled_trees_keep_the_targets_law_and_a_wrong_walk_is_caught(monkeypatch):
    model = L.v8_llama()
    joint = L.exact_joint(model, [1, 2, 3, 1, 2], 5, dict(temp=1.0), vocab=8)
    runs = L.sampled_runs(model, [1, 2, 3, 1, 2], SampledForks, 800, max_tokens=5, k=4, vocab=8, temp=1.0)
    kept = sum(t.accepted for tr in runs.traces for t in tr)
    second = sum(1 for tr in runs.traces for t in tr if t.accepted)
    assert kept > 200 and second > 150
    L.assert_lossless(runs, joint)
    monkeypatch.setattr(tree, "walk", wrong_walk)
    L.assert_caught(L.sampled_runs(model, [1, 2, 3, 1, 2], SampledForks, 400, max_tokens=5, k=4,
                                   vocab=8, temp=1.0), joint)


def test_ngram_proposes_a_tree_of_its_earlier_matches_most_recent_first():
    d = mlx_spec.NGramDrafter(min_n=1, max_n=2, branches=3)
    d.bind(None, None)
    d.prefill([5, 6, 8, 9, 1, 5, 6, 3, 4, 1, 5, 6, 8, 7, 1], None)  # "5 6" then 8 9, 3 4, 8 7
    draft = d.propose(5, 4, mlx_spec.Sampling())  # the context ends "... 1" and y = 5
    sequences = [[6, 8, 7, 1], [6, 3, 4, 1], [6, 8, 9, 1]]
    want_tokens, want_parents = tree.trie(sequences, 4)
    assert draft.tokens.tolist() == want_tokens and draft.parents == want_parents
    assert d.propose(42, 4, mlx_spec.Sampling()).size == 0  # never seen: nothing


def test_tree_sources_keep_greedy_output():
    """n-gram with several matches, a draft model with its runner-up tokens, and the two
    mixed: each verifies trees and keeps the target's output token for token."""
    model = tiny.llama_model(seed=2)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 3, 5, 6, 7, 2, 5, 6]
    want = reference(model, prompt, 40)
    noisy = tiny.llama_model(seed=2)
    noisy.lm_head.weight = noisy.lm_head.weight + 2.0 * mx.random.normal(noisy.lm_head.weight.shape,
                                                                         key=mx.random.key(3))
    sources = {"ngram": (lambda: mlx_spec.NGramDrafter(min_n=1, branches=3), 0),
               "draft-model": (lambda: mlx_spec.DraftModelDrafter(noisy, branches=2), 3),
               "mixed": (lambda: mlx_spec.MixedDrafter(mlx_spec.NGramDrafter(min_n=1),
                                                       mlx_spec.DraftModelDrafter(noisy)), 1)}
    for name, (make, at_least) in sources.items():
        drafter, trees_seen = make(), [0]
        propose = drafter.propose

        def spy(y, k, sampling, propose=propose):
            d = propose(y, k, sampling)
            trees_seen[0] += d.parents is not None and not tree.is_chain(d.parents)
            return d

        drafter.propose = spy
        out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), prompt, drafter, max_tokens=40,
                                            num_draft_tokens=6))
        assert [r.token for r in out] == want, name
        assert trees_seen[0] >= at_least and out[-1].stats.accepted > 0, name


def ministral3_model():
    """A tiny Ministral 3: attention scaled by each query's position (llama_4_scaling_beta), every
    16 positions here, outside its ropes."""
    from mlx_lm.models import ministral3

    args = ministral3.ModelArgs(
        model_type="ministral3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=tiny.VOCAB, head_dim=16,
        max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters=dict(rope_theta=10000.0, rope_type="default", llama_4_scaling_beta=1.0,
                             original_max_position_embeddings=16))
    mx.random.seed(0)
    model = ministral3.Model(args)
    model.lm_head.weight = model.lm_head.weight * 8
    mx.eval(model.parameters())
    return model


def test_a_target_scaling_attention_by_position_verifies_chains():
    """A tree node sits at offset + depth for the ropes, but Ministral 3 scales its query by
    offset + its place in the block: such targets verify the first branch as a chain."""
    model = ministral3_model()
    assert not tree.tree_capable([KVCache()], model) and tree.tree_capable([KVCache()], tiny.llama_model())
    for n in (6, 9, 12):
        prompt = list(range(3, 3 + n))
        out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), prompt, Forks(model, prompt, 40),
                                            max_tokens=40, num_draft_tokens=6))
        assert [r.token for r in out] == reference(model, prompt, 40)
        assert out[-1].stats.tree_steps == 0 and out[-1].stats.accepted > 10


def test_a_draft_model_drafts_chains_for_a_target_that_cannot_verify_trees():
    """No tree is grown for a step that would verify only its first branch (a recurrent target)."""
    drafter = mlx_spec.DraftModelDrafter(tiny.llama_model(seed=1), min_confidence=None, tree_budget=8)
    sizes, propose = [], drafter.propose

    def spy(y, k, sampling):
        draft = propose(y, k, sampling)
        sizes.append((k, draft.size, draft.parents))
        return draft

    drafter.propose = spy
    model = tiny.qwen3_5_model()
    out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, drafter, max_tokens=20, num_draft_tokens=6))
    assert [r.token for r in out] == reference(model, PROMPT, 20)
    assert sizes and all(size <= k and (parents is None or tree.is_chain(parents)) for k, size, parents in sizes)


def test_a_repeated_sibling_is_tried_once():
    """Children [a, a]: the second is no second chance for a (its residual probability is 0).
    Treating them as two candidates (the deliberately wrong rule: the second tried against
    the residual as if a were still in it) nearly doubles a's share."""
    from mlx_spec.sampling import Sampling

    p = np.array([0.2, 0.3, 0.5])
    logits = mx.log(mx.array(np.stack([p] * 3).astype(np.float32)))
    parents, n = (-1, -1), 3000
    mx.random.seed(0)
    right, wrong = np.zeros(3), np.zeros(3)
    for _ in range(n):
        read = [a.tolist() for a in tree.draws(logits, mx.array([0, 0], mx.uint32), parents, Sampling(temp=1.0))]
        path, nxt = tree.walk(parents, [0, 0], read, False)
        right[0 if path else nxt] += 1
        assert read[0][1] == 0  # a's second try: P(a) = 0 once a was rejected
        first = read[0][0]
        read[0] = [first, first / (1 - first)]  # the same draws, as if a were tried afresh
        path, nxt = tree.walk(parents, [0, 0], read, False)
        wrong[0 if path else nxt] += 1

    def chi2(counts):
        return float((((counts - n * p) ** 2) / (n * p)).sum())

    assert chi2(right) < 13.8 < chi2(wrong)  # chi-square, 2 degrees of freedom, p = 0.001


def test_a_tree_block_passes_attribute_writes_to_the_layer():
    """mlx-lm's pipelined forwards tie their sends to the cache (`cache[-1].keys = mx.depends(...)`):
    through a tree block's view of a layer the write must reach the layer itself."""
    layer = KVCache()
    layer.update_and_fetch(mx.zeros((1, 1, 2, 4)), mx.zeros((1, 1, 2, 4)))
    view = tree.TreeCache(layer, mx.ones((1, 1), mx.bool_))
    tied = mx.depends(view.keys, mx.array(1.0))
    view.keys = tied
    assert layer.keys is tied and view.keys is tied and "keys" not in vars(view)


@pytest.mark.parametrize("tokens, parents, q_rows", [
    ([1, 2], (-1, 0, 1), None),  # one parent too many: a chain that read past its tokens
    ([1, 2, 3], (-1, -1), None),  # one too few: a mask of the wrong size
    ([1, 2, 3], None, 2),  # q with a row too few
])
def test_a_draft_whose_shapes_disagree_is_refused_by_name(tokens, parents, q_rows):
    """A custom drafter's malformed Draft is refused where it is made, not verified: a chain
    of 2 tokens with 3 parents read a token past the end (a made-up id, then a crash in the
    embedding lookup)."""
    q = None if q_rows is None else mx.ones((q_rows, 8)) / 8
    with pytest.raises(ValueError, match="one parent per token|one row of probabilities per token"):
        Draft(mx.array(tokens, mx.uint32), q=q, parents=parents)

    class Malformed(mlx_spec.NGramDrafter):
        def propose(self, y, k, sampling):
            return Draft(mx.array(tokens, mx.uint32), q=q, parents=parents)

    with pytest.raises(ValueError, match="per token"):
        list(mlx_spec.stream_generate(tiny.llama_model(seed=2), tiny.tokenizer(), [5, 6, 7], Malformed(),
                                      max_tokens=10, num_draft_tokens=4))
    assert Draft(mx.array(tokens, mx.uint32), parents=(-1,) + tuple(range(len(tokens) - 1))).size == len(tokens)
