"""EAGLE drafters: EAGLE-1/2 and EAGLE-3 heads, as chains of k head steps.

    import mlx_spec
    model, tok = mlx_spec.load("mlx-community/Meta-Llama-3.1-8B-Instruct-bf16")
    drafter = mlx_spec.load_drafter("./eagle3-head", model)   # made by `mlx-spec convert head`
    mlx_spec.generate(model, tok, "Hello", drafter)

`load(folder, config, model)` is the `LOADERS` entry for the head kinds
"eagle" and "eagle3" (mlx_spec/heads.py). A converted folder holds
config.json (head dimensions, the taps it reads in mlx-spec's tap ids, the
target it was converted for) and model.safetensors with the heads.py
parameter names, plus `draft_to_target` [V_d] for EAGLE-3 heads with a
reduced vocabulary. EAGLE-2's dynamic draft tree is not implemented: chains.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ...taps import EMBED, FINAL_NORM
from ..base import check_draft_to_target
from ..layers import quantize_like
from .drafter import EagleDrafter
from .heads import Eagle1Head, Eagle3Head

HEADS = {"eagle": Eagle1Head, "eagle3": Eagle3Head}


def tap_id(value) -> int | str:
    """A tap id as written in a head config: an int, "embed" or "final_norm"."""
    if value in (EMBED, FINAL_NORM) or (isinstance(value, int) and value >= 0):
        return value
    raise ValueError(f"unknown tap id {value!r} in the head config (expected an int >= 0, {EMBED!r} or {FINAL_NORM!r})")


def load(folder, config: dict, model, tree_budget: int | None = None, tree_width: int = 4) -> EagleDrafter:
    """The drafter of a converted EAGLE head folder (weights loaded and evaluated); with
    `tree_budget` it drafts EAGLE-2 dynamic trees of that many nodes."""
    folder = Path(folder)
    kind = config["mlx_spec"]["drafter"]
    path = folder / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no model.safetensors; convert the head again")
    weights = mx.load(str(path))
    d2t = weights.pop("draft_to_target", None)
    v_draft, v_target = config.get("draft_vocab_size"), config.get("vocab_size")
    if d2t is None and v_draft and v_target and v_draft != v_target:
        raise ValueError(f"{folder}: the head drafts over {v_draft} of the target's {v_target} tokens but has no "
                         "draft_to_target table, so its token ids cannot be mapped; convert the head again "
                         "from a checkpoint that has d2t")
    if d2t is not None:
        check_draft_to_target(d2t, str(folder))
    head = HEADS[kind](config)
    quantize_like(head, weights, config)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"{folder}: weights do not fit its config.json ({e}); convert the head again") from e
    mx.eval(head.parameters(), *([d2t] if d2t is not None else []))
    taps = [tap_id(t) for t in config["mlx_spec"]["taps"]]
    return EagleDrafter(head, taps, config, draft_to_target=d2t, tree_budget=tree_budget, tree_width=tree_width)


__all__ = ["EagleDrafter", "Eagle1Head", "Eagle3Head", "load", "tap_id"]
