"""DSpark with a reduced draft vocabulary (`d2t`) and vllm-project/speculators' layout.

speculators' `DSparkSpeculator` checkpoints: the layer config in `transformer_layer_config`,
vLLM's input-of-layer `aux_hidden_state_layer_ids`, `lm_head [V_d, H]`, `markov_w1 [V, r]`,
`markov_w2 [V_d, r]`, `d2t` offsets and a training-only `t2d`; with `sample_from_anchor`
false (or absent) block row 0 holds the anchor only. The drafter is checked against the
NumPy reference (`dflash_synth.Reference.dspark_chain` with d2t and the row skip), greedy
output against the target's own, and sampled q against the scattered softmax.
"""

import json

import mlx.core as mx
import numpy as np
import pytest

import dflash_synth as S
from converters import dspark as conv
from converters.common import ConversionError
from mlx_spec.heads import load_drafter
from mlx_spec.sampling import Sampling
from runs import mlx_lm_greedy as greedy, spec_run, target_arrays
from test_dspark import PROMPT, echo_target, mx_taps

V_D, BLOCK = 48, 7


def draft_vocab(f) -> np.ndarray:
    """Sorted target ids of the draft vocabulary: the target's greedy tokens first."""
    model, _, _ = echo_target()
    seen = sorted(set(PROMPT + greedy(model, PROMPT, 100)))
    rest = [t for t in range(S.V) if t not in seen]
    return np.array(sorted(seen + rest[: V_D - len(seen)]))


def checkpoint(tmp, layout, trained=True, seed=0, **over):
    """(source folder, raw weights, draft ids) of a reduced-vocabulary DSpark checkpoint."""
    model, tcfg, f = echo_target()
    rng, ids, r = np.random.default_rng(seed), draft_vocab(f), 16 if not trained else S.V
    w = S.network_weights(rng, 2, 2)
    if trained:
        w = S.copy_anchor(w, 2)
    w["lm_head.weight"] = np.array(model.lm_head.weight)[ids]  # the target's rows, draft ids
    w["markov_head.markov_w1.weight"] = S._rnd(rng, S.V, r, scale=1.0)
    w["markov_head.markov_w2.weight"] = S._rnd(rng, V_D, r, scale=1 / np.sqrt(r))
    if trained:  # W2 W1[prev] = 100 * onehot(draft id of f(prev)) when f(prev) is in the vocab
        w["markov_head.markov_w1.weight"] = np.eye(S.V, dtype=np.float32) * 10
        w2 = np.zeros((V_D, S.V), np.float32)
        where = {int(t): i for i, t in enumerate(ids)}
        for a in range(S.V):
            if int(f[a]) in where:
                w2[where[int(f[a])], a] = 10
        w["markov_head.markov_w2.weight"] = w2
    w["confidence_head.proj.weight"] = S._rnd(rng, 1, S.H + r)
    w["confidence_head.proj.bias"] = np.array([1.5], np.float32)
    tensors = {k: mx.array(v) for k, v in w.items()}
    tensors["d2t"] = mx.array(ids - np.arange(V_D), dtype=mx.int64)
    tensors["t2d"] = mx.array(np.isin(np.arange(S.V), ids))
    layer = {**tcfg, **S.head_dims(2), "layer_types": ["full_attention"] * 2}
    if layout == "speculators":  # transformers 5 writes the RoPE base into rope_parameters
        layer["rope_parameters"] = {"rope_theta": layer.pop("rope_theta"), "rope_type": "default"}
    if layout == "speculators":
        config = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
                  "transformer_layer_config": layer, "draft_vocab_size": V_D, "block_size": BLOCK,
                  "aux_hidden_state_layer_ids": [0, 3], "mask_token_id": S.MASK, "markov_rank": r,
                  "markov_head_type": "vanilla", "enable_confidence_head": True,
                  "confidence_head_with_markov": True,
                  "speculators_config": {"algorithm": "dspark", "verifier": {"name_or_path": "t"}}}
    else:  # DeepSpec's own layout, reduced vocabulary
        config = {**S.dspark_config(tcfg, 2, [-1, 2], rank=r), "draft_vocab_size": V_D}
    config.update(over)
    src = tmp / f"src-{layout}-{seed}"
    src.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(src / "model.safetensors"), tensors, metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps(config))
    return src, w, ids


def converted(tmp, layout, **kw):
    model, tcfg, _ = echo_target()
    tdir = tmp / "target"
    if not tdir.exists():
        S.write_target(tdir, model, tcfg)
    src, w, ids = checkpoint(tmp, layout, **kw)
    return conv.convert(src, tmp / f"head-{layout}", tdir), w, ids


@pytest.mark.parametrize("layout,skip", [("speculators", 1), ("deepspec", 0)])
def test_chain_matches_numpy_with_the_draft_vocabulary(tmp_path, layout, skip):
    out, w, ids = converted(tmp_path, layout, trained=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mlx_spec"]["taps"] == ["embed", 2]  # speculators' 0, 3 are inputs of layers
    assert (cfg["draft_vocab_size"], cfg["sample_from_anchor"]) == (V_D, not skip)
    assert cfg["source"]["layout"] == ("speculators-dspark" if skip else "deepspec-dspark")
    model, _, _ = echo_target()
    d = load_drafter(out, model)
    d.bind(model, None)
    assert d.max_draft == BLOCK - skip
    ref, E = S.Reference(w, layers=2, windows=[None, None], causal=[False, False], block=BLOCK), \
        target_arrays(model)[0]
    seq = [int(t) for t in np.random.default_rng(2).integers(0, 90, 30)]
    taps = S.target_taps(model, seq, d.taps)
    cat = S.concat_taps(taps, d.taps)
    d.prefill(seq[:12], mx_taps(taps, 0, 12))
    k = BLOCK - skip
    toks, q, conf = d._chain(*d.step_logits(seq[12], k), seq[12], Sampling())
    want, rows, want_c = ref.dspark_chain(cat[:12], seq[12], E, w["lm_head.weight"], k, d2t=ids, skip=skip)
    assert np.array(toks).tolist() == want and set(want) <= set(ids.tolist())
    np.testing.assert_allclose(np.array(conf), want_c, atol=1e-4, rtol=1e-4)
    toks, q, _ = d._chain(*d.step_logits(seq[12], k), seq[12], Sampling(temp=0.8))
    q = np.array(q)  # over the target's vocabulary: the draft softmax at the draft ids, 0 elsewhere
    assert q.shape == (k, S.V) and np.allclose(q.sum(-1), 1, atol=1e-5)
    assert np.all(q[:, np.setdiff1d(np.arange(S.V), ids)] == 0)
    U, prev = ref.hidden(cat[:12], E[[seq[12]] + [S.MASK] * (BLOCK - 1)])[skip:skip + k] @ w["lm_head.weight"].T, seq[12]
    for j, t in enumerate(np.array(toks).tolist()):
        s = (U[j] + w["markov_head.markov_w2.weight"] @ w["markov_head.markov_w1.weight"][prev]) / 0.8
        np.testing.assert_allclose(q[j, ids], np.exp(s - s.max()) / np.exp(s - s.max()).sum(), atol=1e-5)
        assert t in ids
        prev = t


@pytest.mark.parametrize("layout", ["speculators", "deepspec"])
def test_greedy_output_is_the_targets_own(tmp_path, layout):
    model, _, _ = echo_target()
    out, _, _ = converted(tmp_path, layout)
    d = load_drafter(out, model)
    got, stats = spec_run(model, d, PROMPT, 60, d.max_draft)
    assert got == greedy(model, PROMPT, 60)
    print(f"DSpark {layout}, {V_D}-token draft vocabulary: tau {stats.tau:.2f}")
    assert stats.tau > 1.5


def proposal(n):
    return {"speculators_config": {"algorithm": "dspark",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": n}]}}


@pytest.mark.parametrize("over,from_anchor", [
    ({}, False),  # neither field: the configs before sample_from_anchor keep row 0 for the anchor
    ({"sample_from_anchor": True}, True),
    ({**proposal(BLOCK), "sample_from_anchor": False}, True),  # the proposal width decides first
    ({**proposal(BLOCK - 1), "sample_from_anchor": True}, False),
])
def test_which_block_row_drafts_first(over, from_anchor):
    assert conv.drafts_from_anchor({"block_size": BLOCK, **over}) is from_anchor


def test_sample_from_anchor_true_drafts_from_row_zero(tmp_path):
    out, _, _ = converted(tmp_path, "speculators", trained=False, sample_from_anchor=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["sample_from_anchor"] and load_drafter(out, echo_target()[0]).max_draft == BLOCK


BAD = {
    "no d2t": (lambda w, c: w.pop("d2t"), "no d2t"),
    "d2t out of range": (lambda w, c: w.update(d2t=w["d2t"] + S.V), "outside the target's"),
    "no lm_head": (lambda w, c: w.pop("lm_head.weight"), "own lm_head"),
    "markov over the target vocabulary": (
        lambda w, c: w.update({"markov_head.markov_w2.weight": mx.zeros((S.V, 16))}), "misshaped"),
    "no aux ids": (lambda w, c: c.pop("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_reduced_vocabulary_checkpoints_are_refused(tmp_path, case):
    src, _, _ = checkpoint(tmp_path, "speculators", trained=False)
    w, c = dict(mx.load(str(src / "model.safetensors"))), json.loads((src / "config.json").read_text())
    BAD[case][0](w, c)
    with pytest.raises(ConversionError, match=BAD[case][1]):
        conv.build(c, w, echo_target()[1])
