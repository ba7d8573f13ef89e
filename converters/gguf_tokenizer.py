"""Rebuild a Hugging Face tokenizer from the vocabulary stored in a GGUF file's metadata.

transformers (>= 5.17, torch-free) already knows how to turn llama.cpp's `tokenizer.ggml.*` keys
into a `tokenizers.Tokenizer`; this module feeds it, fills the gaps it leaves for the models we
ship (SmolLM's digit-splitting pre-tokenizer, Qwen's NFC normalizer, BOS/EOS insertion), and
saves `tokenizer.json` + `tokenizer_config.json` so that `mlx_lm.load` gets the same tokenizer the
upstream checkpoint has. Invariant: decode(encode(text)) == text for any text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

_CONTROL = 3  # llama.cpp token type of special tokens such as <|im_end|>
# Control tokens that end a turn: llama.cpp stops on these (its "end of generation" set), and so
# must mlx-lm, or an instruct model runs past its answer when the file's EOS is another token.
_END_OF_TURN = (
    "<|im_end|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
)


class TokenizerError(ValueError):
    """The file's tokenizer metadata cannot be turned into a Hugging Face tokenizer."""


def _hf_builders():
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_PRE_TOKENIZER_SPLITS,
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError as e:  # older transformers kept a torch-only variant elsewhere
        raise TokenizerError(f"rebuilding a GGUF tokenizer needs transformers >= 5.17 ({e})") from e
    return GGUF_TOKENIZER_MAPPING, GGUF_PRE_TOKENIZER_SPLITS, convert_gguf_tokenizer


def _fix_pre_tokenizer(backend, pre: str | None, model: str | None, known: dict) -> None:
    """Patch the splits transformers does not know for the files we support."""
    from tokenizers import normalizers, pre_tokenizers

    if pre == "smollm":
        # SmolLM's tokenizer.json: every digit is its own piece, then GPT-2 byte-level splitting.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif model == "gpt2" and pre not in known and pre not in ("default", "gpt-2", "gpt2"):
        print(
            f"warning: unknown pre-tokenizer {pre!r}; using GPT-2's split, tokens may differ",
            file=sys.stderr,
        )
    if pre == "qwen2":
        # Qwen's upstream tokenizer.json normalizes to NFC before splitting.
        backend.normalizer = normalizers.NFC()


def _post_processor(
    tokens: list[str], bos: int | None, eos: int | None, add_bos: bool, add_eos: bool
):
    """BOS/EOS insertion lives in tokenizer.json, so every loader (not only HF) sees it."""
    from tokenizers import processors

    head = [(tokens[bos], bos)] if add_bos and bos is not None else []
    tail = [(tokens[eos], eos)] if add_eos and eos is not None else []
    single = [t for t, _ in head] + ["$A"] + [t for t, _ in tail]
    pair = single + [f"{t}:1" for t, _ in head] + ["$B:1"] + [f"{t}:1" for t, _ in tail]
    specials = dict(head + tail)
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(specials.items())
    )


def check_vocabulary(md: dict[str, Any]) -> None:
    """Refuse tokenizer metadata of the wrong type by name (a token list that is not strings, a
    special token id that is not an integer) before anything reads it."""
    for key, kind in (("tokens", str), ("merges", str), ("token_type", int)):
        value = md.get(f"tokenizer.ggml.{key}")
        if value is not None and not (isinstance(value, list) and all(isinstance(v, kind) for v in value)):
            raise TokenizerError(f"the GGUF metadata's 'tokenizer.ggml.{key}' should be a list of "
                                 f"{'strings' if kind is str else 'integers'}, got {str(value)[:40]!r}")
    for key in ("bos", "eos", "eot", "unknown", "padding"):
        value = md.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TokenizerError(f"the GGUF metadata's 'tokenizer.ggml.{key}_token_id' should be an "
                                 f"integer, got {str(value)[:40]!r}")


def eos_token_ids(md: dict[str, Any]) -> list[int]:
    """The file's EOS and EOT, plus every control token that ends a turn."""
    tokens = md.get("tokenizer.ggml.tokens") or []
    types = md.get("tokenizer.ggml.token_type") or []
    ids = [md.get("tokenizer.ggml.eos_token_id"), md.get("tokenizer.ggml.eot_token_id")]
    index = {t: i for i, t in enumerate(tokens) if t in _END_OF_TURN}
    ids += [i for t, i in index.items() if i < len(types) and types[i] == _CONTROL]
    return sorted({int(i) for i in ids if i is not None})


def save_tokenizer(md: dict[str, Any], out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into `out_dir`.

    Args:
        md: the GGUF metadata, with `tokenizer.ggml.tokens` (and merges, types) as full lists.
        out_dir: the model folder being written.
    """
    from transformers import PreTrainedTokenizerFast

    mapping, known_splits, convert = _hf_builders()
    if "tokenizer.ggml.tokens" not in md:
        raise TokenizerError("the GGUF has no tokenizer (tokenizer.ggml.tokens is missing)")
    tokenizer_dict = {
        name: md[f"tokenizer.{key}"]
        for key, name in mapping["tokenizer"].items()
        if f"tokenizer.{key}" in md
    }
    try:
        backend, _ = convert(md["general.architecture"], tokenizer_dict)
    except (ValueError, KeyError) as e:
        raise TokenizerError(f"cannot rebuild the tokenizer: {e}") from e
    model, pre = md.get("tokenizer.ggml.model"), md.get("tokenizer.ggml.pre")
    _fix_pre_tokenizer(backend, pre, model, known_splits)

    tokens = md["tokenizer.ggml.tokens"]
    ids = {
        name: md.get(f"tokenizer.ggml.{key}")
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
    }
    # llama.cpp adds BOS to sentencepiece vocabularies that do not say otherwise.
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _post_processor(
        tokens, ids["bos_token"], ids["eos_token"], add_bos, add_eos
    )

    specials = {name: tokens[i] for name, i in ids.items() if i is not None and i < len(tokens)}
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=md.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        **specials,
    )
    # chat_template inside tokenizer_config.json (not a .jinja file) so older loaders find it too.
    hf.save_pretrained(str(out_dir), save_jinja_files=False)
    # transformers 5 writes its new class name; the generic fast class is what every loader
    # (older transformers, swift-transformers) knows, and transformers 5 maps it to the same.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
