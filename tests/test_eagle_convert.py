"""EAGLE head conversion: every layout in, one MLX head folder out; bad checkpoints write nothing."""

from __future__ import annotations

import json
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_spec
import tiny
from converters import head as head_cli
from converters.common import ConversionError
from converters.eagle import from_input_of_layer, from_output_of_layer, v1, v3
from converters.eagle.v3 import taps_for
from eagle_fixtures import eagle1_checkpoint, eagle3_checkpoint, target_folder
from mlx_spec.cli import main as cli_main
from mlx_spec.drafters.eagle import EagleDrafter, Eagle1Head, Eagle3Head
from mlx_spec.taps import EMBED, FINAL_NORM

H, V = 64, tiny.VOCAB


@pytest.fixture(scope="module")
def target():
    return tiny.llama_model(layers=6)


@pytest.fixture
def tgt(tmp_path, target):
    return target_folder(tmp_path / "target", target)


def _saved(out):
    return json.loads((out / "config.json").read_text()), mx.load(str(out / "model.safetensors"))


# ---------------------------------------------------------------- layer-id conventions
# EAGLE's `modeling_llama_kv.py` counts the input of layer k; z-lab DFlash the output.


def test_layer_id_translations_are_pinned():
    # EAGLE-3 default: input-of-layer [2, N//2, N-3] -> outputs of layers [1, N//2 - 1, N - 4]
    assert taps_for({}, 32)[0] == [1, 15, 28]  # Llama-3.1-8B: inputs of layers 2, 16, 29
    assert taps_for({}, 30)[0] == [1, 14, 26]  # SmolLM2-135M
    # vLLM / speculators field: input-of-layer ids, 0 = the embedding
    assert taps_for({"eagle_aux_hidden_state_layer_ids": [0, 5, 32]}, 32)[0] == [EMBED, 4, 31]
    assert taps_for({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, 8)[0] == [0, 1, 2]
    # DeepSpec target_layer_ids: output-of-layer ids, -1 = the embedding
    assert taps_for({"target_layer_ids": [-1, 3, 30]}, 32)[0] == [EMBED, 3, 30]
    assert from_input_of_layer([0, 1], 4) == [EMBED, 0] and from_output_of_layer([0, 3], 4) == [0, 3]
    with pytest.raises(ConversionError, match="outside 0..32"):
        from_input_of_layer([33], 32)
    with pytest.raises(ConversionError, match="outside -1..31"):
        from_output_of_layer([32], 32)
    with pytest.raises(ConversionError, match="at least 4"):
        taps_for({}, 3)


# ---------------------------------------------------------------- EAGLE-1/2


@pytest.mark.parametrize("fmt,prefix,fc_bias,qkv_bias", [
    ("bin", "", True, False),  # yuhuili Vicuna-style: pytorch_model.bin with fc.bias
    ("safetensors", "model.", False, True),  # vLLM-style prefix, Qwen2-style qkv biases
])
def test_eagle1_round_trip(tmp_path, tgt, target, fmt, prefix, fc_bias, qkv_bias):
    _, w = eagle1_checkpoint(tmp_path / "src", H, V, layers=2, fmt=fmt, prefix=prefix,
                             fc_bias=fc_bias, qkv_bias=qkv_bias)
    out = v1.convert(tmp_path / "src", tmp_path / "out", tgt)
    cfg, got = _saved(out)
    assert cfg["mlx_spec"]["drafter"] == "eagle" and cfg["mlx_spec"]["taps"] == [FINAL_NORM]
    assert cfg["mlx_spec"]["target"] == {"model_type": "llama", "hidden_size": H, "num_hidden_layers": 6, "vocab_size": V}
    assert cfg["fc_bias"] is fc_bias and cfg["attention_bias"] is qkv_bias and cfg["num_layers"] == 2
    assert set(got) == set(w) - {"embed_tokens.weight"}  # the target's embedding is used
    for k, v in got.items():
        np.testing.assert_array_equal(np.array(v), w[k], err_msg=k)
    drafter = mlx_spec.load_drafter(out, target)
    assert isinstance(drafter, EagleDrafter) and isinstance(drafter.head, Eagle1Head)
    assert "input_layernorm" not in drafter.head.layers[0] and "input_layernorm" in drafter.head.layers[1]


# ---------------------------------------------------------------- EAGLE-3


def test_eagle3_yuhuili_round_trip(tmp_path, tgt, target):
    cfg_in, w = eagle3_checkpoint(tmp_path / "src", H, V, V_d=40, fmt="bin")
    assert cfg_in["num_hidden_layers"] == 40  # the misleading field of the wild
    out = v3.convert(tmp_path / "src", tmp_path / "out", tgt)
    cfg, got = _saved(out)
    assert cfg["mlx_spec"]["drafter"] == "eagle3" and cfg["mlx_spec"]["taps"] == [1, 2, 2]  # N = 6
    assert cfg["source"]["layout"] == "yuhuili" and cfg["num_layers"] == 1 and cfg["draft_vocab_size"] == 40
    assert "t2d" not in got and "d2t" not in got
    np.testing.assert_array_equal(np.array(got["draft_to_target"]), w["d2t"] + np.arange(40))
    assert got["draft_to_target"].dtype == mx.int32
    np.testing.assert_array_equal(np.array(got["layers.0.self_attn.q_proj.weight"]), w["midlayer.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(np.array(got["layers.0.hidden_norm.weight"]), w["midlayer.hidden_norm.weight"])
    drafter = mlx_spec.load_drafter(out, target)
    assert isinstance(drafter.head, Eagle3Head) and drafter.taps == (1, 2, 2)


def test_eagle3_speculators_round_trip_with_options(tmp_path, tgt, target):
    _, w = eagle3_checkpoint(
        tmp_path / "src", H, V, layout="speculators", layers=2, norm_before_fc=True, fc_norm=True,
        qk_norm=True, config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "norm_before_residual": True},
    )
    assert "embed_tokens.weight" in w  # speculators ships a copy...
    out = v3.convert(tmp_path / "src", tmp_path / "out", tgt)
    cfg, got = _saved(out)
    assert "embed_tokens.weight" not in got  # ...which is dropped: same width as the target
    assert cfg["mlx_spec"]["taps"] == [0, 2, 4] and cfg["source"]["layer_ids"]["convention"] == "input-of-layer"
    assert cfg["num_layers"] == 2 and cfg["qk_norm"] and cfg["norm_before_fc"] and cfg["fc_norm"]
    assert cfg["norm_before_residual"] and "draft_to_target" not in got  # full vocabulary: no map
    assert set(got) == set(w) - {"embed_tokens.weight"}
    mlx_spec.load_drafter(out, target)


def test_narrow_eagle3_head_keeps_its_own_embedding(tmp_path, tgt, target):
    eagle3_checkpoint(tmp_path / "src", 32, V, H_t=64, heads=2, kv_heads=1, embed=True, V_d=50)
    out = v3.convert(tmp_path / "src", tmp_path / "out", tgt)
    cfg, got = _saved(out)
    assert cfg["own_embedding"] and got["embed_tokens.weight"].shape == (V, 32) and cfg["fc_input_size"] == 192
    assert "embed_tokens" in mlx_spec.load_drafter(out, target).head


# ---------------------------------------------------------------- the CLI, --format auto, quantization


@pytest.mark.parametrize("maker,kind", [
    (lambda p: eagle1_checkpoint(p, H, V), "eagle"),
    (lambda p: eagle1_checkpoint(p, H, V, fmt="safetensors", prefix="model."), "eagle"),
    (lambda p: eagle3_checkpoint(p, H, V, V_d=48), "eagle3"),
    (lambda p: eagle3_checkpoint(p, H, V, layout="speculators"), "eagle3"),
    (lambda p: eagle3_checkpoint(p, H, V, layout="layers", layers=2), "eagle3"),
])
def test_format_auto_detects_each_layout(tmp_path, tgt, maker, kind):
    maker(tmp_path / "src")
    assert head_cli.detect(tmp_path / "src") == kind
    assert cli_main(["convert", "head", str(tmp_path / "src"), str(tmp_path / "out"), "--target", str(tgt)]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["mlx_spec"]["drafter"] == kind


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_head_loads_and_drafts(tmp_path, tgt, target, bits):
    eagle3_checkpoint(tmp_path / "src", H, V, V_d=48)
    argv = ["convert", "head", str(tmp_path / "src"), str(tmp_path / "out"), "--target", str(tgt),
            "--format", "eagle3", "-q", "--q-bits", str(bits)]
    assert cli_main(argv) == 0
    cfg, got = _saved(tmp_path / "out")
    assert cfg["quantization"] == {"group_size": 64, "bits": bits} and "fc.scales" in got
    t0 = time.perf_counter()
    drafter = mlx_spec.load_drafter(tmp_path / "out", target)
    assert time.perf_counter() - t0 < 1.0  # "loads in a second"
    assert isinstance(drafter.head.fc, nn.QuantizedLinear)
    text = mlx_spec.generate(target, tiny.tokenizer(), [1, 2, 3], drafter, max_tokens=6, num_draft_tokens=3)
    assert len(text.split()) == 6


# ---------------------------------------------------------------- bad checkpoints: clear errors, nothing written


def _bad(tmp_path, tgt, fmt, match):
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=match):
        (v1 if fmt == "eagle" else v3).convert(tmp_path / "src", out, tgt)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_missing_tensor(tmp_path, tgt):
    eagle1_checkpoint(tmp_path / "src", H, V, drop=["layers.0.mlp.down_proj.weight"])
    _bad(tmp_path, tgt, "eagle", r"missing tensor\(s\) \['layers.0.mlp.down_proj.weight'\]")


def test_misshaped_tensor(tmp_path, tgt):
    eagle3_checkpoint(tmp_path / "src", H, V, config={"intermediate_size": 100})
    _bad(tmp_path, tgt, "eagle3", r"layers.0.mlp.gate_proj.weight: \(128, 64\) \(expected \(100, 64\)\)")


def test_head_for_another_target(tmp_path, tgt):
    eagle1_checkpoint(tmp_path / "src", 32, V, heads=2, kv_heads=1)
    _bad(tmp_path, tgt, "eagle", "its hidden_size is 32, the target's is 64")
    eagle3_checkpoint(tmp_path / "src", H, 128, V_d=64, fmt="safetensors", seed=1)
    _bad(tmp_path, tgt, "eagle3", "its vocab_size is 128, the target's is 96")


def test_fc_width_for_other_layers(tmp_path, tgt):
    eagle3_checkpoint(tmp_path / "src", H, V, n_taps=4)
    _bad(tmp_path, tgt, "eagle3", "fc reads 256 features but 3 taps")


def test_unknown_tensor(tmp_path, tgt):
    eagle3_checkpoint(tmp_path / "src", H, V)
    mx.save_safetensors(str(tmp_path / "src" / "extra.safetensors"), {"medusa_head.0.weight": mx.zeros((2, 2))})
    _bad(tmp_path, tgt, "eagle3", r"match no known key, e.g. \['medusa_head.0.weight'\]")


def test_unknown_layout(tmp_path, tgt, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": H}))
    mx.save_safetensors(str(src / "model.safetensors"), {"lm_head.weight": mx.zeros((V, H))})
    with pytest.raises(ValueError, match="cannot tell the head format"):
        head_cli.detect(src)
    assert cli_main(["convert", "head", str(src), str(tmp_path / "out"), "--target", str(tgt)]) == 2
    assert "pass --format" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_config_contradicting_the_checkpoint(tmp_path, tgt):
    eagle1_checkpoint(tmp_path / "src", H, V, fc_bias=False, config={"bias": True})
    _bad(tmp_path, tgt, "eagle", "says bias=True but the checkpoint lacks fc.bias")


def test_bad_d2t(tmp_path, tgt):
    eagle3_checkpoint(tmp_path / "src", H, V, V_d=40, drop=["d2t"])
    _bad(tmp_path, tgt, "eagle3", r"draft vocabulary \(40\) differs from the target's \(96\) but there is no d2t")


def test_cli_reports_errors_and_refuses_to_overwrite(tmp_path, tgt, capsys):
    eagle1_checkpoint(tmp_path / "src", H, V)
    argv = ["convert", "head", str(tmp_path / "src"), str(tmp_path / "out")]
    assert cli_main(argv) == 2 and "--target is required" in capsys.readouterr().err
    assert cli_main(argv + ["--target", str(tgt)]) == 0
    before = (tmp_path / "out" / "model.safetensors").stat().st_mtime_ns
    assert cli_main(argv + ["--target", str(tgt)]) == 2 and "already exists" in capsys.readouterr().err
    assert (tmp_path / "out" / "model.safetensors").stat().st_mtime_ns == before
    assert cli_main(argv + ["--target", str(tgt), "--force"]) == 0
    mine = tmp_path / "mine"  # a folder of the user's own files: --force never deletes it
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    argv[3] = str(mine)
    assert cli_main(argv + ["--target", str(tgt), "--force"]) == 2
    assert "not an earlier output" in capsys.readouterr().err and (mine / "notes.txt").read_text() == "keep"


def test_load_refuses_a_head_for_another_target(tmp_path, tgt):
    eagle3_checkpoint(tmp_path / "src", H, V)
    out = v3.convert(tmp_path / "src", tmp_path / "out", tgt)
    other = tiny.llama_model(layers=4)
    with pytest.raises(ValueError, match="num_hidden_layers: head made for 6, target has 4"):
        mlx_spec.load_drafter(out, other)


def test_hass_head_round_trip_and_auto_detection(tmp_path, tgt):
    _, w = eagle1_checkpoint(tmp_path / "src", H, V, hass=True, first_norm=True)
    assert head_cli.detect(tmp_path / "src") == "eagle"
    out = v1.convert(tmp_path / "src", tmp_path / "out", tgt)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["add_para_norm"] and cfg["first_input_norm"]
    got = mx.load(str(out / "model.safetensors"))
    np.testing.assert_array_equal(np.array(got["hidden_states_layernorm.weight"]), w["hidden_states_layernorm.weight"])
    assert "layers.0.input_layernorm.weight" in got


def test_layer0_input_norm_without_hass_is_refused(tmp_path, tgt):
    eagle1_checkpoint(tmp_path / "src", H, V, first_norm=True, config={"add_para_norm": True},
                      drop=[])  # flag says HASS but the norms are missing
    _bad(tmp_path, tgt, "eagle", "says add_para_norm=True but the checkpoint lacks embedding_layernorm")


def _speculators_eagle1(src):
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"speculators_model_type": "eagle", "layernorms": True,
                                                 "transformer_layer_config": {"hidden_size": H}}))
    mx.save_safetensors(str(src / "model.safetensors"), {"fusion_fc.weight": mx.zeros((H, 2 * H)),
                                                         "pre_lm_head_layernorm.weight": mx.ones((H,))})


def _sglang_multilayer(src, names):
    eagle3_checkpoint(src, H, V)
    extra = {f"{n}.self_attn.q_proj.weight": mx.zeros((H, H)) for n in names}
    mx.save_safetensors(str(src / "extra.safetensors"), extra)


@pytest.mark.parametrize("make, fmt, match", [
    (_speculators_eagle1, "eagle", "speculators EAGLE-1/HASS head .* disagree on where its pre_lm_head_layernorm"),
    (lambda s: _sglang_multilayer(s, ["additional_layers.0", "additional_layers.1"]), "eagle3",
     r"3 layers in SGLang's multi-layer EAGLE-3 layout .* restarts the residual"),
    (lambda s: _sglang_multilayer(s, ["midlayers.0", "midlayers.1"]), "eagle3",
     r"2 layers in a multi-layer EAGLE-3 layout with every layer named midlayers.*re-reads the token embedding"),
])
def test_recognised_but_unsupported_layouts_say_why(tmp_path, tgt, make, fmt, match, capsys):
    make(tmp_path / "src")
    with pytest.raises(ValueError, match=match):  # --format auto
        head_cli.detect(tmp_path / "src")
    _bad(tmp_path, tgt, fmt, match)  # the format named explicitly
    assert cli_main(["convert", "head", str(tmp_path / "src"), str(tmp_path / "out"), "--target", str(tgt)]) == 2
    assert "not" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_layer0_input_norm_is_refused_outside_hass(tmp_path, tgt):
    eagle1_checkpoint(tmp_path / "src", H, V, first_norm=True)
    _bad(tmp_path, tgt, "eagle", "layer 0 has an input_layernorm, which EAGLE-1/2 heads lack")


def test_convert_head_takes_a_zoo_name_for_its_target(tmp_path, tgt, monkeypatch, capsys):
    from mlx_spec import zoo

    asked = []
    monkeypatch.setattr(zoo, "fetch", lambda name: asked.append(name) or tgt)
    eagle1_checkpoint(tmp_path / "src", H, V)
    argv = ["convert", "head", str(tmp_path / "src"), str(tmp_path / "out"), "--target", "smollm2-135m-instruct"]
    assert cli_main(argv) == 0, capsys.readouterr().err
    assert asked == ["smollm2-135m-instruct"] and (tmp_path / "out" / "config.json").is_file()
