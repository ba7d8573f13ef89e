"""--format dspark: DeepSpec DSpark heads (`Qwen3DSparkModel` in deepseek-ai/DeepSpec `deepspec/modeling/dspark/qwen3/`).

The checkpoint is a DFlash network (`fc`, `hidden_norm`, `layers.*`, `norm`,
converted with the DFlash tables) plus:

| key                                  | shape        | head key (same)                   |
|--------------------------------------|--------------|-----------------------------------|
| `embed_tokens.weight`                | [V, H]       | kept unless equal to the target's |
| `lm_head.weight`                     | [V, H]       | kept unless equal to the target's |
| `markov_head.markov_w1.weight`       | [V, r]       | lookup W1                         |
| `markov_head.markov_w2.weight`       | [V, r]       | Linear r -> V                     |
| `confidence_head.proj.{weight,bias}` | [1, H(+r)], [1] |                                |

Config: `block_size`, `mask_token_id`, `target_layer_ids` (output-of-layer;
-1 = the embedding output -> tap `embed`), `markov_rank` (0 = DeepSpec's
"DFlash" checkpoints: same class, no Markov head), `markov_head_type` (only
`vanilla`), `enable_confidence_head`, `confidence_head_with_markov`. In-block
attention is bidirectional in every layer. DeepSpec copies the target's
embedding and LM head byte for byte; when the --target folder holds identical
unquantized tensors they are dropped and the target's are used at run time.
Non-goals: gated/rnn Markov heads, reduced vocabularies (`d2t`), DeepSeek-V4's
in-checkpoint stages (see mlx_spec.drafters.dspark.probe_target).
"""

from __future__ import annotations

from pathlib import Path

from .common import (
    HEAD_FORMAT_VERSION, ConversionError, check_shapes, read_config, read_tensors, rename,
    target_identity, write_head,
)
from .dflash import (
    ZLAB, check_block, layer_attention, network_fields, network_shapes, read_target, tap_ids,
)

TABLE = [
    *ZLAB,
    (r"embed_tokens\.weight", "embed_tokens.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"markov_head\.markov_w([12])\.weight", r"markov_head.markov_w\1.weight"),
    (r"confidence_head\.proj\.(weight|bias)", r"confidence_head.proj.\1"),
]


def detect(config: dict, tensor_names) -> bool:
    names = set(tensor_names)
    return (any("DSpark" in a for a in config.get("architectures") or [])
            or "markov_head.markov_w1.weight" in names
            or {"fc.weight", "hidden_norm.weight", "embed_tokens.weight", "lm_head.weight"} <= names)


def spark_fields(cfg: dict, weights: dict) -> dict:
    """Markov and confidence settings, checked against each other."""
    rank = cfg.get("markov_rank", 0) or 0
    if rank and cfg.get("markov_head_type", "vanilla") != "vanilla":
        raise ConversionError(
            f"markov_head_type {cfg['markov_head_type']!r} is not supported (only 'vanilla')")
    conf = bool(cfg.get("enable_confidence_head", "confidence_head.proj.weight" in weights))
    with_markov = conf and bool(cfg.get("confidence_head_with_markov", rank > 0))
    if with_markov and not rank:
        raise ConversionError("confidence_head_with_markov is set but markov_rank is 0")
    return {"markov_rank": rank, "confidence_head": conf, "confidence_with_markov": with_markov,
            "confidence_bias": "confidence_head.proj.bias" in weights}


def extra_shapes(f: dict, s: dict, V: int, out: dict) -> dict:
    H, r = f["hidden_size"], s["markov_rank"]
    shapes = {k: (V, H) for k in ("embed_tokens.weight", "lm_head.weight") if k in out}
    if r:
        shapes.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r)})
    if s["confidence_head"]:
        shapes["confidence_head.proj.weight"] = (1, H + (r if s["confidence_with_markov"] else 0))
        if s["confidence_bias"]:
            shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def drop_copies(out: dict, target_weights: dict) -> None:
    """Drop embed_tokens / lm_head when they equal the target's own (DeepSpec copies them)."""
    import mlx.core as mx

    mine = {"embed_tokens.weight": "model.embed_tokens.weight",
            "lm_head.weight": "lm_head.weight" if "lm_head.weight" in target_weights
            else "model.embed_tokens.weight"}
    for key, theirs in mine.items():
        t = target_weights.get(theirs)
        if key in out and t is not None and t.shape == out[key].shape and t.dtype == out[key].dtype \
                and mx.array_equal(t, out[key]).item():
            del out[key]


def build(cfg: dict, weights: dict, target: dict, target_weights: dict | None = None) -> tuple[dict, dict]:
    """(head config, head weights); raises before any work on a mismatch."""
    if any("Gemma" in a for a in cfg.get("architectures") or []):
        raise ConversionError("Gemma-4 DSpark heads (Gemma4DSparkModel) are not supported; "
                              "only the Qwen3 layout (Qwen3DSparkModel) is")
    n_layers, n_target, V = cfg.get("num_hidden_layers"), target["num_hidden_layers"], target["vocab_size"]
    ids = cfg.get("target_layer_ids")
    if not ids:
        raise ConversionError("the DSpark config has no target_layer_ids")
    if cfg.get("num_target_layers") not in (None, n_target):
        raise ConversionError(
            f"the head was trained on a {cfg['num_target_layers']}-layer target; --target has "
            f"{n_target} layers. Pass the --target the head was trained for.")
    if cfg.get("vocab_size") not in (None, V):
        raise ConversionError(f"the head's vocab_size {cfg['vocab_size']} is not the target's {V}")
    block_size, mask_id = cfg.get("block_size"), cfg.get("mask_token_id")
    check_block(block_size, mask_id, target)
    spark = spark_fields(cfg, weights)
    windows, causal = layer_attention(cfg, n_layers, causal_override=False)  # bidirectional
    fields = network_fields(cfg, target, len(ids), windows, causal)
    out = rename(weights, TABLE)
    check_shapes(out, {**network_shapes(fields), **extra_shapes(fields, spark, V, out)},
                 "DSpark checkpoint")
    if target_weights:
        drop_copies(out, target_weights)
    config = {
        "mlx_spec": {"format": HEAD_FORMAT_VERSION, "drafter": "dspark",
                     "taps": tap_ids(ids, n_target, embed_ok=True), "target": target_identity(target)},
        **fields, **spark,
        "vocab_size": V, "block_size": block_size, "mask_token_id": mask_id,
        "own_embeddings": "embed_tokens.weight" in out, "own_lm_head": "lm_head.weight" in out,
        "source": {"layout": "deepspec-dspark", "architectures": cfg.get("architectures"),
                   "target_layer_ids": ids,
                   "layer_ids": "output-of-layer (HF hidden_states[id + 1]; -1 = embedding)"},
    }
    return config, out


def target_tensors(target_folder) -> dict:
    """The target's tensors (lazily loaded) when its folder has safetensors, else {}."""
    folder = Path(target_folder).expanduser()
    return read_tensors(folder) if any(folder.glob("*.safetensors")) else {}


def convert(src_folder, out_dir, target_folder, *, quantize_bits=None, group_size=64, force=False) -> Path:
    target = read_target(target_folder)
    if Path(out_dir).exists() and not force:
        raise ConversionError(f"{out_dir} already exists; use --force to replace it")
    src = Path(src_folder)
    config, weights = build(read_config(src), read_tensors(src), target, target_tensors(target_folder))
    return write_head(Path(out_dir), config, weights, quantize_bits=quantize_bits,
                      group_size=group_size, force=force)
