"""The MTP module as an MLX module, and the settings a head folder records.

One forward over T positions (as in vLLM's `vllm/model_executor/models/*_mtp.py` for
these families):

    e = Emb(x_{t+1})            (e[position 0] = 0 for DeepSeek, GLM, MiMo)
    u = proj([enorm(e) ; hnorm(h_t)])     ([hnorm(h_t) ; enorm(e)] for MiMo)
    o = block(u)                the target's own decoder-layer class, causal,
                                RoPE at position t, its own KV cache
    g = norm(o);  logits = head(g)

`h_t` is the target's hidden state at position t (the final-norm output by
default, see `MTPConfig.hidden_state`); a chained step feeds back `g` (or `o`
for "last_layer", so step 0 and later steps see the same kind of vector).
The embedding and LM head are the target's unless the checkpoint ships its
own (DeepSeek-V3 and GLM-4.5 copy them into the module as `embed_tokens` and
`shared_head.head`; GLM-4.6 does not, see vLLM PR #27597).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import CacheList, KVCache

from .families import DSA, FAMILIES, build_block

HIDDEN_STATES = ("final_norm", "last_layer")


@dataclass(frozen=True)
class MTPConfig:
    """The head's own fields in a head folder's config.json."""

    family: str  # the target's mlx-lm model_type
    hidden_state: str = "final_norm"  # target feature read: final-norm output, or last layer's
    own_embed: bool = False  # the module ships its own embedding (else the target's)
    own_head: bool = False  # ... its own LM head
    moe: bool = False  # the block's MLP is a mixture of experts
    num_modules: int = 1  # MTP modules in the source checkpoint (module 0 is used)
    block_pattern: str = ""  # blocks of a multi-block module ("*E": Nemotron-H), else ""

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"MTP family {self.family!r} unknown; supported: {sorted(FAMILIES)}")
        if self.hidden_state not in HIDDEN_STATES:
            raise ValueError(f"hidden_state must be one of {HIDDEN_STATES}, got {self.hidden_state!r}")
        if self.family == "deepseek_v4" and self.hidden_state != "last_layer":
            raise ValueError("a DeepSeek-V4 MTP block reads the trunk's last-layer streams: "
                             "hidden_state must be 'last_layer'")

    @classmethod
    def from_dict(cls, d: dict) -> "MTPConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        return asdict(self)


class MTPHead(nn.Module):
    def __init__(self, cfg: MTPConfig, args):
        super().__init__()
        hidden = args.hidden_size
        eps = getattr(args, "rms_norm_eps", None) or args.layer_norm_epsilon  # Nemotron-H: the latter
        self.enorm = nn.RMSNorm(hidden, eps=eps)
        self.hnorm = nn.RMSNorm(hidden, eps=eps)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = build_block(cfg.family, args, cfg.moe, cfg.block_pattern)
        self.norm = nn.RMSNorm(hidden, eps=eps)
        if cfg.own_embed:
            self.embed = nn.Embedding(args.vocab_size, hidden)
        if cfg.own_head:
            self.head = nn.Linear(hidden, args.vocab_size, bias=False)
        fam = FAMILIES[cfg.family]
        self._embed_first, self._mask_first = fam.embed_first, fam.mask_first_position
        self._dsa = cfg.family in DSA

    def make_cache(self):
        """The block's cache: a KVCache, [KV, indexer keys] for DSA layers, or the block's own
        (one KV per attention block of a multi-block module)."""
        if hasattr(self.block, "make_cache"):
            return self.block.make_cache()
        return CacheList(KVCache(), KVCache()) if self._dsa else KVCache()

    def __call__(self, hidden: mx.array, tokens: mx.array, cache, embed, lm_head):
        """hidden [T, H] at positions p..p+T-1, tokens [T] = x_{p+1..p+T}.

        `embed`/`lm_head` are the target's (used unless the module has its own).
        Returns (logits [T, V], block output o [T, H], normed g [T, H]).
        """
        e = (self.embed if "embed" in self else embed)(tokens[None])  # [1, T, H]
        kv = cache[0] if isinstance(cache, CacheList) else cache  # positions and the mask
        if self._mask_first and kv.offset == 0:
            e = e * (mx.arange(e.shape[1]) > 0)[None, :, None].astype(e.dtype)
        parts = [self.enorm(e), self.hnorm(hidden[None].astype(e.dtype))]
        u = self.proj(mx.concatenate(parts if self._embed_first else parts[::-1], axis=-1))
        mask = create_attention_mask(u, kv, return_array=True)
        o = self.block(u, mask, cache)  # [1, T, H]
        g = self.norm(o)
        logits = (self.head if "head" in self else lm_head)(g)
        return logits[0], o[0], g[0]


def make_head(cfg: MTPConfig, args) -> nn.Module:
    """A fresh head for `cfg.family` (DeepSeek-V4's block has its own class)."""
    if cfg.family == "deepseek_v4":
        from .deepseek_v4 import V4MTPHead

        return V4MTPHead(cfg, args)
    return MTPHead(cfg, args)


def quantize_head(head: MTPHead, group_size: int, bits: int, only: set[str] | None = None) -> None:
    """Quantize the head's quantizable layers in place (all of them, or those in `only`)."""
    def wanted(path: str, m: nn.Module) -> bool:
        if not hasattr(m, "to_quantized"):
            return False
        if only is not None:
            return path in only
        return m.weight.shape[-1] % group_size == 0

    nn.quantize(head, group_size=group_size, bits=bits, class_predicate=wanted)
