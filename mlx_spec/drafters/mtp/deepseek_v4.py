"""The MTP block of a DeepSeek-V4-Flash base checkpoint (`mtp.0.*`), as an MTP head.

DeepSeek's V4 reference (`inference/model.py`, `MTPBlock(Block)`): the block is a full
V4 decoder block (hyper-connection streams, attention with sinks over a sliding window,
MoE) with its own input and output parts; embedding and LM head are the trunk's.

    e = enorm(embed(x_{t+1}))                         # [H]
    x = e_proj(e)[stream axis] + h_proj(hnorm(h_t))  # h_t: the trunk's streams [hc, H]
    o = Block(x)                                      # streams [hc, H], position t
    logits = head(norm(hc_head(o)))                   # hc_head_{fn,base,scale}: its own

h_t is what the trunk's last layer leaves (the streams its own `hc_head` collapses), so
the head reads tap n-1 (`hidden_state: "last_layer"`) and a chained step feeds back o.
The block is mlx-vlm's `DeepseekV4Block` (the `deepseek-v4` extra), built with one local
(uncompressed) attention layer and score routing, as the reference's block at layer id
n_layers has. -0731 checkpoints carry DSpark stages under `mtp.*` instead
(`mlx_spec.drafters.dspark_v4`); a config with `dspark_*` fields is never read as MTP.

Tensor names (the base V4-Flash index, e.g. in NVIDIA's FP4 derivative, and the
reference's module tree): `mtp.0.{enorm,hnorm,norm}.weight`, `mtp.0.{e_proj,h_proj}.weight`
(FP8 with `.scale` tiles), `mtp.0.hc_head_{fn,base,scale}` and the block's own
`attn.*`, `ffn.*`, `attn_norm`, `ffn_norm`, `hc_attn_*`, `hc_ffn_*` as in a trunk layer.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn

from ...cache import WindowKVCache
from ...weights import rename

# mtp.0.X -> head name; the block's tensors go through mlx-vlm's sanitize as layer 0.
TABLE: list[tuple[str, str | None]] = [
    (r"enorm\.weight", "enorm.weight"),
    (r"hnorm\.weight", "hnorm.weight"),
    (r"(e_proj|h_proj)\.(weight|scale)", r"\1.\2"),
    (r"norm\.weight", "norm.weight"),
    (r"hc_head_(fn|base|scale)", r"hc_head.\1"),
    (r"((attn|ffn|attn_norm|ffn_norm)\..+|hc_(attn|ffn)_(fn|base|scale))", r"layers.0.\1"),
]


def is_mtp_checkpoint(config: dict, names) -> bool:
    """A DeepSeek-V4 base MTP block (not -0731's DSpark stages) is in the folder."""
    text = config.get("text_config", config)
    return not any(k.startswith("dspark_") for k in text) and "mtp.0.e_proj.weight" in names


def block_args(args):
    """The block's arguments: one local-attention layer with score routing."""
    return replace(args, num_hidden_layers=1, compress_ratios=[0], num_hash_layers=0)


def head_weights(config: dict, raw: dict) -> dict:
    """`mtp.0.*` tensors (prefix removed, DeepSeek names, FP8/FP4 as stored) -> head weights."""
    from ...targets import deepseek_v4 as target

    renamed, unmapped = rename(raw, TABLE)
    if unmapped:
        raise ValueError(f"deepseek_v4 MTP block: tensor {unmapped[0]!r} matches no known key")
    renamed = target._repack_fp8(renamed)
    vlm_config, vlm_language, _, _ = target._vlm()
    text = {**config.get("text_config", config), "vision_n_layers": 0}
    stand_in = vlm_language.LanguageModel(block_args(vlm_config.ModelConfig.from_dict(text)))
    block = {k: v for k, v in renamed.items() if k.startswith("layers.0.")}
    out = {k: v for k, v in renamed.items() if k not in block}
    for key, value in stand_in.sanitize(block).items():
        if not key.startswith("model.layers.0."):
            raise ValueError(f"deepseek_v4 MTP block: sanitize moved {key} out of the block")
        out["block." + key[len("model.layers.0."):]] = value
    return out


class V4MTPHead(nn.Module):
    """The reference `MTPBlock`, with the same call as `MTPHead`."""

    def __init__(self, cfg, args):
        super().__init__()
        from ...targets import deepseek_v4 as target

        _, vlm_language, _, _ = target._vlm()
        from mlx_vlm.models.base import create_attention_mask
        from mlx_vlm.models.deepseek_v4.hyper_connection import HyperHead

        H, eps = args.hidden_size, args.rms_norm_eps
        self.args, self._mask = args, create_attention_mask
        self.enorm, self.hnorm, self.norm = (nn.RMSNorm(H, eps=eps) for _ in range(3))
        self.e_proj = nn.Linear(H, H, bias=False)
        self.h_proj = nn.Linear(H, H, bias=False)
        self.block = vlm_language.DeepseekV4Block(block_args(args), 0)
        self.hc_head = HyperHead(args)

    def make_cache(self):
        return WindowKVCache(self.args.sliding_window)

    def __call__(self, hidden: mx.array, tokens: mx.array, cache, embed, lm_head):
        """hidden [T, hc, H] (streams) at positions p..p+T-1, tokens [T] = x_{p+1..p+T}.

        Returns (logits [T, V], block output streams o [T, hc, H], g = norm(hc_head(o)))."""
        e = self.e_proj(self.enorm(embed(tokens[None])))  # [1, T, H]
        x = e[:, :, None, :] + self.h_proj(self.hnorm(hidden[None].astype(e.dtype)))
        mask = self._mask(x[:, :, 0, :], cache, window_size=self.args.sliding_window,
                          return_array=True)
        o = self.block(x, mask, cache, tokens[None])
        g = self.norm(self.hc_head(o))
        return lm_head(g)[0], o[0], g[0]
