"""--format dflash: DFlash v1 block drafters, z-lab layout and Meta's Muse Glimmer assistant.

Both layouts hold the same network (z-lab/dflash `dflash/model.py`; the Muse-Glimmer-30B-assistant model card's config and safetensors header); only names and
config fields differ:

| field                | z-lab (`DFlashDraftModel`)              | Muse (`MuseGlimmerAssistantModel`)  |
|----------------------|------------------------------------------|-------------------------------------|
| context projection   | `fc.weight`, `hidden_norm.weight`        | `encoder.fc.weight`, `encoder.output_norm_enc.weight` |
| block size, mask id  | `dflash_config.*`, else top level        | top level                           |
| target layer ids     | `dflash_config.target_layer_ids`         | top-level `target_layer_ids`        |
| in-block attention   | `is_causal`, else `dflash_config.causal`, else sliding => causal | bidirectional |
| logits               | x `output_multiplier`, softcap if set    | the target's multiplier and softcap |

Target layer ids are output-of-layer ids in both (HF `hidden_states[id + 1]`),
which is mlx-spec's tap convention: id k -> tap k. The last layer is refused
(HF's last hidden state is post-final-norm; no published head uses it). The
head ships no embedding or LM head: the target's raw embedding rows and its LM
head are used. Everything is checked before anything is written.
DFlash2 (`DFlash2DraftModel`; vLLM `qwen3_dflash2.py`) adds per-layer `attention_conv` /
`mlp_conv` (`base_kernel [2, taps, H]`, `kernel_projection [2 * taps * H / g, H]`) and a
`candidate_selector` (`hidden_projection [r, H]`, bare `predecessor_codebook` /
`successor_codebook [V, r]`) with `dflash_config` `conv_kernel_size`, `conv_group_size`,
`selector_rank`, `selector_top_k`. Non-goals: MiMo's sink/value-scale variants (refused by name).
"""

from __future__ import annotations

from pathlib import Path

from mlx_spec.taps import EMBED

from .common import (
    HEAD_FORMAT_VERSION, ConversionError, check_shapes, int_fields, read_config, read_tensors, rename,
    target_identity, write_head,
)

LAYERS = [  # checkpoint key -> head key, shared by every DFlash-style layout
    (r"layers\.(\d+)\.self_attn\.([qkvo])_proj\.(weight|bias)", r"layers.\1.self_attn.\2_proj.\3"),
    (r"layers\.(\d+)\.self_attn\.([qk])_norm\.weight", r"layers.\1.self_attn.\2_norm.weight"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight"),
    (r"layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight", r"layers.\1.\2.weight"),
    (r"norm\.weight", "norm.weight"),
]
ZLAB = [(r"fc\.weight", "fc.weight"), (r"hidden_norm\.weight", "hidden_norm.weight"), *LAYERS]
DFLASH2 = [  # z-lab `DFlash2DraftModel` (vLLM `qwen3_dflash2.py`): the v1 names plus these
    *ZLAB,
    (r"layers\.(\d+)\.(attention_conv|mlp_conv)\.base_kernel", r"layers.\1.\2.base_kernel"),
    (r"layers\.(\d+)\.(attention_conv|mlp_conv)\.kernel_projection\.weight",
     r"layers.\1.\2.kernel_projection.weight"),
    # the codebooks are bare parameters (no `.weight`) in the checkpoint
    (r"candidate_selector\.(predecessor|successor)_codebook", r"candidate_selector.\1_codebook.weight"),
    (r"candidate_selector\.hidden_projection\.weight", "candidate_selector.hidden_projection.weight"),
]
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
MUSE = [
    (r"encoder\.fc\.weight", "fc.weight"),
    (r"encoder\.output_norm_enc\.weight", "hidden_norm.weight"),
    *LAYERS,
]
# dflash_config keys that change the math in ways this head does not implement
UNSUPPORTED = ("attention_sink_bias", "attention_value_scale", "use_swa", "backbone_rotary_base",
               "projector_type")


def is_muse(config: dict, names) -> bool:
    return ("encoder.fc.weight" in names or config.get("model_type") == "muse_glimmer_assistant"
            or "MuseGlimmerAssistantModel" in (config.get("architectures") or []))


def unsupported(config: dict, tensor_names) -> str | None:
    """Why a recognised DFlash layout cannot be loaded (converters.head asks before detect)."""
    names = set(tensor_names)
    laguna = config.get("model_type") == "laguna" and ("dflash_config" in config or "gating" in config)
    if laguna or any(".self_attn.g_proj." in n or n.startswith("aux_hidden_norms.") for n in names):
        return (
            "this is a Laguna DFlash head (poolside; model_type 'laguna' with dflash_config). It "
            "adds a per-head softplus output gate (self_attn.g_proj), one norm per tapped target "
            "layer before fc (aux_hidden_norms) and a fused qkv_proj to the z-lab DFlash layers "
            "mlx-spec builds. The only implementations found are other MLX ports (mlx-vlm, "
            "dflash-mlx); without poolside's reference to settle their details (context-window "
            "trimming, the gate's dtype) mlx-spec does not implement it yet."
        )
    return None


def detect(config: dict, tensor_names) -> bool:
    names = set(tensor_names)
    if "encoder.fc.weight" in names:
        return True
    return ({"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
            and "embed_tokens.weight" not in names
            and not any(n.startswith("markov_head.") for n in names))


def read_target(target_folder) -> dict:
    """The target's (flattened) config: its identity, width, depth and vocabulary."""
    if target_folder is None:
        raise ConversionError(
            "--target is required: a DFlash/DSpark head drafts for one target (it uses the "
            "target's embeddings, LM head and hidden states); give the target's folder"
        )
    config = read_config(Path(target_folder).expanduser())
    # text fields may be nested (multimodal checkpoints); mlx-lm picks the class by the top-level type
    nested = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    text = {**config, **nested, "model_type": config.get("model_type")}
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if not isinstance(text.get(key), int):
            raise ConversionError(f"--target {target_folder}: config.json has no {key}")
    return text


def default_layer_ids(n_target: int, n_draft: int) -> list[int]:
    """z-lab's default taps when a config names none (z-lab/dflash `dflash/model.py`; Python's round)."""
    if n_draft == 1:
        return [n_target // 2]
    start, end = 1, n_target - 3
    return [int(round(start + i * (end - start) / (n_draft - 1))) for i in range(n_draft)]


def tap_ids(ids, n_target: int, embed_ok: bool = False) -> list:
    """Output-of-layer ids -> mlx-spec tap ids (same ints; -1 = embedding when allowed)."""
    taps = []
    for i in ids:
        if not isinstance(i, int):
            raise ConversionError(f"target_layer_ids must be integers, got {ids}")
        if i == -1 and embed_ok:
            taps.append(EMBED)
        elif i == n_target - 1:
            raise ConversionError(
                f"target layer id {i} is the target's last layer, whose HF hidden state is the "
                "final-norm output; no published head uses it and its meaning is ambiguous"
            )
        elif not 0 <= i < n_target:
            raise ConversionError(
                f"target layer id {i} is out of range for a {n_target}-layer target: was this "
                "head trained for another target?"
            )
        else:
            taps.append(i)
    return taps


def rope_fields(cfg: dict) -> dict:
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    return {"rope_theta": float(theta), "rope_scaling": scaling,
            "max_position_embeddings": cfg.get("max_position_embeddings")}


def layer_attention(cfg: dict, n_layers: int, causal_override=None) -> tuple[list, list]:
    """Per layer: (sliding window or None, causal inside the block?)."""
    types = cfg.get("layer_types")
    if types is None:  # Qwen3Config's rule
        sliding = cfg.get("use_sliding_window") and cfg.get("sliding_window")
        first = cfg.get("max_window_layers", n_layers)
        types = ["sliding_attention" if sliding and i >= first else "full_attention"
                 for i in range(n_layers)]
    if len(types) != n_layers or set(types) - {"full_attention", "sliding_attention"}:
        raise ConversionError(f"layer_types {types} do not describe {n_layers} full/sliding layers")
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and not isinstance(window, int):
        raise ConversionError("the config has sliding_attention layers but no sliding_window")
    windows = [window if t == "sliding_attention" else None for t in types]
    causal = [t == "sliding_attention" if causal_override is None else bool(causal_override)
              for t in types]
    return windows, causal


def network_fields(cfg: dict, target: dict, n_taps: int, windows, causal) -> dict:
    """The BlockConfig fields of a head (mlx_spec.drafters.dflash.BlockConfig)."""
    int_fields(cfg, "the head's config.json", ("hidden_size", "intermediate_size", "num_attention_heads",
                                                "num_hidden_layers"))
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    if H != target["hidden_size"]:
        raise ConversionError(
            f"the head is {H} wide, the target {target['hidden_size']}: a DFlash-style head "
            "embeds its block with the target's embeddings, so the widths must match. "
            "Pass the --target the head was trained for."
        )
    if cfg.get("target_hidden_size") not in (None, target["hidden_size"]):
        raise ConversionError(f"the head reads a target {cfg['target_hidden_size']} wide, --target is "
                              f"{target['hidden_size']}: pass the --target the head was trained for")
    return {
        "hidden_size": H, "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"], "num_attention_heads": nh,
        "num_key_value_heads": cfg.get("num_key_value_heads") or nh,
        "head_dim": cfg.get("head_dim") or H // nh,
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "attention_bias": bool(cfg.get("attention_bias", False)),
        **rope_fields(cfg),
        "target_hidden_size": target["hidden_size"],
        "num_taps": n_taps, "layer_windows": windows, "layer_causal": causal,
    }


def network_shapes(f: dict) -> dict:
    """Every tensor of the block network with its exact shape."""
    H, I, d = f["hidden_size"], f["intermediate_size"], f["head_dim"]
    q, kv = f["num_attention_heads"] * d, f["num_key_value_heads"] * d
    out = {"fc.weight": (H, f["num_taps"] * f["target_hidden_size"]),
           "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(f["num_hidden_layers"]):
        p = f"layers.{i}"
        out.update({f"{p}.self_attn.q_proj.weight": (q, H), f"{p}.self_attn.k_proj.weight": (kv, H),
                    f"{p}.self_attn.v_proj.weight": (kv, H), f"{p}.self_attn.o_proj.weight": (H, q),
                    f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,),
                    f"{p}.mlp.gate_proj.weight": (I, H), f"{p}.mlp.up_proj.weight": (I, H),
                    f"{p}.mlp.down_proj.weight": (H, I),
                    f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,)})
        if f["attention_bias"]:
            out.update({f"{p}.self_attn.{n}_proj.bias": (s,) for n, s in
                        (("q", q), ("k", kv), ("v", kv), ("o", H))})
    return out


def dflash2_shapes(f: dict) -> dict:
    """DFlash2's tensors: each layer's two grouped convolutions and the candidate selector."""
    H, taps, g, r = f["hidden_size"], f["conv_kernel_size"], f["conv_group_size"], f["selector_rank"]
    if H % g:
        raise ConversionError(f"conv_group_size {g} does not divide hidden_size {H}")
    out = {"candidate_selector.predecessor_codebook.weight": (f["vocab_size"], r),
           "candidate_selector.successor_codebook.weight": (f["vocab_size"], r),
           "candidate_selector.hidden_projection.weight": (r, H)}
    for i in range(f["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            out[f"layers.{i}.{conv}.base_kernel"] = (2, taps, H)
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * (H // g), H)
    return out


def check_block(block_size, mask_id, target: dict) -> None:
    if not (isinstance(block_size, int) and block_size >= 2):
        raise ConversionError(f"block_size must be an integer >= 2, got {block_size!r}")
    if not (isinstance(mask_id, int) and 0 <= mask_id < target["vocab_size"]):
        raise ConversionError(
            f"mask_token_id {mask_id!r} is not a token of the target (vocabulary "
            f"{target['vocab_size']}); was the head made for another model family?"
        )


def muse_logits(target: dict) -> tuple[float, float | None]:
    """The Muse Glimmer target's logit multiplier and softcap, as mlx-lm resolves them."""
    if target.get("model_type") != "muse_glimmer":  # mlx-lm's class for the Glimmer text tower
        raise ConversionError(
            f"the Muse Glimmer assistant drafts for Muse Glimmer targets; --target is a "
            f"{target.get('model_type')!r} model"
        )
    from mlx_lm.models.muse_glimmer import ModelArgs

    args = ModelArgs.from_dict(target)
    return float(args.output_multiplier), float(args.final_logit_softcapping)


def build(cfg: dict, weights: dict, target: dict) -> tuple[dict, dict]:
    """(head config, head weights) for either DFlash layout; raises before any work on a mismatch."""
    reason = unsupported(cfg, weights)
    if reason:
        raise ConversionError(reason)
    muse = is_muse(cfg, weights)
    dcfg = {} if muse else cfg.get("dflash_config") or {}
    arch = cfg.get("architectures") or []
    bad = [k for k in UNSUPPORTED if dcfg.get(k) is not None and dcfg.get(k) is not False
           and not (k == "attention_value_scale" and dcfg[k] == 1.0)]
    if bad:
        raise ConversionError(f"dflash_config sets {bad}, which this DFlash implementation does not support")

    def value(name, default=None):  # z-lab reads dflash_config first, then the top level
        return dcfg.get(name, cfg.get(name, default))

    v2 = (any("DFlash2" in a for a in arch) or any(k.startswith("candidate_selector.") for k in weights)
          or any(value(k) for k in DFLASH2_FIELDS))
    missing = [k for k in DFLASH2_FIELDS if v2 and not isinstance(value(k), int)]
    if missing:
        raise ConversionError(f"a DFlash2 head needs dflash_config {list(DFLASH2_FIELDS)}; "
                              f"{missing} are missing")
    small = [f"{k}={value(k)}" for k in DFLASH2_FIELDS if v2 and value(k) < 1]
    if small:
        raise ConversionError(f"dflash_config {', '.join(small)}: each of {list(DFLASH2_FIELDS)} must be "
                              ">= 1; is this config.json damaged?")

    n_layers, n_target = cfg.get("num_hidden_layers"), target["num_hidden_layers"]
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ConversionError(f"the DFlash config's num_hidden_layers (the head's own layers) is "
                              f"{n_layers!r}; is this a DFlash head's config.json?")
    if cfg.get("num_target_layers") not in (None, n_target):
        raise ConversionError(
            f"the head was trained on a {cfg['num_target_layers']}-layer target; --target has "
            f"{n_target} layers. Pass the --target the head was trained for.")
    ids = value("target_layer_ids") or default_layer_ids(n_target, n_layers)
    block_size, mask_id = value("block_size", 16), value("mask_token_id")
    check_block(block_size, mask_id, target)
    if cfg.get("vocab_size") not in (None, target["vocab_size"]):
        raise ConversionError(f"the head's vocab_size {cfg['vocab_size']} is not the target's {target['vocab_size']}")
    if muse:
        windows, causal = layer_attention(cfg, n_layers, causal_override=False)  # bidirectional
        multiplier, softcap = muse_logits(target)
    else:
        override = cfg.get("is_causal", dcfg.get("causal"))
        windows, causal = layer_attention(cfg, n_layers, override)
        multiplier, softcap = float(value("output_multiplier", 1.0)), value("final_logit_softcapping")
    fields = network_fields(cfg, target, len(ids), windows, causal)
    if v2:
        fields.update({k: int(value(k)) for k in DFLASH2_FIELDS}, vocab_size=target["vocab_size"])
    out = rename(weights, MUSE if muse else DFLASH2 if v2 else ZLAB)
    check_shapes(out, {**network_shapes(fields), **(dflash2_shapes(fields) if v2 else {})},
                 "DFlash2 checkpoint" if v2 else "DFlash checkpoint")
    config = {
        "mlx_spec": {"format": HEAD_FORMAT_VERSION, "drafter": "dflash",
                     "taps": tap_ids(ids, n_target), "target": target_identity(target)},
        **fields,
        "block_size": block_size, "mask_token_id": mask_id,
        "input_embedding_scale": float(value("input_embedding_scale", 1.0)),
        "output_multiplier": multiplier,
        "final_logit_softcapping": float(softcap) if softcap else None,
        "source": {"layout": "muse-glimmer-assistant" if muse else "z-lab-dflash2" if v2 else "z-lab-dflash-v1",
                   "architectures": arch, "target_layer_ids": ids,
                   "layer_ids": "output-of-layer (HF hidden_states[id + 1])"},
    }
    return config, out


def convert(src_folder, out_dir, target_folder, *, quantize_bits=None, group_size=64, force=False) -> Path:
    target = read_target(target_folder)
    src = Path(src_folder)
    if Path(out_dir).exists() and not force:
        raise ConversionError(f"{out_dir} already exists; use --force to replace it")
    if (src / "mask_embedding.pt").exists():
        raise ConversionError("this head ships a separate mask_embedding.pt (MiMo layout), which is not supported")
    config, weights = build(read_config(src), read_tensors(src), target)
    return write_head(Path(out_dir), config, weights, quantize_bits=quantize_bits,
                      group_size=group_size, force=force)
