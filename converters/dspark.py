"""--format dspark: DSpark heads: DeepSpec's (`Qwen3DSparkModel` in deepseek-ai/DeepSpec
`deepspec/modeling/dspark/qwen3/`) and vllm-project/speculators' (`DSparkSpeculator`).

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

Reduced draft vocabularies (vLLM's `qwen3_dspark.py`, speculators' `MarkovHead`):
`draft_vocab_size` V_d < V, `lm_head [V_d, H]`, `markov_w2 [V_d, r]` (W1 stays [V, r],
indexed by target ids), `d2t [V_d]` offsets (target id = draft id + d2t[draft id]),
stored as absolute ids `draft_to_target`; `t2d [V]` is training-only and dropped.

speculators' layout (`speculators_model_type: "dspark"`, `src/speculators/models/dspark/`):
the DeepSpec fields sit in `transformer_layer_config` and the top level;
`aux_hidden_state_layer_ids` are vLLM's input-of-layer ids (vLLM's speculators
`update_dflash` stores `target_layer_ids = [i - 1 for i in aux_hidden_state_layer_ids]`),
so id k reads tap k-1 (0: the embedding). Block row 0 may hold the anchor only (rows 1..
draft, DFlash-style) or draft too (DeepSpec): see `drafts_from_anchor`; speculators'
training aligns its Markov inputs the DFlash way (`prev_token_ids` of row k = block
token k-1), and vLLM runs such checkpoints with `dspark_bonus_anchor`.
Non-goals: gated/rnn Markov heads, DeepSeek-V4's in-checkpoint stages (see
mlx_spec.drafters.dspark.probe_target).
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
    (r"d2t", "d2t"),  # turned into draft_to_target below
    (r"t2d", None),  # target -> draft mask, used in training only
]
SPECULATORS_FIELDS = ("block_size", "mask_token_id", "markov_rank", "markov_head_type",
                      "enable_confidence_head", "confidence_head_with_markov", "draft_vocab_size",
                      "target_hidden_size")


def detect(config: dict, tensor_names) -> bool:
    names = set(tensor_names)
    return (config.get("speculators_model_type") == "dspark"
            or any("DSpark" in a for a in config.get("architectures") or [])
            or "markov_head.markov_w1.weight" in names
            or {"fc.weight", "hidden_norm.weight", "embed_tokens.weight", "lm_head.weight"} <= names)


GEMMA_DSPARK = (
    "this is a DeepSpec Gemma 4 DSpark head (Gemma4DSparkModel, deepseek-ai/DeepSpec "
    "deepspec/modeling/dspark/gemma4). Its backbone is made of Gemma 4 decoder layers (norms "
    "before and after attention and MLP, one K=V projection on full-attention layers with their "
    "own head size, embeddings scaled by sqrt(hidden_size)), and mlx-spec's DSpark drafter builds "
    "only the Qwen3 DFlash backbone (Qwen3DSparkModel, speculators' dspark). For a Gemma 4 target "
    "use its assistant (--format gemma4) or a DFlash head instead."
)


def unsupported(config: dict, tensor_names) -> str | None:
    """Why a recognised DSpark layout cannot be loaded (converters.head asks before detect)."""
    if any("Gemma" in a and "DSpark" in a for a in config.get("architectures") or []):
        return GEMMA_DSPARK
    return None


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


def speculators_config(config: dict) -> dict:
    """A speculators DSpark config in DeepSpec's field names (output-of-layer target ids)."""
    layer = config.get("transformer_layer_config")
    aux = config.get("aux_hidden_state_layer_ids")
    if not isinstance(layer, dict) or not aux:
        raise ConversionError("a speculators DSpark config needs transformer_layer_config and "
                              "aux_hidden_state_layer_ids")
    return {**layer, "architectures": config.get("architectures"),
            **{k: config[k] for k in SPECULATORS_FIELDS if config.get(k) is not None},
            "target_layer_ids": [int(k) - 1 for k in aux],
            "sample_from_anchor": drafts_from_anchor(config), "source_layer_ids": list(aux)}


def drafts_from_anchor(config: dict) -> bool:
    """Whether block row 0 drafts too (DeepSpec) or holds the anchor only (DFlash-style).

    The proposal width pins it (`speculators_config.proposal_methods[0].speculative_tokens`
    = block_size: row 0 drafts; block_size - 1: it does not), then `sample_from_anchor`;
    a config with neither predates the field and keeps row 0 for the anchor."""
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    n, block = methods[0].get("speculative_tokens"), config.get("block_size")
    if isinstance(n, int) and isinstance(block, int) and block - n in (0, 1):
        return block - n == 0
    return bool(config.get("sample_from_anchor", False))


def draft_to_target(d2t, V_d: int, V: int):
    import mlx.core as mx

    if tuple(d2t.shape) != (V_d,):
        raise ConversionError(f"d2t has shape {tuple(d2t.shape)}, expected ({V_d},) for "
                              f"draft_vocab_size {V_d}")
    ids = d2t.astype(mx.int64) + mx.arange(V_d, dtype=mx.int64)
    lo, hi = ids.min().item(), ids.max().item()
    if lo < 0 or hi >= V:
        raise ConversionError(f"d2t maps draft ids to target ids {lo}..{hi}, outside the "
                              f"target's 0..{V - 1}")
    return ids.astype(mx.int32)


def extra_shapes(f: dict, s: dict, V: int, out: dict, V_d: int | None = None) -> dict:
    H, r, V_d = f["hidden_size"], s["markov_rank"], V_d or V
    shapes = {"embed_tokens.weight": (V, H), "lm_head.weight": (V_d, H)}
    shapes = {k: v for k, v in shapes.items() if k in out}
    if r:
        shapes.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V_d, r)})
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
        raise ConversionError(GEMMA_DSPARK)
    speculators = cfg.get("speculators_model_type") == "dspark"
    if speculators:
        cfg = speculators_config(cfg)
    n_layers, n_target, V = cfg.get("num_hidden_layers"), target["num_hidden_layers"], target["vocab_size"]
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ConversionError(f"the DSpark config's num_hidden_layers (the head's own layers) is "
                              f"{n_layers!r}; is this a DSpark head's config.json?")
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
    V_d = int(cfg.get("draft_vocab_size") or V)
    d2t = out.pop("d2t", None)
    if (d2t is not None or V_d != V) and "lm_head.weight" not in out:
        raise ConversionError(f"a reduced draft vocabulary ({V_d} of {V} tokens) needs the "
                              "head's own lm_head.weight, which the checkpoint lacks")
    if d2t is not None:
        out["draft_to_target"] = draft_to_target(d2t, V_d, V)
    elif V_d != V:
        raise ConversionError(f"the draft vocabulary ({V_d}) differs from the target's ({V}) "
                              "but the checkpoint has no d2t")
    check_shapes(out, {**network_shapes(fields), **extra_shapes(fields, spark, V, out, V_d),
                       **({"draft_to_target": (V_d,)} if d2t is not None else {})},
                 "DSpark checkpoint")
    if target_weights:
        drop_copies(out, target_weights)
    config = {
        "mlx_spec": {"format": HEAD_FORMAT_VERSION, "drafter": "dspark",
                     "taps": tap_ids(ids, n_target, embed_ok=True), "target": target_identity(target)},
        **fields, **spark,
        "vocab_size": V, "block_size": block_size, "mask_token_id": mask_id,
        "own_embeddings": "embed_tokens.weight" in out, "own_lm_head": "lm_head.weight" in out,
        "draft_vocab_size": V_d, "sample_from_anchor": bool(cfg.get("sample_from_anchor", True)),
        "source": {"layout": "speculators-dspark" if speculators else "deepspec-dspark",
                   "architectures": cfg.get("architectures"),
                   "target_layer_ids": cfg.get("source_layer_ids", ids),
                   "layer_ids": ("input-of-layer (vLLM aux_hidden_state_layer_ids: id k = tap k-1)"
                                 if speculators else
                                 "output-of-layer (HF hidden_states[id + 1]; -1 = embedding)")},
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
