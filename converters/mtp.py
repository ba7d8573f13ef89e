"""`mlx-spec convert head SRC OUT --format mtp [--target MLX_FOLDER] [-q]`: extract an MTP head.

SRC is a checkpoint that still holds its MTP module: the original Hugging Face
checkpoint (mlx-lm conversions drop it). The module is renamed by the family's
key table (`mlx_spec.drafters.mtp.families.TABLES`), brought to mlx-lm's
in-memory layout (offset norms shifted, experts stacked, FP8/MLA through the
target class's sanitize), checked by loading it strictly into the module built
from the config, optionally quantized, and written as a head folder:

    config.json   {"mlx_spec": {"drafter": "mtp", "taps": ["final_norm"], "target": ...},
                   "family": ..., "hidden_state": "final_norm", "own_embed": ..., ...}
    model.safetensors   enorm, hnorm, proj, block.*, norm [, embed, head]

`--target` names the MLX model the head will run with (e.g. an mlx-community
conversion of SRC); it must be the same architecture. Without it SRC is the target.
"""

from __future__ import annotations

from pathlib import Path

from .common import HEAD_FORMAT_VERSION, ConversionError, read_config, target_identity, write_head


def detect(config: dict, tensor_names) -> bool:
    from mlx_spec.drafters.mtp.families import family_of, module_prefix

    family = family_of(config)
    if family is None:
        return False
    if family == "deepseek_v4":  # -0731's mtp.* are DSpark stages, used in place (--draft dspark)
        from mlx_spec.drafters.mtp.deepseek_v4 import is_mtp_checkpoint

        return is_mtp_checkpoint(config, tensor_names)
    prefix = module_prefix(family, config)
    return any(n.startswith(prefix) for n in tensor_names)


def convert(src_folder, out_dir, target_folder=None, *, quantize_bits=None, group_size=64, force=False) -> Path:
    from mlx.utils import tree_flatten

    from mlx_spec.drafters.mtp.families import FAMILIES, family_of, text_args
    from mlx_spec.drafters.mtp.head import quantize_head
    from mlx_spec.drafters.mtp.load import build_head, extract

    src = Path(src_folder)
    config = read_config(src)
    try:
        found = extract(src, config)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    if found is None:
        raise ConversionError(
            f"{src} holds no MTP module (model type {config.get('model_type')!r}; supported: "
            f"{', '.join(sorted(FAMILIES))})"
        )
    cfg, weights, _ = found
    target = read_config(Path(target_folder)) if target_folder else config
    _check_same_architecture(config, target, cfg.family, family_of(target))
    try:
        head = build_head(cfg, text_args(cfg.family, config=config), weights)
    except ValueError as e:
        raise ConversionError(f"{src}: {e}") from None
    out_config = {
        "mlx_spec": {"format": HEAD_FORMAT_VERSION, "drafter": "mtp", "taps": [cfg.hidden_state],
                     "target": target_identity(target)},
        **cfg.to_dict(),
    }
    if quantize_bits is not None:
        if quantize_bits not in (4, 8):
            raise ConversionError(f"--q-bits must be 4 or 8, got {quantize_bits}")
        quantize_head(head, group_size, quantize_bits)
        weights = dict(tree_flatten(head.parameters()))
        out_config["quantization"] = {"group_size": group_size, "bits": quantize_bits}
    return write_head(Path(out_dir), out_config, weights, force=force)


def _check_same_architecture(src: dict, target: dict, family: str, target_family) -> None:
    if target_family != family:
        raise ConversionError(
            f"--target is a {target.get('model_type')!r} model but the MTP module comes from "
            f"a {family} checkpoint; give the MLX conversion of the same model"
        )
    a, b = src.get("text_config", src), target.get("text_config", target)
    diffs = [f"{k}: {a.get(k)} vs {b.get(k)}" for k in ("hidden_size", "num_hidden_layers", "vocab_size")
             if a.get(k) != b.get(k)]
    if diffs:
        raise ConversionError(f"--target is another model than the MTP source ({'; '.join(diffs)})")
