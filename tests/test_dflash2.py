"""DFlash2 (z-lab `DFlash2DraftModel`): conversion, the path against NumPy, losslessness.

The checkpoint is written in the layout vLLM's `qwen3_dflash2.py` loads: the DFlash v1
tensors plus `layers.{i}.{attention,mlp}_conv.{base_kernel,kernel_projection.weight}` and
`candidate_selector.{hidden_projection.weight,predecessor_codebook,successor_codebook}`
(the codebooks without `.weight`), its fields in `dflash_config`.
"""

import json

import mlx.core as mx
import numpy as np
import pytest

import dflash_synth as S
from converters import dflash as conv
from converters.common import ConversionError
from mlx_spec.heads import load_drafter
from mlx_spec.sampling import Sampling
from runs import mlx_lm_greedy as greedy, spec_run, target_arrays
from test_dflash import PROMPT, as_mx, target

TAPS, GROUP, RANK, TOP, BLOCK = 2, 16, 8, 4, 8


def dflash2_weights(rng, layers=2, identity=False, vocab=S.V, n_taps=2):
    """The DFlash v1 network plus DFlash2's convolutions and selector (checkpoint names);
    `identity`: convolutions that pass their input through, a selector with no edges."""
    w = S.network_weights(rng, layers, n_taps)
    if identity:
        w = S.copy_anchor(w, layers)
    for i in range(layers):
        for c in ("attention_conv", "mlp_conv"):
            base = np.zeros((2, TAPS, S.H), np.float32) if identity else S._rnd(rng, 2, TAPS, S.H, scale=0.5)
            base[:, 0] += 1.0  # tap 0 around 1: the row itself
            w[f"layers.{i}.{c}.base_kernel"] = base
            w[f"layers.{i}.{c}.kernel_projection.weight"] = S._rnd(
                rng, 2 * TAPS * S.H // GROUP, S.H, scale=0.0 if identity else 0.05)
    scale = 0.0 if identity else 1.0
    w["candidate_selector.hidden_projection.weight"] = S._rnd(rng, RANK, S.H)
    w["candidate_selector.predecessor_codebook"] = S._rnd(rng, vocab, RANK, scale=scale)
    w["candidate_selector.successor_codebook"] = S._rnd(rng, vocab, RANK, scale=scale)
    return w


def config(layers=2, ids=(0, 2), n_target=4, vocab=S.V, mask=S.MASK, block=BLOCK, **dflash):
    cfg = S.zlab_config(layers, list(ids), n_target, block=block, mask=mask, vocab_size=vocab,
                        architectures=["DFlash2DraftModel"], is_causal=False)
    cfg["dflash_config"].update(block_size=block, conv_kernel_size=TAPS, conv_group_size=GROUP,
                                selector_rank=RANK, selector_top_k=TOP, output_multiplier=0.5,
                                final_logit_softcapping=20.0, **dflash)
    return cfg


def head(tmp, tname="qwen3-echo", identity=False, seed=0):
    model, tcfg = target(tname)
    tdir = S.write_target(tmp / f"target-{tname}", model, tcfg)
    w = dflash2_weights(np.random.default_rng(seed), identity=identity)
    src = S.save_checkpoint(tmp / f"src{seed}{identity}", config(), w)
    return conv.convert(src, tmp / f"head{seed}{identity}", tdir), w


def reference(w):
    return S.Reference(w, layers=2, windows=[None, None], causal=[False, False], block=BLOCK)


def test_conversion_maps_the_dflash2_tensors_and_fields(tmp_path):
    out, w = head(tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["source"]["layout"] == "z-lab-dflash2" and cfg["layer_causal"] == [False, False]
    assert (cfg["conv_kernel_size"], cfg["conv_group_size"], cfg["selector_rank"],
            cfg["selector_top_k"], cfg["vocab_size"]) == (TAPS, GROUP, RANK, TOP, S.V)
    assert (cfg["output_multiplier"], cfg["final_logit_softcapping"]) == (0.5, 20.0)
    stored = mx.load(str(out / "model.safetensors"))
    assert np.array_equal(np.array(stored["candidate_selector.successor_codebook.weight"]),
                          w["candidate_selector.successor_codebook"])
    assert stored["layers.1.mlp_conv.base_kernel"].shape == (2, TAPS, S.H)


def test_the_drafted_path_and_q_match_numpy_across_commits(tmp_path):
    out, w = head(tmp_path, "qwen3")
    model = target("qwen3")[0]
    d = load_drafter(out, model)
    d.bind(model, None)
    assert d.max_draft == BLOCK - 1
    ref, (E, lm) = reference(w), target_arrays(model)
    seq = [int(t) for t in np.random.default_rng(2).integers(0, 90, 40)]
    taps = S.target_taps(model, seq, d.taps)
    cat = S.concat_taps(taps, d.taps)
    d.prefill(seq[:12], as_mx({k: v[:12] for k, v in taps.items()}))
    done = 12
    for step in (4, 1, 9):
        y = seq[done]
        draft = d.propose(y, BLOCK - 1, Sampling())
        want, sets = ref.dflash2_chain(cat[:done], y, E, lm, BLOCK - 1, TOP, 0.5, 20.0)
        assert np.array(draft.tokens).tolist() == want and draft.q is None
        draft = d.propose(y, BLOCK - 1, Sampling(temp=0.8))
        q = np.array(draft.q)  # each row: over its own top-k only, summing to one
        for j, t in enumerate(np.array(draft.tokens).tolist()):
            assert set(np.nonzero(q[j])[0].tolist()) <= set(sets[j]) and t in sets[j]
        np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
        d.commit(seq[done:done + step], as_mx({k: v[done:done + step] for k, v in taps.items()}))
        done += step


def test_greedy_output_is_the_targets_own(tmp_path):
    model = target("qwen3-echo")[0]
    out, _ = head(tmp_path, identity=True)
    got, stats = spec_run(model, load_drafter(out, model), PROMPT, 60, BLOCK - 1)
    assert got == greedy(model, PROMPT, 60)
    print(f"DFlash2 synthetic tau {stats.tau:.2f}")
    assert stats.tau > 1.5


V8 = 8


def sampled_head(tmp):
    """(target, converted head folder): an 8-token target (3 layers, sharpened) and a random
    1-layer DFlash2 head over it (block 4: k = 3), sharp enough that drafts are often kept."""
    model, tcfg = S.qwen3_target(seed=3, vocab=V8, sharpen=2.0, layers=3)
    tdir = S.write_target(tmp / "t", model, tcfg)
    w = dflash2_weights(np.random.default_rng(5), layers=1, vocab=V8)
    w["norm.weight"] = w["norm.weight"] * 4  # sharper draft distributions
    cfg = config(layers=1, ids=(0, 1), n_target=3, vocab=V8, mask=V8 - 1, block=4)
    return model, conv.convert(S.save_checkpoint(tmp / "s", cfg, w), tmp / "h", tdir)


@pytest.mark.slow
def test_sampled_output_follows_the_target_distribution(tmp_path, monkeypatch):
    """Drafts drawn along the selector's path, checked with their q: the first 3 tokens'
    marginals are the target's; a rule that keeps every draft fails the same check."""
    import mlx_spec.acceptance as acceptance
    from lossless import assert_caught, assert_lossless, exact_joint, sampled_runs

    model, head_dir = sampled_head(tmp_path)
    d = load_drafter(head_dir, model)
    joint = exact_joint(model, [1, 2, 3], 5, dict(temp=1.0), vocab=V8)
    right = sampled_runs(model, [1, 2, 3], lambda: d, 600, max_tokens=5, k=3, vocab=V8, temp=1.0)
    drafted = sum(sum(len(t.proposed) for t in tr) for tr in right.traces)
    accepted = sum(sum(t.accepted for t in tr) for tr in right.traces)
    assert accepted > 150 and accepted / drafted < 0.9 and drafted > 600  # both outcomes, often
    assert_lossless(right, joint)

    def keep_all(logits, draft, q, sampling, length=None):  # wrong: never looks at p
        n = mx.array(draft.shape[0])
        return n, mx.random.categorical(mx.log(sampling.probs(logits)[n]))

    monkeypatch.setattr(acceptance, "accept", keep_all)
    assert_caught(sampled_runs(model, [1, 2, 3], lambda: d, 200, max_tokens=5, k=3, vocab=V8, temp=1.0), joint)



def selector_best_paths(ref, cat, y, E, lm, k, budget):
    """NumPy: the `budget` most likely paths of the selector's chain for anchor `y` (row j's
    log-softmax over its top-k candidates given the token before), found best-first."""
    import heapq

    h = ref.hidden(cat, E[[y] + [ref.mask] * (ref.block - 1)])[1:k + 1]
    logits = np.tanh(h @ lm.T * 0.5 / 20.0) * 20.0
    hp, P, Sc = (h @ ref.w["candidate_selector.hidden_projection.weight"].T,
                 ref.w["candidate_selector.predecessor_codebook"], ref.w["candidate_selector.successor_codebook"])

    def children(j, prev):
        c = np.argsort(-logits[j], kind="stable")[:TOP]
        s = logits[j][c] + (P[prev] * hp[j]) @ Sc[c].T
        return zip(c.tolist(), s - s.max() - np.log(np.exp(s - s.max()).sum()))

    heap, out = [(0.0, ())], []
    while heap and len(out) <= budget:
        neg, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < k:
            for t, lp in children(len(path), path[-1] if path else y):
                heapq.heappush(heap, (neg - float(lp), path + (t,)))
    return out[1:]  # without the root


@pytest.mark.parametrize("budget", [1, 5, 16])
def test_selector_trees_hold_the_budget_most_likely_paths(tmp_path, budget):
    """With a tree budget, the selector drafts the `budget` best paths of its own chain
    (against a NumPy best-first search); the first branch is its greedy path."""
    from mlx_spec import tree
    from test_ddtree import node_paths

    out, w = head(tmp_path, "qwen3")
    model = target("qwen3")[0]
    d, chain = load_drafter(out, model, tree_budget=budget), load_drafter(out, model)
    ref, (E, lm) = reference(w), target_arrays(model)
    seq = [int(t) for t in np.random.default_rng(2).integers(0, 90, 40)]
    taps = S.target_taps(model, seq, d.taps)
    cat = S.concat_taps(taps, d.taps)
    for x in (d, chain):
        x.bind(model, None)
        x.prefill(seq[:12], as_mx({k: v[:12] for k, v in taps.items()}))
    for k in (BLOCK - 1, 3):
        draft = d.propose(seq[12], k, Sampling())
        assert sorted(node_paths(draft)) == sorted(selector_best_paths(ref, cat[:12], seq[12], E, lm, k, budget))
        first = tree.as_chain(draft).tokens.tolist()
        assert first and first == np.array(chain.propose(seq[12], k, Sampling()).tokens).tolist()[: len(first)]
        assert draft.q is None and (budget <= k or not tree.is_chain(draft.parents))  # deeper than k: no


def test_selector_trees_keep_greedy_output(tmp_path):
    model = target("qwen3-echo")[0]
    out, _ = head(tmp_path)
    got, stats = spec_run(model, load_drafter(out, model, tree_budget=8), PROMPT, 60, BLOCK - 1)
    assert got == greedy(model, PROMPT, 60)
    assert stats.tree_steps > 0


@pytest.mark.slow
def test_sampled_selector_trees_keep_the_targets_law_with_deep_paths_accepted(tmp_path):
    """The sampled setup above drafting trees of 5 nodes: the first tokens' law is the
    target's, with paths of depth >= 2 through non-chain trees accepted, off the first
    branch too (the tree walk, not the drafts' q, keeps it exact)."""
    from lossless import assert_lossless, exact_joint, sampled_runs
    from test_ddtree import deep_tree_steps

    model, head_dir = sampled_head(tmp_path)
    d = load_drafter(head_dir, model, tree_budget=5)
    runs = sampled_runs(model, [1, 2, 3], lambda: d, 600, max_tokens=5, k=3, vocab=V8, temp=1.0,
                        record_drafts=True)
    deep, off_first = deep_tree_steps(runs)
    print(f"selector tree steps accepting >= 2 drafts: {deep}; off the first branch: {off_first}")
    assert deep >= 25 and off_first >= 50, (deep, off_first)  # 36 and 405 here
    assert_lossless(runs, exact_joint(model, [1, 2, 3], 5, dict(temp=1.0), vocab=V8))

BAD = {
    "no selector fields": (lambda c, w: c["dflash_config"].pop("selector_top_k"), "selector_top_k"),
    "codebook over another vocabulary": (
        lambda c, w: w.update({"candidate_selector.successor_codebook": np.zeros((S.V + 4, RANK), np.float32)}),
        "misshaped"),
    "group not dividing": (lambda c, w: c["dflash_config"].update(conv_group_size=24), "does not divide"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_dflash2_checkpoints_are_refused(case):
    _, tcfg = target("qwen3")
    w, cfg = dflash2_weights(np.random.default_rng(0)), config()
    BAD[case][0](cfg, w)
    with pytest.raises(ConversionError, match=BAD[case][1]):
        conv.build(cfg, {k: mx.array(v) for k, v in w.items()}, tcfg)


def test_a_dflash2_head_refuses_a_target_of_another_vocabulary(tmp_path):
    """Its codebooks have one row per token of the target it was converted for: bound to a target
    with a larger vocabulary it would look up rows past their end (it used to bind, and draft)."""
    out, _ = head(tmp_path)
    other, _ = S.qwen3_target(seed=1, vocab=4 * S.V)
    d = load_drafter(out, target("qwen3-echo")[0])
    with pytest.raises(ValueError, match=f"drafts over {S.V} tokens, but the target's vocabulary has {4 * S.V}"):
        d.bind(other, None)
