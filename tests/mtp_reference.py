"""An independent NumPy (float64) MTP forward, read straight from the HF tensors.

Written from the families' published forward passes (vLLM's `*_mtp.py`), sharing
no code with mlx_spec: zero-centred norms are applied as `x * (1 + w)` on the
raw offsets, DeepSeek's MLA uses the unsplit `kv_b_proj`, experts run one by
one. `Reference(folder).proposals(hidden, seq, k)` is the greedy chain.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import mtp_checkpoints as ckpts


def rms(x, w, eps, offset=False):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y * ((1.0 + w) if offset else w)


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x, axis=-1):
    x = x - x.max(axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis, keepdims=True)


def rope(x, pos, dims, base, traditional):
    """Rotate the first `dims` features of x [T, heads, d] by position."""
    inv = base ** (-np.arange(0, dims, 2) / dims)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if traditional:  # interleaved pairs (2i, 2i+1)
        a, b = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2], out[..., 1:dims:2] = a * cos - b * sin, a * sin + b * cos
    else:  # halves
        h = dims // 2
        a, b = x[..., :h], x[..., h:dims]
        out[..., :h], out[..., h:dims] = a * cos - b * sin, a * sin + b * cos
    return out


def attend(q, k, v, scale):
    """Causal attention; q [T, nh, d], k [T, nkv, d], v [T, nkv, dv] -> [T, nh * dv]."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    T = q.shape[0]
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    return np.einsum("hqk,khd->qhd", softmax(s), v).reshape(T, -1)


def mlp(W, p, x):
    return (silu(x @ W[p + "gate_proj.weight"].T) * (x @ W[p + "up_proj.weight"].T)) @ W[p + "down_proj.weight"].T


def sigmoid_moe(W, t, x):
    """DeepSeek/GLM router (noaux_tc, one group): sigmoid scores, biased top-k choice."""
    scores = sigmoid(x @ W["mlp.gate.weight"].T)
    pick = np.argsort(-(scores + W["mlp.gate.e_score_correction_bias"]), axis=-1)[:, : t["num_experts_per_tok"]]
    w = np.take_along_axis(scores, pick, -1)
    if t["norm_topk_prob"] and pick.shape[1] > 1:
        w = w / w.sum(-1, keepdims=True)
    w = w * t["routed_scaling_factor"]
    y = np.zeros_like(x)
    for i in range(x.shape[0]):
        for j, e in enumerate(pick[i]):
            y[i] += w[i, j] * mlp(W, f"mlp.experts.{e}.", x[i : i + 1])[0]
    return y + mlp(W, "mlp.shared_experts.", x)


def softmax_moe(W, t, x):
    """Qwen3-Next router: softmax over experts, top-k, and a sigmoid-gated shared expert."""
    probs = softmax(x @ W["mlp.gate.weight"].T)
    pick = np.argsort(-probs, axis=-1)[:, : t["num_experts_per_tok"]]
    w = np.take_along_axis(probs, pick, -1)
    if t["norm_topk_prob"]:
        w = w / w.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    for i in range(x.shape[0]):
        for j, e in enumerate(pick[i]):
            y[i] += w[i, j] * mlp(W, f"mlp.experts.{e}.", x[i : i + 1])[0]
    return y + sigmoid(x @ W["mlp.shared_expert_gate.weight"].T) * mlp(W, "mlp.shared_expert.", x)


def ffn(W, t, x):
    if "mlp.shared_expert_gate.weight" in W:
        return softmax_moe(W, t, x)
    return sigmoid_moe(W, t, x) if "mlp.gate.weight" in W else mlp(W, "mlp.", x)


def qwen3_5_block(W, t, x, pos):
    T, nh, nkv, d, eps = x.shape[0], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"], t["rms_norm_eps"]
    rp = t.get("rope_parameters") or t  # Qwen3-Next keeps rope_theta / partial_rotary_factor at the top
    h = rms(x, W["input_layernorm.weight"], eps, offset=True)
    qg = (h @ W["self_attn.q_proj.weight"].T).reshape(T, nh, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    k = (h @ W["self_attn.k_proj.weight"].T).reshape(T, nkv, d)
    v = (h @ W["self_attn.v_proj.weight"].T).reshape(T, nkv, d)
    q, k = rms(q, W["self_attn.q_norm.weight"], eps, True), rms(k, W["self_attn.k_norm.weight"], eps, True)
    rd = int(d * rp["partial_rotary_factor"])
    q, k = rope(q, pos, rd, rp["rope_theta"], False), rope(k, pos, rd, rp["rope_theta"], False)
    a = attend(q, k, v, d ** -0.5) * sigmoid(gate.reshape(T, -1))
    x = x + a @ W["self_attn.o_proj.weight"].T
    return x + ffn(W, t, rms(x, W["post_attention_layernorm.weight"], eps, offset=True))


def deepseek_v3_block(W, t, x, pos, lora_eps=1e-6):
    """MLA + MoE. DeepSeek-V3/V3.2 and GLM-5 norm the LoRA latents with eps 1e-6, GLM-4.7-Flash
    with rms_norm_eps. DSA's indexer picks keys only past index_topk: dense here."""
    T, nh, eps = x.shape[0], t["num_attention_heads"], t["rms_norm_eps"]
    nope, rd, vd, kvl = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"], t["kv_lora_rank"]
    assert T <= t.get("index_topk", T), "the reference has no sparse DSA selection"
    h = rms(x, W["input_layernorm.weight"], eps)
    q = rms(h @ W["self_attn.q_a_proj.weight"].T, W["self_attn.q_a_layernorm.weight"], lora_eps)
    q = (q @ W["self_attn.q_b_proj.weight"].T).reshape(T, nh, nope + rd)
    kv = h @ W["self_attn.kv_a_proj_with_mqa.weight"].T
    latent = rms(kv[:, :kvl], W["self_attn.kv_a_layernorm.weight"], lora_eps)
    k_pe = rope(kv[:, None, kvl:], pos, rd, t["rope_theta"], True)  # one rope key shared by heads
    kvb = (latent @ W["self_attn.kv_b_proj.weight"].T).reshape(T, nh, nope + vd)
    q = np.concatenate([q[..., :nope], rope(q[..., nope:], pos, rd, t["rope_theta"], True)], -1)
    k = np.concatenate([kvb[..., :nope], np.repeat(k_pe, nh, 1)], -1)
    a = attend(q, k, kvb[..., nope:], (nope + rd) ** -0.5)
    x = x + a @ W["self_attn.o_proj.weight"].T
    return x + ffn(W, t, rms(x, W["post_attention_layernorm.weight"], eps))


def plain_block(W, t, x, pos, rope_dims, qk_norm):
    """GQA attention with q/k/v biases (GLM, MiMo/Qwen2) and a (MoE) MLP."""
    T, nh, nkv, eps = x.shape[0], t["num_attention_heads"], t["num_key_value_heads"], t["rms_norm_eps"]
    d = t.get("head_dim") or t["hidden_size"] // nh
    h = rms(x, W["input_layernorm.weight"], eps)

    def proj(name, heads):
        y = h @ W[f"self_attn.{name}.weight"].T + W.get(f"self_attn.{name}.bias", 0.0)
        return y.reshape(T, heads, d)

    q, k, v = proj("q_proj", nh), proj("k_proj", nkv), proj("v_proj", nkv)
    if qk_norm:
        q, k = rms(q, W["self_attn.q_norm.weight"], eps), rms(k, W["self_attn.k_norm.weight"], eps)
    q, k = rope(q, pos, rope_dims, t["rope_theta"], False), rope(k, pos, rope_dims, t["rope_theta"], False)
    x = x + attend(q, k, v, d ** -0.5) @ W["self_attn.o_proj.weight"].T
    return x + ffn(W, t, rms(x, W["post_attention_layernorm.weight"], eps))


def relu2(x):
    return np.maximum(x, 0.0) ** 2


def nemotron_block(W, t, x, p):
    """One Nemotron-H block `x + mixer(norm(x))`: attention without RoPE ("*") or the
    ReLU² MoE ("E": sigmoid router with correction bias, one shared expert)."""
    h = rms(x, W[p + "norm.weight"], t["layer_norm_epsilon"])
    m = p + "mixer."
    if m + "q_proj.weight" in W:
        T, nh, nkv, d = x.shape[0], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
        q, k, v = ((h @ W[m + f"{n}_proj.weight"].T).reshape(T, heads, d)
                   for n, heads in (("q", nh), ("k", nkv), ("v", nkv)))
        return x + attend(q, k, v, d ** -0.5) @ W[m + "o_proj.weight"].T
    scores = sigmoid(h @ W[m + "gate.weight"].T)
    pick = np.argsort(-(scores + W[m + "gate.e_score_correction_bias"]), -1)[:, : t["num_experts_per_tok"]]
    w = np.take_along_axis(scores, pick, -1)
    w = w / w.sum(-1, keepdims=True) * t["routed_scaling_factor"]
    y = np.zeros_like(x)
    for i in range(x.shape[0]):
        for j, e in enumerate(pick[i]):
            up = relu2(h[i] @ W[m + f"experts.{e}.up_proj.weight"].T)
            y[i] += w[i, j] * (up @ W[m + f"experts.{e}.down_proj.weight"].T)
    shared = relu2(h @ W[m + "shared_experts.up_proj.weight"].T) @ W[m + "shared_experts.down_proj.weight"].T
    return x + y + shared


class Reference:
    """The MTP module of a checkpoint written by `mtp_checkpoints.write`."""

    def __init__(self, folder, family: str):
        self.family = family
        self.t = ckpts.text(json.loads((Path(folder) / "config.json").read_text()))
        P = ckpts.main_params(folder)
        embed = P.get("model.language_model.embed_tokens.weight", P.get("model.embed_tokens.weight"))
        embed = P.get("backbone.embeddings.weight", embed)  # Nemotron-H
        head = P["lm_head.weight"]
        pre = {"qwen3_5": "mtp.", "qwen3_next": "mtp.", "mimo": "model.mtp_layers.0.", "nemotron_h": "mtp."}.get(
            family) or f"model.layers.{self.t['num_hidden_layers']}."
        W = {k[len(pre):]: v for k, v in P.items() if k.startswith(pre)}
        if family in ckpts.QWEN:
            self.enorm, self.hnorm = W["pre_fc_norm_embedding.weight"], W["pre_fc_norm_hidden.weight"]
            self.proj, self.norm = W["fc.weight"], W["norm.weight"]
            self.block = {k[len("layers.0."):]: v for k, v in W.items() if k.startswith("layers.0.")}
        elif family == "nemotron_h":
            self.enorm, self.hnorm, self.proj = W["layers.0.enorm.weight"], W["layers.0.hnorm.weight"], W["layers.0.eh_proj.weight"]
            self.norm, self.block = W["layers.1.final_layernorm.weight"], W
        elif family == "mimo":
            self.enorm, self.hnorm = W["token_layernorm.weight"], W["hidden_layernorm.weight"]
            self.proj, self.norm, self.block = W["input_proj.weight"], W["final_layernorm.weight"], W
        else:
            self.enorm, self.hnorm, self.proj = W["enorm.weight"], W["hnorm.weight"], W["eh_proj.weight"]
            self.norm, self.block = W["shared_head.norm.weight"], W
            embed = W.get("embed_tokens.weight", embed)  # own copies when shipped (DeepSeek-V3)
            head = W.get("shared_head.head.weight", head)
        self.embed, self.head = embed, head

    def _block(self, u, pos):
        t, f = self.t, self.family
        if f == "nemotron_h":
            for i in range(len(t["mtp_hybrid_override_pattern"])):
                u = nemotron_block(self.block, t, u, f"layers.{i}.")
            return u
        if f in ckpts.QWEN:
            return qwen3_5_block(self.block, t, u, pos)  # the same gated attention layer
        if f in ckpts.MLA:
            return deepseek_v3_block(self.block, t, u, pos,
                                     t["rms_norm_eps"] if f == "glm4_moe_lite" else 1e-6)
        d = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
        dims = int(d * t.get("partial_rotary_factor", 1.0))
        return plain_block(self.block, t, u, pos, dims, qk_norm=t.get("use_qk_norm", False))

    def forward(self, hidden, tokens):
        """hidden [T, H] at positions 0..T-1, tokens [T] = x_{1..T}: (logits, o, g)."""
        hidden, tokens = np.asarray(hidden, np.float64), np.asarray(tokens)
        eps, qwen = self.t.get("rms_norm_eps", self.t.get("layer_norm_epsilon")), self.family in ckpts.QWEN
        e = self.embed[tokens]
        if not qwen and self.family != "nemotron_h":  # Nemotron-H masks no position
            e = e.copy()
            e[0] = 0.0  # position 0 carries no token embedding (DeepSeek, GLM, MiMo)
        a, b = rms(e, self.enorm, eps, qwen), rms(hidden, self.hnorm, eps, qwen)
        u = np.concatenate([b, a] if self.family == "mimo" else [a, b], -1) @ self.proj.T
        o = self._block(u, np.arange(len(tokens), dtype=np.float64))
        g = rms(o, self.norm, eps, qwen)
        return g @ self.head.T, o, g

    def proposals(self, hidden, seq, k: int, feed: str = "final_norm") -> list[int]:
        """Greedy chain of k tokens after seq (x_0..x_m), given the target's h_0..h_{m-1}."""
        hs, ts, out = list(np.asarray(hidden, np.float64)), list(seq[1:]), []
        for _ in range(k):
            logits, o, g = self.forward(np.stack(hs), ts)
            out.append(int(np.argmax(logits[-1])))
            hs.append(g[-1] if feed == "final_norm" else o[-1])
            ts.append(out[-1])
        return out
