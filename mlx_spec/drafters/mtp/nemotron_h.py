"""Nemotron-H's MTP module: several target blocks in a row instead of one decoder layer.

NVIDIA's Nemotron-H checkpoints (Nemotron 3 Nano/Super) ship one MTP module at
`mtp.layers.{i}.*` (`language_model.mtp.` in the multimodal ones), one block per
character of `mtp_hybrid_override_pattern` (`*` attention, `E` mixture of
experts; transformers' `mtp_layers_block_type` spells them out). Facts from
vLLM's `vllm/model_executor/models/nemotron_h_mtp.py`:

    u = eh_proj([enorm(e) ; hnorm(h)])       on layer 0 (e: the target's embedding)
    o = blocks(u)                             x + mixer(norm(x)) per block, causal,
                                              attention without RoPE, its own KV cache
    g = final_layernorm(o)                    on the last layer; logits = target lm_head(g)

No position is masked, `h` is the target's final-norm output and a chained step
feeds back `g`: the generic `MTPHead` forward, with this block list as its
`block`. Each block is mlx-lm's own `NemotronHBlock` built from the target's
args, so MoE routing (sigmoid, correction bias, groups), ReLU² experts and a
latent projection, if the target has one, are mlx-lm's.
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, KVCache

# checkpoint key (after `mtp.`) -> head key; the last layer's final norm becomes `norm`
TABLE = [
    (r"layers\.0\.enorm\.weight", "enorm.weight"),
    (r"layers\.0\.hnorm\.weight", "hnorm.weight"),
    (r"layers\.0\.eh_proj\.(.+)", r"proj.\1"),
    (r"layers\.\d+\.final_layernorm\.weight", "norm.weight"),
    (r".*rotary_emb\.inv_freq", None),
    (r".*\.(k_scale|v_scale)", None),  # FP8 KV-cache scales: not used by MLX attention
    (r"layers\.(\d+)\.(norm\.weight|mixer\..+)", r"block.layers.\1.\2"),
]

_CHARS = {"attention": "*", "full_attention": "*", "moe": "E"}


def pattern_of(config: dict) -> str:
    """The MTP module's block pattern ("*E" in the published checkpoints)."""
    text = config.get("text_config") or config.get("llm_config") or config
    pattern = text.get("mtp_hybrid_override_pattern")
    if pattern is None and text.get("mtp_layers_block_type"):
        pattern = "".join(_CHARS.get(t, "?") for t in text["mtp_layers_block_type"])
    if not pattern or set(pattern) - {"*", "E"}:
        raise ValueError(
            f"Nemotron-H MTP needs mtp_hybrid_override_pattern made of '*' (attention) and 'E' "
            f"(MoE) in config.json; got {pattern!r}"
        )
    return "".join(pattern)


def head_weights(raw: dict) -> dict:
    """Checkpoint tensors of the module (prefix removed) -> head weights, experts stacked
    the way mlx-lm's `nemotron_h` sanitize stacks the target's (up -> fc1, down -> fc2)."""
    from .families import apply_table

    w = apply_table(raw, TABLE, "nemotron_h MTP module")
    experts: dict[tuple[str, str], dict[int, mx.array]] = {}
    for k in [k for k in w if ".mixer.experts." in k]:
        m = re.fullmatch(r"(.+\.mixer)\.experts\.(\d+)\.(up|down)_proj\.weight", k)
        if m is None:
            raise ValueError(f"nemotron_h MTP module: unexpected expert tensor {k!r}")
        experts.setdefault((m[1], m[3]), {})[int(m[2])] = w.pop(k)
    for (pre, which), by_id in experts.items():
        if sorted(by_id) != list(range(len(by_id))):
            raise ValueError(f"nemotron_h MTP module: {pre} has experts {sorted(by_id)}, not 0..n-1")
        w[f"{pre}.switch_mlp.{'fc1' if which == 'up' else 'fc2'}.weight"] = mx.stack(
            [by_id[e] for e in range(len(by_id))])
    return w


class NemotronMTPBlocks(nn.Module):
    """The module's blocks, called like one decoder layer; caches one KV per attention block."""

    def __init__(self, args, pattern: str):
        super().__init__()
        from mlx_lm.models.nemotron_h import NemotronHBlock

        self.layers = [NemotronHBlock(args, c) for c in pattern]

    def make_cache(self) -> CacheList:
        return CacheList(*[KVCache() for layer in self.layers if layer.block_type == "*"])

    def __call__(self, x: mx.array, mask, cache: CacheList) -> mx.array:
        kv = iter(cache.caches)
        for layer in self.layers:
            x = layer(x, mask=mask, cache=next(kv) if layer.block_type == "*" else None)
        return x
