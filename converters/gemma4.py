"""--format gemma4: Gemma 4 assistant drafters (`google/gemma-4-*-it-assistant`).

Config (`model_type: gemma4_assistant`, `Gemma4AssistantForCausalLM`; the 12B's
`gemma4_unified_assistant`): `backbone_hidden_size` (the target's width), `text_config`
(the assistant's own Gemma 4 text model), `tie_word_embeddings`, and for E2B/E4B
`use_ordered_embeddings`, `num_centroids`, `centroid_intermediate_top_k`.

| checkpoint key                              | head key                        |
|---------------------------------------------|---------------------------------|
| `model.embed_tokens.weight` [V, H_a]        | `embed_tokens.weight`           |
| `model.layers.{i}.*` (q_proj, q_norm, o_proj, the four norms, mlp, layer_scalar) | `layers.{i}.*` |
| `model.norm.weight`                         | `norm.weight`                   |
| `pre_projection.weight` [H_a, 2 H_t]        | same                            |
| `post_projection.weight` [H_t, H_a]         | same                            |
| `lm_head.weight` [V, H_a] (untied heads)    | same; dropped when tied         |
| `masked_embedding.centroids.weight`, `masked_embedding.token_ordering` [V] | same (ids as int32) |

The layers have no K/V projections: they read the target's (see
mlx_spec.drafters.gemma4_assistant). A layer without `layer_scalar` gets 1, the value
Gemma 4 initialises it to. Every other tensor must be present with its shape.
"""

from __future__ import annotations

from pathlib import Path

from .common import (
    HEAD_FORMAT_VERSION, ConversionError, check_shapes, read_config, read_tensors, rename, target_identity,
    write_head,
)
from .dflash import read_target

MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
TABLE = [
    (r"model\.embed_tokens\.weight", "embed_tokens.weight"),
    (r"model\.layers\.(\d+)\.(.+)", r"layers.\1.\2"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"(pre|post)_projection\.weight", r"\1_projection.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"masked_embedding\.(centroids\.weight|token_ordering)", r"masked_embedding.\1"),
    (r".*rotary_emb\.inv_freq", None),
]
FIELDS = ("backbone_hidden_size", "tie_word_embeddings", "use_ordered_embeddings",
          "num_centroids", "centroid_intermediate_top_k")


def detect(config: dict, tensor_names) -> bool:
    return (config.get("model_type") in MODEL_TYPES
            or any("Gemma4Assistant" in a or "Gemma4UnifiedAssistant" in a
                   for a in config.get("architectures") or []))


def build(cfg: dict, weights: dict, target: dict) -> tuple[dict, dict]:
    """(head config, head weights); raises before any work on a mismatch."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_spec.drafters.gemma4_assistant import AssistantNet

    if target.get("model_type") not in ("gemma4", "gemma4_text"):
        raise ConversionError(f"a Gemma 4 assistant drafts for Gemma 4 targets; --target is a "
                              f"{target.get('model_type')!r} model")
    text = cfg.get("text_config")
    if not isinstance(text, dict) or not isinstance(cfg.get("backbone_hidden_size"), int):
        raise ConversionError("the assistant's config.json lacks text_config or backbone_hidden_size")
    if cfg["backbone_hidden_size"] != target["hidden_size"]:
        raise ConversionError(f"the assistant reads a {cfg['backbone_hidden_size']}-wide target, "
                              f"--target is {target['hidden_size']} wide: pass the target it was "
                              "made for (gemma-4-X-it-assistant drafts for gemma-4-X-it)")
    if text.get("vocab_size", target["vocab_size"]) != target["vocab_size"]:
        raise ConversionError(f"the assistant drafts over {text['vocab_size']} tokens, the target "
                              f"has {target['vocab_size']}")
    config = {
        "mlx_spec": {"format": HEAD_FORMAT_VERSION, "drafter": "gemma4_assistant",
                     "taps": ["final_norm"], "target": target_identity(target)},
        **{k: cfg[k] for k in FIELDS if k in cfg},
        # (the published configs keep it in text_config, the drafter's own model config)
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
        "text_config": {**text, "vocab_size": target["vocab_size"]},
        "source": {"layout": cfg.get("model_type"), "architectures": cfg.get("architectures")},
    }
    if config.get("use_ordered_embeddings") and not all(
            isinstance(cfg.get(k), int) for k in ("num_centroids", "centroid_intermediate_top_k")):
        raise ConversionError("use_ordered_embeddings needs num_centroids and centroid_intermediate_top_k")
    out = rename(weights, TABLE)
    if config["tie_word_embeddings"]:
        out.pop("lm_head.weight", None)  # tied to embed_tokens
    if "masked_embedding.token_ordering" in out:
        order = out["masked_embedding.token_ordering"]
        if order.size and (order.min().item() < 0 or order.max().item() >= target["vocab_size"]):
            raise ConversionError(f"masked_embedding.token_ordering holds token ids outside 0..{target['vocab_size'] - 1}")
        out["masked_embedding.token_ordering"] = order.astype(mx.int32)
    want = dict(tree_flatten(AssistantNet(config).parameters()))
    for key in [k for k in want if k.endswith(".layer_scalar") and k not in out]:
        out[key] = mx.ones((1,))
    check_shapes(out, {k: v.shape for k, v in want.items()}, "Gemma 4 assistant checkpoint")
    return config, out


def convert(src_folder, out_dir, target_folder, *, quantize_bits=None, group_size=64, force=False) -> Path:
    target = read_target(target_folder)
    if Path(out_dir).exists() and not force:
        raise ConversionError(f"{out_dir} already exists; use --force to replace it")
    src = Path(src_folder)
    config, weights = build(read_config(src), read_tensors(src), target)
    return write_head(Path(out_dir), config, weights, quantize_bits=quantize_bits,
                      group_size=group_size, force=force)
