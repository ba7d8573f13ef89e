"""--format eagle: EAGLE-1/2 heads in the yuhuili layout (SafeAILab/EAGLE `eagle/model/cnets1.py`).

Checkpoint (`pytorch_model.bin` or safetensors, optional `model.` prefix):
`fc.weight` [H, 2H] (+ `fc.bias`), `layers.{i}.*` Llama layers where layer 0
has no `input_layernorm`, and a copy of the target's `embed_tokens`, which is
checked and dropped (the drafter uses the target's own embedding and LM head).
The head reads the target's final-norm output (tap `final_norm`). EAGLE-2
ships the same checkpoints; its dynamic tree is not implemented (chains).

HASS heads with `add_para_norm: true` (the variant vLLM reads, `llama_eagle.py`)
add `embedding_layernorm` and `hidden_states_layernorm` (older vLLM: `enorm`,
`hnorm`), RMS norms applied to the token embedding and to the feature before
`fc`; when the file carries `layers.0.input_layernorm` (converted with
`skip_prenorm: false`) layer 0 uses it. HASS heads without the flag are
ordinary EAGLE-2 heads.
"""

from __future__ import annotations

from pathlib import Path

from mlx_spec.taps import FINAL_NORM

from ..common import ConversionError, check_shapes, rename
from . import (
    convert_with, flag, layer_fields, layer_shapes, mlx_spec_block, refuse_unsupported, require,
    strip_model_prefix, target_dims,
    unsupported,  # noqa: F401  (converters.head asks it before detect)
)

# checkpoint key -> head key (None: dropped on purpose)
TABLE = [
    (r"embed_tokens\.weight", None),  # copy of the target's; the target's own is used
    (r"fc\.(weight|bias)", r"fc.\1"),
    (r"(embedding_layernorm|enorm)\.weight", "embedding_layernorm.weight"),  # HASS add_para_norm
    (r"(hidden_states_layernorm|hnorm)\.weight", "hidden_states_layernorm.weight"),
    (r"layers\.(\d+)\.self_attn\.rotary_emb\.inv_freq", None),  # recomputed from rope_theta
    (r"layers\.(\d+)\.self_attn\.([qkvo])_proj\.(weight|bias)", r"layers.\1.self_attn.\2_proj.\3"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight"),
    (r"layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight", r"layers.\1.\2.weight"),
]


def detect(config: dict, tensor_names) -> bool:
    names = {n[len("model."):] if n.startswith("model.") else n for n in tensor_names}
    return (
        "fc.weight" in names
        and "layers.0.self_attn.q_proj.weight" in names
        # EAGLE-1's signature: no input norm on layer 0 (HASS heads may keep it, with add_para_norm)
        and ("layers.0.input_layernorm.weight" not in names or bool(config.get("add_para_norm")))
        and not names & {"norm.weight", "lm_head.weight", "hidden_norm.weight", "d2t"}
        and config.get("speculators_model_type") is None
    )


def build(cfg: dict, weights: dict, target: dict) -> tuple[dict, dict]:
    """(head config, head weights) from a checkpoint's config and tensors; raises on any mismatch."""
    H_t, _, V_t = target_dims(target)
    refuse_unsupported(cfg, weights)
    fields = layer_fields(cfg, "config.json")
    H = fields["hidden_size"]
    require("hidden_size", H, H_t)
    if cfg.get("vocab_size") is not None:
        require("vocab_size", cfg["vocab_size"], V_t)
    weights = strip_model_prefix(weights)
    if "embed_tokens.weight" in weights:
        require("embed_tokens shape", tuple(weights["embed_tokens.weight"].shape), (V_t, H_t))
    out = rename(weights, TABLE)
    fc_bias = flag(cfg, "bias", "fc.bias" in out, "fc.bias")
    qkv = "layers.0.self_attn.q_proj.bias" in out
    fields["attention_bias"] = flag(cfg, "qkv_bias", qkv, "q/k/v biases")
    para_norm = flag(cfg, "add_para_norm", "embedding_layernorm.weight" in out, "embedding_layernorm")
    first_norm = "layers.0.input_layernorm.weight" in out
    if first_norm and not para_norm:
        raise ConversionError(
            "layer 0 has an input_layernorm, which EAGLE-1/2 heads lack; only HASS heads "
            "(add_para_norm: true) keep it. Is this an EAGLE-1 head?"
        )
    n_layers = cfg.get("num_hidden_layers", 1)
    expected = {"fc.weight": (H, 2 * H), **({"fc.bias": (H,)} if fc_bias else {})}
    if para_norm:
        expected.update({"embedding_layernorm.weight": (H,), "hidden_states_layernorm.weight": (H,)})
    for i in range(n_layers):
        expected.update(layer_shapes(f"layers.{i}", fields, H, input_norm=i > 0 or first_norm))
    check_shapes(out, expected, "EAGLE-1 checkpoint")
    config = {
        "mlx_spec": mlx_spec_block("eagle", [FINAL_NORM], target),
        **fields,
        "num_layers": n_layers,
        "fc_bias": fc_bias,
        "add_para_norm": para_norm,
        "first_input_norm": first_norm,
        "source": {"format": "eagle", "architectures": cfg.get("architectures"),
                   "feature": "target final-norm output"},
    }
    return config, out


def convert(src_folder, out_dir, target_folder, *, quantize_bits=None, group_size=64, force=False) -> Path:
    return convert_with(build, src_folder, out_dir, target_folder, quantize_bits=quantize_bits,
                        group_size=group_size, force=force)
