"""Test helpers for EAGLE heads: torch.save-style archives, synthetic checkpoints, a NumPy reference.

* `write_torch_bin` writes the zip layout torch.save uses (protocol-2 pickle
  opcodes written by hand, since torch is not installed);
* `eagle1_checkpoint` / `eagle3_checkpoint` write synthetic heads with the
  exact key names and shapes of the yuhuili EAGLE-1/EAGLE-3 checkpoints and the
  vllm-project/speculators EAGLE-3 format;
* `ref_eagle1` / `ref_eagle3` recompute a head's hidden states from scratch
  in float64 NumPy (no cache), straight from the EAGLE reference forward
  (SafeAILab/EAGLE `eagle/model/cnets1.py`, `cnets.py`).
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np

# ---------------------------------------------------------------- torch zip files


class BF16:
    """Marks a float32 array to be stored as a torch bfloat16 storage (top 16 bits)."""

    def __init__(self, array):
        self.array = np.asarray(array, np.float32)

    def bits(self) -> np.ndarray:
        return (self.array.view(np.uint32) >> 16).astype(np.uint16)


_KINDS = {np.dtype(np.float32): "FloatStorage", np.dtype(np.float16): "HalfStorage",
          np.dtype(np.int64): "LongStorage", np.dtype(np.bool_): "BoolStorage",
          np.dtype(np.int32): "IntStorage"}


class PickleWriter:
    """Protocol-2 pickle opcodes, enough for what torch.save writes for a state dict."""

    def __init__(self):
        self.out = bytearray(b"\x80\x02")  # PROTO 2

    def glob(self, module: str, name: str):
        self.out += b"c" + f"{module}\n{name}\n".encode()

    def text(self, s: str):
        b = s.encode()
        self.out += b"X" + struct.pack("<I", len(b)) + b

    def int(self, v: int):
        if 0 <= v < 256:
            self.out += b"K" + bytes([v])
        elif -(2**31) <= v < 2**31:
            self.out += b"J" + struct.pack("<i", v)
        else:
            b = v.to_bytes(9, "little", signed=True)
            self.out += b"\x8a" + bytes([len(b)]) + b

    def ints(self, values):
        self.out += b"("
        for v in values:
            self.int(v)
        self.out += b"t"  # MARK ... TUPLE

    def op(self, code: bytes):
        self.out += code

    def tensor(self, kind: str, key: str, numel: int, offset: int, size, stride):
        """_rebuild_tensor_v2(persistent storage, offset, size, stride, False, OrderedDict())."""
        self.glob("torch._utils", "_rebuild_tensor_v2")
        self.op(b"(")
        self.op(b"(")  # the storage's persistent id tuple
        self.text("storage")
        self.glob("torch", kind)
        self.text(key)
        self.text("cpu")
        self.int(numel)
        self.op(b"tQ")  # TUPLE, BINPERSID
        self.int(offset)
        self.ints(size)
        self.ints(stride)
        self.op(b"\x89")  # NEWFALSE: requires_grad
        self.glob("collections", "OrderedDict")
        self.op(b")R")  # backward hooks: OrderedDict()
        self.op(b"tR")  # TUPLE, REDUCE


def write_torch_bin(path, tensors: dict, *, byteorder: str = "little", views: dict | None = None) -> None:
    """torch.save(state_dict) layout: one storage per tensor, plus optional views.

    `views` maps extra names to (storage-owner name, offset, size, stride): a
    tensor sharing the owner's storage, as torch writes tied or sliced tensors.
    """
    w, storages, order = PickleWriter(), {}, {}
    w.glob("collections", "OrderedDict")
    w.op(b")R(")  # OrderedDict(), MARK
    for name, value in tensors.items():
        if isinstance(value, BF16):
            kind, flat = "BFloat16Storage", value.bits().ravel()
            shape = value.array.shape
        else:
            value = np.asarray(value)
            kind, flat, shape = _KINDS[value.dtype], value.ravel(), value.shape
        key = str(len(storages))
        storages[key] = flat.astype(flat.dtype.newbyteorder("<" if byteorder == "little" else ">"))
        order[name] = (kind, key, flat.size)
        stride = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
        w.text(name)
        w.tensor(kind, key, flat.size, 0, shape, stride)
    for name, (owner, offset, size, stride) in (views or {}).items():
        kind, key, numel = order[owner]
        w.text(name)
        w.tensor(kind, key, numel, offset, size, stride)
    w.op(b"u.")  # SETITEMS, STOP
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", bytes(w.out))
        z.writestr("archive/byteorder", byteorder)
        for key, flat in storages.items():
            z.writestr(f"archive/data/{key}", flat.tobytes())
        z.writestr("archive/version", "3\n")
        z.writestr("archive/.data/serialization_id", "0123456789")


# ---------------------------------------------------------------- synthetic heads


def target_folder(folder: Path, model) -> Path:
    """A --target folder for a tiny mlx-lm model (its config.json is all converters read)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _layer(rng, p: str, H: int, d_in: int, I: int, nh: int, nkv: int, d: int, *,
           input_norm=True, qkv_bias=False, qk_norm=False) -> dict:
    g = lambda *s: rng.normal(0, 1 / np.sqrt(s[-1]), s).astype(np.float32)
    nrm = lambda n: (1 + 0.1 * rng.normal(size=n)).astype(np.float32)
    w = {
        f"{p}.self_attn.q_proj.weight": g(nh * d, d_in),
        f"{p}.self_attn.k_proj.weight": g(nkv * d, d_in),
        f"{p}.self_attn.v_proj.weight": g(nkv * d, d_in),
        f"{p}.self_attn.o_proj.weight": g(H, nh * d),
        f"{p}.mlp.gate_proj.weight": g(I, H),
        f"{p}.mlp.up_proj.weight": g(I, H),
        f"{p}.mlp.down_proj.weight": g(H, I),
        f"{p}.post_attention_layernorm.weight": nrm(H),
    }
    if input_norm:
        w[f"{p}.input_layernorm.weight"] = nrm(H)
    if qkv_bias:
        for n, size in (("q", nh * d), ("k", nkv * d), ("v", nkv * d)):
            w[f"{p}.self_attn.{n}_proj.bias"] = (0.1 * rng.normal(size=size)).astype(np.float32)
    if qk_norm:
        w[f"{p}.self_attn.q_norm.weight"], w[f"{p}.self_attn.k_norm.weight"] = nrm(d), nrm(d)
    return w


def _dims(H, heads, kv_heads, inter, layers, V):
    return {"hidden_size": H, "intermediate_size": inter or 2 * H, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "num_hidden_layers": layers, "vocab_size": V,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
            "hidden_act": "silu", "model_type": "llama"}


def save_weights(folder: Path, weights: dict, fmt: str, prefix: str = "") -> None:
    named = {(prefix + k if not k.startswith("lm_head") else k): v for k, v in weights.items()}
    if fmt == "bin":
        write_torch_bin(folder / "pytorch_model.bin", named)
    else:
        mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in named.items()})


def _write(folder: Path, cfg: dict, w: dict, config, drop, tweak, fmt: str, prefix: str = ""):
    """Apply the caller's config overrides, dropped keys and tweak; write; return (cfg, w)."""
    cfg.update(config or {})
    for k in drop:
        w.pop(k)
    if tweak is not None:
        tweak(w)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_weights(folder, w, fmt, prefix)
    return cfg, w


def eagle1_checkpoint(folder: Path, H: int, V: int, *, heads=4, kv_heads=2, inter=None, layers=1,
                      fc_bias=True, qkv_bias=False, fmt="bin", prefix="", seed=0, config=None,
                      drop=(), tweak=None, hass=False, hass_names=("embedding_layernorm", "hidden_states_layernorm"),
                      first_norm=False) -> tuple[dict, dict]:
    """An EAGLE-1 head (yuhuili layout); returns (config, {original key: np array}).

    `hass`: a HASS head (`add_para_norm: true`, vLLM `llama_eagle.py`) with the
    two norms named `hass_names`; `first_norm`: layer 0 keeps its input norm.
    `tweak(weights)` edits the weights in place before they are written.
    """
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    I, d = inter or 2 * H, H // heads
    w = {"embed_tokens.weight": rng.normal(size=(V, H)).astype(np.float32),
         "fc.weight": rng.normal(0, 1 / np.sqrt(2 * H), (H, 2 * H)).astype(np.float32)}
    if fc_bias:
        w["fc.bias"] = (0.1 * rng.normal(size=H)).astype(np.float32)
    for i in range(layers):
        w.update(_layer(rng, f"layers.{i}", H, H, I, heads, kv_heads, d, input_norm=i > 0 or first_norm,
                        qkv_bias=qkv_bias))
    cfg = {"architectures": ["LlamaForCausalLM"], **_dims(H, heads, kv_heads, I, layers, V), "bias": fc_bias}
    if hass:
        for name in hass_names:
            w[f"{name}.weight"] = (1 + 0.2 * rng.normal(size=H)).astype(np.float32)
        cfg["add_para_norm"] = True
    if qkv_bias:
        cfg["qkv_bias"] = True
    return _write(folder, cfg, w, config, drop, tweak, fmt, prefix)


def eagle3_checkpoint(folder: Path, H: int, V: int, *, V_d=None, layout="yuhuili", heads=4, kv_heads=2,
                      inter=None, layers=1, H_t=None, n_taps=3, fmt="safetensors", seed=0, config=None,
                      norm_before_fc=False, fc_norm=False, qk_norm=False, embed=None, drop=(),
                      tweak=None) -> tuple[dict, dict]:
    """An EAGLE-3 head (yuhuili or speculators layout); returns (config, weights)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    I, d, H_t, V_d = inter or 2 * H, H // heads, H_t or H, V_d or V
    first = "midlayer" if layout == "yuhuili" else "layers.0"
    w = {"fc.weight": rng.normal(0, 1 / np.sqrt(n_taps * H_t), (H, n_taps * H_t)).astype(np.float32)}
    w.update(_layer(rng, first, H, 2 * H, I, heads, kv_heads, d, qk_norm=qk_norm))
    w[f"{first}.hidden_norm.weight"] = (1 + 0.1 * rng.normal(size=H)).astype(np.float32)
    for i in range(1, layers):
        w.update(_layer(rng, f"layers.{i}", H, H, I, heads, kv_heads, d, qk_norm=qk_norm))
    w["norm.weight"] = (1 + 0.1 * rng.normal(size=H)).astype(np.float32)
    w["lm_head.weight"] = rng.normal(0, 1, (V_d, H)).astype(np.float32)
    if V_d != V:
        used = np.sort(rng.choice(V, V_d, replace=False))
        w["d2t"] = (used - np.arange(V_d)).astype(np.int64)
        w["t2d"] = np.isin(np.arange(V), used)
    if norm_before_fc:
        w["input_norm.weight"] = (1 + 0.1 * rng.normal(size=n_taps * H_t)).astype(np.float32)
    if fc_norm:
        for j in range(n_taps):
            w[f"fc_norm.{j}.weight"] = (1 + 0.1 * rng.normal(size=H_t)).astype(np.float32)
    if embed if embed is not None else layout == "speculators":
        w["embed_tokens.weight"] = rng.normal(size=(V, H)).astype(np.float32)
    dims = _dims(H, heads, kv_heads, I, layers, V)
    if layout == "speculators":
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": dims, "draft_vocab_size": V_d, "norm_before_residual": False,
               "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": None,
               "norm_before_fc": norm_before_fc, "fc_norm": fc_norm, "norm_output": False,
               "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}}}
    else:
        cfg = {"architectures": ["LlamaForCausalLM"], **dims, "draft_vocab_size": V_d}
        cfg["num_hidden_layers"] = 40 if layout == "yuhuili" else layers  # misleading, as in the wild
        if H_t != H:
            cfg["target_hidden_size"] = H_t
    return _write(folder, cfg, w, config, drop, tweak, fmt)


# ---------------------------------------------------------------- NumPy reference (float64)


def rms(x, w, eps=1e-5):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, theta=10000.0):
    """x [n, heads, d] at positions 0..n-1; rotate-half (HF / mlx traditional=False)."""
    n, _, d = x.shape
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = np.arange(n)[:, None] * inv[None]  # [n, d/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def attention(u, w, p, nh, nkv):
    """Causal GQA attention with RoPE over all rows of u [n, D]."""
    lin = lambda name: u @ w[f"{p}.{name}_proj.weight"].T + w.get(f"{p}.{name}_proj.bias", 0)
    q, k, v = lin("self_attn.q"), lin("self_attn.k"), lin("self_attn.v")
    n = u.shape[0]
    d = q.shape[-1] // nh
    q, k, v = q.reshape(n, nh, d), k.reshape(n, nkv, d), v.reshape(n, nkv, d)
    if f"{p}.self_attn.q_norm.weight" in w:
        q, k = rms(q, w[f"{p}.self_attn.q_norm.weight"]), rms(k, w[f"{p}.self_attn.k_norm.weight"])
    q, k = rope(q), rope(k)
    rep = nh // nkv
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", a, v).reshape(n, nh * d)
    return o @ w[f"{p}.self_attn.o_proj.weight"].T


def mlp(x, w, p):
    silu = lambda z: z / (1 + np.exp(-z))
    g, u = x @ w[f"{p}.mlp.gate_proj.weight"].T, x @ w[f"{p}.mlp.up_proj.weight"].T
    return (silu(g) * u) @ w[f"{p}.mlp.down_proj.weight"].T


def std_layer(x, w, p, nh, nkv):
    h = x + attention(rms(x, w[f"{p}.input_layernorm.weight"]), w, p, nh, nkv)
    return h + mlp(rms(h, w[f"{p}.post_attention_layernorm.weight"]), w, p)


def _run_chain(step, emb, feats, chain_tokens, E):
    """Rows of a head run from scratch: real (emb, feature) rows, then chained rows.

    `step(E_rows, F_rows) -> (next_feature_rows, hidden_rows)` is the whole
    head over all rows (causal). Chained row j feeds the previous row's next
    feature and the embedding of chain_tokens[j].
    """
    es, fs = list(emb), list(feats)
    nxt, hid = step(np.array(es), np.array(fs))
    for t in chain_tokens:
        es.append(E[t])
        fs.append(nxt[-1])
        nxt, hid = step(np.array(es), np.array(fs))
    return hid


def ref_eagle1(w, cfg, E, tokens_next, feats, chain_tokens=()):
    """Hidden states g of an EAGLE-1 head (EAGLE `cnets1.py`) for every row; logits = g @ LM.T."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    nh, nkv, L = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]

    en, hn = (w.get(f"{a}.weight", w.get(f"{b}.weight")) for a, b in (("embedding_layernorm", "enorm"),
                                                                       ("hidden_states_layernorm", "hnorm")))

    def step(e, f):
        if en is not None:  # HASS add_para_norm (vLLM llama_eagle.py): norm both inputs of fc
            e, f = rms(e, en), rms(f, hn)
        z = np.concatenate([e, f], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
        n0 = w.get("layers.0.input_layernorm.weight")  # absent in EAGLE-1: no input norm on layer 0
        h = z + attention(z if n0 is None else rms(z, n0), w, "layers.0", nh, nkv)
        h = h + mlp(rms(h, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0")
        for i in range(1, L):
            h = std_layer(h, w, f"layers.{i}", nh, nkv)
        return h, h

    return _run_chain(step, E[np.asarray(tokens_next)], feats, chain_tokens, E)


def ref_eagle3(w, cfg, E, tokens_next, taps_concat, chain_tokens=(), layers=1, norm_before_residual=False):
    """norm(o) of an EAGLE-3 head (EAGLE `cnets.py`) for every row; logits = that @ lm_head.T."""
    w = {("layers.0." + k[9:] if k.startswith("midlayer.") else k): np.asarray(v, np.float64)
         for k, v in w.items() if k not in ("d2t", "t2d")}
    lc = cfg.get("transformer_layer_config", cfg)
    nh, nkv = lc["num_attention_heads"], lc["num_key_value_heads"]
    a = np.asarray(taps_concat, np.float64)
    if "fc_norm.0.weight" in w:
        parts = np.split(a, len([k for k in w if k.startswith("fc_norm.")]), axis=-1)
        a = np.concatenate([rms(p, w[f"fc_norm.{j}.weight"]) for j, p in enumerate(parts)], -1)
    if "input_norm.weight" in w:
        a = rms(a, w["input_norm.weight"])
    g0 = a @ w["fc.weight"].T

    def step(e, g):
        g_n = rms(g, w["layers.0.hidden_norm.weight"])
        u = np.concatenate([rms(e, w["layers.0.input_layernorm.weight"]), g_n], -1)
        h = (g_n if norm_before_residual else g) + attention(u, w, "layers.0", nh, nkv)
        o = h + mlp(rms(h, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0")
        for i in range(1, layers):
            o = std_layer(o, w, f"layers.{i}", nh, nkv)
        return o, rms(o, w["norm.weight"])

    return _run_chain(step, E[np.asarray(tokens_next)], g0, chain_tokens, E)
