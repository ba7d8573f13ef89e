"""Import EAGLE heads: EAGLE-1/2 (`v1`, --format eagle) and EAGLE-3 (`v3`, --format eagle3).

This module holds what both converters share: reading the target's config
(`--target` may be a folder or a Hugging Face repo id; only its config.json is
needed), the head's decoder-layer fields in one normalised form, the
`mlx_spec` block of the output config, and the translation of target layer
ids from each checkpoint's convention into mlx-spec tap ids (SafeAILab/EAGLE `eagle/model/cnets.py`, vLLM `llama_eagle3.py`, speculators' `eagle_aux_hidden_state_layer_ids`):

| convention      | checkpoint id k means                 | mlx-spec tap id             |
|-----------------|---------------------------------------|-----------------------------|
| input-of-layer  | residual stream entering layer k      | k - 1 (k = 0: `EMBED`)      |
| output-of-layer | output of layer k (-1 = embedding)    | k (-1: `EMBED`)             |

Invariant: every check runs before anything is written; a mismatch with the
target raises `ConversionError` naming the field, the head's value and the
target's. Layouts recognised but refused, each with the reason
(`unsupported`): speculators' EAGLE-1/HASS layout (`fusion_fc`), SGLang's
multi-layer EAGLE-3 drafts (`additional_layers.{j}` and `midlayers.{i}`).
"""

from __future__ import annotations

from pathlib import Path

from mlx_spec.taps import EMBED

from ..common import (
    HEAD_FORMAT_VERSION,
    ConversionError,
    int_fields,
    read_config,
    rekey,
    read_tensors,
    target_identity,
    write_head,
)


def target_config(target) -> dict:
    """config.json of the target: a local folder, or a Hugging Face repo id (config only)."""
    if target is None:
        raise ConversionError(
            "--target is required: an EAGLE head drafts for one target model; give the "
            "target's folder or Hugging Face repo id"
        )
    path = Path(target).expanduser()
    if path.is_dir():
        config = read_config(path)
    elif str(target).count("/") == 1 and not str(target).startswith((".", "/", "~")):
        import json

        from huggingface_hub import hf_hub_download

        config = json.loads(Path(hf_hub_download(str(target), "config.json")).read_text())
    else:
        raise ConversionError(f"--target {target}: no such folder (and not a Hugging Face repo id)")
    if not isinstance(config, dict):
        raise ConversionError(f"--target {target}: its config.json is not a JSON object")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if not isinstance(text.get(key, config.get(key)), int):
            raise ConversionError(f"--target {target}: its config.json has no {key}; is it a language model?")
    return config


def unsupported(config: dict, tensor_names) -> str | None:
    """Why a recognised head layout cannot be loaded (None when it is not one of those).

    Each case names what mlx-spec would need and why it does not guess:
    * speculators' EAGLE-1/HASS layout: speculators (the producer,
      `models/eagle.py`) applies `pre_lm_head_layernorm` before the LM head and
      keeps layer 0's input norm, while vLLM (`llama_eagle.py`) loads the same
      tensor as `hidden_states_layernorm` on the incoming feature and drops the
      input norm: the two disagree on the forward, so there is no reference.
    * SGLang multi-layer EAGLE-3 (`llama_eagle3.py`: `midlayer` plus
      `additional_layers.{j}`): every later layer restarts its residual from the
      previous layer's MLP output, unlike the speculators/vLLM multi-layer heads
      mlx-spec reads (`layers.{i}`, residual carried through); no trainer
      publishes checkpoints for that forward.
    * `midlayers.{i}` (a MiniCPM-SALA EAGLE-3 draft for SGLang): every layer
      re-reads the token embedding (2H-wide attention input); SGLang's own
      EAGLE-3 model does not load these names either.
    """
    names = {n[len("model."):] if n.startswith("model.") else n for n in tensor_names}
    if config.get("speculators_model_type") == "eagle" or "fusion_fc.weight" in names:
        return (
            "this is a speculators EAGLE-1/HASS head (fusion_fc, transformer.*): speculators and "
            "vLLM disagree on where its pre_lm_head_layernorm applies (before the LM head vs on the "
            "incoming feature), so mlx-spec does not load it. Missing: a reference forward both agree "
            "on. HASS heads in the SafeAILab layout (fc, layers.*; add_para_norm) convert with "
            "--format eagle."
        )
    for prefix, what in (("additional_layers.", "SGLang's multi-layer EAGLE-3 layout (midlayer + additional_layers.{j})"),
                         ("midlayers.", "a multi-layer EAGLE-3 layout with every layer named midlayers.{i}")):
        n = len({k.split(".")[1] for k in names if k.startswith(prefix)})
        if n:
            extra = 1 if prefix == "additional_layers." else 0
            return (
                f"this EAGLE-3 head has {n + extra} layers in {what}. mlx-spec reads one midlayer, or "
                "speculators' layers.{i} (layer 0 reads the embedding and the feature, later layers are "
                "ordinary with the residual carried through). In SGLang's multi-layer forward each later "
                "layer restarts the residual from the previous layer's MLP output"
                + (" and every layer re-reads the token embedding" if not extra else "")
                + "; that forward is not implemented. If the head was trained with speculators/vLLM "
                "semantics, re-save its layers as layers.{i}.* and convert with --format eagle3."
            )
    return None


def refuse_unsupported(config: dict, tensor_names) -> None:
    """Raise `ConversionError` for a layout `unsupported` names."""
    reason = unsupported(config, tensor_names)
    if reason:
        raise ConversionError(reason)


def target_dims(config: dict) -> tuple[int, int, int]:
    """(hidden_size, num_hidden_layers, vocab_size) of a target config."""
    ident = target_identity(config)
    return ident["hidden_size"], ident["num_hidden_layers"], ident["vocab_size"]


def require(what: str, head_value, target_value, hint: str = "") -> None:
    """Refuse a head whose `what` differs from the target's."""
    if head_value != target_value:
        raise ConversionError(
            f"this head was made for another target: its {what} is {head_value}, the target's "
            f"is {target_value}{hint}. Pass the --target the head was trained for."
        )


def strip_model_prefix(weights: dict) -> dict:
    """Drop the `model.` prefix some repackaged checkpoints put on every non-head key."""
    return rekey(weights, lambda k: k[len("model."):] if k.startswith("model.") else k)


def layer_fields(cfg: dict, where: str) -> dict:
    """The head's decoder-layer fields (mlx_spec.drafters.layers.LayerArgs) from an HF config."""
    int_fields(cfg, where, ("hidden_size", "intermediate_size", "num_attention_heads"))
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}  # newer transformers nest rope settings here
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = rope
    return {
        "hidden_size": H,
        "intermediate_size": cfg["intermediate_size"],
        "num_attention_heads": nh,
        "num_key_value_heads": cfg.get("num_key_value_heads") or nh,
        "head_dim": cfg.get("head_dim") or H // nh,
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
        "rope_scaling": scaling,
        "max_position_embeddings": cfg.get("max_position_embeddings"),
    }


def layer_shapes(prefix: str, f: dict, d_in: int, input_norm: bool = True) -> dict:
    """Expected tensor shapes of one Llama-style head layer reading `d_in` features."""
    H, I, d = f["hidden_size"], f["intermediate_size"], f["head_dim"]
    q, kv = f["num_attention_heads"] * d, f["num_key_value_heads"] * d
    shapes = {
        f"{prefix}.self_attn.q_proj.weight": (q, d_in),
        f"{prefix}.self_attn.k_proj.weight": (kv, d_in),
        f"{prefix}.self_attn.v_proj.weight": (kv, d_in),
        f"{prefix}.self_attn.o_proj.weight": (H, q),
        f"{prefix}.mlp.gate_proj.weight": (I, H),
        f"{prefix}.mlp.up_proj.weight": (I, H),
        f"{prefix}.mlp.down_proj.weight": (H, I),
        f"{prefix}.post_attention_layernorm.weight": (H,),
    }
    if input_norm:
        shapes[f"{prefix}.input_layernorm.weight"] = (H,)
    if f.get("attention_bias"):
        shapes.update({f"{prefix}.self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))})
    if f.get("qk_norm"):
        shapes.update({f"{prefix}.self_attn.q_norm.weight": (d,), f"{prefix}.self_attn.k_norm.weight": (d,)})
    return shapes


def flag(cfg: dict, key: str, present: bool, what: str) -> bool:
    """A boolean option: the config's value when it states one (checked against the file), else the file's."""
    value = cfg.get(key)
    if value is None:
        return present
    if bool(value) != present:
        raise ConversionError(
            f"config.json says {key}={value} but the checkpoint {'has' if present else 'lacks'} {what}"
        )
    return bool(value)


def from_input_of_layer(ids, n_layers: int) -> list:
    """Checkpoint ids meaning 'the input of layer k' (HF hidden_states[k]) as tap ids."""
    out = []
    for k in ids:
        if not (isinstance(k, int) and 0 <= k <= n_layers):
            raise ConversionError(f"target layer id {k!r} is outside 0..{n_layers} (input-of-layer ids)")
        out.append(EMBED if k == 0 else k - 1)
    return out


def from_output_of_layer(ids, n_layers: int) -> list:
    """Checkpoint ids meaning 'the output of layer k' (HF hidden_states[k+1], -1 = embedding) as tap ids."""
    out = []
    for k in ids:
        if not (isinstance(k, int) and -1 <= k < n_layers):
            raise ConversionError(f"target layer id {k!r} is outside -1..{n_layers - 1} (output-of-layer ids)")
        out.append(EMBED if k == -1 else k)
    return out


def mlx_spec_block(kind: str, taps: list, target: dict) -> dict:
    return {"format": HEAD_FORMAT_VERSION, "drafter": kind, "taps": taps, "target": target_identity(target)}


def convert_with(build, src_folder, out_dir, target_folder, *, quantize_bits=None,
                 group_size=64, force=False) -> Path:
    """Read the checkpoint, `build(cfg, weights, target) -> (config, weights)`, write the head."""
    if Path(out_dir).exists() and not force:  # before reading any tensor
        raise ConversionError(f"{out_dir} already exists; use --force to replace it")
    target = target_config(target_folder)
    cfg = read_config(Path(src_folder))
    config, weights = build(cfg, read_tensors(Path(src_folder)), target)
    return write_head(Path(out_dir), config, weights, quantize_bits=quantize_bits,
                      group_size=group_size, force=force)
