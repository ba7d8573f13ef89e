"""A trained EAGLE-3 head on disk: mlx-spec's own folder, and the two published layouts.

* `write_head(dir, head, config, d2t)`: config.json + model.safetensors exactly
  as `mlx-spec convert head` writes them, so `mlx_spec.load_drafter(dir, model)`
  and `--draft dir` load it directly. Files are written to a temporary name and
  renamed (weights first, config last): a crash never leaves a torn file.
* `export(dir, out, layout)`: the same weights in
  - `midlayer`: the reference layout (SafeAILab/EAGLE `eagle/traineagle3`,
    SpecForge, SGLang): a LlamaConfig plus `draft_vocab_size`, tensors
    `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t` (offsets: target id =
    draft id + d2t[draft id]) and `t2d` (bool mask over the target vocabulary);
  - `speculators`: vllm-project/speculators' Eagle3 format
    (`speculators_model_type: "eagle3"`, `transformer_layer_config`,
    `layers.{i}.*`, and a copy of the target's `embed_tokens`, as its
    checkpoints carry one).
  Both record the taps as `eagle_aux_hidden_state_layer_ids` (input-of-layer
  ids: mlx-spec tap k, the output of layer k, is the input of layer k + 1), and
  both convert back with `mlx-spec convert head OUT DIR --target MODEL`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..drafters.base import target_args, vocab_size
from ..taps import EMBED

LAYOUTS = ("midlayer", "speculators")


def target_identity(model) -> dict:
    """What a head folder records about its target (checked by `load_drafter`)."""
    a = target_args(model)
    out = {k: a.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers")}
    out["vocab_size"] = vocab_size(model)
    return out


def head_config(model, taps: list, draft_vocab: int, num_layers: int = 1) -> dict:
    """The config.json of a new EAGLE-3 head for `model`: one layer shaped like the target's."""
    from converters.eagle import layer_fields

    a = target_args(model)
    fields = {**layer_fields(a, "the target's config"), "attention_bias": False, "qk_norm": False}
    H, V = fields["hidden_size"], vocab_size(model)
    return {
        "mlx_spec": {"format": 1, "drafter": "eagle3", "taps": list(taps), "target": target_identity(model)},
        **fields,
        "fc_bias": False, "norm_before_fc": False, "fc_norm": False, "norm_before_residual": False,
        "norm_output": False, "own_lm_head": True, "own_embedding": False,
        "num_layers": num_layers, "num_taps": len(taps), "fc_input_size": len(taps) * H,
        "draft_vocab_size": int(draft_vocab), "vocab_size": V, "target_hidden_size": H,
        "source": {"format": "mlx-spec train eagle3"},
    }


def _replace(path: Path, write) -> None:
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")  # mx.save_* keep the suffix
    write(tmp)
    os.replace(tmp, path)


def save_tensors(path: Path, tensors: dict, metadata: dict | None = None) -> None:
    """mx.save_safetensors through a temporary file and a rename."""
    _replace(Path(path), lambda t: mx.save_safetensors(str(t), tensors, metadata=metadata or {}))


def save_json(path: Path, obj) -> None:
    _replace(Path(path), lambda t: t.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n"))


def write_head(folder, head, config: dict, d2t: mx.array, metadata: dict | None = None) -> Path:
    """The loadable head folder: model.safetensors (head + `draft_to_target`), then config.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(head.parameters()))
    weights["draft_to_target"] = d2t.astype(mx.int32)
    save_tensors(folder / "model.safetensors", weights, {"format": "mlx", **(metadata or {})})
    save_json(folder / "config.json", config)
    return folder


def aux_layer_ids(taps: list) -> list[int]:
    """mlx-spec tap ids (outputs of layers) as EAGLE-3 input-of-layer ids."""
    return [0 if t == EMBED else int(t) + 1 for t in taps]


def _llama_config(cfg: dict) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size")
    out = {k: cfg[k] for k in keys if cfg.get(k) is not None}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "num_hidden_layers": cfg["num_layers"], "tie_word_embeddings": False,
            "attention_bias": bool(cfg.get("attention_bias", False)), "torch_dtype": "float32", **out}


def _options(cfg: dict) -> dict:
    """The head's forward options as both layouts' configs say them (what `convert head` reads
    back): a realigned published head keeps the options it was trained with."""
    return {"bias": bool(cfg.get("fc_bias", False)),
            **{k: bool(cfg.get(k, False)) for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")}}


def export(src, out, layout: str, model=None, force: bool = False) -> Path:
    """Write head folder `src` in a published `layout` to `out`; `model` (the target) is
    needed for speculators' embedding copy."""
    from converters.common import staging_dir

    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    src = Path(src)
    if Path(out).expanduser().resolve() == src.expanduser().resolve():
        raise ValueError(f"{out} is the head's own folder: export to another folder")
    try:
        cfg = json.loads((src / "config.json").read_text())
    except (OSError, ValueError):
        cfg = None
    block = cfg.get("mlx_spec") if isinstance(cfg, dict) else None
    if not isinstance(block, dict) or block.get("drafter") != "eagle3":
        raise ValueError(f"{src} is not an EAGLE-3 head folder of mlx-spec (one `train eagle3` or "
                         "`convert head` wrote: config.json with an 'mlx_spec' block of drafter eagle3)")
    if cfg.get("quantization"):
        raise ValueError(f"{src} is quantized; export the float head")
    w = dict(mx.load(str(src / "model.safetensors")))
    V, V_d = cfg["vocab_size"], cfg.get("draft_vocab_size") or cfg["vocab_size"]
    # a head over the whole vocabulary has no id table: draft id i is target id i
    ids = np.array(w.pop("draft_to_target", mx.arange(V_d)), np.int64)
    w["d2t"] = mx.array(ids - np.arange(V_d), mx.int64)
    t2d = np.zeros(V, bool)
    t2d[ids] = True
    w["t2d"] = mx.array(t2d)
    aux = aux_layer_ids(cfg["mlx_spec"]["taps"])
    llama = _llama_config(cfg)
    if layout == "midlayer":
        if cfg["num_layers"] != 1:
            raise ValueError("the midlayer layout holds one layer; export a multi-layer head as speculators")
        w = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in w.items()}
        config = {**llama, **_options(cfg), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": V_d,
                  "target_hidden_size": cfg["target_hidden_size"],
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True}}
    else:
        if model is None:
            raise ValueError("the speculators layout carries the target's embedding: pass the target model")
        from ..taps import decoder_stack, embedding

        emb = embedding(decoder_stack(model))
        if "scales" in emb:
            raise ValueError("the target's embedding is quantized; export speculators from a float target")
        w["embed_tokens.weight"] = emb.weight
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": llama, "draft_vocab_size": V_d, **_options(cfg),
                  "target_hidden_size": cfg["target_hidden_size"],
                  "eagle_aux_hidden_state_layer_ids": aux,
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "verifier": {"architectures": [], "name_or_path": None}}}
    with staging_dir(Path(out), force) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), w, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(out)
