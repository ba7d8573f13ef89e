"""Loading head drafters: `load_drafter(path, model)` and the folder contract.

A converted head folder holds `config.json` and `model.safetensors`. Its config
has an `mlx_spec` block:

    {"mlx_spec": {"format": 1, "drafter": "eagle3", "taps": [2, 16, 29],
                  "target": {"model_type": ..., "hidden_size": ...,
                             "num_hidden_layers": ..., "vocab_size": ...}},
     ... the head's own architecture fields ...}

`drafter` names a loader in `LOADERS` ("module:function", imported on use);
each loader takes `(folder, config, model)` and returns a drafter. A folder
without that block may still be a target checkpoint that carries drafter
weights (MTP, DSpark): the `TARGET_PROBES` (kind -> loader that returns None
when the folder has no such weights) are asked in order.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

from .load_errors import ModelFileNotFoundError, explained
from .drafters.base import check_target

# kind -> "module:function(folder, config, model, **options) -> Drafter"
LOADERS: dict[str, str] = {
    "eagle": "mlx_spec.drafters.eagle:load",
    "eagle3": "mlx_spec.drafters.eagle:load",
    "mtp": "mlx_spec.drafters.mtp:load_head_folder",  # MTP heads extracted by convert head
    "dflash": "mlx_spec.drafters.dflash:load",
    "dspark": "mlx_spec.drafters.dspark:load",
    "gemma4_assistant": "mlx_spec.drafters.gemma4_assistant:load",
}
# kind -> "module:function(folder, config, model, **options) -> Drafter | None" for target
# checkpoints that carry drafter weights; None when the folder has none of that kind.
TARGET_PROBES: dict[str, str] = {
    "mtp": "mlx_spec.drafters.mtp:probe",
    "dspark": "mlx_spec.drafters.dspark:probe_target",  # DeepSeek-V4's in-checkpoint DSpark (mtp.*)
}


def _call(spec: str, *args, **options):
    module, func = spec.split(":")
    fn = getattr(importlib.import_module(module), func)
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(options) - set(params))
        if unknown:  # e.g. tree_budget for a head that drafts chains only
            kind = module.rsplit(".", 1)[-1]
            raise ValueError(f"{kind} drafters take no {', '.join(unknown)} option "
                             f"(it accepts: {', '.join(n for n in params if n not in ('folder', 'config', 'model')) or 'none'})")
    return fn(*args, **options)


def read_head_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a head or model folder (no config.json)")
    return json.loads(path.read_text())


def load_drafter(path: str | Path, model, kind: str | None = None, **options):
    """The drafter a folder describes, for `model` (the target).

    A missing or damaged file raises `ModelLoadError` naming it and the fix.

    `path` is a converted head folder, or a target checkpoint folder that
    carries drafter weights (e.g. MTP layers); `kind` ("mtp", "dspark", ...)
    insists on one kind of drafter. `options` go to that kind's loader (e.g.
    DSpark's `confidence_threshold`).
    """
    folder = Path(path).expanduser()
    if not folder.exists():  # (heads are local folders: nothing is downloaded here)
        raise ModelFileNotFoundError(folder, "does not exist",
                                     "give a converted head's folder (`mlx-spec convert head SRC OUT`) or a "
                                     "checkpoint folder that carries MTP or DSpark weights")
    with explained(folder, "head"):  # damaged or missing files: a ModelLoadError naming them
        config = read_head_config(folder)
        block = config.get("mlx_spec")
        if block is not None:
            found = block.get("drafter")
            if found not in LOADERS:
                raise ValueError(
                    f"{folder}: unknown drafter kind {found!r} (this mlx-spec knows "
                    f"{sorted(LOADERS)}); was it converted by a newer version?"
                )
            if kind is not None and found != kind:
                raise ValueError(f"{folder} holds a {found} head, not {kind}")
            check_target(model, str(folder), made_for=block.get("target", {}))  # converted for this model?
            return _call(LOADERS[found], folder, config, model, **options)
        for name, probe in TARGET_PROBES.items():
            if kind in (None, name):
                drafter = _call(probe, folder, config, model, **options)
                if drafter is not None:
                    return drafter
    wanted = f"{kind} weights" if kind else "drafter weights"
    text = config.get("text_config", config)
    if kind == "mtp" and any(k.startswith("dspark_") for k in text):
        raise ValueError(f"{folder} carries DeepSeek-V4 DSpark stages under mtp.*, not an MTP "
                         "block: use kind 'dspark' (--draft dspark)")
    if kind is not None:
        raise ValueError(f"{folder} carries no {wanted} (model type {config.get('model_type')!r}): use "
                         "another drafter (ngram, a draft model with --draft-model, or a converted head)")
    raise ValueError(
        f"{folder} is neither a converted head (no 'mlx_spec' block in config.json) nor a target "
        f"checkpoint with {wanted}. A small model of the target's family drafts as a draft model "
        "(--draft-model, or draft_model= in Python); an EAGLE, DFlash or DSpark head needs "
        "`mlx-spec convert head` first"
    )
