"""Tiny random-weight targets and a real (tiny) Hugging Face tokenizer for fast tests."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import gemma3_text, llama, qwen2
from mlx_lm.tokenizer_utils import TokenizerWrapper

VOCAB = 96


def tokenizer(vocab: int = VOCAB, eos: int | None = None) -> TokenizerWrapper:
    """A word-level tokenizer over ids 0..vocab-1 ("w0".."w95"); `eos` ends text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    eos_token = None if eos is None else f"w{eos}"
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, unk_token="w1")
    return TokenizerWrapper(hf)


def _finish(model, seed: int, sharpen: float):
    # Random weights give near-flat logits; sharpening makes argmax ties (and
    # thus float-rounding flips between block and single-token forwards) rare.
    head = model.lm_head if hasattr(model, "lm_head") else None
    if head is not None and sharpen != 1.0:
        model.lm_head.weight = head.weight * sharpen
    mx.eval(model.parameters())
    return model


def llama_model(seed=0, layers=2, hidden=64, heads=4, kv_heads=2, tied=False,
                vocab=VOCAB, sharpen=8.0, **kw):
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=2 * hidden, num_attention_heads=heads,
        num_key_value_heads=kv_heads, rms_norm_eps=1e-5, vocab_size=vocab,
        tie_word_embeddings=tied, **kw,
    )
    model = llama.Model(args)
    if tied:
        model.model.embed_tokens.weight = model.model.embed_tokens.weight * 4
    return _finish(model, seed, sharpen)


def model_folder(folder, layers: int = 2, eos: int | None = 0, chat_template: str | None = None):
    """A folder `mlx_spec.load` reads: a tiny llama's config.json and weights, and the tokenizer."""
    import dataclasses
    import json
    from pathlib import Path

    from mlx.utils import tree_flatten

    folder = Path(folder)
    folder.mkdir(parents=True)
    model = llama_model(layers=layers)
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    hf = tokenizer(eos=eos)._tokenizer
    hf.chat_template = chat_template
    hf.save_pretrained(str(folder))
    return folder


def qwen2_model(seed=0, layers=2, hidden=64, vocab=VOCAB, sharpen=8.0):
    mx.random.seed(seed)
    args = qwen2.ModelArgs(
        model_type="qwen2", hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=1,
        rms_norm_eps=1e-6, vocab_size=vocab, tie_word_embeddings=False,
    )
    return _finish(qwen2.Model(args), seed, sharpen)


def gemma3_model(seed=0, layers=4, window=8, vocab=VOCAB):
    """Gemma 3 text model with sliding-window layers (window `window`, pattern 2)."""
    mx.random.seed(seed)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=layers,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-6, vocab_size=vocab, sliding_window=window,
        sliding_window_pattern=2, max_position_embeddings=4096,
    )
    model = gemma3_text.Model(args)
    emb = model.model.embed_tokens
    emb.weight = emb.weight * 3  # tied head: sharpen through the embedding
    mx.eval(model.parameters())
    return model


def qwen3_5_model(seed=0, layers=4, vocab=VOCAB, head_dim=16):
    """Hybrid Qwen3.5 text model: GatedDeltaNet (ArraysCache) + full-attention layers."""
    from mlx_lm.models import qwen3_5

    mx.random.seed(seed)
    text = dict(
        model_type="qwen3_5_text", hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, vocab_size=vocab, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        full_attention_interval=2, tie_word_embeddings=False, rms_norm_eps=1e-6,
    )
    model = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text))
    lm = model.language_model
    lm.lm_head.weight = lm.lm_head.weight * 8
    mx.eval(model.parameters())
    return model


DEEPSEEK_V41 = dict(
    model_type="deepseek_v41", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
    num_attention_heads=4, head_dim=32, q_lora_rank=32, qk_rope_head_dim=8, o_groups=2,
    o_lora_rank=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
    hc_mult=2, hc_sinkhorn_iters=3, rms_norm_eps=1e-6, max_position_embeddings=4096,
    # Layer 1 pools groups of 4 window rows and indexes them; layer 2 reads its pool.
    compress_ratios=[0, 4, 4, 0], kv_source_layer_ids=[1], index_source_layer_ids=[1],
    index_n_heads=2, index_head_dim=16, index_topk=4,
    hc_eps=1e-6, swiglu_limit=10.0, routed_scaling_factor=1.5, rope_theta=10000.0,
)


def deepseek_v41_model(seed=0, window=8, sharpen=8.0, **overrides):
    """DeepSeek-V4.1 (mlx-lm `deepseek_v41`, LayerCache) with a small window and one pooled layer.

    The mHC mixing, attention sinks and router start at zero in mlx-lm; they get
    random values here so every part of the block matters.
    """
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import deepseek_v41

    mx.random.seed(seed)
    args = deepseek_v41.ModelArgs.from_dict({**DEEPSEEK_V41, "sliding_window": window, **overrides})
    model = deepseek_v41.Model(args)
    scales = {".fn": 0.05, ".base": 0.5, ".sinks": 1.0, "gate.weight": 0.3,
              "e_score_correction_bias": 0.1}
    new = []
    for name, value in tree_flatten(model.parameters()):
        for suffix, scale in scales.items():
            if name.endswith(suffix):
                new.append((name, mx.random.normal(value.shape) * scale))
    model.update(tree_unflatten(new))
    model.lm_head.weight = model.lm_head.weight * sharpen
    mx.eval(model.parameters())
    return model
