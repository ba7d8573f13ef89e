"""Reading DeepSeek-V4 DSpark stages (`mtp.{s}.*`) from the target's own checkpoint folder.

Stage tensors use the trunk's DeepSeek names, so they go through the target
class's own `sanitize` (mlx-lm `deepseek_v41.Model.sanitize`: renaming, FP8/FP4
repacking, expert stacking), renamed `mtp.{s}.X -> layers.{s}.X` on the way in
and called with the stages' args (their expert count may differ). The parts
that are not a block (main_proj/main_norm on the first stage; norm, hc_head,
Markov and confidence heads on the last) come out top-level. Two layouts:

* "0731" (V4-Flash-0731): `markov_head.markov_w{1,2}`, `hc_head_{fn,base,scale}`;
  its arithmetic differs from V4.1's (net.py, flash.py).
* "v41" (V4.1, from a vendored reference): `markov_head.{embed,head}`, no hc_head.

The stages are the `mtp.0 .. mtp.{S-1}` present (0731's HF config says
`num_nextn_predict_layers: 1` for its 3 stages). FP8 `.scale` grids are read as
square tiles whose size follows from the shapes (0731: 128x128, V4.1: 32x32) and
brought to mlx-lm's 32x32 layout before `sanitize`. Every tensor must land on a
parameter of the stages built from the target's config, with its shape; anything
missing, misshaped or left over is an error.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import deepseek_v41 as dsv4

from ...weights import check_fit, fp8_tile, quantize_as_stored
from ..spark_chain import SparkConfig
from ..mtp.families import load_tensors, tensor_index
from .drafter import V4DSparkDrafter
from .net import DSparkStages, stage_args

REQUIRED = ("dspark_block_size", "dspark_target_layer_ids", "dspark_noise_token_id")
FIRST_ONLY = ("main_proj.", "main_norm.")
LAST_ONLY = ("norm.", "hc_head_", "markov_head.", "confidence_head.")
# Routes image tokens (mlx-lm's sanitize drops it from the trunk too); a text drafter never
# sees one, so it is skipped on purpose.
IGNORED = (".gate.bias_vl",)
V41_MARKOV = {"markov_head.embed.weight": "markov_head.markov_w1.weight",
              "markov_head.head.weight": "markov_head.markov_w2.weight"}
# mlx-lm name piece -> DeepSeek name piece, for messages and test fixtures (inverse of _rename).
NATIVE = [(".self_attn.", ".attn."), (".mlp.", ".ffn."), (".input_layernorm.", ".attn_norm."),
          (".post_attention_layernorm.", ".ffn_norm."), (".attn_hc.", ".hc_attn_"),
          (".ffn_hc.", ".hc_ffn_"), (".sinks", ".attn_sink"), (".q_a_proj.", ".wq_a."),
          (".q_b_proj.", ".wq_b."), (".kv_proj.", ".wkv."), (".o_a_proj.", ".wo_a."),
          (".o_b_proj.", ".wo_b."), (".q_a_norm.", ".q_norm."), (".compressor.kv_norm.", ".compressor.norm."),
          (".indexer.k_proj.", ".indexer.wk."), (".gate.e_score_correction_bias", ".gate.bias"),
          (".shared_experts.gate_proj.", ".shared_experts.w1."),
          (".shared_experts.down_proj.", ".shared_experts.w2."),
          (".shared_experts.up_proj.", ".shared_experts.w3."),
          (".experts.switch_mlp.gate_proj.", ".experts.{e}.w1."),
          (".experts.switch_mlp.down_proj.", ".experts.{e}.w2."),
          (".experts.switch_mlp.up_proj.", ".experts.{e}.w3."), (".gate_proj.", ".wgate.")]


def native_name(key: str) -> str:
    """An mlx-lm deepseek_v41 parameter name in DeepSeek's checkpoint naming."""
    if key == "lm_head.weight":
        return "head.weight"
    if key == "model.embed_tokens.weight":
        return "embed.weight"
    key = "." + key.removeprefix("model.")
    for mine, theirs in NATIVE:
        key = key.replace(mine, theirs)
    return key[1:]


def _stage_key(key: str, stage: int, last: int) -> str:
    """A sanitized stage tensor `layers.{s}.X` -> its DSparkStages parameter name."""
    rest = key.split(".", 2)[2]
    if rest.startswith(FIRST_ONLY + LAST_ONLY):
        if rest.startswith(FIRST_ONLY) and stage != 0 or rest.startswith(LAST_ONLY) and stage != last:
            where = "the first" if rest.startswith(FIRST_ONLY) else "the last"
            raise ValueError(f"mtp.{stage}.{rest}: expected only on {where} DSpark stage")
        return V41_MARKOV.get(rest, rest)
    return key


def _to_32_tiles(raw: dict) -> dict:
    """Dense FP8 weights' tile scales -> the 32x32 grid mlx-lm's `sanitize` expects."""
    out = dict(raw)
    for key, scale in raw.items():
        weight = raw.get(key.removesuffix("scale") + "weight") if key.endswith(".scale") else None
        if weight is None or scale.ndim != 2 or scale.shape[0] == weight.shape[0]:
            continue  # not a tile grid (experts keep one scale row per weight row)
        tile = fp8_tile(weight.shape, scale.shape)
        if tile is None:
            raise ValueError(
                f"{key}: a scale grid {tuple(scale.shape)} for the FP8 weight "
                f"{tuple(weight.shape)} fits no square tile (32x32, 64x64, 128x128, ...); "
                "the checkpoint is damaged or in an unknown FP8 layout")
        k = tile // 32
        if k > 1:
            out[key] = mx.repeat(mx.repeat(scale, k, axis=0), k, axis=1)[
                : -(-weight.shape[0] // 32), : -(-weight.shape[1] // 32)]
    return out


def stage_weights(raw: dict, args: dsv4.ModelArgs, stages: int) -> dict:
    """`mtp.{s}.*` tensors (DeepSeek names) -> DSparkStages weights (MLX names and layout)."""
    renamed = {}
    for key, value in _to_32_tiles(raw).items():
        if key.endswith(IGNORED):
            continue
        if ".engram." in key:
            raise ValueError(f"{key}: engram stages are not supported (neither by mlx-lm)")
        stage = int(key.split(".")[1])
        if stage >= stages:
            raise ValueError(f"{key}: expected only {stages} DSpark stages")
        renamed["layers." + key.split(".", 1)[1]] = value
    try:  # `sanitize` reads only `self.args`: run it with the stages' args, not the target's
        clean = dsv4.Model.sanitize(SimpleNamespace(args=args), renamed)
    except ValueError as e:
        raise ValueError(f"DSpark stage tensors (mtp.*): {e}") from None
    out = {}
    for key, value in clean.items():
        key = key.removeprefix("model.")
        out[_stage_key(key, int(key.split(".")[1]), stages - 1)] = value
    return out


def _quantize_like_target(net: nn.Module, model) -> None:
    """Unquantized stages of a quantized target: quantize each block module as the
    same module of the target's layer 0 (class, bits, group size, mode)."""
    trunk = dict(model.layers[0].named_modules())

    def like(path: str, m: nn.Module):
        parts = path.split(".")
        name = ".".join(parts[2:])
        twin = trunk.get(name, trunk.get(_vlm_name(name))) if parts[0] == "layers" else None
        if not hasattr(m, "to_quantized") or not hasattr(twin, "bits"):
            return False
        return {"group_size": twin.group_size, "bits": twin.bits,
                "mode": getattr(twin, "mode", "affine")}

    nn.quantize(net, class_predicate=like)


# mlx-lm deepseek_v41 module path -> mlx-vlm deepseek_v4's (a DeepSeek-V4-Flash target's layers)
VLM_NAMES = [("self_attn.q_a_proj", "attn.wq_a"), ("self_attn.q_b_proj", "attn.wq_b"),
             ("self_attn.kv_proj", "attn.wkv"), ("self_attn.o_a_proj", "attn.wo_a"),
             ("self_attn.o_b_proj", "attn.wo_b"), ("mlp.experts.switch_mlp.", "ffn.switch_mlp."),
             ("mlp.shared_experts.", "ffn.shared_experts."), ("mlp.gate", "ffn.gate")]


def _vlm_name(name: str) -> str:
    for mine, theirs in VLM_NAMES:
        name = name.replace(mine, theirs)
    return name


def _source_name(key: str, last: int) -> str:
    """Where a DSparkStages parameter comes from in the checkpoint (for messages)."""
    if key.startswith("layers."):
        return "mtp." + native_name(key).removeprefix("layers.")
    return f"mtp.{0 if key.startswith(FIRST_ONLY) else last}.{key}"


def _load_strict(net: nn.Module, weights: dict, model, folder) -> None:
    stored_quant = any(k.endswith(".scales") for k in weights)
    if stored_quant:
        quantize_as_stored(net, weights)
    last = len(net.layers) - 1
    check_fit(dict(tree_flatten(net.parameters())), weights, "DSpark stage",
              "the folder does not hold this target's DeepSeek-V4 DSpark stages (or is damaged)",
              where=f"{folder}: ", source=lambda key: f"{key} (checkpoint name {_source_name(key, last)})")
    net.load_weights(list(weights.items()), strict=True)
    if not stored_quant:
        _quantize_like_target(net, model)
    mx.eval(net.parameters())


def _variant(index: dict, last: int, folder) -> tuple[str, bool]:
    """("0731" | "v41", has a confidence bias), refusing a last stage without a Markov head."""
    p = f"mtp.{last}."
    if f"{p}markov_head.markov_w1.weight" not in index and f"{p}markov_head.embed.weight" not in index:
        raise ValueError(
            f"{folder}: the last DSpark stage has no Markov head: expected "
            f"{p}markov_head.markov_w1.weight (V4-Flash-0731) or {p}markov_head.embed.weight "
            "(V4.1); is num_nextn_predict_layers right?")
    variant = "0731" if f"{p}markov_head.markov_w1.weight" in index else "v41"
    if (variant == "0731") != (f"{p}hc_head_fn" in index):
        raise ValueError(
            f"{folder}: the last DSpark stage mixes the two namings: "
            + ("markov_w1/markov_w2 (V4-Flash-0731) without hc_head_fn" if variant == "0731"
               else "markov_head.embed/head (V4.1) with hc_head_fn")
            + "; the stage arithmetic depends on which model this is")
    return variant, f"{p}confidence_head.proj.bias" in index


def _stage_count(text: dict, names: list, folder) -> int:
    """S from the mtp.* tensors present, which must be mtp.0 .. mtp.{S-1}.

    `num_nextn_predict_layers` is not the count (V4-Flash-0731's HF config says 1 for
    its 3 stages); it may only not exceed it. `n_mtp_layers` (the reference's own
    name), when a config carries it, must equal it."""
    have = sorted({int(k.split(".")[1]) for k in names})
    stages = len(have)
    if have != list(range(stages)):
        raise ValueError(f"{folder}: mtp.* tensors for stages {have}: DSpark stages must be "
                         f"mtp.0 .. mtp.{have[-1]} with none missing")
    declared = text.get("n_mtp_layers")
    if declared is not None and int(declared) != stages:
        raise ValueError(f"{folder}: config.json declares n_mtp_layers {declared}, but the "
                         f"safetensors hold {stages} DSpark stages (mtp.0 .. mtp.{stages - 1})")
    nextn = text.get("num_nextn_predict_layers")
    if nextn is not None and int(nextn) > stages:
        raise ValueError(f"{folder}: config.json declares num_nextn_predict_layers {nextn}, "
                         f"but the safetensors hold only {stages} DSpark stages")
    return stages


def probe(folder, config: dict, model, *, confidence_threshold: float | None = None,
          cut: str = "sync", sample_drafts: bool = True,
          num_speculative_tokens: int | None = None) -> V4DSparkDrafter | None:
    """The DSpark drafter of a DeepSeek-V4 target folder; None without dspark_* fields.

    `num_speculative_tokens` N builds blocks of N rows `[y, noise x (N-1)]` instead of
    `dspark_block_size`, as vLLM's `"num_speculative_tokens": N` does (the V4-Flash-0731
    model card runs N = 7 with its 5-row trained block); up to N drafts per step."""
    text = config.get("text_config", config)
    if not any(key.startswith("dspark_") for key in text):
        return None
    folder = Path(folder)
    missing = [k for k in REQUIRED if k not in text]
    if missing:
        raise ValueError(f"{folder}: config.json has dspark_* fields but lacks {missing}; "
                         "is it a complete DeepSeek-V4 DSpark config?")
    target_args = _target_args(model, text, folder)
    have = model.args  # mlx-lm's deepseek_v41 args, or mlx-vlm's deepseek_v4 config
    differ = [f"{k}: {text[k]} there, {getattr(have, k)} in the model"
              for k in ("hidden_size", "vocab_size", "num_hidden_layers")
              if text.get(k) is not None and text[k] != getattr(have, k, text[k])]
    if differ:  # before any stage tensor is read
        raise ValueError(f"{folder} is not the loaded target's checkpoint ({'; '.join(differ)}); "
                         "pass the target's own folder")
    ids = list(text["dspark_target_layer_ids"])
    index = tensor_index(folder)
    names = [k for k in index if k.startswith("mtp.")]
    if not names:
        raise ValueError(
            f"{folder}: config.json declares DeepSeek-V4 DSpark stages but the safetensors "
            "hold no mtp.* tensors (mlx-lm conversions drop them); point at the original "
            "DeepSeek checkpoint folder")
    stages = _stage_count(text, names, folder)
    variant, conf_bias = _variant(index, stages - 1, folder)
    last = f"mtp.{stages - 1}."
    rank_key = next(k for k in (f"{last}markov_head.markov_w1.weight", f"{last}markov_head.embed.weight")
                    if k in index)
    rank = int(text.get("dspark_markov_rank") or index[rank_key][1][-1])
    confidence = f"{last}confidence_head.proj.weight" in index
    args = stage_args(target_args, stages, text)
    net = DSparkStages(args, len(ids), rank, variant=variant, confidence=confidence,
                       confidence_bias=conf_bias)
    _load_strict(net, stage_weights(load_tensors(index, names), args, stages), model, folder)
    spark = SparkConfig(vocab_size=args.vocab_size, markov_rank=rank, confidence_head=confidence,
                        confidence_with_markov=True, confidence_bias=conf_bias)
    drafter = V4DSparkDrafter(
        net, spark, ids, block_size=int(text["dspark_block_size"]),
        noise_token_id=int(text["dspark_noise_token_id"]), window=args.sliding_window,
        confidence_threshold=confidence_threshold, cut=cut, sample_drafts=sample_drafts)
    if num_speculative_tokens is not None:
        drafter.set_block(num_speculative_tokens)
    return drafter


def _target_args(model, text: dict, folder) -> dsv4.ModelArgs:
    """The stages' base arguments: the target's own (mlx-lm `deepseek_v41`), or, for a
    DeepSeek-V4-Flash target (`mlx_spec.targets.deepseek_v4`), its config read as mlx-lm's."""
    from ...targets.deepseek_v4 import DeepseekV4

    if isinstance(getattr(model, "args", None), dsv4.ModelArgs):
        return model.args
    if isinstance(model, DeepseekV4):
        return dsv4.ModelArgs.from_dict({k: v for k, v in text.items() if k != "engram_layer_ids"})
    raise ValueError(
        f"{folder} carries DeepSeek-V4 DSpark stages, which run only on a DeepSeek-V4 target "
        "(mlx_spec.load of a deepseek_v4 folder, or mlx-lm's deepseek_v41 model), not "
        f"{type(model).__module__}.{type(model).__name__}")
