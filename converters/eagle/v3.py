"""--format eagle3: EAGLE-3 heads in the yuhuili/SGLang and speculators layouts (SafeAILab/EAGLE `eagle/model/cnets.py`, vllm-project/speculators `models/eagle3/`).

Layouts (keys may carry a `model.` prefix):
* yuhuili / SGLang / SpecForge: a LlamaConfig at the top level plus
  `draft_vocab_size` (and optionally `target_hidden_size`, `bias`); tensors
  `midlayer.*` (one layer, whatever `num_hidden_layers` says), `fc`, `norm`,
  `lm_head` [V_d, H], `d2t`, `t2d`.
* speculators (`speculators_model_type: "eagle3"`): dimensions in
  `transformer_layer_config`, options `norm_before_residual`, `norm_before_fc`
  (`input_norm.weight`), `fc_norm` (`fc_norm.{j}.weight`), `norm_output`;
  tensors `layers.{i}.*` (layer 0 reads 2H, later layers are ordinary),
  usually a copy of `embed_tokens`.

Rules: `midlayer.` becomes `layers.0.`; `d2t` (offsets) becomes
`draft_to_target` = d2t + arange(V_d) (absolute target ids, int32); `t2d`
(training only) is checked and dropped; `embed_tokens` is dropped when the
head is as wide as the target (the target's embedding is used: some drafts
ship a random one) and kept otherwise.

Taps: `eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`; the
vLLM/speculators field) are input-of-layer ids; DeepSpec's `target_layer_ids`
are output-of-layer ids; with neither, the EAGLE-3 default input-of-layer
`[2, N//2, N-3]`. All become mlx-spec tap ids (see converters.eagle).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..common import ConversionError, check_shapes, rekey, rename
from . import (
    convert_with,
    flag, from_input_of_layer, from_output_of_layer, layer_fields, layer_shapes,
    mlx_spec_block, refuse_unsupported, require, strip_model_prefix, target_dims,
)

# checkpoint key (after `midlayer.` -> `layers.0.`) -> head key (None: dropped on purpose)
TABLE = [
    (r"embed_tokens\.weight", "embed_tokens.weight"),  # kept only for narrow heads (below)
    (r"fc\.(weight|bias)", r"fc.\1"),
    (r"input_norm\.weight", "input_norm.weight"),  # speculators norm_before_fc
    (r"fc_norm\.(\d+)\.weight", r"fc_norm.\1.weight"),  # speculators fc_norm, one per tap
    (r"layers\.(\d+)\.self_attn\.rotary_emb\.inv_freq", None),  # recomputed from rope_theta
    (r"layers\.(\d+)\.self_attn\.([qkvo])_proj\.(weight|bias)", r"layers.\1.self_attn.\2_proj.\3"),
    (r"layers\.(\d+)\.self_attn\.([qk])_norm\.weight", r"layers.\1.self_attn.\2_norm.weight"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight"),
    (r"layers\.(\d+)\.(input_layernorm|hidden_norm|post_attention_layernorm)\.weight", r"layers.\1.\2.weight"),
    (r"norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"d2t", "d2t"),  # turned into draft_to_target below
    (r"t2d", None),  # target -> draft mask, used in training only
]


def detect(config: dict, tensor_names) -> bool:
    names = {n[len("model."):] if n.startswith("model.") else n for n in tensor_names}
    return config.get("speculators_model_type") == "eagle3" or (
        "fc.weight" in names
        and ("midlayer.hidden_norm.weight" in names or "layers.0.hidden_norm.weight" in names)
    )


def _layer_config(cfg: dict, weights: dict) -> tuple[dict, str, int]:
    """(the config holding the layer dimensions, layout name, number of head layers)."""
    if cfg.get("speculators_model_type") == "eagle3":
        lc = cfg.get("transformer_layer_config")
        if not isinstance(lc, dict):
            raise ConversionError("speculators config.json lacks transformer_layer_config")
        return lc, "speculators", lc.get("num_hidden_layers", 1)
    if any(k.startswith("midlayer.") for k in weights):
        return cfg, "yuhuili", 1  # one midlayer, whatever num_hidden_layers claims
    return cfg, "layers", 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("layers."))


def taps_for(cfg: dict, n_target: int) -> tuple[list, dict]:
    """Tap ids of the checkpoint's target layers, and how they were found."""
    nested = cfg.get("eagle_config") or {}
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return from_input_of_layer(ids, n_target), {"ids": ids, "convention": "input-of-layer"}
    if cfg.get("target_layer_ids") is not None:
        ids = cfg["target_layer_ids"]
        return from_output_of_layer(ids, n_target), {"ids": ids, "convention": "output-of-layer"}
    if n_target < 4:
        raise ConversionError(f"the target has {n_target} layers; the EAGLE-3 default taps need at least 4")
    ids = [2, n_target // 2, n_target - 3]
    return from_input_of_layer(ids, n_target), {"ids": ids, "convention": "input-of-layer (EAGLE-3 default)"}


def _draft_to_target(d2t, V_d: int, V_t: int) -> mx.array:
    require("d2t length", tuple(d2t.shape), (V_d,))
    ids = d2t.astype(mx.int64) + mx.arange(V_d, dtype=mx.int64)
    lo, hi = ids.min().item(), ids.max().item()
    if lo < 0 or hi >= V_t:
        raise ConversionError(f"d2t maps draft ids to target ids {lo}..{hi}, outside the target's 0..{V_t - 1}")
    return ids.astype(mx.int32)


def build(cfg: dict, weights: dict, target: dict) -> tuple[dict, dict]:
    """(head config, head weights) from a checkpoint's config and tensors; raises on any mismatch."""
    H_t, N_t, V_t = target_dims(target)
    refuse_unsupported(cfg, weights)
    weights = strip_model_prefix(weights)
    lc, layout, n_layers = _layer_config(cfg, weights)
    weights = rekey(weights, lambda k: "layers.0." + k[9:] if k.startswith("midlayer.") else k)
    fields = layer_fields(lc, "config.json" if lc is cfg else "transformer_layer_config")
    H = fields["hidden_size"]
    head_H_t = cfg.get("target_hidden_size") or H
    require("target hidden size", head_H_t, H_t)
    V = lc.get("vocab_size") or cfg.get("vocab_size") or V_t
    require("vocab_size", V, V_t)
    V_d = cfg.get("draft_vocab_size") or V
    taps, source = taps_for(cfg, N_t)
    k = len(taps)
    if "fc.weight" in weights and weights["fc.weight"].shape[-1] != k * H_t:
        raise ConversionError(
            f"fc reads {weights['fc.weight'].shape[-1]} features but {k} taps of the target's "
            f"hidden size {H_t} make {k * H_t}: the head was made for another target or other layers"
        )
    if "t2d" in weights:
        require("t2d length", tuple(weights["t2d"].shape), (V_t,))
    out = rename(weights, TABLE)
    if "embed_tokens.weight" in out:
        require("embed_tokens shape", tuple(out["embed_tokens.weight"].shape), (V_t, H))
        if H == H_t:  # same width: use the target's embedding (some drafts ship a random copy)
            del out["embed_tokens.weight"]
    d2t = out.pop("d2t", None)
    if d2t is not None:
        out["draft_to_target"] = _draft_to_target(d2t, V_d, V_t)
    elif V_d != V_t:
        raise ConversionError(f"the draft vocabulary ({V_d}) differs from the target's ({V_t}) but there is no d2t")
    fields["attention_bias"] = flag(lc, "attention_bias", "layers.0.self_attn.q_proj.bias" in out, "q/k/v biases")
    fields["qk_norm"] = "layers.0.self_attn.q_norm.weight" in out
    options = {
        "fc_bias": flag(cfg, "bias", "fc.bias" in out, "fc.bias"),
        "norm_before_fc": flag(cfg, "norm_before_fc", "input_norm.weight" in out, "input_norm.weight"),
        "fc_norm": flag(cfg, "fc_norm", "fc_norm.0.weight" in out, "fc_norm weights"),
        "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
        "norm_output": bool(cfg.get("norm_output", False)),
        "own_lm_head": "lm_head.weight" in out or V_d != V_t,
        "own_embedding": "embed_tokens.weight" in out,
    }
    if not options["own_lm_head"] and H != H_t:
        raise ConversionError("the head has no lm_head and is narrower than the target; missing tensor lm_head.weight")
    expected = _expected(fields, options, n_layers, k, H_t, V_d, V_t, d2t is not None)
    check_shapes(out, expected, f"EAGLE-3 checkpoint ({layout} layout)")
    config = {
        "mlx_spec": mlx_spec_block("eagle3", taps, target),
        **fields, **options,
        "num_layers": n_layers, "num_taps": k, "fc_input_size": k * H_t,
        "draft_vocab_size": V_d, "vocab_size": V_t, "target_hidden_size": H_t,
        "source": {"format": "eagle3", "layout": layout, "layer_ids": source,
                   "architectures": cfg.get("architectures")},
    }
    return config, out


def _expected(f, o, n_layers, k, H_t, V_d, V_t, has_map) -> dict:
    H = f["hidden_size"]
    shapes = {"fc.weight": (H, k * H_t), "norm.weight": (H,)}
    shapes.update(layer_shapes("layers.0", f, 2 * H))
    shapes["layers.0.hidden_norm.weight"] = (H,)
    for i in range(1, n_layers):
        shapes.update(layer_shapes(f"layers.{i}", f, H))
    if o["fc_bias"]:
        shapes["fc.bias"] = (H,)
    if o["norm_before_fc"]:
        shapes["input_norm.weight"] = (k * H_t,)
    if o["fc_norm"]:
        shapes.update({f"fc_norm.{j}.weight": (H_t,) for j in range(k)})
    if o["own_lm_head"]:
        shapes["lm_head.weight"] = (V_d, H)
    if o["own_embedding"]:
        shapes["embed_tokens.weight"] = (V_t, H)
    if has_map:
        shapes["draft_to_target"] = (V_d,)
    return shapes


def convert(src_folder, out_dir, target_folder, *, quantize_bits=None, group_size=64, force=False) -> Path:
    return convert_with(build, src_folder, out_dir, target_folder, quantize_bits=quantize_bits,
                        group_size=group_size, force=force)
