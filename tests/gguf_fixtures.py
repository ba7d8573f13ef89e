"""Helpers for the GGUF and zoo tests: a tiny llama GGUF written with `gguf.GGUFWriter`, and
perplexity on a fixed English paragraph (the sanity check that a conversion is right)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

PARAGRAPH = (
    "The history of the printing press begins in the middle of the fifteenth century, when "
    "Johannes Gutenberg, a goldsmith from Mainz, combined movable metal type with oil-based ink "
    "and a wooden press adapted from those used to make wine. Before his invention, books were "
    "copied by hand, which made them rare and expensive."
)


def perplexity(model, tokenizer, text: str = PARAGRAPH) -> float:
    """exp(mean next-token negative log-likelihood) of `text` under `model`."""
    import mlx.core as mx
    import mlx.nn as nn

    ids = mx.array(tokenizer.encode(text))[None]  # [1, T]
    logits = model(ids[:, :-1]).astype(mx.float32)  # [1, T-1, V]
    nll = nn.losses.cross_entropy(logits, ids[:, 1:], reduction="mean")
    return math.exp(nll.item())


def random_perplexity(model, tokenizer, text: str = PARAGRAPH, seed: int = 0) -> float:
    """Perplexity of the same architecture with its weights replaced by random ones."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    rng = np.random.default_rng(seed)  # numpy's normal sampler is several times faster here
    params = tree_flatten(model.parameters())
    random = [
        (k, mx.array(rng.standard_normal(v.shape, dtype=np.float32) * 0.02).astype(v.dtype))
        for k, v in params
    ]
    model.update(tree_unflatten(random))
    try:
        return perplexity(model, tokenizer, text)
    finally:
        model.update(tree_unflatten(params))


# A tiny model: small enough to write and convert in well under a second.
TINY = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "layers": 2, "ffn": 128}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (the byte-level BPE base vocabulary)."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(0xA1, 0xAC + 1))
        + list(range(0xAE, 0xFF + 1))
    )
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def tiny_tokens() -> list[str]:
    return _byte_alphabet() + SPECIALS + ["Ġt", "he", "Ġthe"]


def _block_shapes(arch: str, t: dict) -> dict[str, tuple[int, ...]]:
    h, q, kv, f = t["hidden"], t["heads"] * t["head_dim"], t["kv_heads"] * t["head_dim"], t["ffn"]
    shapes = {
        "attn_norm.weight": (h,),
        "ffn_norm.weight": (h,),
        "attn_q.weight": (q, h),
        "attn_k.weight": (kv, h),
        "attn_v.weight": (kv, h),
        "attn_output.weight": (h, q),
        "ffn_gate.weight": (f, h),
        "ffn_up.weight": (f, h),
        "ffn_down.weight": (h, f),
    }
    if arch == "qwen2":
        shapes |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if arch == "gemma3":
        shapes |= {
            "attn_q_norm.weight": (t["head_dim"],),
            "attn_k_norm.weight": (t["head_dim"],),
            "post_attention_norm.weight": (h,),
            "post_ffw_norm.weight": (h,),
        }
    return shapes


def _llama_cpp_transform(name: str, w: np.ndarray, arch: str, t: dict) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to a tensor before writing it."""
    from converters.gguf_arch import permute_rotary

    if arch == "llama" and ".attn_q." in name:
        return permute_rotary(w, t["heads"])
    if arch == "llama" and ".attn_k." in name:
        return permute_rotary(w, t["kv_heads"])
    if arch == "gemma3" and name.endswith("norm.weight"):
        return w + 1.0
    return w


def llama3_rope_factors(head_dim: int, theta: float, factor: float = 32.0) -> np.ndarray:
    """The `rope_freqs` llama.cpp's converter writes for Llama 3.1+, written out as its loop."""
    low, high, old = 1.0, 4.0, 8192
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    tied: bool = True,
    q8_ffn: bool = False,
    seed: int = 0,
    rope_theta: float = 10000.0,
    rope_freqs: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny `arch` model as llama.cpp would; return its tensors under their GGUF names,
    as the original (Hugging Face) checkpoint had them: what a correct conversion gives back.
    `rope_freqs`: a Llama 3.1-style rope scaling tensor to add (not returned)."""
    import gguf

    t, rng = TINY, np.random.default_rng(seed)
    tokens = tiny_tokens()
    vocab = len(tokens)
    shapes = {"token_embd.weight": (vocab, t["hidden"]), "output_norm.weight": (t["hidden"],)}
    if not tied:
        shapes["output.weight"] = (vocab, t["hidden"])
    for i in range(t["layers"]):
        shapes |= {f"blk.{i}.{k}": s for k, s in _block_shapes(arch, t).items()}
    original = {k: rng.standard_normal(s).astype(np.float32) * 0.5 for k, s in shapes.items()}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(t["layers"])
    w.add_context_length(256)
    w.add_embedding_length(t["hidden"])
    w.add_feed_forward_length(t["ffn"])
    w.add_head_count(t["heads"])
    w.add_head_count_kv(t["kv_heads"])
    w.add_key_length(t["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(rope_theta)
    if arch == "gemma3":
        w.add_sliding_window(16)
        w.add_sliding_window_pattern([True, False])  # local, global: a period of 2
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * len(SPECIALS) + [1] * 3)  # 1 normal, 3 control
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    for name, value in original.items():
        stored = _llama_cpp_transform(name, value, arch, t)
        if q8_ffn and ".ffn_" in name and stored.ndim == 2:
            quant = gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, quant, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            # what the file can give back: the Q8_0 rounding of the stored tensor
            original[name] = gguf.quants.dequantize(quant, gguf.GGMLQuantizationType.Q8_0).reshape(
                value.shape
            )
        else:
            w.add_tensor(name, stored)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return original
