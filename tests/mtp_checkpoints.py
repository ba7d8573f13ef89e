"""Tiny synthetic target checkpoints with MTP modules, in the layouts the real ones ship.

`write(folder, family)` builds a random tiny mlx-lm model of the family, turns
its weights back into Hugging Face naming (the inverse of mlx-lm's sanitize:
offset norms, conv1d axes, MLA `kv_b_proj`), adds the MTP tensors under the
names the real checkpoints use (as vLLM's `*_mtp.py` loaders read them), and
writes config.json + model.safetensors + a tokenizer, so `mlx_lm.load(folder)`
works as on a downloaded checkpoint.

The weights are shaped so the head agrees with the target often (but not
always): residual branches are small, so the target is close to a bigram
model, and the MTP projection passes the next token's embedding through.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

import tiny

V = tiny.VOCAB
QWEN = ("qwen3_5", "qwen3_next")  # zero-centred norms, mtp.* at the top level
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
         "mrope_section": [1, 1, 0]}

CONFIGS = {
    "qwen3_5": lambda v: {
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": False,
        "text_config": dict(
            model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=v,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
            rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=dict(_ROPE),
            max_position_embeddings=4096, mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False),
    },
    # 61 main layers: mlx-lm's deepseek_v3 sanitize drops a hard-coded "model.layers.61".
    "deepseek_v3": lambda v: dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=v,
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=61,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
        routed_scaling_factor=1.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, n_group=1, topk_group=1, num_experts_per_tok=2, moe_layer_freq=1,
        first_k_dense_replace=61, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, attention_bias=False, num_nextn_predict_layers=1,
        tie_word_embeddings=False),
    # GLM-4.7-Flash: DeepSeek-V3's MLA (kv_b_proj) in GLM's MoE, the MTP module at layer N.
    "glm4_moe_lite": lambda v: dict(
        model_type="glm4_moe_lite", architectures=["Glm4MoeLiteForCausalLM"], vocab_size=v,
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
        routed_scaling_factor=1.8, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, n_group=1, topk_group=1, num_experts_per_tok=2, moe_layer_freq=1,
        first_k_dense_replace=1, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, attention_bias=False, partial_rotary_factor=1.0,
        tie_word_embeddings=False, num_nextn_predict_layers=1),
    # DeepSeek-V3.2 and GLM-5 (DSA): MLA plus the lightning indexer. index_topk exceeds every
    # test sequence, so attention stays dense (the indexer only runs and caches its keys).
    "deepseek_v32": lambda v: {**_DSA(v), "model_type": "deepseek_v32",
                               "architectures": ["DeepseekV32ForCausalLM"]},
    "glm_moe_dsa": lambda v: {**_DSA(v), "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"],
                              "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
                              "indexer_rope_interleave": True},
    "glm4_moe": lambda v: dict(
        model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=v, hidden_size=64,
        intermediate_size=128, max_position_embeddings=4096, moe_intermediate_size=32,
        norm_topk_prob=True, num_attention_heads=4, n_group=1, head_dim=16, topk_group=1,
        n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0, num_experts_per_tok=2,
        first_k_dense_replace=2, num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, use_qk_norm=True, tie_word_embeddings=False,
        attention_bias=True, partial_rotary_factor=0.5, num_nextn_predict_layers=1),
    # MoE main layers: mlx-lm's qwen3_next sanitize only drops mtp.* (and shifts norms)
    # when per-expert keys are present, as in a real Qwen3-Next checkpoint.
    "qwen3_next": lambda v: dict(
        model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], hidden_size=64,
        num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, shared_expert_intermediate_size=32, mlp_only_layers=[],
        moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=v, rope_theta=10000.0,
        partial_rotary_factor=0.25, max_position_embeddings=4096, norm_topk_prob=True,
        tie_word_embeddings=False, full_attention_interval=2, num_nextn_predict_layers=1),
    # Nemotron-H (Nemotron 3 Super layout): Mamba, attention (no RoPE) and ReLU² MoE blocks;
    # the MTP module is an attention block then a MoE block (`mtp_hybrid_override_pattern`).
    "nemotron_h": lambda v: dict(
        model_type="nemotron_h", architectures=["NemotronHForCausalLM"], vocab_size=v, hidden_size=64,
        intermediate_size=128, max_position_embeddings=4096, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, attention_bias=False, mamba_num_heads=4,
        mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=2,
        mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
        hybrid_override_pattern="M*E", moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, n_group=1, n_routed_experts=4, n_shared_experts=1,
        topk_group=1, num_experts_per_tok=2, norm_topk_prob=True, routed_scaling_factor=1.5,
        tie_word_embeddings=False, num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E"),
    "mimo": lambda v: dict(
        model_type="mimo", architectures=["MiMoForCausalLM"], hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        vocab_size=v, max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
        num_nextn_predict_layers=1),
}


def _DSA(v):
    return dict(vocab_size=v, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.5, kv_lora_rank=16,
                q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, n_group=1,
                topk_group=1, num_experts_per_tok=2, moe_layer_freq=1, first_k_dense_replace=1,
                max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
                rope_scaling=None, attention_bias=False, index_head_dim=16, index_n_heads=2,
                index_topk=512, num_nextn_predict_layers=1, tie_word_embeddings=False)


MLA = ("deepseek_v3", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")  # kv_b_proj attention


def text(config: dict) -> dict:
    return config.get("text_config", config)


# ---- the main model ---------------------------------------------------------

def _main_model(family: str, config: dict, rng, residual: float, sharpen: float):
    arch = importlib.import_module(f"mlx_lm.models.{family}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    params = {}
    for k, w in tree_flatten(model.parameters()):
        a = np.array(w, dtype=np.float32)
        if k.endswith("norm.weight") and a.ndim == 1 and "linear_attn" not in k:
            a = 1.0 + 0.1 * rng.standard_normal(a.shape)
        elif any(s in k for s in ("o_proj", "down_proj", "out_proj", "fc2")):
            a = a * residual
        elif k.endswith("lm_head.weight"):
            a = a * sharpen
        elif k.endswith(("embed_tokens.weight", "embeddings.weight")):
            a = a * 8.0  # the token's own embedding dominates the residual stream
        params[k] = mx.array(a.astype(np.float32))
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model, params


def _to_hf(family: str, config: dict, params: dict) -> dict:
    """mlx-lm in-memory names/layouts -> the Hugging Face checkpoint's."""
    out = {}
    for k, w in params.items():
        if family == "qwen3_next" and ".switch_mlp." in k:  # stacked -> one tensor per expert
            for e in range(w.shape[0]):
                out[k.replace(".switch_mlp.", f".experts.{e}.")] = w[e]
            continue
        if family == "nemotron_h" and ".switch_mlp." in k:  # fc1/fc2 -> experts.{e}.up/down_proj
            for e in range(w.shape[0]):
                name = k.replace(".switch_mlp.", f".experts.{e}.")
                out[name.replace(".fc1.", ".up_proj.").replace(".fc2.", ".down_proj.")] = w[e]
            continue
        if family == "nemotron_h" and "conv1d.weight" in k:
            w = w.moveaxis(2, 1)  # [C, K, 1] -> [C, 1, K]
        if family in QWEN:
            norm = k.endswith((".input_layernorm.weight", ".post_attention_layernorm.weight",
                               "model.norm.weight", ".q_norm.weight", ".k_norm.weight"))
            if norm and w.ndim == 1:
                w = w - 1.0  # HF stores these as offsets from 1
            if "conv1d.weight" in k:
                w = w.moveaxis(2, 1)  # [C, K, 1] -> [C, 1, K]
            k = k.replace("language_model.model.", "model.language_model.").replace(
                "language_model.lm_head.", "lm_head.")
        if family in MLA and k.endswith("self_attn.embed_q.weight"):
            t = text(config)
            wv = params[k.replace("embed_q", "unembed_out")]
            kv_b = mx.concatenate([w.swapaxes(-1, -2), wv], axis=1)  # [nh, nope + v, kv_lora]
            out[k.replace("embed_q", "kv_b_proj")] = kv_b.reshape(-1, t["kv_lora_rank"])
            continue
        if family in MLA and k.endswith("self_attn.unembed_out.weight"):
            continue
        out[k] = w
    return out


# ---- the MTP module, in HF naming ---------------------------------------------

def _block_shapes(family: str, t: dict) -> dict:
    H, I = t["hidden_size"], t["intermediate_size"]
    nh, nkv = t["num_attention_heads"], t["num_key_value_heads"]
    d = t.get("head_dim") or H // nh
    s = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    if family in MLA:
        qd = t["qk_nope_head_dim"] + t["qk_rope_head_dim"]
        s.update({
            "self_attn.q_a_proj.weight": (t["q_lora_rank"], H),
            "self_attn.q_a_layernorm.weight": (t["q_lora_rank"],),
            "self_attn.q_b_proj.weight": (nh * qd, t["q_lora_rank"]),
            "self_attn.kv_a_proj_with_mqa.weight": (t["kv_lora_rank"] + t["qk_rope_head_dim"], H),
            "self_attn.kv_a_layernorm.weight": (t["kv_lora_rank"],),
            "self_attn.kv_b_proj.weight": (nh * (t["qk_nope_head_dim"] + t["v_head_dim"]), t["kv_lora_rank"]),
            "self_attn.o_proj.weight": (H, nh * t["v_head_dim"]),
        })
        if "index_topk" in t:  # the DSA lightning indexer
            ih, idim = t["index_n_heads"], t["index_head_dim"]
            s.update({"self_attn.indexer.wq_b.weight": (ih * idim, t["q_lora_rank"]),
                      "self_attn.indexer.wk.weight": (idim, H), "self_attn.indexer.k_norm.weight": (idim,),
                      "self_attn.indexer.k_norm.bias": (idim,), "self_attn.indexer.weights_proj.weight": (ih, H)})
    else:
        q_out = 2 * nh * d if family in QWEN else nh * d  # Qwen: query + output gate
        s.update({"self_attn.q_proj.weight": (q_out, H), "self_attn.k_proj.weight": (nkv * d, H),
                  "self_attn.v_proj.weight": (nkv * d, H), "self_attn.o_proj.weight": (H, nh * d)})
        if family == "mimo" or t.get("attention_bias"):
            s.update({"self_attn.q_proj.bias": (nh * d,), "self_attn.k_proj.bias": (nkv * d,),
                      "self_attn.v_proj.bias": (nkv * d,)})
        if family in QWEN or t.get("use_qk_norm"):
            s.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    if t.get("num_experts"):  # Qwen3-Next: softmax router, one gated shared expert
        E, Im, Is = t["num_experts"], t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
        s.update({"mlp.gate.weight": (E, H), "mlp.shared_expert_gate.weight": (1, H)})
        for e in range(E):
            s.update({f"mlp.experts.{e}.gate_proj.weight": (Im, H), f"mlp.experts.{e}.up_proj.weight": (Im, H),
                      f"mlp.experts.{e}.down_proj.weight": (H, Im)})
        s.update({"mlp.shared_expert.gate_proj.weight": (Is, H), "mlp.shared_expert.up_proj.weight": (Is, H),
                  "mlp.shared_expert.down_proj.weight": (H, Is)})
    elif t.get("n_routed_experts"):  # the MTP layer sits past first_k_dense_replace: MoE
        E, Im = t["n_routed_experts"], t["moe_intermediate_size"]
        Is = Im * t["n_shared_experts"]
        s.update({"mlp.gate.weight": (E, H), "mlp.gate.e_score_correction_bias": (E,)})
        for e in range(E):
            s.update({f"mlp.experts.{e}.gate_proj.weight": (Im, H), f"mlp.experts.{e}.up_proj.weight": (Im, H),
                      f"mlp.experts.{e}.down_proj.weight": (H, Im)})
        s.update({"mlp.shared_experts.gate_proj.weight": (Is, H), "mlp.shared_experts.up_proj.weight": (Is, H),
                  "mlp.shared_experts.down_proj.weight": (H, Is)})
    else:
        s.update({"mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)})
    return s


def _nemotron_mtp_shapes(t: dict) -> dict:
    """`mtp.layers.{i}.*` of a Nemotron-H checkpoint with pattern "*E" (vLLM nemotron_h_mtp.py)."""
    H, nh, nkv, d = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    E, Im, Is = t["n_routed_experts"], t["moe_intermediate_size"], t["moe_shared_expert_intermediate_size"]
    s = {"layers.0.enorm.weight": (H,), "layers.0.hnorm.weight": (H,), "layers.0.eh_proj.weight": (H, 2 * H),
         "layers.0.norm.weight": (H,), "layers.0.mixer.q_proj.weight": (nh * d, H),
         "layers.0.mixer.k_proj.weight": (nkv * d, H), "layers.0.mixer.v_proj.weight": (nkv * d, H),
         "layers.0.mixer.o_proj.weight": (H, nh * d), "layers.1.norm.weight": (H,),
         "layers.1.mixer.gate.weight": (E, H), "layers.1.mixer.gate.e_score_correction_bias": (E,),
         "layers.1.mixer.shared_experts.up_proj.weight": (Is, H),
         "layers.1.mixer.shared_experts.down_proj.weight": (H, Is), "layers.1.final_layernorm.weight": (H,)}
    for e in range(E):
        s[f"layers.1.mixer.experts.{e}.up_proj.weight"] = (Im, H)
        s[f"layers.1.mixer.experts.{e}.down_proj.weight"] = (H, Im)
    return s


def _random(rng, key: str, shape, offset_norms: bool, residual: float) -> np.ndarray:
    if key.endswith("norm.weight") or "layernorm" in key:
        noise = 0.1 * rng.standard_normal(shape)
        return noise if offset_norms else 1.0 + noise
    if key.endswith("e_score_correction_bias") or key.endswith(".bias"):
        return 0.1 * rng.standard_normal(shape)
    w = rng.standard_normal(shape) / np.sqrt(shape[-1])
    return w * residual if any(s in key for s in ("o_proj", "down_proj")) else w


def _mtp_tensors(family: str, config: dict, hf: dict, rng, residual: float, glm46: bool) -> dict:
    t = text(config)
    H = t["hidden_size"]
    qwen = family in QWEN
    if family == "nemotron_h":
        out = {"mtp." + k: _random(rng, k, s, False, residual) for k, s in _nemotron_mtp_shapes(t).items()}
        noise = 0.3 * rng.standard_normal((H, H)) / np.sqrt(H)
        out["mtp.layers.0.eh_proj.weight"] = np.concatenate([np.eye(H), noise], axis=1)
        out["mtp.layers.1.final_layernorm.weight"] = (np.array(hf["backbone.norm_f.weight"])
                                                      + 0.02 * rng.standard_normal(H))
        return {k: mx.array(np.asarray(v, np.float32)) for k, v in out.items()}
    block = {k: _random(rng, k, s, qwen, residual) for k, s in _block_shapes(family, t).items()}
    # The projection passes the next token's embedding through, plus a little of h.
    eye, noise = np.eye(H), 0.3 * rng.standard_normal((H, H)) / np.sqrt(H)
    proj = np.concatenate([noise, eye] if family == "mimo" else [eye, noise], axis=1)
    norms = {n: _random(rng, n + "norm.weight", (H,), qwen, 1.0) for n in ("e", "h")}
    # A trained head's last norm matches the target's final norm closely.
    final = np.array(hf.get("model.language_model.norm.weight", hf.get("model.norm.weight")))
    norms["final"] = final + 0.02 * rng.standard_normal(H)
    if qwen:
        out = {f"mtp.layers.0.{k}": v for k, v in block.items()}
        out.update({"mtp.fc.weight": proj, "mtp.pre_fc_norm_embedding.weight": norms["e"],
                    "mtp.pre_fc_norm_hidden.weight": norms["h"], "mtp.norm.weight": norms["final"]})
    elif family == "mimo":
        p = "model.mtp_layers.0."
        out = {p + k: v for k, v in block.items()}
        out.update({p + "token_layernorm.weight": norms["e"], p + "hidden_layernorm.weight": norms["h"],
                    p + "input_proj.weight": proj, p + "final_layernorm.weight": norms["final"]})
    else:  # DeepSeek / GLM: the module is layer N, after the main layers
        p = f"model.layers.{t['num_hidden_layers']}."
        out = {p + k: v for k, v in block.items()}
        out.update({p + "enorm.weight": norms["e"], p + "hnorm.weight": norms["h"],
                    p + "eh_proj.weight": proj, p + "shared_head.norm.weight": norms["final"]})
        if not glm46:  # DeepSeek-V3 / GLM-4.5 ship copies of the embedding and LM head
            out[p + "embed_tokens.weight"] = np.array(hf["model.embed_tokens.weight"])
            out[p + "shared_head.head.weight"] = np.array(hf["lm_head.weight"])
    return {k: mx.array(np.asarray(v, np.float32)) for k, v in out.items()}


def write(folder, family: str, *, vocab: int = V, seed: int = 0, mtp: bool = True,
          glm46: bool = False, residual: float = 0.1, sharpen: float = 16.0) -> Path:
    """Write a tiny `family` checkpoint (with its MTP module unless mtp=False) to `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = CONFIGS[family](vocab)
    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    _, params = _main_model(family, config, rng, residual, sharpen)
    hf = _to_hf(family, config, params)
    if mtp:
        hf.update(_mtp_tensors(family, config, hf, rng, residual, glm46))
    mx.save_safetensors(str(folder / "model.safetensors"), hf, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    tiny.tokenizer(vocab=vocab)._tokenizer.save_pretrained(str(folder))
    return folder


def main_params(folder) -> dict:
    """The tensors of a written checkpoint, as float64 NumPy arrays (for the reference)."""
    return {k: np.array(v, dtype=np.float64) for k, v in mx.load(str(Path(folder) / "model.safetensors")).items()}
