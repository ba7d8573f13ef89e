"""Bad checkpoints and heads are refused by name before anything runs, and heads that convert
also draft: raw FP8/integer weights, a head trained for a target of another depth, a config
without the head's layer count, a reduced-vocabulary head without its id table, a missing
shard, a folder that does not exist, quantization group sizes MLX has no kernel for, and
Gemma 4 assistants with a quantized embedding (their own or the target's)."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import dflash_synth as S
import mlx_spec
import mtp_checkpoints
import test_gemma4_assistant as G
import tiny
from converters import dflash, gemma4, mtp
from converters.common import ConversionError, write_head
from converters.eagle import v3
from eagle_fixtures import eagle3_checkpoint, target_folder
from mlx_spec.drafters.mtp.families import module_prefix
from mlx_spec.load_errors import ModelFileNotFoundError
from mlx_spec.sampling import Sampling
from mlx_spec.taps import Taps
from runs import mlx_lm_greedy as greedy, spec_run


def test_weights_that_are_not_floating_point_are_refused_by_name(tmp_path):
    """An FP8 or integer-quantized tensor read as is would be its raw bytes (1.0 in e4m3 is 56)."""
    target = tiny.llama_model(layers=6)
    tdir = target_folder(tmp_path / "target", target)
    eagle3_checkpoint(tmp_path / "src", 64, tiny.VOCAB)
    w = mx.load(str(tmp_path / "src" / "model.safetensors"))
    w["fc.weight"] = mx.full(w["fc.weight"].shape, 56, mx.uint8)
    mx.save_safetensors(str(tmp_path / "src" / "model.safetensors"), w)
    with pytest.raises(ConversionError, match=r"fc\.weight \(mlx.core.uint8\).* not floating point"):
        v3.convert(tmp_path / "src", tmp_path / "out", tdir)
    assert not (tmp_path / "out").exists()


def test_a_reduced_vocabulary_head_without_its_id_table_is_refused(tmp_path):
    target = tiny.llama_model(layers=6)
    tdir = target_folder(tmp_path / "target", target)
    eagle3_checkpoint(tmp_path / "src", 64, tiny.VOCAB, V_d=48)
    out = v3.convert(tmp_path / "src", tmp_path / "out", tdir)
    mlx_spec.load_drafter(out, target)  # whole, it loads
    w = mx.load(str(out / "model.safetensors"))
    del w["draft_to_target"]
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "mlx"})
    with pytest.raises(ValueError, match="48 of the target's 96 tokens but has no draft_to_target"):
        mlx_spec.load_drafter(out, target)
    # A table mapping two draft tokens to one target token (a damaged or hand-made checkpoint)
    # would make a tree's siblings repeat; it is refused by name.
    w["draft_to_target"] = mx.concatenate([mx.arange(47, dtype=mx.int32), mx.array([3], mx.int32)])
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "mlx"})
    with pytest.raises(ValueError, match="draft_to_target must map each draft token to its own target "
                                         r"token \(distinct ids >= 0\), but it has 1 repeated"):
        mlx_spec.load_drafter(out, target)


@pytest.fixture
def dflash_target(tmp_path):
    model, tcfg = S.qwen3_target(seed=0)  # 4 layers
    return S.write_target(tmp_path / "t", model, tcfg)


def test_a_dflash_head_for_a_target_of_another_depth_is_refused(tmp_path, dflash_target):
    w = S.network_weights(np.random.default_rng(0), 2, 2)
    src = S.save_checkpoint(tmp_path / "src", S.zlab_config(2, [0, 2], 36), w)
    with pytest.raises(ConversionError, match="36-layer target; --target has 4 layers"):
        dflash.convert(src, tmp_path / "out", dflash_target)
    src = S.save_checkpoint(tmp_path / "src4", S.zlab_config(2, [0, 2], 4), w)
    assert dflash.convert(src, tmp_path / "out", dflash_target).is_dir()  # the right target converts


def test_a_dflash_config_without_its_layer_count_is_refused_clearly(tmp_path, dflash_target):
    cfg = S.zlab_config(2, [0, 2], 4)
    del cfg["num_hidden_layers"], cfg["layer_types"]
    src = S.save_checkpoint(tmp_path / "src", cfg, S.network_weights(np.random.default_rng(0), 2, 2))
    with pytest.raises(ConversionError, match="num_hidden_layers .* is None"):
        dflash.convert(src, tmp_path / "out", dflash_target)


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_a_missing_shard_with_the_mtp_module_is_named(tmp_path, family):
    src = mtp_checkpoints.write(tmp_path / family, family)
    w = mx.load(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    prefix = module_prefix(family, json.loads((src / "config.json").read_text()))
    body = {k: v for k, v in w.items() if not k.startswith(prefix)}
    mx.save_safetensors(str(src / "model-00001-of-00002.safetensors"), body, metadata={"format": "pt"})
    where = {k: "model-00001-of-00002.safetensors" if k in body else "model-00002-of-00002.safetensors" for k in w}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": where}))
    with pytest.raises((ConversionError, ValueError), match=r"model-00002-of-00002\.safetensors.*download"):
        mtp.convert(src, tmp_path / "out", None)


def test_a_head_folder_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(ModelFileNotFoundError, match="does not exist") as e:
        mlx_spec.load_drafter(tmp_path / "no_such_head", tiny.llama_model())
    assert "Hugging Face" not in str(e.value)


def test_quantization_group_sizes_without_a_kernel_are_refused(tmp_path):
    w = {"fc.weight": mx.zeros((96, 96))}
    with pytest.raises(ConversionError, match="--q-group-size must be 32, 64 or 128, got 48"):
        write_head(tmp_path / "h", {}, w, quantize_bits=4, group_size=48)
    assert not (tmp_path / "h").exists()


def test_gemma4_assistants_draft_with_a_quantized_embedding(tmp_path):
    """-q quantizes an E2B/E4B assistant's ordered embedding, whose selected rows its output
    layer reads; and mlx-community's Gemma 4 targets are quantized, so the target's embedding
    is too: either way drafting works and the output is the target's."""
    model, tcfg = G.target()
    cfg, w = G.assistant(np.random.default_rng(0), ordered=True)
    src, tdir = tmp_path / "src", tmp_path / "target"
    for folder, c in ((src, cfg), (tdir, tcfg)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(c))
    mx.save_safetensors(str(src / "model.safetensors"), {k: mx.array(v) for k, v in w.items()})
    out = gemma4.convert(src, tmp_path / "head_q", tdir, quantize_bits=8, group_size=32)
    d = mlx_spec.load_drafter(out, model)
    assert isinstance(d.net.embed_tokens, nn.QuantizedEmbedding)
    got, stats = spec_run(model, d, G.PROMPT, 12, 3)
    assert got == greedy(model, G.PROMPT, 12) and stats.drafted > 0

    # A quantized target (its embedding: uint32 words) drafts as a float target holding the
    # same (dequantized) weights: the features fed to the assistant are the same numbers.
    quantized, _ = G.target()
    nn.quantize(quantized, group_size=64, bits=8, class_predicate=lambda _, m: (
        hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0))
    assert isinstance(quantized.model.embed_tokens, nn.QuantizedEmbedding)
    plain, _ = G.target()
    plain.load_weights([(f"{name}.weight", mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits))
                        for name, m in quantized.named_modules() if hasattr(m, "scales")], strict=False)
    head, _ = G.convert(tmp_path, tcfg)
    qs = []
    for target in (quantized, plain):
        d = mlx_spec.load_drafter(head, target)
        d.bind(target, None)
        with Taps(target, d.taps) as t:
            target(mx.array([G.PROMPT]))
            d.prefill(G.PROMPT, t.read())
        mx.random.seed(3)  # the same draws: each step's q compared
        qs.append(np.array(d.propose(G.PROMPT[-1], 3, Sampling(temp=1.0)).q))
    np.testing.assert_allclose(qs[0], qs[1], atol=2e-3)
    got, _ = spec_run(quantized, d, G.PROMPT, 12, 3)
    assert got == greedy(quantized, G.PROMPT, 12)


def test_a_gemma4_assistant_untied_in_its_text_config_keeps_its_lm_head(tmp_path):
    """The published assistants say tie_word_embeddings in text_config; an untied one's own
    lm_head must not be dropped for the embedding."""
    model, tcfg = G.target()
    cfg, w = G.assistant(np.random.default_rng(0))
    del cfg["tie_word_embeddings"]
    cfg["text_config"]["tie_word_embeddings"] = False
    w["lm_head.weight"] = np.random.default_rng(1).standard_normal(w["model.embed_tokens.weight"].shape).astype(np.float32)
    src, tdir = tmp_path / "src", tmp_path / "target"
    for folder, c in ((src, cfg), (tdir, tcfg)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(c))
    mx.save_safetensors(str(src / "model.safetensors"), {k: mx.array(v) for k, v in w.items()})
    out = gemma4.convert(src, tmp_path / "head", tdir)
    np.testing.assert_array_equal(np.array(mx.load(str(out / "model.safetensors"))["lm_head.weight"]), w["lm_head.weight"])
    d = mlx_spec.load_drafter(out, model)
    got, _ = spec_run(model, d, G.PROMPT, 12, 3)
    assert got == greedy(model, G.PROMPT, 12)


def test_damaged_shard_layouts_are_named(tmp_path):
    from converters.common import read_tensors

    a = tmp_path / "a"
    a.mkdir()
    mx.save_safetensors(str(a / "model-1.safetensors"), {"x": mx.zeros(2)})
    mx.save_safetensors(str(a / "model-2.safetensors"), {"x": mx.ones(2)})
    with pytest.raises(ConversionError, match=r"\['x'\] are in more than one weight file"):
        read_tensors(a)
    (a / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ConversionError, match="no 'weight_map'"):
        read_tensors(a)


def test_a_damaged_or_truncated_source_file_is_named_not_a_traceback(tmp_path):
    from converters.common import read_config, read_tensors

    eagle3_checkpoint(tmp_path / "src", 64, tiny.VOCAB)
    f = tmp_path / "src" / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ConversionError, match=r"model\.safetensors is truncated .*download it again"):
        read_tensors(tmp_path / "src")
    (tmp_path / "src" / "config.json").write_text("[1, 2]")
    with pytest.raises(ConversionError, match="holds a JSON list, not the object of a model config"):
        read_config(tmp_path / "src")
    (tmp_path / "src" / "config.json").write_text("{not json")
    with pytest.raises(ConversionError, match=r"config\.json is not valid JSON"):
        read_config(tmp_path / "src")


@pytest.mark.parametrize("alias", ["model. prefix", "midlayer / layers.0"])
def test_two_copies_of_one_tensor_under_aliases_are_refused_not_merged(tmp_path, alias):
    """A `model.`-prefixed copy beside the plain one, or `midlayer.*` beside `layers.0.*`, used to
    collapse into one tensor, the last read winning (a zero copy could become the head's)."""
    target = tiny.llama_model(layers=6)
    tdir = target_folder(tmp_path / "target", target)
    eagle3_checkpoint(tmp_path / "src", 64, tiny.VOCAB)
    w = mx.load(str(tmp_path / "src" / "model.safetensors"))
    if alias == "model. prefix":
        w["model.fc.weight"] = mx.zeros_like(w["fc.weight"])
    else:
        key = next(k for k in w if k.startswith(("midlayer.", "layers.0.")))
        other = "layers.0." + key[9:] if key.startswith("midlayer.") else "midlayer." + key[9:]
        w[other] = mx.zeros_like(w[key])
    mx.save_safetensors(str(tmp_path / "src" / "model.safetensors"), w)
    with pytest.raises(ConversionError, match="both name .*two copies of one tensor"):
        v3.convert(tmp_path / "src", tmp_path / "out", tdir)
    assert not (tmp_path / "out").exists()


def test_mtp_weights_read_as_raw_bytes_or_in_a_stray_file_are_refused(tmp_path):
    src = mtp_checkpoints.write(tmp_path / "m", "qwen3_5")
    prefix = module_prefix("qwen3_5", json.loads((src / "config.json").read_text()))
    w = mx.load(str(src / "model.safetensors"))
    proj = next(k for k in w if k.startswith(prefix) and k.endswith(".weight") and w[k].ndim == 2)
    stray = {proj: mx.zeros_like(w[proj])}
    mx.save_safetensors(str(src / "zz-extra.safetensors"), stray, metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="in more than one weight file .*remove the stray copy"):
        mtp.convert(src, tmp_path / "out", None)
    (src / "zz-extra.safetensors").unlink()
    w[proj] = mx.full(w[proj].shape, 56, mx.uint8)  # an FP8 byte pattern, without scales
    mx.save_safetensors(str(src / "model.safetensors"), w, metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="uint8, not floating point"):
        mtp.convert(src, tmp_path / "out", None)
    assert not (tmp_path / "out").exists()


def test_dflash_settings_that_cannot_draft_are_refused_at_conversion(tmp_path, dflash_target):
    w = S.network_weights(np.random.default_rng(0), 2, 2)
    src = S.save_checkpoint(tmp_path / "src", S.zlab_config(2, [0, 2], 4, target_hidden_size=2 * S.H), w)
    with pytest.raises(ConversionError, match=f"reads a target {2 * S.H} wide, --target is {S.H}"):
        dflash.convert(src, tmp_path / "out", dflash_target)
    cfg = S.zlab_config(2, [0, 2], 4)
    cfg["dflash_config"].update(conv_kernel_size=3, conv_group_size=0, selector_rank=4, selector_top_k=2)
    src = S.save_checkpoint(tmp_path / "src2", cfg, w)
    with pytest.raises(ConversionError, match="conv_group_size=0: each of .* must be >= 1"):
        dflash.convert(src, tmp_path / "out", dflash_target)


def test_config_counts_given_as_strings_are_refused_by_name(tmp_path, dflash_target):
    """A "2" (a string) for num_key_value_heads used to reach the shape table ('2222...')."""
    target = tiny.llama_model(layers=6)
    tdir = target_folder(tmp_path / "target", target)
    eagle3_checkpoint(tmp_path / "src", 64, tiny.VOCAB)
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": "2"}))
    with pytest.raises(ConversionError, match="num_key_value_heads='2' must be positive integers"):
        v3.convert(tmp_path / "src", tmp_path / "out", tdir)
    dcfg = {**S.zlab_config(2, [0, 2], 4), "head_dim": "16"}
    src = S.save_checkpoint(tmp_path / "dsrc", dcfg, S.network_weights(np.random.default_rng(0), 2, 2))
    with pytest.raises(ConversionError, match="head_dim='16' must be positive integers"):
        dflash.convert(src, tmp_path / "dout", dflash_target)
