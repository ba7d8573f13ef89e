"""DFlash: conversion of both layouts, logits vs a NumPy reference, proposals/tau, losslessness."""

import argparse
import json

import mlx.core as mx
import numpy as np
import pytest

import dflash_synth as S
import mlx_spec
from lossless import (assert_caught, assert_deep, assert_lossless, exact_joint, sampled_runs,
                      use_rule, wrong_rule)
from runs import mlx_lm_greedy as greedy_reference, spec_run
from converters import dflash as conv
from converters import head as head_cli
from converters.common import ConversionError
from mlx_spec.cache import WindowKVCache
from mlx_spec.heads import load_drafter
from mlx_spec.taps import Taps

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7]
_targets = {}


def target(name):
    """Tiny targets, built once: qwen3 (random / echo) and muse_glimmer (window 8)."""
    if name not in _targets:
        if name == "qwen3":
            _targets[name] = S.qwen3_target(seed=0)
        elif name == "qwen3-echo":
            m, c = S.qwen3_target(seed=0)
            _targets[name] = (S.echo_target(m, mix=3.0), c)
        elif name == "muse":
            _targets[name] = S.muse_target(seed=1, window=8)
        elif name == "muse-echo":
            m, c = S.muse_target(seed=1, window=8)
            _targets[name] = (S.echo_target(m, gain=24.0, mix=3.0), c)
    return _targets[name]


def make_head(tmp, tname, layout="zlab", copy=False, dtype=mx.float32, seed=0, **cfg_kw):
    """Write a target folder and a checkpoint in `layout`, convert it; return (folder, weights, src)."""
    model, tcfg = target(tname)
    tdir = S.write_target(tmp / f"target-{tname}", model, tcfg)
    L, ids = 2, [0, 2]
    w = S.network_weights(np.random.default_rng(seed), L, len(ids))
    if copy:
        w = S.copy_anchor(w, L)
    if layout == "muse":
        cfg = S.muse_head_config(L, ids, window=6)
        src = S.save_checkpoint(tmp / f"src-{layout}", cfg, S.to_muse_names(w), dtype)
    else:
        cfg = S.zlab_config(L, ids, 4, **cfg_kw)
        src = S.save_checkpoint(tmp / f"src-{layout}", cfg, w, dtype)
    out = conv.convert(src, tmp / f"head-{layout}-{tname}", tdir)
    return out, w, tdir


def run(model, drafter, n=60, k=15, prompt=PROMPT, **kw):
    return spec_run(model, drafter, prompt, n, k, **kw)


def as_mx(taps, start=0):
    return {k: mx.array(v[start:].astype(np.float32)) for k, v in taps.items()}


# ---- conversion ---------------------------------------------------------------------------


def cli(src, out, tgt, *extra):
    parser = argparse.ArgumentParser()
    head_cli.add_arguments(parser)
    return head_cli.run(parser.parse_args([str(src), str(out), "--target", str(tgt), *extra]))


def test_zlab_round_trip_keeps_every_tensor_and_records_the_rules(tmp_path):
    model, tcfg = target("qwen3")
    tdir = S.write_target(tmp_path / "t", model, tcfg)
    w = S.network_weights(np.random.default_rng(3), 2, 2)
    cfg = S.zlab_config(2, [0, 2], 4, layer_types=["sliding_attention", "full_attention"],
                        sliding_window=8)
    src = S.save_checkpoint(tmp_path / "src", cfg, w, mx.bfloat16)
    assert cli(src, tmp_path / "head", tdir) == 0  # --format auto finds it
    head = json.loads((tmp_path / "head" / "config.json").read_text())
    assert head["mlx_spec"] == {"format": 1, "drafter": "dflash", "taps": [0, 2],
                                "target": {"model_type": "qwen3", "hidden_size": 64,
                                           "num_hidden_layers": 4, "vocab_size": 96}}
    assert head["layer_windows"] == [8, None] and head["layer_causal"] == [True, False]
    assert (head["block_size"], head["mask_token_id"], head["output_multiplier"]) == (16, 95, 1.0)
    stored = mx.load(str(tmp_path / "head" / "model.safetensors"))
    assert set(stored) == set(w)
    for k, v in w.items():
        assert stored[k].dtype == mx.bfloat16
        assert mx.array_equal(stored[k], mx.array(v).astype(mx.bfloat16)).item(), k


def test_muse_assistant_layout_maps_encoder_names_and_takes_the_targets_logit_rules(tmp_path):
    out, w, _ = make_head(tmp_path, "muse", layout="muse")
    head = json.loads((out / "config.json").read_text())
    assert head["source"]["layout"] == "muse-glimmer-assistant"
    assert head["mlx_spec"]["taps"] == [0, 2]
    assert head["layer_causal"] == [False, False]  # bidirectional, sliding windows kept
    assert head["layer_windows"] == [6, 6]
    assert head["output_multiplier"] == 0.25 and head["final_logit_softcapping"] == 20.0
    stored = mx.load(str(out / "model.safetensors"))
    assert np.array_equal(np.array(stored["fc.weight"]), w["fc.weight"])
    assert np.array_equal(np.array(stored["hidden_norm.weight"]), w["hidden_norm.weight"])


def test_layer_id_conventions_are_pinned():
    assert conv.default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab Qwen3-4B
    assert conv.default_layer_ids(8, 1) == [4]
    assert conv.tap_ids([1, 13, 25, 37, 49], 52) == [1, 13, 25, 37, 49]  # Muse: output-of-layer
    assert conv.tap_ids([-1, 3], 36, embed_ok=True) == ["embed", 3]  # DeepSpec: -1 = embedding
    with pytest.raises(ConversionError, match="last layer"):
        conv.tap_ids([35], 36)
    # tap k is the OUTPUT of decoder layer k, i.e. HF hidden_states[k + 1]
    model, _ = target("qwen3")
    x = mx.array([PROMPT])
    with Taps(model, [0, 2]) as taps:
        model(x)
        got = taps.read()
    h = model.model.embed_tokens(x)
    for i, layer in enumerate(model.model.layers[:3]):
        h = layer(h, "causal", None)
        if i in got:
            assert mx.allclose(got[i], h[0], atol=1e-5).item()


def test_in_block_causality_rules():
    types = ["sliding_attention", "full_attention"]
    assert conv.layer_attention({"layer_types": types, "sliding_window": 4}, 2) == ([4, None], [True, False])
    assert conv.layer_attention({"layer_types": types, "sliding_window": 4}, 2, False)[1] == [False, False]
    qwen = {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}
    assert conv.layer_attention(qwen, 2) == ([None, 5], [False, True])
    w = S.network_weights(np.random.default_rng(0), 2, 2)
    model, tcfg = target("qwen3")
    base = S.zlab_config(2, [0, 2], 4, layer_types=types, sliding_window=4)
    assert conv.build({**base, "is_causal": False}, w, tcfg)[0]["layer_causal"] == [False, False]
    nested = {**base, "dflash_config": {**base["dflash_config"], "causal": True}}
    assert conv.build(nested, w, tcfg)[0]["layer_causal"] == [True, True]


# ---- the forward against NumPy --------------------------------------------------------------


@pytest.mark.parametrize("case", ["zlab-sliding-causal", "muse-bidirectional-window"])
def test_draft_logits_match_numpy_across_commits(tmp_path, case):
    if case.startswith("zlab"):
        out, w, _ = make_head(tmp_path, "qwen3", layer_types=["sliding_attention", "full_attention"],
                              sliding_window=8)
        ref = S.Reference(w, layers=2, windows=[8, None], causal=[True, False], block=16)
        model, mult, cap = target("qwen3")[0], 1.0, None
    else:
        out, w, _ = make_head(tmp_path, "muse", layout="muse")
        ref = S.Reference(w, layers=2, windows=[6, 6], causal=[False, False], block=16, eps=1e-5)
        model, mult, cap = target("muse")[0], 0.25, 20.0
    d = load_drafter(out, model)
    d.bind(model, None)
    E, head = (np.array(a, np.float64) for a in (model.model.embed_tokens.weight, model.lm_head.weight))
    seq = [int(t) for t in np.random.default_rng(1).integers(0, 90, 40)]
    taps = S.target_taps(model, seq, d.taps)
    d.prefill(seq[:20], as_mx({k: v[:20] for k, v in taps.items()}))
    done = 20
    for step in (3, 1, 5, 11):  # context grows well past the windows
        anchor = seq[done]
        got = np.array(d.logits(d.hidden(anchor)[1:]))
        want = ref.dflash_logits(S.concat_taps(taps, d.taps)[:done], anchor, E, head, mult, cap)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
        d.commit(seq[done:done + step], as_mx({k: v[done:done + step] for k, v in taps.items()}))
        done += step


def reference_run(model, d, ref, emitted, prompt, k):
    """Replay a greedy run's steps with the NumPy reference: its proposals and its tau."""
    E, head = (np.array(a, np.float64) for a in (model.model.embed_tokens.weight, model.lm_head.weight))
    seq, pos, proposals, ns = prompt + emitted, len(prompt), [], []
    taps = S.concat_taps(S.target_taps(model, seq, d.taps), d.taps)
    while pos < len(seq) - 1:
        kk = min(k, len(seq) - pos - 2)  # the loop never drafts past max_tokens
        props = [int(t) for t in np.argmax(ref.dflash_logits(taps[:pos], seq[pos], E, head), 1)[:kk]]
        n = 0
        while n < kk and props[n] == seq[pos + 1 + n]:
            n += 1
        proposals.append(props)
        ns.append(n)
        pos += n + 1
    return proposals, ns


def test_proposals_and_tau_equal_the_numpy_reference(tmp_path):
    model, _ = target("qwen3-echo")
    out, w, _ = make_head(tmp_path, "qwen3-echo", copy=True)
    got, stats = run(model, load_drafter(out, model), n=120, k=15)
    assert got == greedy_reference(model, PROMPT, 120)
    ref = S.Reference(w, layers=2, windows=[None, None], causal=[False, False], block=16)
    proposals, ns = reference_run(model, load_drafter(out, model), ref, got, PROMPT, 15)
    steps = stats.trace
    assert [t.proposed for t in steps[: len(proposals)]] == proposals
    assert [t.accepted for t in steps[: len(ns)]] == ns
    tau_ref = np.mean([n + 1 for n in ns])
    print(f"DFlash synthetic tau: drafter {stats.tau:.3f}, NumPy reference {tau_ref:.3f}")
    assert 2.0 < stats.tau < 15.0  # partial acceptance: accept, reject and roll back all happen


# ---- losslessness ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [4, 15])
@pytest.mark.parametrize("tname,layout,copy", [("qwen3", "zlab", False), ("qwen3-echo", "zlab", True),
                                               ("muse-echo", "muse", True)])
def test_greedy_output_is_the_targets_own(tmp_path, tname, layout, copy, k):
    model, _ = target(tname)
    out, _, _ = make_head(tmp_path, tname, layout=layout, copy=copy)
    cache = mlx_spec.make_cache(model)
    got, stats = run(model, load_drafter(out, model), n=100, k=k, prompt_cache=cache)
    assert got == greedy_reference(model, PROMPT, 100)
    assert stats.drafted > stats.accepted  # rejected drafts were rolled back
    if tname.startswith("muse"):  # sliding target layers, run far past their 8-token window
        assert any(isinstance(c, WindowKVCache) for c in cache)
        assert 0 < stats.accepted and stats.acceptance_rate < 1


def test_a_quantized_head_still_decodes_losslessly(tmp_path):
    model, tcfg = target("qwen3-echo")
    tdir = S.write_target(tmp_path / "t", model, tcfg)
    w = S.copy_anchor(S.network_weights(np.random.default_rng(0), 2, 2), 2)
    src = S.save_checkpoint(tmp_path / "src", S.zlab_config(2, [0, 2], 4), w)
    assert cli(src, tmp_path / "q8", tdir, "-q", "--q-bits", "8", "--q-group-size", "32") == 0
    stored = mx.load(str(tmp_path / "q8" / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.scales" in stored
    got, stats = run(model, load_drafter(tmp_path / "q8", model), n=60)
    assert got == greedy_reference(model, PROMPT, 60) and stats.tau > 2


V8 = 8
FLASH_PROMPT = [1, 2, 3]


def sampled_flash(tmp_path_factory):
    """(target, head folder, exact law) on an 8-token vocabulary, with a random 1-layer head
    whose q is flat enough (q(d) well below 1) that ignoring it changes acceptance."""
    if "flash" not in _targets:
        tmp = tmp_path_factory.mktemp("flash-sampled")
        model, tcfg = S.qwen3_target(seed=3, vocab=V8, sharpen=2.0, layers=3)
        tdir = S.write_target(tmp / "t", model, tcfg)
        w = S.network_weights(np.random.default_rng(5), 1, 2)
        cfg = S.zlab_config(1, [0, 1], 3, block=4, mask=V8 - 1, vocab_size=V8)
        head = conv.convert(S.save_checkpoint(tmp / "s", cfg, w), tmp / "h", tdir)
        joint = exact_joint(model, FLASH_PROMPT, 5, dict(temp=1.0), vocab=V8)
        _targets["flash"] = (model, head, joint)
    return _targets["flash"]


def flash_runs(tmp_path_factory, sample_drafts, runs, seed0=0):
    model, head, _ = sampled_flash(tmp_path_factory)
    d = load_drafter(head, model)
    d.sample_drafts = sample_drafts
    return sampled_runs(model, FLASH_PROMPT, lambda: d, runs, max_tokens=5, k=3, vocab=V8,
                        seed0=seed0, temp=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("sample_drafts", [False, True], ids=["point-mass", "own-q"])
def test_sampled_output_follows_the_target_distribution(tmp_path_factory, sample_drafts):
    """A 3-token block (k = 3, max_tokens = 5): argmax drafts checked as point masses, or
    drafts drawn from the head's own q_j; marginals of positions 1..4 and neighbouring
    pairs against np_sampler's exact law."""
    runs = flash_runs(tmp_path_factory, sample_drafts, 1500 if sample_drafts else 800)
    assert_deep(runs, events=40)
    assert_lossless(runs, sampled_flash(tmp_path_factory)[-1])


@pytest.mark.slow
def test_the_check_catches_q_ignored_for_a_q_bearing_head(monkeypatch, tmp_path_factory):
    """Wrong on purpose: accept d_j with probability min(1, p_j(d_j)), ignoring q_j(d_j).
    This matters only where q is returned: `sample_drafts=True`."""
    use_rule(monkeypatch, wrong_rule(use_q=False))
    runs = flash_runs(tmp_path_factory, True, 400, seed0=10_000)
    assert_caught(runs, sampled_flash(tmp_path_factory)[-1])


# ---- bad input ------------------------------------------------------------------------------


def _bad(tmp_path, mutate_cfg=None, mutate_w=None, tname="qwen3", layout="zlab"):
    model, tcfg = target(tname)
    w = S.network_weights(np.random.default_rng(0), 2, 2)
    cfg = S.muse_head_config(2, [0, 2], 6) if layout == "muse" else S.zlab_config(2, [0, 2], 4)
    if layout == "muse":
        w = S.to_muse_names(w)
    if mutate_cfg:
        mutate_cfg(cfg)
    if mutate_w:
        mutate_w(w)
    return conv.build(cfg, {k: mx.array(v) for k, v in w.items()}, tcfg)


BAD = {
    "missing tensor": (None, lambda w: w.pop("layers.1.mlp.up_proj.weight"), "missing tensor"),
    "misshaped fc": (None, lambda w: w.update({"fc.weight": np.zeros((64, 64), np.float32)}), "misshaped"),
    "unknown key": (None, lambda w: w.update({"d2t": np.zeros(3, np.float32)}), "match no known key"),
    "dflash2": (lambda c: c.update(architectures=["DFlash2DraftModel"]), None, "DFlash2"),
    "sink bias": (lambda c: c["dflash_config"].update(attention_sink_bias=True), None, "attention_sink_bias"),
    "layer out of range": (lambda c: c["dflash_config"].update(target_layer_ids=[0, 7]), None, "out of range"),
    "mask outside vocab": (lambda c: c["dflash_config"].update(mask_token_id=500), None, "mask_token_id"),
    "other width": (lambda c: c.update(hidden_size=32), None, "wide"),
    "other vocab": (lambda c: c.update(vocab_size=1000), None, "vocab_size"),
    "laguna": (lambda c: c.update(model_type="laguna", gating="per-head"), None, "Laguna DFlash head .*self_attn.g_proj"),
    "laguna gate tensor": (None, lambda w: w.update({"layers.0.self_attn.g_proj.weight": np.zeros((4, 64), np.float32)}),
                           "Laguna DFlash head"),
}


def test_format_auto_names_why_laguna_heads_are_refused(tmp_path):
    src = tmp_path / "laguna"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({**S.zlab_config(2, [0, 2], 4), "model_type": "laguna",
                                                 "gating": "per-head"}))
    w = S.network_weights(np.random.default_rng(0), 2, 2)
    mx.save_safetensors(str(src / "model.safetensors"), {k: mx.array(v) for k, v in w.items()})
    with pytest.raises(ValueError, match="Laguna DFlash head"):
        head_cli.detect(src)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints_are_refused_with_the_reason(tmp_path, case):
    cfg_fn, w_fn, msg = BAD[case]
    with pytest.raises(ConversionError, match=msg):
        _bad(tmp_path, cfg_fn, w_fn)


def test_muse_assistant_needs_a_muse_target_and_a_target_at_all(tmp_path):
    model, tcfg = target("qwen3")
    w = S.to_muse_names(S.network_weights(np.random.default_rng(0), 2, 2))
    with pytest.raises(ConversionError, match="Muse Glimmer targets"):
        conv.build(S.muse_head_config(2, [0, 2], 6), {k: mx.array(v) for k, v in w.items()}, tcfg)
    with pytest.raises(ConversionError, match="--target is required"):
        conv.convert(tmp_path, tmp_path / "out", None)


def test_a_head_for_another_target_or_a_damaged_folder_is_refused(tmp_path):
    out, _, _ = make_head(tmp_path, "qwen3")
    other, _ = S.qwen3_target(seed=0, layers=2)
    with pytest.raises(ValueError, match="converted for another target"):
        load_drafter(out, other)
    weights = mx.load(str(out / "model.safetensors"))
    weights.pop("norm.weight")
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    with pytest.raises(ValueError, match="convert the head again"):
        load_drafter(out, target("qwen3")[0])


def test_bind_names_every_way_another_target_does_not_fit(tmp_path):
    out, _, _ = make_head(tmp_path, "qwen3")  # taps [0, 2] of a 4-layer, 64-wide target
    d = load_drafter(out, target("qwen3")[0])
    narrow, _ = S.qwen3_target(seed=0, layers=2, hidden=32, vocab=90)
    with pytest.raises(ValueError, match=r"this DFlash head cannot draft for this target: reads target "
                       r"layers \[2\].*; 64 wide, but the target's embeddings are 32 wide; "
                       r"mask_token_id 95 is outside the target's vocabulary \(0..89\)\. "
                       r"Use a head made for this model"):
        d.bind(narrow, None)
