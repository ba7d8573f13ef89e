"""GGUF import: exact weights on tiny synthetic files, clear errors that leave nothing behind,
and (marked `download`) the real SmolLM2 from the zoo: tokenizer round trips, a coherent greedy
answer, and a perplexity far below that of random weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf_fixtures import (
    PARAGRAPH,
    llama3_rope_factors,
    perplexity,
    random_perplexity,
    tiny_tokens,
    write_tiny_gguf,
)

from converters import gguf as gg
from converters.gguf_arch import hf_name, permute_rotary, unpermute_rotary


def _saved(folder: Path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    return {
        k: np.array(v.astype(mx.float32))
        for k, v in mx.load(str(folder / "model.safetensors")).items()
    }


def _leftovers(parent: Path, keep: set[str] = frozenset()) -> list[str]:
    """Everything in `parent` that is not an input file: would be a (half-written) output."""
    return sorted(p.name for p in parent.iterdir() if p.suffix != ".gguf" and p.name not in keep)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)  # 8 heads of dim 16
    assert not np.array_equal(permute_rotary(w, 8), w)
    np.testing.assert_array_equal(unpermute_rotary(permute_rotary(w, 8), 8), w)
    b = np.arange(32, dtype=np.float32)  # biases are permuted the same way
    np.testing.assert_array_equal(unpermute_rotary(permute_rotary(b, 2), 2), b)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_tiny_model_converts_to_the_original_weights(tmp_path, arch):
    import mlx.core as mx
    from mlx_lm import load

    tied = arch != "qwen2"
    original = write_tiny_gguf(tmp_path / "tiny.gguf", arch, tied=tied)
    out = gg.convert(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)

    saved = _saved(out)
    expected = {hf_name(k, arch): v for k, v in original.items()}
    assert set(saved) == set(expected)
    for name, value in expected.items():
        # exact, except Gemma's norms, which went through +1 and -1 in float32
        np.testing.assert_allclose(saved[name], value, rtol=0, atol=1e-6, err_msg=name)
    if arch == "llama":  # the test means something: the file held them permuted
        stored_q = permute_rotary(original["blk.0.attn_q.weight"], 4)
        assert not np.allclose(stored_q, saved["model.layers.0.self_attn.q_proj.weight"])

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == {"gemma3": "gemma3_text"}.get(arch, arch)
    assert config["tie_word_embeddings"] is tied
    assert config["vocab_size"] == len(tiny_tokens())
    if arch == "gemma3":
        assert config["sliding_window_pattern"] == 2 and config["sliding_window"] == 16
    model, tokenizer = load(str(out))  # strict: every weight has its place
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, len(tiny_tokens()))


def test_quantized_tensors_are_dequantized(tmp_path):
    original = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", q8_ffn=True)
    saved = _saved(gg.convert(tmp_path / "tiny.gguf", tmp_path / "out", progress=False))
    got = saved["model.layers.1.mlp.down_proj.weight"]
    np.testing.assert_allclose(got, original["blk.1.ffn_down.weight"], atol=1e-6)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    from mlx_lm import load

    factors = llama3_rope_factors(16, 500000.0)
    assert 1.0 < factors[4] < 32.0  # the tiny head still has a smoothed (medium) frequency
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", rope_theta=500000.0, rope_freqs=factors)
    out = gg.convert(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert not any("rope" in k for k in _saved(out))
    load(str(out))


def test_unknown_rope_freqs_are_refused(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", rope_freqs=np.full(8, 2.0, np.float32))
    with pytest.raises(gg.GGUFError, match="not Llama 3's rope scaling"):
        gg.convert(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    assert _leftovers(tmp_path) == []


def test_tiny_tokenizer_and_eos(tmp_path):
    from mlx_lm import load

    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    _, tok = load(str(gg.convert(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)))
    tokens = tiny_tokens()
    assert tok.encode(" the", add_special_tokens=False) == [tokens.index("Ġthe")]
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [tokens.index("<|im_end|>")]
    # both end-of-turn control tokens stop generation, not only the file's EOS
    assert {tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")} <= set(tok.eos_token_ids)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>hi<|im_end|>"
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype(tmp_path, dtype):
    import mlx.core as mx

    write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2")
    out = gg.convert(tmp_path / "tiny.gguf", tmp_path / "out", dtype=dtype, progress=False)
    assert {v.dtype for v in mx.load(str(out / "model.safetensors")).values()} == {
        getattr(mx, dtype)
    }


def test_quantize_option_loads(tmp_path):
    import mlx.core as mx
    from mlx_lm import load

    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    out = gg.convert(
        tmp_path / "tiny.gguf", tmp_path / "out", quantize=True, q_bits=8, progress=False
    )
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    model, _ = load(str(out))
    assert model(mx.array([[1, 2]])).shape == (1, 2, len(tiny_tokens()))


def test_unsupported_architecture_is_named_and_leaves_nothing(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(gg.GGUFError, match="unsupported GGUF architecture 'mamba'"):
        gg.convert(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("damage", ["truncated", "garbage", "cut_header", "empty"])
def test_corrupt_file_gives_clear_error_and_leaves_nothing(tmp_path, damage):
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, "llama")
    data = src.read_bytes()
    src.write_bytes(
        {
            "truncated": data[: len(data) * 2 // 3],
            "garbage": b"\x00\x01not a gguf" * 100,
            "cut_header": data[:3000],
            "empty": b"",
        }[damage]
    )
    with pytest.raises(gg.GGUFError, match="tiny.gguf"):
        gg.convert(src, tmp_path / "out", progress=False)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("method, value, says", [
    ("add_head_count", 3, r"metadata gives 3 heads of 16 \(num_attention_heads\), 48 rows, but "
                          r"blk\.0\.attn_q\.weight has 64: the file's metadata contradicts its tensors"),
    ("add_bos_token_id", 10**6, r"special token id\(s\) \[1000000\] outside its \d+-token vocabulary"),
    ("add_eos_token_id", 10**6, r"special token id\(s\) \[1000000\] outside its \d+-token vocabulary"),
])
def test_metadata_that_contradicts_the_file_is_named_and_leaves_nothing(tmp_path, monkeypatch, method, value, says):
    """(A wrong head count crashed in a reshape; an out-of-range token id went into config.json.)"""
    import gguf

    real = getattr(gguf.GGUFWriter, method)
    monkeypatch.setattr(gguf.GGUFWriter, method, lambda self, _value: real(self, value))
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    monkeypatch.undo()
    with pytest.raises(gg.GGUFError, match=says):
        gg.convert(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("key, value, kind, says", [
    ("llama.embedding_length", "sixty-four", "STRING", "'llama.embedding_length' should be an integer, got 'sixty-four'"),
    ("llama.block_count", [2, 2], "UINT32", "'llama.block_count' should be an integer, got '.2, 2.'"),
    ("llama.attention.head_count", 4.9, "FLOAT32", "head_count should be an integer .or one per layer., got '4.9"),
    ("llama.attention.layer_norm_rms_epsilon", "tiny", "STRING", "layer_norm_rms_epsilon' should be a number"),
    ("tokenizer.ggml.eos_token_id", "x", "STRING", "'tokenizer.ggml.eos_token_id' should be an integer, got 'x'"),
    ("tokenizer.ggml.tokens", list(range(300)), "UINT32", "'tokenizer.ggml.tokens' should be a list of strings"),
    ("tokenizer.ggml.merges", [1, 2, 3], "UINT32", "'tokenizer.ggml.merges' should be a list of strings"),
])
def test_metadata_of_the_wrong_type_is_named_and_leaves_nothing(tmp_path, monkeypatch, key, value, kind, says):
    """(Each was a traceback: int('sixty-four'), 'int' object is not iterable, ...; a head count of
    4.9 was cut to 4.)"""
    import gguf

    real = gguf.GGUFWriter.add_key_value

    def add(self, name, val, vtype, *args, **kwargs):
        if name == key:
            val = value
            if isinstance(value, list):
                vtype, kwargs["sub_type"] = gguf.GGUFValueType.ARRAY, getattr(gguf.GGUFValueType, kind)
            else:
                vtype = getattr(gguf.GGUFValueType, kind)
        return real(self, name, val, vtype, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_key_value", add)
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    monkeypatch.undo()
    with pytest.raises(gg.GGUFError, match=says):
        gg.convert(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    assert _leftovers(tmp_path) == []


def test_a_token_list_longer_than_the_embedding_is_refused(tmp_path, monkeypatch):
    """Token ids past the embedding's rows (here BOS and EOS) read memory outside the matrix of
    the converted model; a padded embedding (more rows than tokens) stays allowed."""
    import gguf

    real = gguf.GGUFWriter.add_tensor
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", lambda self, name, data, *a, **kw: real(
        self, name, data[:200] if name in ("token_embd.weight", "output.weight") else data, *a, **kw))
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    monkeypatch.undo()
    with pytest.raises(gg.GGUFError, match=r"its tokenizer has \d+ tokens but token_embd.weight only 200 rows"):
        gg.convert(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    assert _leftovers(tmp_path) == []


def test_missing_file(tmp_path):
    with pytest.raises(gg.GGUFError, match="no such file"):
        gg.convert(tmp_path / "nope.gguf", tmp_path / "out", progress=False)


def test_existing_out_dir_needs_force(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(gg.GGUFError, match="already exists"):
        gg.convert(tmp_path / "tiny.gguf", out, progress=False)
    assert (out / "old.txt").exists()
    # --force replaces an earlier output (it holds a config.json), never a folder of other files
    # (a parent folder named by mistake): that is refused with nothing deleted.
    with pytest.raises(gg.GGUFError, match="not an earlier output"):
        gg.convert(tmp_path / "tiny.gguf", out, force=True, progress=False)
    assert (out / "old.txt").read_text() == "old" and _leftovers(tmp_path) == ["out"]
    (out / "config.json").write_text("{}")
    gg.convert(tmp_path / "tiny.gguf", out, force=True, progress=False)
    assert not (out / "old.txt").exists() and (out / "config.json").exists()
    assert _leftovers(tmp_path) == ["out"]
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(gg.GGUFError, match="not a folder"):
        gg.convert(tmp_path / "tiny.gguf", tmp_path / "a-file", force=True, progress=False)
    assert (tmp_path / "a-file").read_text() == "x"


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gg, "_save_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gg.convert(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    assert _leftovers(tmp_path) == []


def test_cli(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    gg.add_arguments(parser)
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    args = parser.parse_args(
        [str(tmp_path / "tiny.gguf"), str(tmp_path / "out"), "--dtype", "bfloat16"]
    )
    assert gg.run(args) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "out")
    assert gg.run(args) == 2  # exists now
    assert capsys.readouterr().err.startswith("error: ")
    (tmp_path / "bad.gguf").write_bytes(b"nope")
    assert gg.run(parser.parse_args([str(tmp_path / "bad.gguf"), str(tmp_path / "o2")])) == 2
    assert "error: " in capsys.readouterr().err


# --- the real SmolLM2-135M-Instruct from the zoo (downloads 93 MB once per machine) ---

ROUND_TRIPS = [
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🚀🎉, Ελληνικά, русский",
    "def quicksort(arr):\n    if len(arr) <= 1:\n\treturn arr  # tabs & {braces} [1, 2]\n",
    "Digits 0123456789, 3.14159, 1,000,000 and -42e10",
    "  leading spaces, trailing spaces   \n\n\r\nand  double  spaces",
]


@pytest.mark.download
@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_smollm2_round_trips(smollm2, text):
    _, tok = smollm2
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.download
def test_smollm2_splits_digits_and_knows_its_specials(smollm2):
    _, tok = smollm2
    ids = tok.encode("12345", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == list("12345")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [im_end]
    assert im_end in tok.eos_token_ids


@pytest.mark.download
def test_smollm2_answers_capital_of_france(smollm2):
    from mlx_lm import generate

    model, tok = smollm2
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    assert "Paris" in generate(model, tok, prompt, max_tokens=12)


@pytest.mark.download
def test_smollm2_perplexity_far_below_random(smollm2):
    model, tok = smollm2
    ppl = perplexity(model, tok, PARAGRAPH)
    assert ppl < 40, ppl  # measured about 11
    assert random_perplexity(model, tok, PARAGRAPH) > 100 * ppl
