"""EAGLE drafters: head math equals an independent NumPy implementation; decoding stays lossless.

The reference (tests/eagle_fixtures.py) recomputes every head row from scratch
in float64 with no cache, from the checkpoint's ORIGINAL tensors, so it also
checks the converter's key mapping and the drafter's cache/rollback handling.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_spec
import tiny
from runs import mlx_lm_greedy as greedy_reference
from converters.eagle import v1, v3
from eagle_fixtures import eagle1_checkpoint, eagle3_checkpoint, ref_eagle1, ref_eagle3, target_folder
from mlx_spec.sampling import Sampling
from mlx_spec.taps import FINAL_NORM

H, V = 64, tiny.VOCAB


class Recorder:
    """Stands in for the drafter's head module and keeps each call's normed hidden rows."""

    def __init__(self, head):
        self.head, self.calls = head, []

    def __call__(self, emb, feat, cache):
        nxt, out = self.head(emb, feat, cache)
        self.calls.append(out[0])
        return nxt, out

    def __getattr__(self, name):
        return getattr(self.head, name)

    def __contains__(self, key):
        return key in self.head


def _convert(tmp_path, model, kind, **kw):
    tgt = target_folder(tmp_path / "target", model)
    make, conv = (eagle1_checkpoint, v1) if kind == "eagle" else (eagle3_checkpoint, v3)
    cfg, w = make(tmp_path / "src", kw.pop("H", H), V, **kw)
    out = conv.convert(tmp_path / "src", tmp_path / "out", tgt)
    return cfg, w, mlx_spec.load_drafter(out, model)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


CASES = {
    "eagle1": ("eagle", dict(layers=2, fc_bias=True, qkv_bias=True, fmt="bin")),
    "hass": ("eagle", dict(layers=2, hass=True, first_norm=True, fmt="safetensors")),
    "hass-vllm-v0-names": ("eagle", dict(hass=True, hass_names=("enorm", "hnorm"))),
    "eagle3-yuhuili": ("eagle3", dict(V_d=50)),
    "eagle3-speculators-options": ("eagle3", dict(
        layout="speculators", layers=2, qk_norm=True, norm_before_fc=True, fc_norm=True, V_d=70,
        config={"norm_before_residual": True})),
}


@pytest.mark.parametrize("case", list(CASES))
def test_draft_logits_equal_numpy_reference(tmp_path, case):
    kind, kw = CASES[case]
    model = tiny.llama_model(layers=6)
    cfg, w, drafter = _convert(tmp_path, model, kind, **kw)
    drafter.bind(model, tiny.tokenizer())
    rec = drafter.head = Recorder(drafter.head)
    rng = np.random.default_rng(0)
    H_t = 64
    E = np.array(model.model.embed_tokens.weight, np.float64)
    LM = np.array(model.lm_head.weight, np.float64) if kind == "eagle" else np.asarray(w["lm_head.weight"], np.float64)
    d2t = (w["d2t"] + np.arange(len(w["d2t"]))) if "d2t" in w else np.arange(V)

    def taps(n):
        return {t: mx.array(rng.normal(size=(n, H_t)).astype(np.float32)) for t in drafter.taps}

    def feats(tp):  # what the reference reads: final-norm output, or the taps side by side
        if kind == "eagle":
            return np.array(tp[FINAL_NORM], np.float64)
        return np.concatenate([np.array(tp[t], np.float64) for t in drafter.taps], -1)

    def reference(tokens_next, feature_rows, chain):
        if kind == "eagle":
            return ref_eagle1(w, cfg, E, tokens_next, feature_rows, chain)
        return ref_eagle3(w, cfg, E, tokens_next, feature_rows, chain, layers=kw.get("layers", 1),
                          norm_before_residual=bool(kw.get("config", {}).get("norm_before_residual")))

    prompt = [5, 9, 2, 33, 7, 1]
    all_feats, all_next = [feats(t := taps(len(prompt)))], list(prompt[1:])
    drafter.prefill(prompt, t)
    sampling = Sampling(temp=1.0)
    y, k = 40, 4
    for step in range(3):  # propose -> commit, three times, with rejections and a skipped proposal
        rec.calls.clear()
        draft = drafter.propose(y, k, sampling)
        mx.eval(draft.tokens, draft.q)
        toks = np.array(draft.tokens).tolist()
        ctx_next = all_next + [y]
        hid = reference(ctx_next, np.concatenate(all_feats), [t for t in toks[:-1]])  # [T + k - 1, H]
        want_hidden = hid[len(ctx_next) - 1:]  # rows predicting d0 .. d(k-1)
        got_hidden = np.concatenate([np.array(rec.calls[0][-1:])] + [np.array(c) for c in rec.calls[1:]])
        np.testing.assert_allclose(got_hidden, want_hidden, atol=1e-4, rtol=1e-4)
        logits = want_hidden @ LM.T
        np.testing.assert_allclose(got_hidden @ LM.T, logits, atol=1e-4 * np.abs(logits).max())
        q_want = np.zeros((k, V))
        q_want[:, d2t] = _softmax(logits)  # draft vocabulary scattered into the target's
        np.testing.assert_allclose(np.array(draft.q), q_want, atol=1e-5)
        assert all(q_want[i, t] > 0 for i, t in enumerate(toks))  # tokens come from q, as target ids
        n = [1, 0, k][step]  # accept some, none, all
        kept = [y] + toks[:n]
        tp = taps(n + 1)
        drafter.commit(kept, tp)
        all_feats.append(feats(tp))
        all_next += kept
        y = int(rng.integers(0, V))
        if step == 1:  # a step where the loop had no room to draft: commit without propose
            kept = [y]
            tp = taps(1)
            drafter.commit(kept, tp)
            all_next.append(y)
            all_feats.append(feats(tp))
            y = int(rng.integers(0, V))
    # the head's cache holds committed rows with real features only; the rest waits for the next y
    rows = sum(len(f) for f in all_feats)
    assert drafter.cache[0].offset + drafter._feats.shape[0] == rows and len(drafter._toks) == drafter._feats.shape[0] - 1




def quantized_llama():
    model = tiny.llama_model(layers=6, tied=True)
    nn.quantize(model, group_size=32, bits=4)  # quantized embedding and tied LM head too
    mx.eval(model.parameters())
    return model


TARGETS = {
    "llama": lambda: tiny.llama_model(layers=6),
    "llama-q4-tied": quantized_llama,
    "qwen2": lambda: tiny.qwen2_model(layers=4),
    "gemma3-sliding": lambda: tiny.gemma3_model(layers=4, window=8),
    "qwen3_5-hybrid": lambda: tiny.qwen3_5_model(layers=4),
}


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("arch", list(TARGETS))
def test_greedy_output_is_the_targets(tmp_path, arch, kind):
    model = TARGETS[arch]()
    kw = dict(V_d=60) if kind == "eagle3" else {}
    _, _, drafter = _convert(tmp_path, model, kind, seed=3, **kw)
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]  # longer than gemma3's window
    want = greedy_reference(model, prompt, 24)
    got = [r.token for r in mlx_spec.stream_generate(model, tiny.tokenizer(), prompt, drafter,
                                                      max_tokens=24, num_draft_tokens=3)]
    assert got == want


def test_bind_refuses_another_target_naming_each_mismatch(tmp_path):
    _, _, drafter = _convert(tmp_path, tiny.llama_model(layers=6), "eagle3", V_d=50)
    deep = list(dict.fromkeys(t for t in drafter.taps if isinstance(t, int) and t >= 2))  # each named once
    assert deep  # the default EAGLE-3 taps of a 6-layer target reach past layer 1
    with pytest.raises(ValueError) as err:
        drafter.bind(tiny.llama_model(layers=2), None)
    msg = str(err.value)
    assert msg.startswith("this EAGLE head cannot draft for this target: converted for another target "
                          "(num_hidden_layers: head made for 6, target has 2); ")
    assert f"reads target layers {deep}, but the target has 2 decoder layers (0..1)" in msg
    assert msg.endswith("convert it again with --target pointing here).") and "Use a head made for this model" in msg
