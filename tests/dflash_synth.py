"""Test helpers for DFlash/DSpark: tiny targets, synthetic checkpoints, a NumPy reference.

* `qwen3_target` / `muse_target`: tiny random mlx-lm targets (classes `qwen3`,
  `muse_glimmer`); `write_target` saves one as a folder (config.json + safetensors).
* `zlab_checkpoint`, `muse_checkpoint`, `dspark_checkpoint`: write checkpoints in
  the real layouts (z-lab `dflash/model.py`, Meta's Muse-Glimmer-30B-assistant, DeepSpec
  `Qwen3DSparkModel`) with random weights.
* `Reference`: an independent float64 NumPy implementation of the block forward,
  DFlash logits and DSpark's Markov chain / confidences, recomputed from scratch
  from ALL committed taps (no cache), so it also checks the drafter's incremental
  context cache and its sliding-window trimming.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import muse_glimmer, qwen3

from mlx_spec.taps import Taps

V, H, MASK = 96, 64, 95


def qwen3_config(layers=4, vocab=V, hidden=H):
    return dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=hidden,
                num_hidden_layers=layers, intermediate_size=2 * hidden, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, vocab_size=vocab,
                max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=10000.0)


def muse_config(layers=4, window=8, vocab=V, hidden=H):
    return dict(model_type="muse_glimmer", hidden_size=hidden, num_hidden_layers=layers,
                intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=vocab, sliding_window=window, rope_theta=10000.0,
                max_position_embeddings=4096, output_multiplier=0.25, final_logit_softcapping=20.0)


def _finish(model, config, sharpen, mask_zero):
    emb = model.model.embed_tokens
    if mask_zero and config["vocab_size"] > MASK:  # the mask row carries no token direction
        emb.weight = emb.weight * (mx.arange(config["vocab_size"]) != MASK)[:, None]
    model.lm_head.weight = model.lm_head.weight * sharpen
    mx.eval(model.parameters())
    return model, config


def qwen3_target(seed=0, sharpen=8.0, mask_zero=True, **kw):
    mx.random.seed(seed)
    config = qwen3_config(**kw)
    return _finish(qwen3.Model(qwen3.ModelArgs.from_dict(config)), config, sharpen, mask_zero)


def muse_target(seed=0, sharpen=16.0, mask_zero=True, **kw):
    mx.random.seed(seed)
    config = muse_config(**kw)
    return _finish(muse_glimmer.Model(muse_glimmer.ModelArgs.from_dict(config)), config,
                   sharpen, mask_zero)


def echo_target(model, shift=0, gain=6.0, mix=0.5):
    """Make the target mostly emit its input token shifted by `shift` (a predictable chain).

    lm_head row v = E[v - shift] (scaled), and the layers' residual writes are
    scaled by `mix`, so argmax usually is t + shift and sometimes is not.
    """
    E = model.model.embed_tokens.weight
    Vt = E.shape[0]
    model.lm_head.weight = E[(mx.arange(Vt) - shift) % Vt] * gain
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * mix
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * mix
    mx.eval(model.parameters())
    return model


def write_target(folder: Path, model, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _rnd(rng, *shape, scale=None):
    scale = 1 / np.sqrt(shape[-1]) if scale is None else scale
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def network_weights(rng, layers, n_taps, hidden=H, heads=4, kv_heads=2, head_dim=16, inter=2 * H):
    """Random DFlash network tensors with the z-lab names."""
    q, kv = heads * head_dim, kv_heads * head_dim
    w = {"fc.weight": _rnd(rng, hidden, n_taps * hidden),
         "hidden_norm.weight": 1 + _rnd(rng, hidden, scale=0.1),
         "norm.weight": 1 + _rnd(rng, hidden, scale=0.1)}
    for i in range(layers):
        p = f"layers.{i}"
        w.update({f"{p}.self_attn.q_proj.weight": _rnd(rng, q, hidden),
                  f"{p}.self_attn.k_proj.weight": _rnd(rng, kv, hidden),
                  f"{p}.self_attn.v_proj.weight": _rnd(rng, kv, hidden),
                  f"{p}.self_attn.o_proj.weight": _rnd(rng, hidden, q),
                  f"{p}.self_attn.q_norm.weight": 1 + _rnd(rng, head_dim, scale=0.1),
                  f"{p}.self_attn.k_norm.weight": 1 + _rnd(rng, head_dim, scale=0.1),
                  f"{p}.mlp.gate_proj.weight": _rnd(rng, inter, hidden),
                  f"{p}.mlp.up_proj.weight": _rnd(rng, inter, hidden),
                  f"{p}.mlp.down_proj.weight": _rnd(rng, hidden, inter),
                  f"{p}.input_layernorm.weight": 1 + _rnd(rng, hidden, scale=0.1),
                  f"{p}.post_attention_layernorm.weight": 1 + _rnd(rng, hidden, scale=0.1)})
    return w


def copy_anchor(w: dict, layers: int, context_weight=1e-3, heads=4, kv_heads=2, head_dim=16) -> dict:
    """Weights that make every block row repeat the anchor: near-uniform attention,
    identity values/outputs, no MLP, and a faint context (tiny hidden_norm)."""
    w = dict(w)
    w["hidden_norm.weight"] = np.full_like(w["hidden_norm.weight"], context_weight)
    w["norm.weight"] = np.ones_like(w["norm.weight"])
    for i in range(layers):
        for n in ("input_layernorm", "post_attention_layernorm"):
            w[f"layers.{i}.{n}.weight"] = np.ones_like(w[f"layers.{i}.{n}.weight"])
        p = f"layers.{i}.self_attn"
        w[f"{p}.q_proj.weight"] = w[f"{p}.q_proj.weight"] * 0.05
        w[f"{p}.v_proj.weight"] = np.eye(kv_heads * head_dim, H, dtype=np.float32)
        o = np.zeros_like(w[f"{p}.o_proj.weight"])
        for j in range(kv_heads):  # kv head j is read by query heads j*rep ..: route one back
            for c in range(head_dim):
                o[j * head_dim + c, j * (heads // kv_heads) * head_dim + c] = 4.0
        w[f"{p}.o_proj.weight"] = o
        w[f"layers.{i}.mlp.down_proj.weight"] = w[f"layers.{i}.mlp.down_proj.weight"] * 0
    return w


def save_checkpoint(folder: Path, config: dict, weights: dict, dtype=mx.float32) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {k: mx.array(v).astype(dtype) for k, v in weights.items()},
                        metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def head_dims(layers, hidden=H):
    return dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6)


def zlab_config(layers, ids, n_target, block=16, mask=MASK, **extra):
    """A z-lab DFlash v1 config.json (ids nested under dflash_config)."""
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, **head_dims(layers),
            "block_size": block, "num_target_layers": n_target, "vocab_size": V,
            "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "dflash_config": {"mask_token_id": mask, "target_layer_ids": ids},
            "layer_types": ["full_attention"] * layers, **extra}


def muse_head_config(layers, ids, window, block=16, mask=MASK):
    """Meta's assistant config.json: top-level ids/mask, no vocab_size, no is_causal."""
    return {"architectures": ["MuseGlimmerAssistantModel"], "model_type": "muse_glimmer_assistant",
            "block_size": block, "mask_token_id": mask, "target_layer_ids": ids, **head_dims(layers),
            "layer_types": ["sliding_attention"] * layers, "sliding_window": window,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "hidden_act": "silu"}


def to_muse_names(w: dict) -> dict:
    names = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    return {names.get(k, k): v for k, v in w.items()}


def dspark_config(target_cfg, layers, ids, block=7, mask=MASK, rank=16, **extra):
    """A DeepSpec DSpark config: a copy of the target's config with draft overrides."""
    return {**target_cfg, "architectures": ["Qwen3DSparkModel"], **head_dims(layers),
            "num_target_layers": target_cfg["num_hidden_layers"], "block_size": block,
            "layer_types": ["full_attention"] * layers, "mask_token_id": mask,
            "target_layer_ids": ids, "num_anchors": 512, "enable_confidence_head": True,
            "confidence_head_with_markov": rank > 0, "markov_rank": rank,
            "markov_head_type": "vanilla", "tie_word_embeddings": False, **extra}


def spark_weights(rng, target, rank, conf=True, with_markov=True):
    """DSpark extras; embed_tokens / lm_head byte-identical to the target's."""
    w = {"embed_tokens.weight": np.array(target.model.embed_tokens.weight),
         "lm_head.weight": np.array(target.lm_head.weight)}
    if rank:
        w["markov_head.markov_w1.weight"] = _rnd(rng, V, rank, scale=1.0)
        w["markov_head.markov_w2.weight"] = _rnd(rng, V, rank, scale=1 / np.sqrt(rank))
    if conf:
        w["confidence_head.proj.weight"] = _rnd(rng, 1, H + (rank if with_markov else 0))
        w["confidence_head.proj.bias"] = np.array([1.5], np.float32)
    return w


def target_taps(model, tokens, ids) -> dict:
    """{tap: [T, H]} for `tokens`, from one plain forward of the target."""
    with Taps(model, ids) as taps:
        mx.eval(model(mx.array(tokens)[None]))
        return {k: np.array(v, dtype=np.float64) for k, v in taps.read().items()}


class Reference:
    """Float64 NumPy DFlash/DSpark forward from a weight dict with the z-lab names."""

    def __init__(self, w: dict, *, layers, windows, causal, block, mask=MASK, theta=10000.0,
                 eps=1e-6, heads=4, kv_heads=2, head_dim=16):
        self.w = {k: np.asarray(v, np.float64) for k, v in w.items()}
        self.block, self.mask = block, mask
        self.layers, self.windows, self.causal = layers, windows, causal
        self.theta, self.eps, self.nh, self.nkv, self.d = theta, eps, heads, kv_heads, head_dim

    def rms(self, x, w, eps=None):
        eps = self.eps if eps is None else eps
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(self, x, pos):  # x [T, n, d], rotate-half convention
        half = self.d // 2
        ang = pos[:, None] * self.theta ** (-np.arange(half) * 2.0 / self.d)
        cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def hidden(self, taps_cat, x):
        """taps_cat [P, k*H_t] for positions 0..P-1, x [B, H] block embeddings -> h [B, H]."""
        w, P, B = self.w, taps_cat.shape[0], x.shape[0]
        C = self.rms(taps_cat @ w["fc.weight"].T, w["hidden_norm.weight"])
        qpos, kpos = np.arange(P, P + B), np.arange(P + B)
        for i in range(self.layers):
            p = f"layers.{i}."
            u = self.rms(x, w[p + "input_layernorm.weight"])
            conv = p + "attention_conv.base_kernel" in w  # DFlash2
            if conv:
                u, finish = self.conv(p + "attention_conv.", u)
            q = self.rms((u @ w[p + "self_attn.q_proj.weight"].T).reshape(B, self.nh, self.d),
                         w[p + "self_attn.q_norm.weight"])
            both = np.concatenate([C, u])
            k = self.rms((both @ w[p + "self_attn.k_proj.weight"].T).reshape(P + B, self.nkv, self.d),
                         w[p + "self_attn.k_norm.weight"])
            v = (both @ w[p + "self_attn.v_proj.weight"].T).reshape(P + B, self.nkv, self.d)
            q, k = self.rope(q, qpos), self.rope(k, kpos)
            seen = np.ones((B, P + B), bool)
            dq = qpos[:, None] - kpos[None]
            if self.causal[i]:
                seen &= dq >= 0
            if self.windows[i]:
                seen &= dq < self.windows[i]
                if not self.causal[i]:
                    seen &= -dq < self.windows[i]
            out = np.zeros((B, self.nh, self.d))
            for h in range(self.nh):
                kv = h // (self.nh // self.nkv)
                s = q[:, h] @ k[:, kv].T / np.sqrt(self.d)
                s = np.where(seen, s, -np.inf)
                a = np.exp(s - s.max(-1, keepdims=True))
                out[:, h] = (a / a.sum(-1, keepdims=True)) @ v[:, kv]
            a = out.reshape(B, -1) @ w[p + "self_attn.o_proj.weight"].T
            x = x + (finish(a) if conv else a)
            m = self.rms(x, w[p + "post_attention_layernorm.weight"])
            if conv:
                m, finish = self.conv(p + "mlp_conv.", m)
            g, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
            f = (g / (1 + np.exp(-g)) * up) @ w[p + "mlp.down_proj.weight"].T
            x = x + (finish(f) if conv else f)
        return self.rms(x, w["norm.weight"])

    def conv(self, p, u):
        """DFlash2's grouped dynamic convolution around a sublayer: (conv'd input, finish)."""
        base, proj = self.w[p + "base_kernel"], self.w[p + "kernel_projection.weight"]
        B, H, taps = u.shape[0], u.shape[1], base.shape[1]
        G = proj.shape[0] // (2 * taps)
        coef = (u @ proj.T).reshape(B, 2, taps, G)

        def apply(h, c, b):  # out[t] = sum_{o <= t} (b[o] + c[t, o] per group) * h[t - o]
            out = np.zeros_like(h)
            for t in range(B):
                for o in range(min(taps, t + 1)):
                    out[t] += (b[o] + np.repeat(c[t, o], H // G)) * h[t - o]
            return out

        return apply(u, coef[:, 0], base[0]), lambda a: apply(a, coef[:, 1], base[1])

    def dflash2_chain(self, taps_cat, anchor, embed, head, k, top_k, multiplier=1.0, softcap=None):
        """DFlash2 greedy path: (tokens [k], candidate sets [k, top_k])."""
        ids = [anchor] + [self.mask] * (self.block - 1)
        h = self.hidden(taps_cat, embed[ids])[1:k + 1]
        logits = h @ head.T * multiplier
        if softcap:
            logits = np.tanh(logits / softcap) * softcap
        w, prev, toks, sets = self.w, anchor, [], []
        hp = h @ w["candidate_selector.hidden_projection.weight"].T
        for j in range(k):
            c = np.argsort(-logits[j], kind="stable")[:top_k]
            s = logits[j][c] + (w["candidate_selector.predecessor_codebook"][prev] * hp[j]) \
                @ w["candidate_selector.successor_codebook"][c].T
            prev = int(c[np.argmax(s)])
            toks.append(prev)
            sets.append(sorted(c.tolist()))
        return toks, sets

    def dflash_logits(self, taps_cat, anchor, embed, head, multiplier=1.0, softcap=None):
        """DFlash: logits [B-1, V] of the mask rows for `anchor` (raw embedding rows)."""
        B = self.block
        ids = [anchor] + [self.mask] * (B - 1)
        logits = self.hidden(taps_cat, embed[ids])[1:] @ head.T * multiplier
        return np.tanh(logits / softcap) * softcap if softcap else logits

    def dspark_chain(self, taps_cat, anchor, embed, head, k, d2t=None, skip=0):
        """DSpark greedy: (tokens [k], step logits [k, V_d], confidences [k]).

        `d2t` [V_d]: target ids of a reduced draft vocabulary (`head`, W2 over V_d; W1 over
        the target's); `skip` 1: block row 0 holds the anchor only (speculators' slots)."""
        ids = [anchor] + [self.mask] * (self.block - 1)
        h = self.hidden(taps_cat, embed[ids])[skip:skip + k]
        U, w = h @ head.T, self.w
        prev, toks, rows, confs = anchor, [], [], []
        for j in range(k):
            e = w["markov_head.markov_w1.weight"][prev]
            s = U[j] + w["markov_head.markov_w2.weight"] @ e
            c = np.concatenate([h[j], e]) @ w["confidence_head.proj.weight"][0] + w["confidence_head.proj.bias"][0]
            t = int(np.argmax(s))
            toks.append(t if d2t is None else int(d2t[t]))
            rows.append(s)
            confs.append(1 / (1 + np.exp(-c)))
            prev = toks[-1]
        return toks, np.array(rows), np.array(confs)


def concat_taps(taps: dict, ids) -> np.ndarray:
    return np.concatenate([taps[i] for i in ids], -1)
