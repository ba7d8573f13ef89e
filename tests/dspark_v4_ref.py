"""Test helpers for DeepSeek-V4 DSpark: synthetic `mtp.*` stages and a float64 NumPy reference.

* `stage_tensors(rng, cfg, variant, ...)`: the stages in DeepSeek checkpoint naming
  (shapes from DeepSeek's V4 reference code and mlx-lm's `deepseek_v41.py`),
  V4-Flash-0731 ("0731") or V4.1 ("v41") names.
* `Reference`: the stage forward written from the DSpark paper (DeepSpec's
  `DSpark_paper.pdf`, section 3), DeepSeek's V4 reference `DSparkBlock` and the V4
  block (mHC + attention with sinks + MoE) in NumPy, from the native tensors,
  recomputed from scratch from all committed taps (no cache, no MLX).

The two models differ in five places (`RULES`; sources in docs/dflash.md):

| rule   | V4-Flash-0731 (vLLM dspark.py, 0731 reference ports) | V4.1 (reference model.py dba1be0) |
|--------|------------------------------------------------------|-----------------------------------|
| taps   | streams leaving layer l (`h = layer(h)`, then mean)  | streams entering layer l          |
| mhc    | each sublayer collapses with its own pre             | pre carried one sublayer forward  |
| qnorm  | q /= rms(q) per head after wq_b, before RoPE         | none                              |
| kv_fp8 | non-RoPE dims only, blocks of 64                     | the whole vector, blocks of 32    |
| head   | hc_head(streams)                                     | collapse with the last stage's pre|
"""

from __future__ import annotations

import numpy as np


def _rnd(rng, *shape, scale=None):
    scale = 1.0 / np.sqrt(shape[-1]) if scale is None else scale
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def stage_tensors(rng, cfg: dict, variant: str, n_taps: int, rank: int, stages: int = 3,
                  experts: int | None = None) -> dict:
    """Random `mtp.{s}.*` tensors for a tiny config (float32, no FP8/FP4 packing)."""
    H, hc, nh, hd = cfg["hidden_size"], cfg["hc_mult"], cfg["num_attention_heads"], cfg["head_dim"]
    ql, g, ol, inter = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"], cfg["moe_intermediate_size"]
    E, V, mix = experts or cfg["n_routed_experts"], cfg["vocab_size"], (2 + hc) * hc
    w = {}
    for s in range(stages):
        p = f"mtp.{s}."
        w.update({
            p + "attn.wq_a.weight": _rnd(rng, ql, H), p + "attn.q_norm.weight": 1 + _rnd(rng, ql, scale=0.1),
            p + "attn.wq_b.weight": _rnd(rng, nh * hd, ql), p + "attn.wkv.weight": _rnd(rng, hd, H),
            p + "attn.kv_norm.weight": 1 + _rnd(rng, hd, scale=0.1),
            p + "attn.wo_a.weight": _rnd(rng, g * ol, nh * hd // g), p + "attn.wo_b.weight": _rnd(rng, H, g * ol),
            p + "attn.attn_sink": _rnd(rng, nh, scale=1.0),
            p + "attn_norm.weight": 1 + _rnd(rng, H, scale=0.1), p + "ffn_norm.weight": 1 + _rnd(rng, H, scale=0.1),
            p + "ffn.gate.weight": _rnd(rng, E, H, scale=0.3), p + "ffn.gate.bias": _rnd(rng, E, scale=0.1),
            p + "ffn.shared_experts.w1.weight": _rnd(rng, inter, H),
            p + "ffn.shared_experts.w3.weight": _rnd(rng, inter, H),
            p + "ffn.shared_experts.w2.weight": _rnd(rng, H, inter),
        })
        for e in range(E):
            w[p + f"ffn.experts.{e}.w1.weight"] = _rnd(rng, inter, H)
            w[p + f"ffn.experts.{e}.w3.weight"] = _rnd(rng, inter, H)
            w[p + f"ffn.experts.{e}.w2.weight"] = _rnd(rng, H, inter)
        for which in ("attn", "ffn"):
            w[p + f"hc_{which}_fn"] = _rnd(rng, mix, hc * H, scale=0.05)
            w[p + f"hc_{which}_base"] = _rnd(rng, mix, scale=0.5)
            w[p + f"hc_{which}_scale"] = 1 + _rnd(rng, 3, scale=0.2)
    w["mtp.0.main_proj.weight"] = _rnd(rng, H, n_taps * H)
    w["mtp.0.main_norm.weight"] = 1 + _rnd(rng, H, scale=0.1)
    last = f"mtp.{stages - 1}."
    w[last + "norm.weight"] = 1 + _rnd(rng, H, scale=0.1)
    w1, w2 = ("markov_w1", "markov_w2") if variant == "0731" else ("embed", "head")
    w[last + f"markov_head.{w1}.weight"] = _rnd(rng, V, rank, scale=1.0)
    w[last + f"markov_head.{w2}.weight"] = _rnd(rng, V, rank, scale=0.5)
    w[last + "confidence_head.proj.weight"] = _rnd(rng, 1, H + rank, scale=0.3)
    if variant == "0731":
        w[last + "hc_head_fn"] = _rnd(rng, hc, hc * H, scale=0.05)
        w[last + "hc_head_base"] = _rnd(rng, hc, scale=0.5)
        w[last + "hc_head_scale"] = 1 + _rnd(rng, 1, scale=0.2)
    return w


def fp8_round(x: np.ndarray, block: int = 32) -> np.ndarray:
    """Fake FP8 e4m3 with a power-of-two scale per `block` values (round half to even)."""
    shape = x.shape
    b = x.reshape(*shape[:-1], -1, block)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), 1e-4)
    scale = 2.0 ** np.ceil(np.log2(amax / 448.0))
    v = np.clip(b / scale, -448, 448)
    mag = np.abs(v)
    e = np.floor(np.log2(np.maximum(mag, 2.0 ** -6)))  # subnormals share the 2^-6 binade's step
    step = 2.0 ** (e - 3)
    return (np.round(v / step) * step * scale).reshape(shape)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


RULES = {
    "0731": dict(taps="output", mhc="own", qnorm=True, kv_fp8="nope64", head="hc_head"),
    "v41": dict(taps="input", mhc="carried", qnorm=False, kv_fp8="all32", head="pre"),
}


class Reference:
    """Float64 DSpark-in-V4 forward from native tensors `w` (`mtp.{s}.*`) and a config dict.

    The variant follows the Markov head's names; `flip` overrides single rules (to show
    that a test would see each one)."""

    def __init__(self, w: dict, cfg: dict, layer_ids, block: int, noise: int, stages: int = 3,
                 **flip):
        self.w = {k: np.asarray(v, np.float64) for k, v in w.items()}
        self.c, self.ids, self.B, self.noise, self.S = cfg, list(layer_ids), block, noise, stages
        self.eps = cfg["rms_norm_eps"]
        head = f"mtp.{stages - 1}.markov_head."
        self.variant = "v41" if head + "embed.weight" in self.w else "0731"
        names = ("embed", "head") if self.variant == "v41" else ("markov_w1", "markov_w2")
        self.m1, self.m2 = (self.w[f"{head}{n}.weight"] for n in names)
        self.rule = {**RULES[self.variant], **flip}

    def taps(self) -> tuple:
        """The target hidden states read, as mlx-spec tap ids (k: leaving layer k)."""
        if self.rule["taps"] == "output":
            return tuple(self.ids)
        return tuple("embed" if l == 0 else l - 1 for l in self.ids)

    def rms(self, x, weight=None):
        y = x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps)
        return y if weight is None else y * weight

    def rope(self, x, pos, inverse=False):
        """Interleaved RoPE on the last `qk_rope_head_dim` dims of x [T, ..., d] at positions pos [T]."""
        rd = self.c["qk_rope_head_dim"]
        theta = self.c.get("rope_theta", 10000.0) ** (-np.arange(0, rd, 2) / rd)
        ang = np.asarray(pos, np.float64)[:, None] * theta * (-1 if inverse else 1)  # [T, rd/2]
        ang = ang.reshape(ang.shape[0], *([1] * (x.ndim - 2)), -1)
        a, b = x[..., -rd::2], x[..., -rd + 1::2]
        out = x.copy()
        out[..., -rd::2] = a * np.cos(ang) - b * np.sin(ang)
        out[..., -rd + 1::2] = a * np.sin(ang) + b * np.cos(ang)
        return out

    def hc(self, streams, p, which):
        """mHC weights of one block part: pre [T,hc], post [T,hc], comb [T,hc(from),hc(to)]."""
        hc, T = self.c["hc_mult"], streams.shape[0]
        fn, base, scale = (self.w[f"{p}hc_{which}_{n}"] for n in ("fn", "base", "scale"))
        mix = self.rms(streams.reshape(T, -1)) @ fn.T
        mix = mix * np.repeat(scale, [hc, hc, hc * hc]) + base
        pre = sigmoid(mix[:, :hc]) + self.c["hc_eps"]
        post = 2 * sigmoid(mix[:, hc:2 * hc])
        comb = mix[:, 2 * hc:].reshape(T, hc, hc)
        comb = np.exp(comb - comb.max(-1, keepdims=True))
        comb = comb / comb.sum(-1, keepdims=True) + self.c["hc_eps"]
        eps = self.c["hc_eps"]
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
        for _ in range(self.c["hc_sinkhorn_iters"] - 1):
            comb = comb / (comb.sum(-1, keepdims=True) + eps)
            comb = comb / (comb.sum(-2, keepdims=True) + eps)
        return pre, post, comb

    def kv(self, p, x, pos):
        kv = self.rope(self.rms(x @ self.w[p + "attn.wkv.weight"].T, self.w[p + "attn.kv_norm.weight"]), pos)
        if self.rule["kv_fp8"] == "none":  # mlx-vlm's V4 trunk layers keep K/V unrounded
            return kv
        if self.rule["kv_fp8"] == "all32":
            return fp8_round(kv, 32)
        rd = self.c["qk_rope_head_dim"]
        return np.concatenate([fp8_round(kv[:, :-rd], 64), kv[:, -rd:]], -1)

    def attention(self, p, x, ctx, pos):
        """DSpark attention: block rows x [B,H] see [ctx rows ; all block rows], with sinks."""
        nh, hd, g = self.c["num_attention_heads"], self.c["head_dim"], self.c["o_groups"]
        B = x.shape[0]
        q = self.rms(x @ self.w[p + "attn.wq_a.weight"].T, self.w[p + "attn.q_norm.weight"])
        q = (q @ self.w[p + "attn.wq_b.weight"].T).reshape(B, nh, hd)
        if self.rule["qnorm"]:
            q = self.rms(q)  # per head, over head_dim, no weight
        q = self.rope(q, pos)
        keys = np.concatenate([ctx, self.kv(p, x, pos)])  # [C+B, hd], K = V
        s = np.einsum("bhd,kd->bhk", q, keys) / np.sqrt(hd)
        sink = self.w[p + "attn.attn_sink"][None, :, None]
        m = np.maximum(s.max(-1, keepdims=True), sink)
        e = np.exp(s - m)
        probs = e / (e.sum(-1, keepdims=True) + np.exp(sink - m))
        out = self.rope(np.einsum("bhk,kd->bhd", probs, keys), pos, inverse=True)
        out = out.reshape(B, g, -1)
        wo_a = self.w[p + "attn.wo_a.weight"].reshape(g, -1, out.shape[-1])
        out = np.einsum("bgi,goi->bgo", out, wo_a).reshape(B, -1)
        return out @ self.w[p + "attn.wo_b.weight"].T

    def swiglu(self, x, w1, w3, w2):
        lim = self.c.get("swiglu_limit", 10.0)
        gate, up = np.minimum(x @ w1.T, lim), np.clip(x @ w3.T, -lim, lim)
        return (gate * sigmoid(gate) * up) @ w2.T

    def moe(self, p, x):
        w, k = self.w, self.c["num_experts_per_tok"]
        scores = np.sqrt(np.logaddexp(0, x @ w[p + "ffn.gate.weight"].T))  # sqrt(softplus)
        out = self.swiglu(x, *(w[p + f"ffn.shared_experts.w{i}.weight"] for i in (1, 3, 2)))
        for t in range(x.shape[0]):
            top = np.argsort(-(scores[t] + w[p + "ffn.gate.bias"]), kind="stable")[:k]
            gates = scores[t, top] / (scores[t, top].sum() + 1e-20) * self.c.get("routed_scaling_factor", 1.5)
            for e, gw in zip(top, gates):
                out[t] += gw * self.swiglu(x[t:t + 1], *(w[p + f"ffn.experts.{e}.w{i}.weight"] for i in (1, 3, 2)))[0]
        return out

    def block(self, taps_mean, anchor, embed):
        """(h [B,H] pre-norm, U-input norm(h)) for anchor at position P = len(taps_mean)."""
        P, W, hc = len(taps_mean), self.c["sliding_window"], self.c["hc_mult"]
        lo = max(0, P - W)
        m = self.rms(taps_mean[lo:] @ self.w["mtp.0.main_proj.weight"].T, self.w["mtp.0.main_norm.weight"])
        ctx_pos, pos = np.arange(lo, P), np.arange(P, P + self.B)
        streams = np.repeat(embed[[anchor] + [self.noise] * (self.B - 1)][:, None], hc, 1)
        pre_mix = np.zeros((self.B, hc))
        pre_mix[:, 0] = 1
        for s in range(self.S):
            p = f"mtp.{s}."
            own = self.rule["mhc"] == "own"
            a_pre, a_post, a_comb = self.hc(streams, p, "attn")
            mix = a_pre if own else pre_mix
            h = self.rms((mix[..., None] * streams).sum(1), self.w[p + "attn_norm.weight"])
            h = self.attention(p, h, self.kv(p, m, ctx_pos).reshape(-1, self.c["head_dim"]), pos)
            streams = a_post[..., None] * h[:, None] + np.einsum("tij,tih->tjh", a_comb, streams)
            f_pre, f_post, f_comb = self.hc(streams, p, "ffn")
            mix = f_pre if own else a_pre
            h = self.moe(p, self.rms((mix[..., None] * streams).sum(1), self.w[p + "ffn_norm.weight"]))
            streams = f_post[..., None] * h[:, None] + np.einsum("tij,tih->tjh", f_comb, streams)
            pre_mix = f_pre
        last = f"mtp.{self.S - 1}."
        if self.rule["head"] == "hc_head":  # sigmoid(mix * scale + base) + eps
            mix = self.rms(streams.reshape(self.B, -1)) @ self.w[last + "hc_head_fn"].T
            pre_mix = sigmoid(mix * self.w[last + "hc_head_scale"] + self.w[last + "hc_head_base"]) + self.c["hc_eps"]
        x = (pre_mix[..., None] * streams).sum(1)
        return x, self.rms(x, self.w[last + "norm.weight"])

    def chain(self, taps_mean, anchor, embed, head, k):
        """Greedy Markov chain: (tokens, base logits U [k,V], confidences [k])."""
        h, normed = self.block(taps_mean, anchor, embed)
        U = normed[:k] @ head.T
        conf_w = self.w[f"mtp.{self.S - 1}.confidence_head.proj.weight"][0]
        prev, toks, confs = anchor, [], []
        for j in range(k):
            e = self.m1[prev]
            toks.append(int(np.argmax(U[j] + self.m2 @ e)))
            confs.append(sigmoid(conf_w @ np.concatenate([h[j], e])))
            prev = toks[-1]
        return toks, U, np.array(confs)


FP8_KEYS = ("attn.wq_a.", "attn.wq_b.", "attn.wkv.", "attn.wo_a.", "attn.wo_b.", "shared_experts.", "main_proj.",
            "indexer.wq_b.")


def packed(w: dict, seed: int = 0, tile: int = 32) -> tuple[dict, dict]:
    """(stored, dequantized): FP8 e4m3 bytes + `tile`x`tile` ue8m0 scales for the dense stage
    weights (0731: 128, V4.1: 32; the last tile row/column may be partial), FP4 (e2m1, two
    per byte) + 1x32 ue8m0 scales for the routed experts, as in the V4 checkpoints
    (DeepSeek's V4 reference code, vLLM's V4 DSpark loader); `dequantized` holds the float
    values they encode."""
    import mlx.core as mx

    rng, stored, plain = np.random.default_rng(seed), {}, dict(w)
    for k, v in w.items():
        if not k.endswith(".weight") or v.ndim != 2:
            continue
        if ".ffn.experts." in k:
            q, s = mx.quantize(mx.array(v), group_size=32, bits=4, mode="mxfp4")
            stored[k], stored[k[:-6] + "scale"] = q.view(mx.int8), s
            plain[k] = np.array(mx.dequantize(q, s, group_size=32, bits=4, mode="mxfp4").astype(mx.float32))
        elif any(p in k for p in FP8_KEYS):
            grid = (-(-v.shape[0] // tile), -(-v.shape[1] // tile))
            tiles = rng.integers(125, 129, grid).astype(np.uint8)
            scale = np.repeat(np.repeat(2.0 ** (tiles.astype(np.float64) - 127), tile, 0), tile, 1)
            scale = scale[: v.shape[0], : v.shape[1]]
            b = mx.to_fp8(mx.array((v / scale).astype(np.float32)))
            stored[k], stored[k[:-6] + "scale"] = b, mx.array(tiles)
            plain[k] = np.array(mx.from_fp8(b, mx.float32), np.float64) * scale
    return {**w, **stored}, plain
