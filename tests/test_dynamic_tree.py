"""EAGLE-2 dynamic draft trees (`DraftModelDrafter(tree_budget=N)`): the nodes kept are exactly
the top-N by cumulative draft probability under EAGLE-2's expansion rule (against a NumPy
brute force), the draft's cache keeps exactly the accepted path, and the output is the
target's: greedy token for token (sampled: test_drawn_trees.py)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

import mlx_spec
import tiny
from mlx_spec import dynamic_tree, learned, tree, tree_shape
from mlx_spec.sampling import Sampling
from runs import mlx_lm_greedy as reference
from test_tree import spy_picks

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 3, 5, 6, 7, 2, 5, 6]


def brute_force(logits_of, depth: int, width: int, budget: int, worth=None) -> set[tuple[int, ...]]:
    """EAGLE-2 by enumeration, in float64: expand the `width` best nodes of each depth by
    cumulative log-probability with their `width` best tokens, keep the `budget` best of all.
    `worth(p, rank)`: what a child of probability p, its parent's rank-th, adds to its path's
    value (default: log p)."""
    def logq(path):
        x = np.asarray(logits_of(path), np.float64)
        return x - np.log(np.exp(x - x.max()).sum()) - x.max()

    worth = worth or (lambda p, rank: np.log(p))
    value, frontier = {(): 0.0}, [()]
    for _ in range(depth):
        born = {}
        for p in frontier:
            lq = logq(p)
            for rank, t in enumerate(np.argsort(-lq)[:width]):
                born[p + (int(t),)] = value[p] + worth(np.exp(lq[t]), rank)
        value.update(born)
        frontier = sorted(born, key=lambda q: -born[q])[:width]
    del value[()]
    return set(sorted(value, key=lambda q: (-value[q], len(q)))[:budget])


def paths_of(draft) -> list[tuple[int, ...]]:
    tokens, out = draft.tokens.tolist(), []
    for j, p in enumerate(draft.parents):
        out.append((out[p] if p >= 0 else ()) + (tokens[j],))
    return out


def spy_brute_force(d, chain_logits, budget: int, width: int, scratch: str, to_id=lambda i: i,
                    times: int = 3) -> list:
    """Wrap head drafter `d`'s propose: its first `times` trees must be the brute force over
    `chain_logits(d, y, path of target ids)` (the head's own chain along each path; `to_id`
    maps the head's logits index to a target id) and reach depth 2. `scratch` names the
    drafter's attribute counting rows to drop at commit (put back after the checks).
    Returns the count of checked trees (a one-element list)."""
    checked, real = [0], d.propose

    def spy(y, k, sampling):
        before = d.save_state()
        draft = real(y, k, sampling)
        after, rows = d.save_state(), getattr(d, scratch)
        if checked[0] < times:
            def logits_of(path):
                d.restore_state(before)
                return chain_logits(d, y, [to_id(i) for i in path])

            want = {tuple(map(to_id, p)) for p in brute_force(logits_of, min(k, budget), width, budget)}
            assert set(paths_of(draft)) == want
            assert max(tree.depths(draft.parents)) >= 2
            checked[0] += 1
            d.restore_state(after)
            setattr(d, scratch, rows)
        return draft

    d.propose = spy
    return checked


def check_shape(draft, logits_of):
    """Breadth-first, siblings distinct and by decreasing draft probability."""
    tree.depths(draft.parents)
    tokens = draft.tokens.tolist()
    for row, kids in enumerate(tree.children(draft.parents)):
        assert len({tokens[j] for j in kids}) == len(kids)
        if len(kids) > 1:
            parent = () if row == 0 else paths_of(draft)[row - 1]
            lq = np.asarray(logits_of(parent))
            assert all(lq[tokens[a]] >= lq[tokens[b]] for a, b in zip(kids, kids[1:]))


class Synthetic:
    """A drafter's `step` over a fixed random table: the logits of a path are a function of
    the path alone, found from the mask (the row's ancestors among the rows fed so far)."""

    def __init__(self, vocab=40, seed=0):
        self.vocab, self.seed, self.fed = vocab, seed, []

    def logits_of(self, path):
        rng = np.random.default_rng([self.seed, len(path), *path])
        return (3.0 * rng.standard_normal(self.vocab)).astype(np.float32)

    def step(self, tokens, slots, mask, shift):
        tokens, mask = tokens.tolist(), np.array(mask)
        w, W = mask.shape
        self.fed += tokens
        assert W == len(self.fed)
        if slots is None:
            assert W == w  # depth 1: the root's children
        else:  # each row's parent: its slot among the depth fed before
            assert all(mask[i, W - 2 * w + p] for i, p in enumerate(slots.tolist()))
        rows = []
        for i in range(w):
            path = tuple(self.fed[j] for j in range(W) if mask[i, j])
            assert path[-1] == tokens[i] and (W - w) + shift == len(path) - 1  # its position
            rows.append(self.logits_of(path))
        return mx.array(np.stack(rows))


@pytest.mark.parametrize("depth, width, budget, seed",
                         [(4, 3, 8, 0), (6, 4, 12, 1), (5, 2, 16, 2), (3, 8, 16, 3), (8, 1, 8, 4), (1, 4, 3, 5)])
def test_kept_nodes_are_the_top_budget_by_cumulative_probability(depth, width, budget, seed):
    s = Synthetic(seed=seed)
    draft, fed = dynamic_tree.grow(mx.array(s.logits_of(())), s.step, depth=depth, width=width,
                                   budget=budget, sampling=Sampling())
    want = brute_force(s.logits_of, depth, min(width, budget), budget)
    assert set(paths_of(draft)) == want and draft.size == len(want)
    check_shape(draft, s.logits_of)
    assert max(tree.depths(draft.parents)) >= min(2, depth)
    # every fed row is a frontier node, at its depth's rows
    assert sorted(fed.values()) == list(range(len(s.fed)))
    assert all(s.fed[row] == path[-1] for path, row in fed.items())
    if width == 1:
        assert tree.is_chain(draft.parents)  # the greedy chain is the width-1 tree


def test_a_wrong_rule_fails_the_brute_force(monkeypatch):
    """The comparison has power: ranking by another distribution than the drafter's (here
    its logits at temperature 4) keeps other nodes."""
    monkeypatch.setattr(dynamic_tree, "scores", lambda logits, sampling: mx.log(mx.softmax(logits / 4, axis=-1)))
    s = Synthetic(seed=7)
    draft, _ = dynamic_tree.grow(mx.array(s.logits_of(())), s.step, depth=5, width=3, budget=10,
                                 sampling=Sampling())
    assert set(paths_of(draft)) != brute_force(s.logits_of, 5, 3, 10)


def noisy_draft(seed=3, scale=2.0):
    draft = tiny.llama_model(seed=2)
    draft.lm_head.weight = draft.lm_head.weight + scale * mx.random.normal(draft.lm_head.weight.shape,
                                                                           key=mx.random.key(seed))
    return draft


def test_a_real_draft_model_grows_the_brute_force_tree():
    """Each depth's frontier fed in one forward over the draft's cache with a tree mask gives
    each node the logits of a forward over its own path."""
    target, draft = tiny.llama_model(seed=2), noisy_draft()
    d = mlx_spec.DraftModelDrafter(draft, tree_budget=10, tree_width=3)
    d.bind(target, None)
    d.prefill(PROMPT, None)
    proposal = d.propose(11, 6, Sampling())

    def logits_of(path):
        return np.array(draft(mx.array([PROMPT + [11, *path]]))[0, -1])

    assert set(paths_of(proposal)) == brute_force(logits_of, 6, 3, 10)
    assert max(tree.depths(proposal.parents)) >= 3


def test_calibration_learns_from_the_nodes_the_target_examined():
    cal = dynamic_tree.Calibration()
    nodes = {(5,): (0.55, True), (6,): (0.3, False), (5, 7): (0.62, True), (5, 8): (0.21, False),
             (6, 9): (0.9, True), (5, 7, 4): (0.97, True)}
    cal.learn(nodes, [11, 5, 7, 1])  # the target kept 5 and 7, then said 1
    seen = cal.offered - dynamic_tree.Calibration().offered
    kept = cal.kept - dynamic_tree.Calibration().kept
    # examined: (5,) kept, (6,) not, (5, 7) kept, (5, 8) not, (5, 7, 4) not; (6, 9)'s parent was not kept
    assert np.allclose(seen[0], [0, 0, 0, 0, 0, 0.55, 0.62, 0, 0, 0.97]) and np.allclose(kept[0][[5, 6, 9]], [1, 1, 0])
    assert np.allclose(seen[1], [0, 0, 0.21, 0.3, 0, 0, 0, 0, 0, 0]) and kept[1].sum() == 0
    for _ in range(200):  # best children at p ~ 0.55 nearly always kept: worth nearly 1
        cal.learn({(5,): (0.55, True)}, [11, 5, 2])
    worth = np.exp(np.array(cal.values(mx.log(mx.array([[0.55, 0.3]])))))[0]
    assert worth[0] > 0.95  # runner-ups at 0.3: bin 3's prior (1.4 kept of 1.4 offered) and one not kept
    assert worth[1] == pytest.approx(0.3 * 1.4 / (1.4 + 0.3), rel=1e-4)


def test_a_request_teaches_the_calibration_the_nodes_below_the_kept_path():
    """The drafter hears the kept tokens at commit and the target's next token as the next y:
    the nodes below the kept path (examined, none kept) are learned then. A draft that is
    never right has every best child examined and none kept (before: nothing was learned)."""
    model = tiny.llama_model(seed=2)
    d = mlx_spec.DraftModelDrafter(tiny.llama_model(seed=9, layers=1), tree_budget=4, tree_width=2)
    out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, d, max_tokens=16, num_draft_tokens=4))
    assert [r.token for r in out] == reference(model, PROMPT, 16)
    prior = dynamic_tree.Calibration()
    examined = (d.calibration.offered - prior.offered)[0].sum()
    kept = (d.calibration.kept - prior.kept)[0].sum()
    assert out[-1].stats.tree_steps >= 8 and examined > 1 and kept < examined / 2


def test_calibrated_trees_are_the_brute_force_with_calibrated_values():
    """A draft model's dynamic tree with a learned calibration keeps exactly the nodes a
    brute force keeps when each child adds log min(1, p * factor) for its bin and rank; and
    here that is another tree than the uncalibrated one, so the check can tell them apart."""
    target, draft = tiny.llama_model(seed=2), noisy_draft()
    d = mlx_spec.DraftModelDrafter(draft, tree_budget=10, tree_width=3)
    d.bind(target, None)
    d.prefill(PROMPT, None)
    rng = np.random.default_rng(0)
    for _ in range(300):  # best children kept often whatever p; runner-ups rarely
        p = float(rng.uniform(0.05, 1.0))
        d.calibration.learn({(3,): (p, True), (4,): (p / 3, False)}, [11, 3 if rng.random() < 0.95 else 4])
    factors = np.exp(np.array(d.calibration.log_factors())).reshape(2, -1)
    assert factors[0][:8].min() > 1.2 and factors[1][:4].max() < 0.8  # (runner-ups reach p / 3 < 0.34)

    def worth(p, rank):
        return np.log(min(1.0, p * factors[int(rank > 0), min(int(p * 10), 9)]))

    def logits_of(path):
        return np.array(draft(mx.array([PROMPT + [11, *path]]))[0, -1])

    got = set(paths_of(d.propose(11, 6, Sampling())))
    assert got == brute_force(logits_of, 6, 3, 10, worth)
    assert got != brute_force(logits_of, 6, 3, 10)


@pytest.mark.parametrize("width", [1, 3])
def test_the_draft_cache_after_commit_is_a_fresh_forward_over_the_accepted_tokens(width):
    target, draft = tiny.llama_model(seed=2), noisy_draft()
    probe = mlx_spec.DraftModelDrafter(draft, tree_budget=9, tree_width=width)
    probe.bind(target, None)
    probe.prefill(PROMPT, None)
    nodes = paths_of(probe.propose(11, 5, Sampling()))
    assert len(nodes) == (9 if width > 1 else 5)  # width 1: a chain of k
    for path in [()] + nodes:
        for split in sorted({0, len(path)}):  # the loop may commit a prefix, then the rest
            d = mlx_spec.DraftModelDrafter(draft, tree_budget=9, tree_width=width)
            d.bind(target, None)
            d.prefill(PROMPT, None)
            d.propose(11, 5, Sampling())
            kept = [11, *path]
            d.commit(kept[: split + 1], None)
            if split < len(path):
                d.commit(kept[split + 1 :], None)
            seen = PROMPT + kept
            n = d.cache[0].offset
            assert seen[n:] == d._pending, (path, split)
            fresh = [KVCache() for _ in draft.layers]
            draft(mx.array([seen[:n]]), cache=fresh)
            for c, f in zip(d.cache, fresh):
                np.testing.assert_allclose(np.array(c.keys[..., :n, :]), np.array(f.keys[..., :n, :]), atol=1e-4)
                np.testing.assert_allclose(np.array(c.values[..., :n, :]), np.array(f.values[..., :n, :]), atol=1e-4)
            # and it drafts on from there as a fresh drafter would
            again = d.propose(7, 3, Sampling())
            d2 = mlx_spec.DraftModelDrafter(draft, tree_budget=9, tree_width=width)
            d2.bind(target, None)
            d2.prefill(seen, None)
            assert paths_of(again) == paths_of(d2.propose(7, 3, Sampling()))


@pytest.mark.usefixtures("untimed_seeded_rows")  # seeded: choices from costs and tokens only
@pytest.mark.parametrize("budget, width, k", [(8, 4, 8), (6, 2, 8), (5, 1, 8), (1, 4, 4), (16, 8, 16), (12, 3, "auto")])
def test_greedy_through_dynamic_trees_is_plain_decoding(budget, width, k):
    target = tiny.llama_model(seed=2)
    want = reference(target, PROMPT, 40)
    d = mlx_spec.DraftModelDrafter(noisy_draft(), tree_budget=budget, tree_width=width)
    out = list(mlx_spec.stream_generate(target, tiny.tokenizer(), PROMPT, d, max_tokens=40,
                                        num_draft_tokens=k, seed=0))
    assert [r.token for r in out] == want
    s = out[-1].stats
    assert s.accepted > 0
    assert (s.tree_steps > 0) == (width > 1 and budget > 1)


def test_greedy_on_smollm2_with_a_perturbed_copy_as_draft(smollm2, smollm2_path):
    model, tok = smollm2
    draft, _ = mlx_spec.load(str(smollm2_path))
    norm = draft.model.norm
    norm.weight = norm.weight * (1 + 0.3 * mx.random.normal(norm.weight.shape, key=mx.random.key(0)))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Explain in detail how rivers form."}],
                                     add_generation_prompt=True)
    want = reference(model, prompt, 40)
    d = mlx_spec.DraftModelDrafter(draft, tok, tree_budget=8)
    out = list(mlx_spec.stream_generate(model, tok, prompt, d, max_tokens=40, num_draft_tokens=8, trace=True))
    got = [r.token for r in out]
    assert len(got) >= 30 and got == want[: len(got)]  # (plain decoding by mlx-lm does not stop at EOS)
    s = out[-1].stats
    assert s.tree_steps > 0 and s.tau > 1.5


def test_bad_tree_settings_are_refused():
    draft = tiny.llama_model(seed=2)
    for bad in (0, 17, 2.5, "8"):
        with pytest.raises(ValueError, match="tree_budget"):
            mlx_spec.DraftModelDrafter(draft, tree_budget=bad)
    with pytest.raises(ValueError, match="tree_width"):
        mlx_spec.DraftModelDrafter(draft, tree_budget=8, tree_width=0)
    with pytest.raises(ValueError, match="give one of them"):
        mlx_spec.DraftModelDrafter(draft, branches=2, tree_budget=8)


def test_a_sliding_window_draft_falls_back_to_chains():
    target, draft = tiny.gemma3_model(), tiny.gemma3_model(seed=1)
    d = mlx_spec.DraftModelDrafter(draft, tree_budget=8)
    out = list(mlx_spec.stream_generate(target, tiny.tokenizer(), PROMPT, d, max_tokens=20, num_draft_tokens=4))
    assert [r.token for r in out] == reference(target, PROMPT, 20)
    assert out[-1].stats.tree_steps == 0


def test_a_recurrent_draft_still_drafts_chains():
    target, draft = tiny.llama_model(seed=2), tiny.qwen3_5_model()
    for budget in (None, 8):
        d = mlx_spec.DraftModelDrafter(draft, tree_budget=budget)
        out = list(mlx_spec.stream_generate(target, tiny.tokenizer(), PROMPT, d, max_tokens=12, num_draft_tokens=4))
        assert [r.token for r in out] == reference(target, PROMPT, 12)
        assert out[-1].stats.tree_steps == 0


class Planned(mlx_spec.DraftModelDrafter):
    """Records each proposal: the shape `auto` planned for it, the draft, the most rows that one
    depth of its tree fed to the draft model."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.made, self.deep = [], 0

    def propose(self, y, k, sampling):
        plan, self.deep = self._plan, 0
        draft = super().propose(y, k, sampling)
        self.made.append((plan, draft, self.deep))
        return draft

    def _tree_logits(self, tokens, *a):
        self.deep = max(self.deep, tokens.shape[0])  # the widest depth fed
        return super()._tree_logits(tokens, *a)


@pytest.mark.usefixtures("untimed_seeded_rows")
def test_auto_plans_each_tree_before_it_is_drafted(monkeypatch):
    """`auto` picks a dynamic tree's shape before drafting it: a chain pick drafts a chain (no
    tree forward of the draft model at all), a half or a quarter pick grows a tree of that
    budget, feeding half the rows a depth (not a whole tree cut afterwards), and the output
    stays the target's."""
    picks = spy_picks(monkeypatch)
    monkeypatch.setattr(learned, "verify_seconds", lambda model, n_max=17, recalibrate=False:  # deep drafts pay
                        [1e-5] if n_max == 1 else [1e-3 * (1 + 0.02 * n) for n in range(n_max)])
    target = tiny.llama_model(seed=2)
    d = Planned(noisy_draft(), tree_budget=8, tree_width=4)
    out = list(mlx_spec.stream_generate(target, tiny.tokenizer(), PROMPT, d, max_tokens=60,
                                        num_draft_tokens="auto", seed=0))
    assert [r.token for r in out] == reference(target, PROMPT, 60)
    assert [plan for plan, _, _ in d.made] == picks and set(picks) == set(tree_shape.ShapeChoice.SHAPES), picks
    for plan, draft, rows in d.made:
        if plan == 0:
            assert draft.parents is None and rows == 0
        else:  # (a whole tree cut afterwards would have fed 4 rows a depth)
            assert draft.size <= -(-8 // plan) and rows <= (4 if plan == 1 else 2)
    assert {plan for plan, _, rows in d.made if rows} == {1, 2, 4}, d.made  # trees two or more deep
    assert max(rows for plan, _, rows in d.made if plan == 1) == 4
    assert any(draft.parents is not None and not tree.is_chain(draft.parents) for _, draft, _ in d.made)



def test_what_the_calibration_learned_starts_the_next_process_warm(monkeypatch):
    """A request's tree nodes teach the calibration; the next process (here: the in-process
    calibrations forgotten) starts from it, not from the prior, as its policies do."""
    from mlx_spec.drafters import draft_model
    from mlx_spec.identity import IdentityMap

    target, draft = tiny.llama_model(seed=2), noisy_draft()
    d = mlx_spec.DraftModelDrafter(draft, tree_budget=8, tree_width=3)
    list(mlx_spec.stream_generate(target, tiny.tokenizer(), PROMPT, d, max_tokens=40, num_draft_tokens=8))
    first = d.calibration
    assert first.learned > 0 and learned.tree_calibration_file(target, draft).exists()
    prior = np.array(dynamic_tree.Calibration().log_factors())
    assert not np.allclose(np.array(first.log_factors()), prior)

    monkeypatch.setattr(draft_model, "_CALIBRATIONS", IdentityMap())  # a new process
    again = mlx_spec.DraftModelDrafter(draft, tree_budget=8, tree_width=3)
    again.bind(target, None)
    assert again.calibration is not first and again.calibration.learned == 0
    np.testing.assert_allclose(np.array(again.calibration.log_factors()), np.array(first.log_factors()), atol=1e-6)
    chains = mlx_spec.DraftModelDrafter(draft)  # no tree: nothing read, nothing kept
    chains.bind(target, None)
    assert chains.calibration is None


def test_a_kept_calibration_counts_as_a_few_nodes_a_bin_and_a_damaged_one_as_none(tmp_path):
    cal = dynamic_tree.Calibration()
    state = cal.state()
    many = {"kept": (np.array(state["offered"]) * 500 * 0.5).tolist(), "offered": (np.array(state["offered"]) * 500).tolist()}
    cal.restore(many)  # half of what was offered kept, in every bin, seen 2000 times
    mid = (np.arange(cal.BINS) + 0.5) / cal.BINS
    np.testing.assert_allclose(cal.offered, np.tile(cal.CARRIED * mid, (2, 1)))
    np.testing.assert_allclose(np.exp(np.array(cal.log_factors())), 0.5, rtol=1e-5)
    for _ in range(32):  # this process's text: best children at p ~ 0.55 always kept
        cal.learn({(5,): (0.55, True)}, [11, 5, 2])
    assert np.exp(np.array(cal.log_factors()))[5] > 1.1  # moved (the whole carried count: still 0.52)

    target, draft = tiny.llama_model(seed=2), noisy_draft()
    path = learned.tree_calibration_file(target, draft)
    path.parent.mkdir(parents=True, exist_ok=True)
    for bad in ("{", '{"kept": [1, 2], "offered": [1, 2]}', '{"kept": 3}',
                '{"kept": [[NaN]], "offered": [[1]]}',
                '{"kept": %s, "offered": %s}' % (state["kept"], [[0.0] * cal.BINS] * 2)):
        path.write_text(bad)
        got = learned.load_tree_calibration(target, draft)
        np.testing.assert_allclose(got.kept, dynamic_tree.Calibration().kept)
        np.testing.assert_allclose(got.offered, dynamic_tree.Calibration().offered)
