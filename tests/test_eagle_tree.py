"""EAGLE heads drafting EAGLE-2 dynamic trees (`load_drafter(..., tree_budget=N)`): every node's
logits are the head's chain run along the node's path (so the kept nodes are the brute
force's), the head's cache is back to the committed context after each step, and greedy
output is the target's."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_spec
import tiny
from converters.eagle import v1, v3
from eagle_fixtures import eagle1_checkpoint, eagle3_checkpoint, target_folder
from runs import mlx_lm_greedy as reference
from test_dynamic_tree import spy_brute_force

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]


def drafter_for(tmp_path, model, kind, **options):
    tgt = target_folder(tmp_path / "target", model)
    make, conv = (eagle1_checkpoint, v1) if kind == "eagle" else (eagle3_checkpoint, v3)
    kw = dict(V_d=60) if kind == "eagle3" else {}
    make(tmp_path / "src", 64, tiny.VOCAB, seed=3, **kw)
    out = conv.convert(tmp_path / "src", tmp_path / "out", tgt)
    return mlx_spec.load_drafter(out, model, **options)


def chain_logits(d, y, path_ids):
    """The head's logits after feeding the waiting pairs, y, then `path_ids` one by one,
    each with the head's own feature of the step before (the chain's recurrence)."""
    toks = mx.array(d._toks + [y], mx.uint32)
    feat, out = d.head(d._embed(toks[None]), d._feats[None], d.cache)
    for t in path_ids:
        feat, out = d.head(d._embed(mx.array([[t]], mx.uint32)), feat[:, -1:], d.cache)
    return np.array(d._lm(out[0, -1]).astype(mx.float32))


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_head_trees_are_the_brute_force_over_the_heads_chain(tmp_path, kind):
    model = tiny.llama_model(layers=6)
    d = drafter_for(tmp_path, model, kind, tree_budget=9, tree_width=3)
    d2t = None if d._d2t is None else d._d2t.tolist()
    to_id = (lambda i: i) if d2t is None else (lambda i: d2t[i])
    checked = spy_brute_force(d, chain_logits, 9, 3, "_chained", to_id)
    want = reference(model, PROMPT, 16)
    out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, d, max_tokens=16, num_draft_tokens=5))
    assert [r.token for r in out] == want and checked[0] == 3


@pytest.mark.usefixtures("untimed_seeded_rows")  # seeded: choices from costs and tokens only
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("k", [4, "auto"])
def test_greedy_through_head_trees_is_plain_decoding_and_the_cache_is_the_context(tmp_path, kind, k):
    model = tiny.llama_model(layers=6)
    d = drafter_for(tmp_path, model, kind, tree_budget=8)
    seen, real_commit = [], d.commit

    def commit(tokens, taps):
        real_commit(tokens, taps)
        seen.append((len(tokens), d.cache[0].offset + d._feats.shape[0]))

    d.commit = commit
    plans, real_plan = [], d.plan_tree
    d.plan_tree = lambda shape: (plans.append(shape), real_plan(shape))[1]
    out = list(mlx_spec.stream_generate(model, tiny.tokenizer(), PROMPT, d, max_tokens=24,
                                        num_draft_tokens=k, seed=0))
    assert [r.token for r in out] == reference(model, PROMPT, 24)
    assert out[-1].stats.tree_steps > 0
    assert (k != "auto") == (plans == []) and (k != "auto" or {0, 1} <= set(plans)), plans  # chains planned too
    # after each commit, the head's rows plus its waiting features are exactly the target's
    # committed positions: every tree row was dropped
    fed = len(PROMPT)
    for n, rows in seen:
        fed += n
        assert rows == fed


def test_bad_tree_settings_are_refused_for_heads(tmp_path):
    model = tiny.llama_model(layers=6)
    with pytest.raises(ValueError, match="tree_budget must be an integer"):
        drafter_for(tmp_path, model, "eagle", tree_budget=0)
    for bad, says in [(dict(tree_budget=True), "tree_budget must be an integer"),  # (True is an int)
                      (dict(tree_budget=4, tree_width=True), "tree_width must be an integer")]:
        with pytest.raises(ValueError, match=says):
            mlx_spec.load_drafter(tmp_path / "out", model, **bad)
