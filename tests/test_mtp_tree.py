"""MTP heads drafting EAGLE-2 dynamic trees (`tree_budget=N`): every node's logits are the
module's own chain run along the node's path (so the kept nodes are the brute force's), the
module's cache holds only committed positions after each step, greedy output is the target's,
and modules whose cache cannot mask tree rows are refused by name."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

import mlx_spec
import mtp_checkpoints as ckpts
from runs import mlx_lm_greedy as reference
from test_dynamic_tree import spy_brute_force

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root, out = tmp_path_factory.mktemp("mtp_tree"), {}
    for case, family in (("qwen3_5", "qwen3_5"), ("mimo", "mimo"), ("deepseek_v3.2", "deepseek_v32")):
        folder = ckpts.write(root / case, family)
        out[case] = (folder, *load(str(folder)))
    return out


def chain_logits(d, y, path):
    """The module's logits after feeding the queued hidden states and y, then `path` one
    token at a time, each step fed its own output (the chain's recurrence)."""
    hidden = mx.concatenate(d._hidden) if len(d._hidden) > 1 else d._hidden[0]
    logits, fed = d._run(hidden, mx.array(d._tokens + [y], mx.uint32))
    logits, fed = logits[-1], fed[-1:]
    for t in path:
        step, fed = d._run(fed, mx.array([t], mx.uint32))
        logits = step[-1]
    return np.array(logits.astype(mx.float32))


@pytest.mark.parametrize("case", ["mimo"])  # (Qwen3.5 targets verify chains: they draft no trees)
def test_mtp_trees_are_the_brute_force_over_the_modules_chain(made, case):
    folder, model, tok = made[case]
    d = mlx_spec.load_drafter(folder, model, kind="mtp", tree_budget=9, tree_width=3)
    checked = spy_brute_force(d, chain_logits, 9, 3, "_drafted")
    out = list(mlx_spec.stream_generate(model, tok, PROMPT, d, max_tokens=16, num_draft_tokens=5))
    assert [r.token for r in out] == reference(model, PROMPT, 16) and checked[0] == 3


@pytest.mark.parametrize("k", [3, "auto"])
def test_greedy_through_mtp_trees_is_plain_and_the_cache_is_the_context(made, k):
    folder, model, tok = made["mimo"]  # (Qwen3.5 targets have recurrent layers: chains are verified)
    d = mlx_spec.load_drafter(folder, model, kind="mtp", tree_budget=6)
    seen, real_commit = [], d.commit

    def commit(tokens, taps):
        real_commit(tokens, taps)
        seen.append((len(tokens), d.cache[0].offset + sum(h.shape[0] for h in d._hidden)))

    d.commit = commit
    plans, real_plan = [], d.plan_tree
    d.plan_tree = lambda shape: (plans.append(shape), real_plan(shape))[1]
    out = list(mlx_spec.stream_generate(model, tok, PROMPT, d, max_tokens=30, num_draft_tokens=k, seed=0))
    assert [r.token for r in out] == reference(model, PROMPT, 30)
    assert out[-1].stats.tree_steps > 0
    assert (k != "auto") == (plans == []) and (k != "auto" or {0, 1} <= set(plans)), plans  # chains planned too
    fed = len(PROMPT)  # committed target positions: every tree row was trimmed at commit
    for n, rows in seen:
        fed += n
        assert rows == fed


def test_modules_whose_cache_cannot_mask_tree_rows_are_refused(made):
    folder, model, _ = made["deepseek_v3.2"]
    with pytest.raises(ValueError, match=r"deepseek_v32 MTP modules draft chains only.*leave tree_budget out"):
        mlx_spec.load_drafter(folder, model, kind="mtp", tree_budget=4)
    folder, model, _ = made["qwen3_5"]
    with pytest.raises(ValueError, match="tree_budget must be an integer"):
        mlx_spec.load_drafter(folder, model, kind="mtp", tree_budget=0)
    with pytest.raises(ValueError, match="take tree_budget and tree_width only, got \\['confidence'\\]"):
        mlx_spec.load_drafter(folder, model, kind="mtp", confidence=0.5)
