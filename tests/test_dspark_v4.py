"""DSpark inside a DeepSeek-V4 checkpoint (`mtp.*` stages): NumPy reference, losslessness, errors.

The target is a tiny mlx-lm `deepseek_v41` model (window 8, one pooled layer)
saved in DeepSeek's own tensor names next to synthetic `mtp.{0,1,2}.*` stages,
and loaded back through mlx-lm's `load_model` (its `sanitize`). Both namings run:
"0731" (V4-Flash-0731 arithmetic) and "v41" (V4.1); `R.RULES` lists how they differ.
"""

import argparse
import json
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

import dspark_v4_ref as R
import tiny
from mlx_spec.drafters.dspark_v4 import V4DSparkDrafter, native_name
from mlx_spec.drafters.dspark_v4.load import fp8_tile
from mlx_spec.heads import load_drafter
from mlx_spec.sampling import Sampling
from mlx_spec.taps import Taps
from runs import mlx_lm_greedy as greedy, replay_greedy_blocks, spec_run, target_arrays

WINDOW, BLOCK, NOISE, IDS = 8, 5, 95, [1, 2, 3]
TAPS = {"0731": (1, 2, 3), "v41": (0, 1, 2)}  # leaving layers 1..3 | entering layers 1..3
# 96 - 32 = 64 non-RoPE K/V dims: one 0731 FP8 block of 64, two V4.1 blocks of 32.
DIMS = {"head_dim": 96, "qk_rope_head_dim": 32, "index_head_dim": 32}
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 12]
CONFIG = {**tiny.DEEPSEEK_V41, **DIMS, "sliding_window": WINDOW, "dspark_block_size": BLOCK,
          "dspark_target_layer_ids": IDS, "dspark_noise_token_id": NOISE,
          "num_nextn_predict_layers": 3}
_state = {}


def trunk_tensors(model) -> dict:
    """The target's parameters under DeepSeek checkpoint names (experts one by one)."""
    out = {}
    for k, v in tree_flatten(model.parameters()):
        if ".experts.switch_mlp." in k:
            out.update({native_name(k).replace("{e}", str(e)): v[e] for e in range(v.shape[0])})
        else:
            out[native_name(k)] = v.reshape(-1, v.shape[-1]) if k.endswith(".o_a_proj.weight") else v
    return out


def target(tmp_path_factory):
    """(mlx-lm-loaded target, its DeepSeek-named trunk, the bigram its greedy output follows)."""
    if "t" not in _state:
        made = tiny.deepseek_v41_model(seed=1, window=WINDOW, **DIMS)
        trunk = trunk_tensors(made)
        folder = tmp_path_factory.mktemp("trunk")
        write(folder, CONFIG, trunk)
        model, _ = load_model(folder)  # mlx-lm's sanitize reads the DeepSeek names back
        for (k, a), (_, b) in zip(tree_flatten(made.parameters()), tree_flatten(model.parameters())):
            assert np.array_equal(np.array(a), np.array(b)), k
        seq = PROMPT + greedy(model, PROMPT, 80)
        f = np.arange(tiny.VOCAB)
        for a in set(seq):
            nxt = Counter(b for x, b in zip(seq, seq[1:]) if x == a)
            if nxt:
                f[a] = nxt.most_common(1)[0][0]
        _state["t"] = (model, trunk, f)
    return _state["t"]


def write(folder, config, tensors) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {k: mx.array(v) if isinstance(v, np.ndarray) else v for k, v in tensors.items()})


def stages(variant="0731", trained=False, seed=0, f=None):
    """Synthetic stage tensors; `trained`: a Markov head that encodes the target's bigram f."""
    rank = tiny.VOCAB if trained else 16
    w = R.stage_tensors(np.random.default_rng(seed), CONFIG, variant, len(IDS), rank)
    if trained:
        names = ("markov_w1", "markov_w2") if variant == "0731" else ("embed", "head")
        w2 = np.zeros((tiny.VOCAB, tiny.VOCAB), np.float32)
        w2[f, np.arange(tiny.VOCAB)] = 10
        w[f"mtp.2.markov_head.{names[0]}.weight"] = np.eye(tiny.VOCAB, dtype=np.float32) * 10
        w[f"mtp.2.markov_head.{names[1]}.weight"] = w2
    return w, rank


def folder_with(tmp_path, tmp_path_factory, variant="0731", trained=False, **kw):
    model, trunk, f = target(tmp_path_factory)
    w, rank = stages(variant, trained, f=f)
    folder = tmp_path / f"v4-{variant}-{trained}"
    write(folder, {**CONFIG, "dspark_markov_rank": rank, **kw}, {**trunk, **w})
    return folder, model, w


def reference(w, **flip):
    return R.Reference(w, CONFIG, IDS, BLOCK, NOISE, **flip)


def tap_means(model, seq, taps) -> np.ndarray:
    """[T, len(IDS) * H]: the hc-stream mean of each tap over one target forward of seq."""
    with Taps(model, taps) as t:
        model(mx.array([seq]))
        got = t.read()
    return np.concatenate([np.array(got[i], np.float64).mean(1) for i in taps], -1)


def raw_taps(model, seq, taps):
    with Taps(model, taps) as t:
        model(mx.array([seq]))
        return t.read()


# ---- loading ---------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["0731", "v41"])
def test_stage_forward_and_chain_match_numpy_across_commits(tmp_path, tmp_path_factory, variant):
    folder, model, w = folder_with(tmp_path, tmp_path_factory, variant)
    d = load_drafter(folder, model)  # no kind: found through TARGET_PROBES
    ref, (E, head) = reference(w), target_arrays(model)
    assert isinstance(d, V4DSparkDrafter) and d.max_draft == BLOCK and d.net.variant == variant
    assert d.taps == ref.taps() == TAPS[variant]
    assert ("hc_head_fn" in d.net) == (variant == "0731")
    d.bind(model, None)
    seq = [int(t) for t in np.random.default_rng(2).integers(0, 90, 40)]
    taps, cat = raw_taps(model, seq, d.taps), tap_means(model, seq, d.taps)
    d.prefill(seq[:12], {i: v[:12] for i, v in taps.items()})  # 12 > the 8-row window
    done = 12
    for step in (4, 1, 9):
        y = seq[done]
        U, h = d.step_logits(y, BLOCK)
        h_ref, normed = ref.block(cat[:done], y, E)
        np.testing.assert_allclose(np.array(h), h_ref, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.array(U), normed @ head.T, atol=1e-4, rtol=1e-4)
        toks, q, conf = d._chain(U, h, y, Sampling())
        want_t, _, want_c = ref.chain(cat[:done], y, E, head, BLOCK)
        assert np.array(toks).tolist() == want_t and q is None
        np.testing.assert_allclose(np.array(conf), want_c, atol=1e-4, rtol=1e-4)
        toks, q, _ = d._chain(U, h, y, Sampling(temp=0.8))  # q_j built on the drawn prefix
        prev = y
        for j, t in enumerate(np.array(toks).tolist()):
            s = (normed[j] @ head.T + ref.m2 @ ref.m1[prev]) / 0.8
            np.testing.assert_allclose(np.array(q[j]), np.exp(s - s.max()) / np.exp(s - s.max()).sum(),
                                       atol=1e-5)
            prev = t
        d.commit(seq[done:done + step], {i: v[done:done + step] for i, v in taps.items()})
        done += step


@pytest.mark.parametrize("variant,tile", [("0731", 128), ("v41", 32)])
def test_fp8_fp4_stage_tensors_are_repacked_and_match_numpy(tmp_path, tmp_path_factory, variant, tile):
    """DeepSeek's packed storage: e4m3 bytes + ue8m0 tiles (0731: 128x128, V4.1: 32x32),
    experts e2m1 + 1x32 scales."""
    model, trunk, _ = target(tmp_path_factory)
    w, rank = stages(variant)
    stored, plain = R.packed(w, tile=tile)
    assert stored["mtp.0.main_proj.scale"].shape == (-(-64 // tile), -(-192 // tile))
    write(tmp_path, {**CONFIG, "dspark_markov_rank": rank}, {**trunk, **stored})
    d = load_drafter(tmp_path, model, kind="dspark")
    attn, experts = d.net.layers[1].self_attn, d.net.layers[1].mlp.experts.switch_mlp
    assert (attn.q_b_proj.mode, attn.o_a_proj.mode, experts.up_proj.mode) == ("mxfp8", "mxfp8", "mxfp4")
    assert d.net.main_proj.mode == "mxfp8" and not hasattr(attn.kv_norm, "mode")
    d.bind(model, None)
    seq = PROMPT + [3, 4, 5]
    taps = raw_taps(model, seq, d.taps)
    d.prefill(seq, taps)
    U, h = d.step_logits(9, BLOCK)
    h_ref, normed = reference(plain).block(tap_means(model, seq, d.taps), 9, target_arrays(model)[0])
    np.testing.assert_allclose(np.array(h), h_ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(U), normed @ target_arrays(model)[1].T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["0731", "v41"])
def test_each_rule_that_differs_between_the_variants_is_seen(tmp_path, tmp_path_factory, variant):
    """The NumPy reference with any one of the five rules of the other model no longer
    matches the drafter: the test above pins each difference (taps, mHC wiring, q norm,
    K/V FP8 rounding, final collapse)."""
    folder, model, w = folder_with(tmp_path, tmp_path_factory, variant)
    d = load_drafter(folder, model, kind="dspark")
    d.bind(model, None)
    seq, E = PROMPT + [3, 4, 5], target_arrays(model)[0]
    d.prefill(seq, raw_taps(model, seq, d.taps))
    h = np.array(d.step_logits(9, BLOCK)[1])
    other = R.RULES["v41" if variant == "0731" else "0731"]
    hc_head = {k: v for k, v in stages("0731")[0].items() if "hc_head_" in k}  # for v41's flip
    for rule in R.RULES[variant]:
        ref = reference({**hc_head, **w}, **{rule: other[rule]})
        h_ref, _ = ref.block(tap_means(model, seq, ref.taps()), 9, E)
        assert np.abs(h - h_ref).max() > 1e-2, rule


def test_0731_config_with_one_nextn_layer_loads_its_three_stages(tmp_path, tmp_path_factory):
    """V4-Flash-0731's HF config says num_nextn_predict_layers 1 (n_mtp_layers 3 is only in
    inference/config.json): the stages present are counted."""
    folder, model, _ = folder_with(tmp_path, tmp_path_factory, num_nextn_predict_layers=1)
    d = load_drafter(folder, model, kind="dspark")
    assert len(d.net.layers) == 3 and d.net.variant == "0731"


def test_fp8_scale_grid_that_fits_no_tile_is_refused(tmp_path, tmp_path_factory):
    assert fp8_tile((4096, 12288), (32, 96)) == 128  # 0731 main_proj (real header)
    assert fp8_tile((8192, 4096), (64, 32)) == 128  # 0731 wo_a
    assert fp8_tile((4096, 12288), (128, 384)) == 32
    assert fp8_tile((96, 64), (1, 1)) == 128 and fp8_tile((4096, 12288), (30, 96)) is None
    model, trunk, _ = target(tmp_path_factory)
    w, rank = stages()
    stored, _ = R.packed(w, tile=128)
    stored["mtp.0.main_proj.scale"] = mx.zeros((3, 5), dtype=mx.uint8)
    write(tmp_path, {**CONFIG, "dspark_markov_rank": rank}, {**trunk, **stored})
    with pytest.raises(ValueError, match=r"main_proj\.scale: a scale grid \(3, 5\).*fits no square tile"):
        load_drafter(tmp_path, model, kind="dspark")


def run(model, d, n, k=BLOCK, **kw):
    return spec_run(model, d, PROMPT, n, k, **kw)


def reference_steps(model, d, ref, got, k, threshold=None):
    """Replay a greedy run with NumPy: per step (proposal, accepted, running confidences, cut)."""
    (E, head), seq = target_arrays(model), PROMPT + got
    cat = tap_means(model, seq, d.taps)

    def chain(pos):
        toks, _, conf = ref.chain(cat[:pos], seq[pos], E, head, BLOCK)
        return toks, conf

    return replay_greedy_blocks(seq, len(PROMPT), k, BLOCK, chain, threshold)


@pytest.mark.parametrize("variant", ["0731", "v41"])
@pytest.mark.parametrize("threshold", [None, 0.3])
def test_greedy_is_the_targets_own_and_tau_equals_numpy(tmp_path, tmp_path_factory, threshold,
                                                         variant):
    folder, model, w = folder_with(tmp_path, tmp_path_factory, variant, trained=True)
    d = load_drafter(folder, model, kind="dspark", confidence_threshold=threshold, cut="sync")
    got, stats = run(model, d, n=48)  # 11 + 48 positions: far past the 8-row window
    assert got == greedy(model, PROMPT, 48)
    steps = reference_steps(model, d, reference(w), got, BLOCK, threshold)
    assert [t.proposed for t in stats.trace] == [s[0] for s in steps]
    assert [t.accepted for t in stats.trace] == [s[1] for s in steps]
    if threshold is not None:  # each cut keeps exactly the prefix whose running product clears it
        for _, _, a, cut in steps:
            assert (a[:cut] >= threshold).all() and (cut == BLOCK or a[cut] < threshold)
        assert {s[3] for s in steps} - {BLOCK}, "the cut never acted"
    tau_ref = np.mean([s[1] + 1 for s in steps])
    print(f"DeepSeek-V4 DSpark {variant} synthetic tau (threshold {threshold}): drafter {stats.tau:.3f}, "
          f"NumPy {tau_ref:.3f}")
    assert stats.tau == pytest.approx(tau_ref) and stats.tau > 1.3


@pytest.mark.parametrize("variant", ["v41-mask-cut", "sampled"])
def test_other_modes_keep_the_output(tmp_path, tmp_path_factory, variant):
    folder, model, _ = folder_with(tmp_path, tmp_path_factory, "v41", trained=True)
    d = load_drafter(folder, model, confidence_threshold=0.3, cut="mask")
    if variant == "v41-mask-cut":
        got, stats = run(model, d, n=30)
        assert got == greedy(model, PROMPT, 30) and stats.accepted > 0
        return
    # sampling: drafts drawn from q, seeded, the same run twice, every drafted row a distribution
    a, _ = run(model, d, n=20, temp=0.8, seed=3)
    b, stats = run(model, d, n=20, temp=0.8, seed=3)
    assert a == b and stats.drafted > 0


@pytest.mark.parametrize("variant", ["0731", "v41"])
def test_quantized_target_gets_quantized_stages_and_stays_lossless(tmp_path, tmp_path_factory,
                                                                   variant):
    folder, _, _ = folder_with(tmp_path, tmp_path_factory, variant, trained=True)
    qmodel, _ = load_model(folder)
    nn.quantize(qmodel, group_size=32, bits=8, class_predicate=lambda p, m: (
        p.startswith("model.layers.") and isinstance(m, nn.Linear) and m.weight.shape[-1] % 32 == 0))
    d = load_drafter(folder, qmodel, kind="dspark")
    q_a = d.net.layers[0].self_attn.q_a_proj
    assert isinstance(q_a, nn.QuantizedLinear) and (q_a.bits, q_a.group_size) == (8, 32)
    got, _ = run(qmodel, d, n=24)
    assert got == greedy(qmodel, PROMPT, 24)


def test_cli_draft_dspark_loads_the_stages(tmp_path, tmp_path_factory):
    from mlx_spec import generate_cli

    folder, model, _ = folder_with(tmp_path, tmp_path_factory)
    args = argparse.Namespace(draft="dspark", draft_model=None)
    assert isinstance(generate_cli.make_drafter(args, model, str(folder)), V4DSparkDrafter)


# ---- bad checkpoints -------------------------------------------------------------------------


def _edit_drop(key):
    return lambda w, c: w.pop(key)


BAD = {
    "missing tensor": (lambda w, c: w.pop("mtp.1.attn.wkv.weight"), r"mtp\.1\.attn\.wkv\.weight.*missing.*\(96, 64\)"),
    "misshaped tensor": (lambda w, c: w.update({"mtp.0.main_proj.weight": w["mtp.0.main_proj.weight"][:, :128]}),
                         r"main_proj\.weight has shape \(64, 128\), expected \(64, 192\)"),
    "missing field": (lambda w, c: c.pop("dspark_noise_token_id"), "lacks \\['dspark_noise_token_id'\\]"),
    "no stages": (lambda w, c: [w.pop(k) for k in list(w)], r"no mtp\.\* tensors"),
    "stage gap": (lambda w, c: [w.pop(k) for k in list(w) if k.startswith("mtp.1.")], "none missing"),
    "n_mtp_layers": (lambda w, c: c.update(n_mtp_layers=2), "declares n_mtp_layers 2"),
    "more stages declared": (lambda w, c: c.update(num_nextn_predict_layers=4), "only 3 DSpark stages"),
    "mixed namings": (lambda w, c: w.pop("mtp.2.hc_head_fn"), "mixes the two namings"),
    "stray head part": (lambda w, c: w.update({"mtp.0.norm.weight": w["mtp.2.norm.weight"]}),
                        "expected only on the last"),
    "unknown tensor": (lambda w, c: w.update({"mtp.1.attn.extra.weight": np.ones((2, 2), np.float32)}),
                       "unexpected DSpark stage tensor"),
    "missing expert": (lambda w, c: w.pop("mtp.2.ffn.experts.1.w2.weight"), "expert"),
    "no markov head": (lambda w, c: w.pop("mtp.2.markov_head.markov_w1.weight"), "no Markov head"),
    "wrong rank": (lambda w, c: c.update(dspark_markov_rank=8), r"markov_w1\.weight has shape"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints_are_refused_clearly(tmp_path, tmp_path_factory, case):
    model, _, _ = target(tmp_path_factory)
    w, rank = stages()
    config = {**CONFIG, "dspark_markov_rank": rank}
    edit, match = BAD[case]
    edit(w, config)
    write(tmp_path, config, w or {"embed.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(ValueError, match=match):
        load_drafter(tmp_path, model, kind="dspark")


def test_other_targets_are_refused(tmp_path, tmp_path_factory):
    w, rank = stages()
    write(tmp_path, {**CONFIG, "dspark_markov_rank": rank}, w)
    with pytest.raises(ValueError, match="deepseek_v41"):
        load_drafter(tmp_path, tiny.llama_model(), kind="dspark")


def test_bind_refuses_a_shallower_narrower_target(tmp_path, tmp_path_factory):
    folder, model, _ = folder_with(tmp_path, tmp_path_factory)
    d = load_drafter(folder, model, kind="dspark")
    small = tiny.deepseek_v41_model(num_hidden_layers=2, hidden_size=32, compress_ratios=[0, 4])
    with pytest.raises(ValueError, match=r"these DeepSeek-V4 DSpark stages cannot draft for this target: "
                       r"reads target layers \[2, 3\], but the target has 2 decoder layers \(0..1\); 64 "
                       r"wide, but the target's embeddings are 32 wide\. Use the weights of this very model"):
        d.bind(small, None)


# ---- sampled output through the whole loop -------------------------------------------------


@pytest.mark.slow
def test_sampled_output_follows_the_target_distribution(tmp_path):
    """The stages' Markov chain at k = 3 (max_tokens = 5) on the windowed, pooled
    DeepSeek-V4.1 target: marginals of positions 1..4 and neighbouring pairs against
    np_sampler's exact law. No confidence cut: these random stages' confidences are so
    low that any threshold cuts to 0 drafts (the old max_tokens=3 run with threshold 0.6
    hardly ever verified a draft); the cut is SparkChain's, tested at depth in
    test_dspark.py."""
    from lossless import assert_deep, assert_lossless, exact_joint, sampled_runs

    V8 = 8
    model = tiny.deepseek_v41_model(seed=3, window=4, sharpen=2.0, vocab_size=V8, **DIMS)
    config = {**CONFIG, "vocab_size": V8, "sliding_window": 4, "dspark_block_size": 3,
              "dspark_noise_token_id": V8 - 1, "dspark_markov_rank": 4}
    w = R.stage_tensors(np.random.default_rng(4), config, "0731", len(IDS), 4)
    write(tmp_path, config, {**trunk_tensors(model), **w})
    d = load_drafter(tmp_path, model, kind="dspark")
    joint = exact_joint(model, [1, 2, 3], 5, dict(temp=1.0), vocab=V8)
    runs = sampled_runs(model, [1, 2, 3], lambda: d, 400, max_tokens=5, k=3, vocab=V8, temp=1.0)
    assert_deep(runs, events=30)
    assert_lossless(runs, joint)
