"""Gemma 4 assistant drafters on tiny Gemma 4 targets (mlx-lm `gemma4_text`).

The assistant checkpoint is written in the layout of `google/gemma-4-*-it-assistant`
(`model.*` text model with query-only attention, `pre_projection`, `post_projection`,
tied embeddings; E2B/E4B's `masked_embedding`). The NumPy reference recomputes the
target's keys/values of its last sliding and last full layer from the taps and runs the
assistant step from the equations in `mlx_spec/drafters/gemma4_assistant.py`.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text

import tiny
from converters import gemma4 as conv
from converters.common import ConversionError
from mlx_spec.heads import load_drafter
from mlx_spec.sampling import Sampling
from mlx_spec.taps import FINAL_NORM, Taps
from runs import mlx_lm_greedy as greedy, spec_run

V, H, HA, HD, WINDOW = tiny.VOCAB, 64, 32, 16, 8
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        "full_attention": {"rope_type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 1.0}}
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 12, 13]


def target_config(shared=0, k_eq_v=False, per_layer=0):
    return dict(model_type="gemma4_text", hidden_size=H, num_hidden_layers=6, intermediate_size=2 * H,
                num_attention_heads=4, head_dim=HD, global_head_dim=HD, num_key_value_heads=1,
                num_global_key_value_heads=1 if k_eq_v else None, attention_k_eq_v=k_eq_v,
                num_kv_shared_layers=shared, hidden_size_per_layer_input=per_layer,
                vocab_size_per_layer_input=V, vocab_size=V, sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention"] * 3, rope_parameters=ROPE,
                final_logit_softcapping=30.0, use_double_wide_mlp=False, tie_word_embeddings=True,
                rms_norm_eps=1e-6, max_position_embeddings=4096)


def target(seed=0, **kw):
    mx.random.seed(seed)
    cfg = target_config(**kw)
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(cfg))
    new = [(k, v * 4 if k.endswith("embed_tokens.weight") else
            (mx.random.normal(v.shape) * 0.3 + 1 if k.endswith("layer_scalar") else v))
           for k, v in tree_flatten(model.parameters())]
    model.load_weights(new)
    mx.eval(model.parameters())
    return model, cfg


def assistant(rng, ordered=False):
    """(config, tensors in the published names)."""
    text = dict(model_type="gemma4_text", hidden_size=HA, num_hidden_layers=2, intermediate_size=2 * HA,
                num_attention_heads=2, head_dim=HD, global_head_dim=HD, num_key_value_heads=1,
                vocab_size=V, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                rope_parameters=ROPE, rms_norm_eps=1e-6, hidden_size_per_layer_input=0,
                num_kv_shared_layers=0, use_double_wide_mlp=False, tie_word_embeddings=True)
    cfg = {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
           "backbone_hidden_size": H, "tie_word_embeddings": True, "use_ordered_embeddings": ordered,
           "num_centroids": 8, "centroid_intermediate_top_k": 3, "text_config": text}
    r = lambda *s, scale=None: (rng.standard_normal(s) * (scale or 1 / np.sqrt(s[-1]))).astype(np.float32)
    norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    w = {"model.embed_tokens.weight": r(V, HA, scale=1.0), "model.norm.weight": norm(HA),
         "pre_projection.weight": r(HA, 2 * H), "post_projection.weight": r(H, HA, scale=1.0)}
    for i in range(2):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": r(2 * HD, HA), p + "self_attn.q_norm.weight": norm(HD),
                  p + "self_attn.o_proj.weight": r(HA, 2 * HD), p + "mlp.gate_proj.weight": r(2 * HA, HA),
                  p + "mlp.up_proj.weight": r(2 * HA, HA), p + "mlp.down_proj.weight": r(HA, 2 * HA),
                  p + "layer_scalar": np.array([0.8], np.float32)})
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            w[p + n + ".weight"] = norm(HA)
    if ordered:
        w["masked_embedding.centroids.weight"] = r(8, HA)
        w["masked_embedding.token_ordering"] = rng.permutation(V).astype(np.int64)
    return cfg, w


def convert(tmp, tcfg, ordered=False, seed=0):
    cfg, w = assistant(np.random.default_rng(seed), ordered)
    src, tdir = tmp / f"src{ordered}", tmp / "target"
    for folder, c in ((src, cfg), (tdir, tcfg)):
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(c))
    mx.save_safetensors(str(src / "model.safetensors"), {k: mx.array(v) for k, v in w.items()})
    return conv.convert(src, tmp / f"head{ordered}", tdir), w


# ---- NumPy reference ------------------------------------------------------------------------


def rms(x, w=None, eps=1e-6):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


def rope(x, pos, theta):  # x [T, n, d], rotate-half pairs
    half = x.shape[-1] // 2
    ang = np.asarray(pos, np.float64)[:, None] * theta ** (-np.arange(half) * 2.0 / x.shape[-1])
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def target_kv(model, x_in, layer, kind, k_eq_v):
    """The target layer's K [T, 1, d], V from its input x_in [T, H]."""
    W = {k: np.array(v, np.float64) for k, v in tree_flatten(model.parameters())}
    p = f"model.layers.{layer}."
    u = rms(x_in, W[p + "input_layernorm.weight"])
    k = (u @ W[p + "self_attn.k_proj.weight"].T).reshape(len(x_in), 1, HD)
    v = k if k_eq_v else (u @ W[p + "self_attn.v_proj.weight"].T).reshape(len(x_in), 1, HD)
    return rope(rms(k, W[p + "self_attn.k_norm.weight"]), np.arange(len(x_in)), ROPE[kind]["rope_theta"]), rms(v)


def assistant_chain(w, kv, x0_embed, h0, pos, embed_scale, E_target, k):
    """Greedy chain of k steps (tokens) from the reference equations."""
    A = {kk: np.asarray(v, np.float64) for kk, v in w.items()}
    tok_emb, h, out = x0_embed, h0, []
    for _ in range(k):
        x = A["pre_projection.weight"] @ np.concatenate([tok_emb * embed_scale, h])
        for i, kind in enumerate(["sliding_attention", "full_attention"]):
            p = f"model.layers.{i}."
            u = rms(x, A[p + "input_layernorm.weight"])
            q = rope(rms((A[p + "self_attn.q_proj.weight"] @ u).reshape(1, 2, HD), A[p + "self_attn.q_norm.weight"]),
                     [pos], ROPE[kind]["rope_theta"])[0]
            K, Vv = kv[kind]
            if kind == "sliding_attention":
                K, Vv = K[-WINDOW:], Vv[-WINDOW:]
            s = q @ K[:, 0].T  # [2 heads, T], scale 1
            a = np.exp(s - s.max(-1, keepdims=True))
            o = ((a / a.sum(-1, keepdims=True)) @ Vv[:, 0]).reshape(-1)
            x = x + rms(A[p + "self_attn.o_proj.weight"] @ o, A[p + "post_attention_layernorm.weight"])
            m = rms(x, A[p + "pre_feedforward_layernorm.weight"])
            m = A[p + "mlp.down_proj.weight"] @ (gelu(A[p + "mlp.gate_proj.weight"] @ m) * (A[p + "mlp.up_proj.weight"] @ m))
            x = (x + rms(m, A[p + "post_feedforward_layernorm.weight"])) * A[p + "layer_scalar"]
        g = rms(x, A["model.norm.weight"])
        t = int(np.argmax(A["model.embed_tokens.weight"] @ g))
        out.append(t)
        tok_emb, h = E_target[t], A["post_projection.weight"] @ g
    return out


# ---- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shared,k_eq_v", [(0, False), (2, True)], ids=["31B-like", "kv-shared-E-like"])
def test_the_chain_matches_numpy_and_the_kv_is_the_targets_own(tmp_path, shared, k_eq_v):
    model, tcfg = target(shared=shared, k_eq_v=k_eq_v, per_layer=8 if shared else 0)
    out, w = convert(tmp_path, tcfg)
    d = load_drafter(out, model)
    d.bind(model, None)
    # the last layer of each type that computes its own K/V (KV-shared layers reuse them)
    src = {"sliding_attention": 2, "full_attention": 3} if shared else {"sliding_attention": 4, "full_attention": 5}
    assert d._src == src and d.taps == (FINAL_NORM, *(i - 1 for i in src.values()))
    with Taps(model, d.taps) as t:
        cache = model.make_cache()
        model(mx.array([PROMPT]), cache=cache)
        taps = t.read()
    d.prefill(PROMPT, taps)
    full = src["full_attention"]  # what the target itself cached for that layer
    np.testing.assert_allclose(np.array(d._kv["full_attention"][0]),
                               np.array(cache[full].keys[..., :len(PROMPT), :]), atol=1e-5)
    E = np.array(model.model.embed_tokens.weight, np.float64)
    kv = {kind: target_kv(model, np.array(taps[i - 1], np.float64), i, kind, k_eq_v and kind == "full_attention")
          for kind, i in src.items()}
    y = 20
    want = assistant_chain(w, kv, E[y], np.array(taps[FINAL_NORM][-1], np.float64), len(PROMPT) - 1, H ** 0.5, E, 4)
    assert np.array(d.propose(y, 4, Sampling()).tokens).tolist() == want


def test_greedy_output_is_the_targets_own_and_sampling_carries_q(tmp_path):
    model, tcfg = target(shared=2, per_layer=8)
    out, _ = convert(tmp_path, tcfg)
    d = load_drafter(out, model)
    got, stats = spec_run(model, d, PROMPT, 40, 3)  # past the 8-row window
    assert got == greedy(model, PROMPT, 40) and stats.drafted > 0
    a, _ = spec_run(model, d, PROMPT, 20, 3, temp=0.9, seed=4)
    b, _ = spec_run(model, d, PROMPT, 20, 3, temp=0.9, seed=4)
    assert a == b
    d.bind(model, None)
    with Taps(model, d.taps) as t:
        model(mx.array([PROMPT]))
        d.prefill(PROMPT, t.read())
    q = np.array(d.propose(3, 3, Sampling(temp=0.9)).q)
    assert q.shape == (3, V) and np.allclose(q.sum(-1), 1, atol=1e-5)


def test_the_centroid_masked_head_of_e2b_e4b(tmp_path):
    model, tcfg = target()
    out, w = convert(tmp_path, tcfg, ordered=True)
    d = load_drafter(out, model)
    d.bind(model, None)
    me = d.net.masked_embedding
    g = mx.array(np.random.default_rng(1).standard_normal(HA).astype(np.float32))
    logits = np.array(me(g, d.net.embed_tokens))
    cent = w["masked_embedding.centroids.weight"] @ np.array(g)
    keep = np.argsort(-cent)[:3]
    ids = w["masked_embedding.token_ordering"].reshape(8, -1)[keep].reshape(-1)
    sel = w["model.embed_tokens.weight"][ids] @ np.array(g)
    np.testing.assert_allclose(logits[ids], sel, atol=1e-4)
    rest = np.setdiff1d(np.arange(V), ids)
    assert np.allclose(logits[rest], sel.min() - 1, atol=1e-4)
    got, _ = spec_run(model, d, PROMPT, 20, 3)
    assert got == greedy(model, PROMPT, 20)


def test_the_assistant_of_another_target_is_refused(tmp_path):
    cfg, w = assistant(np.random.default_rng(0))
    with pytest.raises(ConversionError, match="reads a 64-wide target, --target is 128 wide"):
        conv.build(cfg, {k: mx.array(v) for k, v in w.items()}, {**target_config(), "hidden_size": 128})
    with pytest.raises(ConversionError, match="drafts for Gemma 4 targets"):
        conv.build(cfg, {k: mx.array(v) for k, v in w.items()}, {**target_config(), "model_type": "qwen3"})
    cut = dict(w, **{"model.layers.1.mlp.up_proj.weight": w["model.layers.1.mlp.up_proj.weight"][:-1]})
    with pytest.raises(ConversionError, match="misshaped.*mlp.up_proj"):
        conv.build(cfg, {k: mx.array(v) for k, v in cut.items()}, target_config())
    w.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ConversionError, match="missing.*mlp.up_proj"):
        conv.build(cfg, {k: mx.array(v) for k, v in w.items()}, target_config())


def test_a_dflash_head_on_a_gemma4_target_embeds_as_hugging_face_does(tmp_path):
    """z-lab DFlash heads for Gemma 4 embed their block with the target's `embed_tokens`,
    which in Hugging Face is Gemma's scaled word embedding (x sqrt(H))."""
    import dflash_synth as S
    from converters import dflash as dflash_conv

    model, tcfg = target()
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(tcfg))
    w = S.network_weights(np.random.default_rng(0), 2, 2)
    src = S.save_checkpoint(tmp_path / "src", S.zlab_config(2, [1, 3], 6, block=8, mask=4), w)
    d = load_drafter(dflash_conv.convert(src, tmp_path / "head", tmp_path / "t"), model)
    d.bind(model, None)
    taps = S.target_taps(model, PROMPT, d.taps)
    d.prefill(PROMPT, {k: mx.array(v.astype(np.float32)) for k, v in taps.items()})
    E = np.array(model.model.embed_tokens.weight, np.float64)
    ref = S.Reference(w, layers=2, windows=[None, None], causal=[False, False], block=8, mask=4)
    want = ref.dflash_logits(S.concat_taps(taps, d.taps), 20, E * H ** 0.5, E)
    np.testing.assert_allclose(np.array(d.logits(d.hidden(20)[1:])), want, atol=1e-3, rtol=1e-3)
    got, _ = spec_run(model, d, PROMPT, 20, 7)
    assert got == greedy(model, PROMPT, 20)
