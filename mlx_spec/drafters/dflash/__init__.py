"""DFlash block drafters (z-lab v1 layout, Meta's Muse Glimmer assistant): `load(folder, config, model)`.

A converted head folder (`mlx-spec convert head ... --format dflash`) holds the
block network's weights (`fc`, `hidden_norm`, `layers.*`, `norm`) and a config
whose `mlx_spec.taps` are already in mlx-spec's tap convention (see docs/dflash.md).
The network lives in `net.py`, the protocol side in `drafter.py`.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..layers import quantize_like
from .drafter import DFlashDrafter
from .net import BlockConfig, BlockContext, ContextCache, DFlashNet


def read_weights(folder: Path) -> dict:
    path = Path(folder) / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no model.safetensors; convert the head again")
    return mx.load(str(path))


def assign(module: nn.Module, weights: dict, config: dict, what: str) -> None:
    """Load `weights` into `module` (quantized as stored); every key must match exactly."""
    quantize_like(module, weights, config)
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(
            f"{what} does not match its config ({e}); the folder is damaged or was "
            "written by another version: convert the head again"
        ) from None


def load(folder, config: dict, model, *, sample_drafts: bool = True,
         tree_budget: int | None = None) -> DFlashDrafter:
    """The DFlash drafter stored in a converted head folder (LOADERS["dflash"]); with
    `tree_budget` it drafts DDTree-style trees of that many nodes (`block_tree`)."""
    cfg = BlockConfig.from_dict(config)
    net = DFlashNet(cfg)
    assign(net, read_weights(folder), config, f"DFlash head {folder}")
    return DFlashDrafter(
        net, cfg, config["mlx_spec"]["taps"],
        output_multiplier=float(config.get("output_multiplier", 1.0)),
        softcap=config.get("final_logit_softcapping"),
        sample_drafts=sample_drafts, tree_budget=tree_budget,
    )


__all__ = [
    "BlockConfig", "BlockContext", "ContextCache", "DFlashDrafter", "DFlashNet",
    "assign", "load", "read_weights",
]
