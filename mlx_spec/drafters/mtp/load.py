"""Loading an MTP drafter from a target checkpoint or from an extracted head folder.

* `probe(folder, config, model)` (`TARGET_PROBES["mtp"]`): the target's own
  folder. None when the family has no MTP support or the config declares no MTP
  module; a clear error when the config declares one but its tensors are gone
  (what mlx-lm conversions do: `sanitize` drops them).
* `load_head_folder(folder, config, model)` (`LOADERS["mtp"]`): a folder written
  by `mlx-spec convert head SRC OUT --format mtp`.
* `extract(folder)`: the module's settings and MLX-ready weights, read from the
  safetensors headers and only the MTP tensors (shared by the converter).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ...weights import check_fit, quantize_as_stored
from .drafter import MTPDrafter
from .families import (
    declared_modules,
    family_of,
    load_tensors,
    module_prefix,
    norms_are_offsets,
    tensor_index,
    text_args,
    text_config,
    to_head_weights,
)
from .head import MTPConfig, MTPHead, make_head


def _missing_error(folder: Path, family: str, config: dict, prefix: str) -> ValueError:
    import json

    n = declared_modules(config)
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # the shards that hold them may just not be here
        where = json.loads(index.read_text()).get("weight_map", {})
        absent = sorted({f for k, f in where.items() if k.startswith(prefix) and not (folder / f).is_file()})
        if absent:
            return ValueError(f"{folder}: the MTP module's tensors ('{prefix}*') are in {absent[:3]}, which "
                              "model.safetensors.index.json lists but the folder lacks; download those shards too")
    return ValueError(
        f"{folder}: config.json declares {n} MTP module(s) for this {family} model, but "
        f"the safetensors hold no '{prefix}*' tensors. MLX conversions usually drop them "
        "(mlx-lm's sanitize removes MTP weights). Extract the head from the original "
        "Hugging Face checkpoint: mlx-spec convert head ORIGINAL_HF_FOLDER OUT --format mtp "
        f"--target {folder}, then pass --draft OUT."
    )


def extract(folder: Path, config: dict | None = None):
    """(MTPConfig, head weights, source config) of the checkpoint's first MTP module.

    Returns None when the model type has no MTP support or the checkpoint neither
    declares nor holds an MTP module; raises ValueError when it declares one it lacks.
    """
    import json

    folder = Path(folder)
    config = config if config is not None else json.loads((folder / "config.json").read_text())
    family = family_of(config)
    if family is None:
        return None
    index = tensor_index(folder)
    if family == "deepseek_v4":
        from .deepseek_v4 import is_mtp_checkpoint

        if not is_mtp_checkpoint(config, index):
            return None  # -0731's mtp.* are DSpark stages (kind "dspark"), or no block at all
    prefix = module_prefix(family, config)
    names = [k for k in index if k.startswith(prefix)]
    if not names:
        if declared_modules(config) > 0:
            raise _missing_error(folder, family, config, prefix)
        return None
    raw = load_tensors(index, names)
    weights = to_head_weights(
        family, config, {k[len(prefix):]: v for k, v in raw.items()}, norms_are_offsets(family, folder, prefix)
    )
    cfg = MTPConfig(
        family=family,
        hidden_state="last_layer" if family == "deepseek_v4" else "final_norm",
        own_embed="embed.weight" in weights,
        own_head="head.weight" in weights,
        moe=any(".switch_mlp." in k for k in weights),
        num_modules=max(declared_modules(config), 1),
        block_pattern=_pattern(family, config),
    )
    return cfg, weights, config


def _pattern(family: str, config: dict) -> str:
    if family != "nemotron_h":
        return ""
    from .nemotron_h import pattern_of

    return pattern_of(config)


def build_head(cfg: MTPConfig, args, weights: dict) -> MTPHead:
    """An `MTPHead` holding `weights` (strictly: every tensor, nothing else); modules with
    `.scales` are quantized as their tensors say."""
    head = make_head(cfg, args)
    # Quantized as stored: each module's bits, group size and mode read from its tensors
    # (a DeepSeek-V4 block mixes mxfp8 and mxfp4; `quantization` only says that some are).
    quantize_as_stored(head, weights)
    check_fit(dict(tree_flatten(head.parameters())), weights, f"{cfg.family} MTP",
              "were these MTP weights converted for this target (its config)?")
    head.load_weights(list(weights.items()), strict=True)
    mx.eval(head.parameters())
    head.eval()  # mlx-vlm's V4 block takes its decode path only outside training
    return head


def probe(folder, config: dict, model, **options) -> MTPDrafter | None:
    """The MTP drafter of a target checkpoint folder, or None when it has no MTP module.

    `options` may be meant for another kind's probe (load_drafter asks each in turn);
    an MTP drafter takes `tree_budget` and `tree_width` only, so others are refused
    only when MTP weights are found.
    """
    family = family_of(config)
    if family is None:
        return None
    args = text_args(family, model=model)
    _check_same_model(config, args, folder)  # before reading any tensor
    found = extract(Path(folder), config)
    if found is None:
        return None
    other = sorted(set(options) - {"tree_budget", "tree_width"})
    if other:
        raise ValueError(f"{folder} carries an MTP module; MTP drafters take tree_budget and "
                         f"tree_width only, got {other}")
    cfg, weights, _ = found
    return MTPDrafter(build_head(cfg, args, weights), cfg, **options)


def load_head_folder(folder, config: dict, model, tree_budget: int | None = None,
                     tree_width: int = 4) -> MTPDrafter:
    """An extracted MTP head folder (`mlx-spec convert head ... --format mtp`)."""
    cfg = MTPConfig.from_dict(config)
    have = family_of({"model_type": getattr(model, "model_type", None)})
    if have != cfg.family:
        raise ValueError(
            f"{folder} is a {cfg.family} MTP head; the target is a "
            f"{getattr(model, 'model_type', type(model).__name__)} model"
        )
    args = text_args(cfg.family, model=model)
    weights = mx.load(str(Path(folder) / "model.safetensors"))
    return MTPDrafter(build_head(cfg, args, weights), cfg, tree_budget, tree_width)


def load_mtp(path, model, hidden_state: str | None = None, **options) -> MTPDrafter:
    """Python API: the MTP drafter in `path` (target checkpoint or head folder).

    `hidden_state` overrides the feature the head reads ("final_norm" or "last_layer");
    `options`: `tree_budget`, `tree_width` (EAGLE-2 dynamic trees instead of chains).
    """
    from ...heads import load_drafter

    drafter = load_drafter(path, model, kind="mtp", **options)
    if hidden_state is not None and hidden_state != drafter.config.hidden_state:
        from dataclasses import replace

        drafter = MTPDrafter(drafter.head, replace(drafter.config, hidden_state=hidden_state),
                             drafter.tree_budget, drafter.tree_width)
    return drafter


def _check_same_model(config: dict, args, folder) -> None:
    text = text_config(config)
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        have, want = getattr(args, key, None), text.get(key)
        if want is not None and have is not None and have != want:
            raise ValueError(
                f"{folder} is not the loaded target's checkpoint ({key}: {want} there, "
                f"{have} in the model); pass the target's own folder"
            )


__all__ = ["build_head", "extract", "load_head_folder", "load_mtp", "probe"]
