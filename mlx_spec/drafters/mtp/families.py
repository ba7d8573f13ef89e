"""Where each family keeps its MTP module, and how it becomes MLX weights.

A family is the target's mlx-lm `model_type`. Its MTP module (tensor names as
the checkpoints ship them and vLLM loads them: `vllm/model_executor/models/`
`deepseek_mtp.py`, `glm4_moe_mtp.py`, `qwen3_next_mtp.py`, `qwen3_5_mtp.py`,
`mimo_mtp.py`; DeepSeek-V3's `README_WEIGHTS.md`) is read from the checkpoint's
safetensors and renamed, by one key table per layout, into the head's own names:

    enorm, hnorm   norms on the token embedding and on the target hidden state
    proj           the [H, 2H] projection of their concatenation
    block.*        one decoder layer, loaded into the target's own mlx-lm class
    norm           the norm in front of the LM head
    embed, head    the module's own embedding / LM head, only when shipped

Invariant: `extract` returns weights that load strictly into the `MTPHead`
built for the same family, already in mlx-lm's in-memory layout: norms stored
as offsets are shifted by +1 exactly when mlx-lm shifts the target's (see
`norms_are_offsets`), experts are stacked, DeepSeek's FP8 and `kv_b_proj` go
through the target class's own `sanitize`.

Non-goals: MTP modules after the first (every shipped checkpoint has one; the
drafter chains module 0). DeepSeek-V4 and Nemotron-H have their own modules
(`deepseek_v4.py`, `nemotron_h.py`).
"""

from __future__ import annotations

import importlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ...weights import merged_shards, read_file, rename, shard_files


@dataclass(frozen=True)
class Family:
    layout: str  # "deepseek" | "qwen" | "mimo": where the module lives, its key table
    embed_first: bool  # concatenation order fed to proj: [e ; h] or [h ; e]
    mask_first_position: bool  # e[position 0] = 0 (DeepSeek, GLM, MiMo)


FAMILIES: dict[str, Family] = {
    "deepseek_v3": Family("deepseek", embed_first=True, mask_first_position=True),
    "glm4_moe": Family("deepseek", embed_first=True, mask_first_position=True),
    # GLM-4.7-Flash (DeepSeek-V3 MLA in GLM's MoE): the same module at model.layers.{N}
    "glm4_moe_lite": Family("deepseek", embed_first=True, mask_first_position=True),
    # DeepSeek-V3.2 and GLM-5 (DSA: MLA plus a lightning indexer with its own key cache)
    "deepseek_v32": Family("deepseek", embed_first=True, mask_first_position=True),
    "glm_moe_dsa": Family("deepseek", embed_first=True, mask_first_position=True),
    "qwen3_5": Family("qwen", embed_first=True, mask_first_position=False),
    "qwen3_5_moe": Family("qwen", embed_first=True, mask_first_position=False),
    "qwen3_next": Family("qwen", embed_first=True, mask_first_position=False),
    "mimo": Family("mimo", embed_first=False, mask_first_position=True),
    # DeepSeek-V4-Flash base: e_proj(e) + h_proj(h) per stream (`deepseek_v4.py` here)
    "deepseek_v4": Family("deepseek_v4", embed_first=True, mask_first_position=False),
    # Nemotron-H: a row of target blocks (`mtp_hybrid_override_pattern`), `nemotron_h.py` here
    "nemotron_h": Family("nemotron_h", embed_first=True, mask_first_position=False),
}

# Families whose decoder layer caches [attention KV, indexer keys] (a CacheList).
DSA = ("deepseek_v32", "glm_moe_dsa")

# Checkpoint key (after the module's prefix) -> head key; None drops on purpose.
TABLES: dict[str, list[tuple[str, str | None]]] = {
    "deepseek": [
        (r"enorm\.weight", "enorm.weight"),
        (r"hnorm\.weight", "hnorm.weight"),
        (r"eh_proj\.(.+)", r"proj.\1"),
        (r"shared_head\.norm\.weight", "norm.weight"),
        (r"shared_head\.head\.(.+)", r"head.\1"),
        (r"embed_tokens\.(.+)", r"embed.\1"),
        (r".*rotary_emb\.inv_freq", None),
        (r"(.+)", r"block.\1"),
    ],
    "qwen": [
        (r"fc\.(.+)", r"proj.\1"),
        (r"pre_fc_norm_embedding\.weight", "enorm.weight"),
        (r"pre_fc_norm_hidden\.weight", "hnorm.weight"),
        (r"norm\.weight", "norm.weight"),
        (r"layers\.0\.(.+)", r"block.\1"),
        (r"layers\.[1-9]\d*\..+", None),  # further MTP layers: the drafter chains layer 0
    ],
    "mimo": [
        (r"token_layernorm\.weight", "enorm.weight"),
        (r"hidden_layernorm\.weight", "hnorm.weight"),
        (r"input_proj\.(.+)", r"proj.\1"),
        (r"final_layernorm\.weight", "norm.weight"),
        (r".*rotary_emb\.inv_freq", None),
        (r"(.+)", r"block.\1"),
    ],
}

# Qwen norms stored as offsets from 1 (`x * (1 + w)`), in head naming.
_QWEN_OFFSET_NORMS = (
    "enorm.weight", "hnorm.weight", "norm.weight", "block.input_layernorm.weight",
    "block.post_attention_layernorm.weight", "block.self_attn.q_norm.weight",
    "block.self_attn.k_norm.weight",
)


def family_of(config: dict) -> str | None:
    """The family name of a target config (None: no MTP support for it)."""
    from mlx_lm.utils import MODEL_REMAPPING

    mt = config.get("model_type")
    mt = MODEL_REMAPPING.get(mt, mt)
    return mt if mt in FAMILIES else None


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def declared_modules(config: dict) -> int:
    """How many MTP modules the config says the checkpoint has."""
    text = text_config(config)
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        for where in (text, config):
            if where.get(key):
                return int(where[key])
    return 0


def module_prefix(family: str, config: dict) -> str:
    layout = FAMILIES[family].layout
    if layout == "deepseek":
        return f"model.layers.{text_config(config)['num_hidden_layers']}."
    return {"qwen": "mtp.", "mimo": "model.mtp_layers.0.", "deepseek_v4": "mtp.0.", "nemotron_h": "mtp."}[layout]


# ---- reading only what is needed from the safetensors -----------------------

def tensor_index(folder: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """{name: (file, shape)} from the safetensors headers, reading no tensor data."""
    return {k: v[:2] for k, v in _headers(folder).items()}


def _headers(folder: Path) -> dict[str, tuple[Path, tuple[int, ...], str | None]]:
    """{name: (file, shape, the file's metadata "format")} for the shards that
    `model.safetensors.index.json` lists (all present), else every *.safetensors; a tensor
    in two files, or a header that cannot be read, is refused by name."""
    folder = Path(folder)
    files = shard_files(folder, "model.safetensors.index.json", "*.safetensors")
    return merged_shards(folder, files, _header)


def _header(f: Path) -> dict:
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        fmt = (header.get("__metadata__") or {}).get("format")
        return {k: (f, tuple(v["shape"]), fmt) for k, v in header.items() if k != "__metadata__"}
    except (struct.error, ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{f} has a damaged safetensors header: download it again") from None


def load_tensors(index: dict, names) -> dict[str, mx.array]:
    """The named tensors, loaded lazily file by file."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(index[name][0], []).append(name)
    out = {}
    for f, keys in by_file.items():
        arrays = read_file(f, lambda: mx.load(str(f)))  # lazy: only the arrays used are read
        out.update({k: arrays[k] for k in keys})
    return out


def norms_are_offsets(family: str, folder: Path, prefix: str) -> bool:
    """mlx-lm's own rule for adding 1.0 to the target's norms, applied to the MTP norms.

    qwen3_5(_moe): when the checkpoint's conv1d weights are still in the HF layout
    (last axis != 1), i.e. raw HF weights. qwen3_next: when per-expert MoE keys are
    present (raw HF weights). MLX conversions were shifted when they were written.
    When those tensors are not in the folder (only the shard holding the MTP
    module was downloaded), that shard's writer decides: "mlx" (mlx-lm's
    `save_model`) means shifted already, anything else (PyTorch's "pt") raw.
    """
    if FAMILIES[family].layout != "qwen":
        return False
    headers = _headers(folder)
    if family == "qwen3_next":
        seen = [k for k in headers if k.startswith("model.layers.") and ".mlp." in k]
        raw = any(k.endswith(".mlp.experts.0.up_proj.weight") for k in seen)
    else:
        seen = [s for k, (_, s, _) in headers.items() if "conv1d.weight" in k]
        raw = any(s[-1] != 1 for s in seen)
    if seen:
        return raw
    fmt = {fmt for k, (_, _, fmt) in headers.items() if k.startswith(prefix)}
    return fmt != {"mlx"}


# ---- renaming ---------------------------------------------------------------

def apply_table(weights: dict, table: list[tuple[str, str | None]], where: str) -> dict:
    out, unmapped = rename(weights, table)
    if unmapped:
        raise ValueError(f"{where}: MTP tensor {unmapped[0]!r} matches no known key")
    return out


def to_head_weights(family: str, config: dict, raw: dict, shift: bool) -> dict:
    """Checkpoint tensors of one MTP module (prefix removed) -> head weights, MLX layout."""
    layout = FAMILIES[family].layout
    if layout == "deepseek_v4":
        from .deepseek_v4 import head_weights

        return head_weights(config, raw)
    if layout == "nemotron_h":
        from .nemotron_h import head_weights

        return head_weights(raw)
    if layout == "deepseek":
        raw = _through_target_sanitize(family, config, raw)
    weights = apply_table(raw, TABLES[layout], f"{family} MTP module")
    if layout == "qwen":
        weights = _stack_qwen_experts(weights)
        if shift:
            weights = {k: v + 1.0 if k in _QWEN_OFFSET_NORMS else v for k, v in weights.items()}
    return weights


def _through_target_sanitize(family: str, config: dict, raw: dict) -> dict:
    """Run the module's tensors through the target class's own `sanitize`.

    They are placed at main-layer index 0 of a one-layer stand-in of the target
    (lazy, never evaluated), so FP8 dequantization, expert stacking and the MLA
    `kv_b_proj` split follow the installed mlx-lm exactly.
    """
    arch = importlib.import_module(f"mlx_lm.models.{family}")
    args = arch.ModelArgs.from_dict({**text_config(config), "num_hidden_layers": 1})
    shadow = arch.Model(args)
    done = shadow.sanitize({f"model.layers.0.{k}": v for k, v in raw.items()})
    stray = [k for k in done if not k.startswith("model.layers.0.")]
    if stray:
        raise ValueError(f"{family} sanitize moved MTP tensors out of their layer: {stray[:3]}")
    return {k[len("model.layers.0."):]: v for k, v in done.items()}


def _stack_qwen_experts(w: dict) -> dict:
    """Per-expert (Qwen3-Next) or fused (Qwen3.5-MoE) experts -> `switch_mlp`."""
    pre = "block.mlp."
    fused = w.pop(pre + "experts.gate_up_proj", None)
    if fused is not None:  # [E, 2I, H]: gate rows first
        mid = fused.shape[-2] // 2
        w[pre + "switch_mlp.gate_proj.weight"] = fused[..., :mid, :]
        w[pre + "switch_mlp.up_proj.weight"] = fused[..., mid:, :]
        w[pre + "switch_mlp.down_proj.weight"] = w.pop(pre + "experts.down_proj")
    n = sum(1 for k in w if re.fullmatch(r"block\.mlp\.experts\.\d+\.up_proj\.weight", k))
    for name in ("gate_proj", "up_proj", "down_proj") if n else ():
        w[f"{pre}switch_mlp.{name}.weight"] = mx.stack(
            [w.pop(f"{pre}experts.{e}.{name}.weight") for e in range(n)]
        )
    return w


# ---- the block: one decoder layer of the target's own class ----------------

def text_args(family: str, config: dict | None = None, model=None):
    """The mlx-lm args the target's layers are built from (from the model, else the config)."""
    if model is not None:
        lm = getattr(model, "language_model", model)
        return lm.args
    if family in ("qwen3_5", "qwen3_5_moe"):  # both use qwen3_5's text args
        from mlx_lm.models import qwen3_5

        return qwen3_5.TextModelArgs.from_dict(text_config(config))
    if family == "deepseek_v4":  # mlx-vlm's (mlx_spec.targets.deepseek_v4)
        from ...targets.deepseek_v4 import _vlm

        return _vlm()[0].ModelConfig.from_dict({**text_config(config), "vision_n_layers": 0})
    return importlib.import_module(f"mlx_lm.models.{family}").ModelArgs.from_dict(config)


def build_block(family: str, args, moe: bool, pattern: str = "") -> nn.Module:
    """A fresh decoder layer for the MTP module; `moe`: its MLP is a mixture of experts;
    `pattern`: the blocks of a multi-block module (Nemotron-H)."""
    n = args.num_hidden_layers
    if family == "nemotron_h":
        from .nemotron_h import NemotronMTPBlocks

        return NemotronMTPBlocks(args, pattern)
    if family in ("qwen3_5", "qwen3_5_moe"):
        from mlx_lm.models import qwen3_5

        block = qwen3_5.DecoderLayer(args, layer_idx=args.full_attention_interval - 1)
        return _qwen_mlp(block, args, moe, qwen3_5.SparseMoeBlock, qwen3_5.MLP)
    if family == "qwen3_next":
        from mlx_lm.models import qwen3_next as q

        block = q.Qwen3NextDecoderLayer(args, layer_idx=args.full_attention_interval - 1)
        return _qwen_mlp(block, args, moe, q.Qwen3NextSparseMoeBlock, q.Qwen3NextMLP)
    if family == "deepseek_v3":
        from mlx_lm.models import deepseek_v3

        return deepseek_v3.DeepseekV3DecoderLayer(args, layer_idx=n)  # the MTP layer's own index
    if family == "glm4_moe":
        from mlx_lm.models import glm4_moe

        return glm4_moe.DecoderLayer(args, layer_idx=n)
    if family == "glm4_moe_lite":
        from mlx_lm.models import glm4_moe_lite

        return glm4_moe_lite.Glm4MoeLiteDecoderLayer(args, layer_idx=n)
    if family in DSA:  # glm_moe_dsa's model is deepseek_v32's
        from mlx_lm.models import deepseek_v32

        return deepseek_v32.DeepseekV32DecoderLayer(args, layer_idx=n)
    if family == "mimo":
        from mlx_lm.models import mimo

        return mimo.TransformerBlock(args)
    raise ValueError(f"no MTP support for model type {family!r}")


def _qwen_mlp(block, args, moe: bool, moe_cls, mlp_cls):
    # The layer class picks dense/MoE from the main layers' settings; the MTP
    # layer's own tensors decide (Qwen3-Next's MTP layer is MoE, say).
    if moe and not isinstance(block.mlp, moe_cls):
        block.mlp = moe_cls(args)
    elif not moe and isinstance(block.mlp, moe_cls):
        block.mlp = mlp_cls(args.hidden_size, args.intermediate_size)
    return block
