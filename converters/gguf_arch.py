"""What each supported GGUF architecture means in mlx-lm terms.

For every architecture llama.cpp writes and mlx-lm can run, three things: the `config.json` built
from the GGUF metadata, the Hugging Face name of every tensor, and the transforms that undo what
llama.cpp's converter did to the weights (the Q/K row permutation for llama, the +1 on Gemma 3
norms). Invariant: after `to_hf`, every tensor equals the one in the original HF checkpoint, up to
the quantization loss. Non-goal: architectures mlx-lm does not ship a model class for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# Per-block tensor names, GGUF -> Hugging Face (the block prefix is added separately).
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 has four norms per block; llama.cpp names them differently from Llama's two.
_GEMMA3_BLOCK_NAMES = _BLOCK_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class ArchError(ValueError):
    """The file's architecture or metadata is outside what this converter handles."""


def hf_name(gguf_name: str, arch: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None: not a weight."""
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight or bias
    block_names = _GEMMA3_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{suffix}"
    if stem == "rope_freqs":  # folded into config.json by `llama3_rope_scaling`
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    raise ArchError(
        f"tensor {gguf_name!r} has no Hugging Face equivalent for architecture {arch!r}"
    )


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows for the llama architecture.

    HF stores each head's rotary pairs as two halves (NeoX layout); llama.cpp interleaves them
    (GPT-J layout) by reshaping rows to [heads, 2, half] and swapping the last two axes. This
    swaps them back: [heads, half, 2] -> [heads, 2, half].
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (HF -> GGUF), the inverse of `unpermute_rotary`; used by tests."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_hf(gguf_name: str, w: np.ndarray, arch: str, config: dict) -> np.ndarray:
    """The tensor as the HF checkpoint had it, from the float32 array dequantized from the GGUF."""
    if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
        heads = config["num_attention_heads" if ".attn_q." in gguf_name else "num_key_value_heads"]
        return unpermute_rotary(w, heads)
    if arch == "gemma3" and gguf_name.endswith("norm.weight"):
        # HF Gemma computes `x * (1 + w)`; llama.cpp folds the 1 into the stored weight.
        return w - 1.0
    return w


def _meta(md: dict[str, Any], key: str, default: Any = ...) -> Any:
    if key in md:
        return md[key]
    if default is ...:
        raise ArchError(f"the GGUF metadata lacks {key!r}")
    return default


def _num(md: dict[str, Any], key: str, cast=int, default: Any = ...) -> Any:
    """A numeric metadata value, `cast`; a value of another type is refused by name."""
    value = _meta(md, key, default)
    if not _is_number(value) or cast is int and value != int(value):
        raise ArchError(f"the GGUF metadata's {key!r} should be {'an integer' if cast is int else 'a number'}, "
                        f"got {str(value)[:40]!r}")
    return cast(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)


def _uniform(value: Any, key: str) -> int:
    """Some files store a per-layer list (e.g. KV heads); mlx-lm's models need one value."""
    if value == [] or not all(_is_number(v) and v == int(v) for v in (value if isinstance(value, list) else [value])):
        raise ArchError(f"the GGUF metadata's {key} should be an integer (or one per layer), got {str(value)[:40]!r}")
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ArchError(f"{key} varies across layers ({sorted(set(value))}); not supported")
        return int(value[0])
    return int(value)


def _f32(x: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.999999747e-06. Keep the digits float32 has."""
    return float(f"{float(x):.7g}")


def _rope_scaling(md: dict, arch: str, context: int) -> dict | None:
    kind = md.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = _f32(_num(md, f"{arch}.rope.scaling.factor", float))
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    if kind == "yarn":
        original = _num(md, f"{arch}.rope.scaling.original_context_length", int, context / factor)
        return {"type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise ArchError(f"rope scaling {kind!r} is not supported")


def _common(md: dict, arch: str, tensors: dict[str, tuple[int, ...]]) -> dict:
    """The fields llama, qwen2 and gemma3 share; `tensors` maps GGUF names to numpy shapes."""
    heads = _uniform(_meta(md, f"{arch}.attention.head_count"), "head_count")
    context = _num(md, f"{arch}.context_length")
    config = {
        "hidden_size": _num(md, f"{arch}.embedding_length"),
        "num_hidden_layers": _num(md, f"{arch}.block_count"),
        "intermediate_size": _uniform(_meta(md, f"{arch}.feed_forward_length"), "ffn length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _uniform(
            md.get(f"{arch}.attention.head_count_kv", heads), "head_count_kv"
        ),
        "rms_norm_eps": _f32(_num(md, f"{arch}.attention.layer_norm_rms_epsilon", float)),
        "rope_theta": _f32(_num(md, f"{arch}.rope.freq_base", float, 10000.0)),
        "max_position_embeddings": context,
        # The embedding's rows, not the token list: some files pad the matrix.
        "vocab_size": int(_meta(tensors, "token_embd.weight")[0]),
        # llama.cpp writes `output.weight` only when it differs from the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if (scaling := _rope_scaling(md, arch, context)) is not None:
        config["rope_scaling"] = scaling
    return config


def _llama(md: dict, tensors: dict) -> dict:
    config = _common(md, "llama", tensors)
    head_dim = _num(
        md, "llama.attention.key_length", int, config["hidden_size"] // config["num_attention_heads"]
    )
    if md.get("llama.rope.dimension_count", head_dim) != head_dim:
        raise ArchError("partial rotary embeddings are not supported for llama")
    return config | {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "head_dim": int(head_dim),
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
    }


def _qwen2(md: dict, tensors: dict) -> dict:
    config = _common(md, "qwen2", tensors)
    # mlx-lm's qwen2 derives head_dim from hidden_size; refuse files where that would be wrong.
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    if md.get("qwen2.attention.key_length", head_dim) != head_dim:
        raise ArchError("qwen2 files with head_dim != hidden_size / heads are not supported")
    return config | {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}


def _gemma3(md: dict, tensors: dict) -> dict:
    config = _common(md, "gemma3", tensors)
    head_dim = _num(md, "gemma3.attention.key_length")
    # llama.cpp's own rule (llama-model.cpp): only the 27B (62 layers) scales queries by
    # hidden/heads; every other size by head_dim. The file does not store the scalar.
    if config["num_hidden_layers"] == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        scalar = head_dim
    return config | {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "head_dim": head_dim,
        "query_pre_attn_scalar": scalar,
        "sliding_window": _num(md, "gemma3.attention.sliding_window"),
        # llama.cpp hard-codes both for Gemma 3: 5 local layers then 1 global, local base 10k.
        "sliding_window_pattern": _window_period(
            md.get("gemma3.attention.sliding_window_pattern", 6)
        ),
        "rope_local_base_freq": _f32(_num(md, "gemma3.rope.freq_base_swa", float, 10000.0)),
    }


def llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float) -> dict:
    """mlx-lm's `llama3` rope scaling, from the per-frequency factors Llama 3.1+ files store.

    llama.cpp writes the scaling as a `rope_freqs` tensor, not as metadata. The largest factor
    is the scaling factor. The other three parameters are the ones all Llama 3.x models use. We
    check them by recomputing every factor (the formula of HF's `_compute_llama3_parameters`).
    """
    low, high, original = 1.0, 4.0, 8192
    factor = float(factors.max())
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (original / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    expected = np.where(
        wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, medium)
    )
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4):
        raise ArchError("its rope_freqs tensor is not Llama 3's rope scaling; not supported")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def _window_period(pattern: int | list) -> int:
    """mlx-lm wants a period; newer files may store one sliding/global flag per layer instead."""
    if not isinstance(pattern, list):
        return _uniform(pattern, "sliding_window_pattern")
    period = pattern.index(False) + 1 if False in pattern else len(pattern) + 1
    if pattern != [(i + 1) % period != 0 for i in range(len(pattern))]:
        raise ArchError("a non-periodic sliding-window layer pattern is not supported")
    return period


CONFIG_BUILDERS: dict[str, Callable[[dict, dict], dict]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "gemma3": _gemma3,
}


def _check_heads(config: dict, tensors: dict[str, tuple[int, ...]]) -> None:
    """The metadata's head counts against the attention weights' rows (a file whose metadata
    contradicts its tensors is refused here, not by a reshape deep in the conversion)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for tensor, key in (("blk.0.attn_q.weight", "num_attention_heads"), ("blk.0.attn_k.weight", "num_key_value_heads")):
        rows = tensors.get(tensor, (None,))[0]
        if rows is not None and rows != config[key] * head_dim:
            raise ArchError(f"the metadata gives {config[key]} heads of {head_dim} ({key}), {config[key] * head_dim} "
                            f"rows, but {tensor} has {rows}: the file's metadata contradicts its tensors")


def build_config(
    md: dict[str, Any], tensors: dict[str, tuple[int, ...]], rope_freqs: np.ndarray | None = None
) -> dict:
    """config.json for mlx-lm from GGUF metadata, tensor shapes and the `rope_freqs` tensor."""
    arch = md.get("general.architecture")
    if arch not in CONFIG_BUILDERS:
        raise ArchError(
            f"unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(sorted(CONFIG_BUILDERS))}"
        )
    config = CONFIG_BUILDERS[arch](md, tensors)
    _check_heads(config, tensors)
    if rope_freqs is not None:
        if arch != "llama" or "rope_scaling" in config:
            raise ArchError(f"a rope_freqs tensor in a {arch} file is not supported")
        head_dim = config["head_dim"]
        config["rope_scaling"] = llama3_rope_scaling(rope_freqs, head_dim, config["rope_theta"])
    return config
