"""A tiny DeepSeek-V4-Flash(-0731) checkpoint in the published layout, for tests.

Layout (DeepSeek's V4 reference `inference/model.py` names, `model_type: deepseek_v4`,
the HF config's `quantization_config` with 128x128 ue8m0 tiles and `expert_dtype: fp4`):
`embed.weight`, `layers.{i}.attn.{wq_a,wq_b,wkv,wo_a,wo_b}.weight` as F8_E4M3 with a
`.scale` tile grid (F8_E8M0), `attn.{q_norm,kv_norm}`, `attn.attn_sink`,
`attn.compressor.*` / `attn.indexer.*` on compressed layers, `ffn.gate.{weight,bias}`
(`ffn.gate.tid2eid` on the first `num_hash_layers` layers), `ffn.experts.{e}.w{1,2,3}`
as packed FP4 (I8) with 1x32 F8_E8M0 scales, `ffn.shared_experts.w{1,2,3}` FP8,
`hc_{attn,ffn}_{fn,base,scale}`, `attn_norm`, `ffn_norm`; top level `norm.weight`,
`head.weight`, `hc_head_{fn,base,scale}`. The model is mlx-vlm's `deepseek_v4` with random
weights; `native` writes its parameters under those names.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

import dspark_v4_ref as R
import tiny

CONFIG = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=tiny.VOCAB,
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
    head_dim=96, q_lora_rank=32, qk_rope_head_dim=32, o_groups=2, o_lora_rank=16,
    moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    hc_mult=2, hc_sinkhorn_iters=3, hc_eps=1e-6, rms_norm_eps=1e-6, swiglu_limit=10.0,
    routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", topk_method="noaux_tc",
    norm_topk_prob=True, max_position_embeddings=32768, rope_theta=10000.0,
    compress_rope_theta=160000.0, sliding_window=8, compress_ratios=[0, 4, 128, 0],
    num_hash_layers=1, index_n_heads=2, index_head_dim=32, index_topk=4,
    num_nextn_predict_layers=1, tie_word_embeddings=False, expert_dtype="fp4",
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 2048,
                  "beta_fast": 32, "beta_slow": 1},
    quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                         "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
)
# mlx-vlm piece -> DeepSeek piece (experts are split per expert separately)
NATIVE = [(".attn_hc.", ".hc_attn_"), (".ffn_hc.", ".hc_ffn_"),
          (".ffn.gate.e_score_correction_bias", ".ffn.gate.bias"),
          (".shared_experts.gate_proj.", ".shared_experts.w1."),
          (".shared_experts.down_proj.", ".shared_experts.w2."),
          (".shared_experts.up_proj.", ".shared_experts.w3.")]
TOP = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
       "model.norm.weight": "norm.weight", "model.hc_head.fn": "hc_head_fn",
       "model.hc_head.base": "hc_head_base", "model.hc_head.scale": "hc_head_scale"}
TRUNK_FP8 = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.",
             ".attn.indexer.wq_b.", ".shared_experts.")


def language_model(config: dict = CONFIG, seed: int = 1, sharpen: float = 8.0):
    """mlx-vlm's DeepSeek-V4 language model with random weights everywhere that matters
    (mHC, sinks, router, compressor position biases start at zero in mlx-vlm)."""
    from mlx_vlm.models.deepseek_v4 import config as C
    from mlx_vlm.models.deepseek_v4 import language as L

    mx.random.seed(seed)
    lm = L.LanguageModel(C.ModelConfig.from_dict(config))
    scales = {".fn": 0.05, ".base": 0.5, ".attn_sink": 1.0, "gate.weight": 0.3,
              "e_score_correction_bias": 0.1, ".ape": 0.5}
    new = []
    for name, value in tree_flatten(lm.parameters()):
        if name.endswith("tid2eid"):
            k, E = value.shape[-1], config["n_routed_experts"]
            new.append((name, mx.array(np.stack([np.random.default_rng(seed + t).permutation(E)[:k]
                                                 for t in range(value.shape[0])]).astype(np.int32))))
        for suffix, scale in scales.items():
            if name.endswith(suffix):
                new.append((name, mx.random.normal(value.shape) * scale))
    lm.update(tree_unflatten(new))
    lm.lm_head.weight = lm.lm_head.weight * sharpen
    mx.eval(lm.parameters())
    return lm


def native(lm) -> dict:
    """The language model's parameters as float32/int32 NumPy arrays under DeepSeek's names."""
    out = {}
    for k, v in tree_flatten(lm.parameters()):
        a = np.array(v)
        if k in TOP:
            out[TOP[k]] = a
            continue
        k = k.removeprefix("model.")
        if ".ffn.switch_mlp." in k:
            w = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[k.split(".")[-2]]
            base = k.split(".ffn.")[0]
            out.update({f"{base}.ffn.experts.{e}.{w}.weight": a[e] for e in range(a.shape[0])})
            continue
        for mine, theirs in NATIVE:
            k = k.replace(mine, theirs)
        out[k] = a.reshape(-1, a.shape[-1]) if k.endswith(".attn.wo_a.weight") else a
    return out


def pack(tensors: dict, tile: int = 128) -> tuple[dict, dict]:
    """(stored, dequantized): FP8 + tile scales for the dense attention / shared-expert
    weights, FP4 for the routed experts (`dspark_v4_ref.packed`), the rest as they are."""
    fp8 = [k for k in tensors if k.endswith(".weight") and any(p in "." + k for p in TRUNK_FP8)]
    experts = [k for k in tensors if ".ffn.experts." in k]
    sub = {k: tensors[k] for k in fp8 + experts}
    stored, plain = R.packed(sub, tile=tile)
    return {**tensors, **stored}, {**tensors, **plain}


_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64",
           np.dtype(np.int8): "I8"}


def write(folder: Path, config: dict, tensors: dict) -> Path:
    """config.json, the tokenizer, and model.safetensors with DeepSeek's dtypes: FP8 weights
    as F8_E4M3, their scales (and FP4 experts' scales) as F8_E8M0, FP4 experts as I8."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    tiny.tokenizer(eos=0)._tokenizer.save_pretrained(str(folder))
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for key, value in sorted(tensors.items()):
        a = np.ascontiguousarray(np.array(value))
        if a.dtype == np.uint8:
            kind = "F8_E8M0" if key.endswith(".scale") else "F8_E4M3"
        else:
            kind = _DTYPES[a.dtype]
        blob = a.tobytes()
        header[key] = {"dtype": kind, "shape": list(a.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for blob in blobs:
            f.write(blob)
    return folder


def checkpoint(folder: Path, config: dict = CONFIG, seed: int = 1, extra: dict | None = None):
    """(folder, float model with the values the stored FP8/FP4 tensors encode)."""
    from mlx_vlm.models.deepseek_v4 import config as C
    from mlx_vlm.models.deepseek_v4 import language as L

    stored, plain = pack(native(language_model(config, seed)))
    write(folder, config, {**stored, **(extra or {})})
    lm = L.LanguageModel(C.ModelConfig.from_dict(config))
    lm.load_weights(list(lm.sanitize({k: mx.array(np.asarray(v, np.float32) if v.dtype == np.float64 else v)
                                      for k, v in plain.items()}).items()))
    mx.eval(lm.parameters())
    return folder, lm
