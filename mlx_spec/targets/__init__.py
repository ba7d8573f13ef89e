"""Targets mlx-lm cannot load, run on a maintained implementation installed as an extra.

`mlx_spec.load(folder)` looks up the folder's `model_type` in `TARGETS` before
handing it to mlx-lm. Each entry names the loader ("module:function(folder, config,
lazy) -> (model, tokenizer)") and the pip extra that brings its implementation; the
module imports that implementation only when such a model is loaded.

The model a loader returns speaks mlx-lm's model interface (`model(inputs,
cache=...)` returns logits, `make_cache()`, `model.model.layers`, `args`), so the
decode loop, taps and rollback treat it like any mlx-lm model.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

# model_type -> (loader "module:function(folder, config, lazy) -> (model, tokenizer)", pip extra)
TARGETS: dict[str, tuple[str, str]] = {
    # DeepSeek-V4-Flash / -0731: mlx-vlm's `deepseek_v4` (mlx-lm has only `deepseek_v41`)
    "deepseek_v4": ("mlx_spec.targets.deepseek_v4:load", "deepseek-v4"),
}


def config_of(folder: Path) -> dict | None:
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def loader_for(config: dict | None):
    """The `TARGETS` loader for a config, or None when mlx-lm loads it."""
    entry = TARGETS.get((config or {}).get("model_type"))
    if entry is None:
        return None
    module, func = entry[0].split(":")
    return getattr(importlib.import_module(module), func)


def missing_extra(model_type: str, package: str, error: ImportError) -> ImportError:
    """The error for a target whose implementation is not installed: what to install."""
    extra = TARGETS[model_type][1]
    return ImportError(
        f"model_type {model_type!r} runs on {package}'s implementation, which is not "
        f"installed ({error}). Install mlx-spec's extra for it, in the checkout: "
        f"pip install -e '.[{extra}]'"
    )
