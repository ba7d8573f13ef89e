"""`mlx-spec convert head SRC OUT --format mtp`: an extracted head drafts exactly like the
MTP module read from the target checkpoint, quantized or not, and bad input is refused."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

import mlx_spec
import mtp_checkpoints as ckpts
from converters import mtp as mtp_converter
from converters.common import ConversionError
from mlx_spec.cli import main as cli
from mlx_spec.drafters.mtp import MTPDrafter, load_head_folder
from mlx_spec.sampling import Sampling
from mlx_spec.taps import FINAL_NORM, decoder_stack

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7]


def proposals(drafter, model, tok, k=4):
    drafter.bind(model, tok)
    hidden = decoder_stack(model)(mx.array(PROMPT)[None])[0]
    drafter.prefill(PROMPT, {FINAL_NORM: hidden})
    return drafter.propose(3, k, Sampling()).tokens.tolist()


@pytest.mark.parametrize("family,opts", [("qwen3_5", {}), ("deepseek_v3", {}), ("glm4_moe", {"glm46": True}),
                                         ("mimo", {}), ("nemotron_h", {})],
                         ids=["qwen3_5", "deepseek_v3", "glm4.6", "mimo", "nemotron_h"])
def test_extracted_head_drafts_like_the_checkpoints_own(tmp_path, family, opts):
    src = ckpts.write(tmp_path / "src", family, **opts)
    model, tok = load(str(src))
    assert mtp_converter.detect(json.loads((src / "config.json").read_text()),
                                mx.load(str(src / "model.safetensors")).keys())
    assert cli(["convert", "head", str(src), str(tmp_path / "head"), "--format", "mtp"]) == 0
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["mlx_spec"]["drafter"] == "mtp" and config["family"] == family
    assert config["mlx_spec"]["taps"] == ["final_norm"] and config["hidden_state"] == "final_norm"
    head = mlx_spec.load_drafter(tmp_path / "head", model)
    own = mlx_spec.load_drafter(src, model, kind="mtp")
    assert isinstance(head, MTPDrafter)
    assert proposals(head, model, tok) == proposals(own, model, tok)


def test_head_for_an_mlx_conversion_that_dropped_mtp(tmp_path):
    # Same weights twice: the "original" with mtp.*, the "MLX conversion" without.
    original = ckpts.write(tmp_path / "hf", "qwen3_5", seed=4)
    converted = ckpts.write(tmp_path / "mlx", "qwen3_5", seed=4, mtp=False)
    model, tok = load(str(converted))
    with pytest.raises(ValueError, match="convert head"):
        mlx_spec.load_drafter(converted, model, kind="mtp")
    out = mtp_converter.convert(original, tmp_path / "head", converted)
    want = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=30)]

    def run(drafter, target):
        return list(mlx_spec.stream_generate(target, tok, PROMPT, drafter, max_tokens=30,
                                             num_draft_tokens=3, trace=True))

    got = run(mlx_spec.load_drafter(out, model), model)
    model_hf, _ = load(str(original))
    own = run(mlx_spec.load_drafter(original, model_hf, kind="mtp"), model_hf)
    assert [r.token for r in got] == want == [r.token for r in own]
    assert got[-1].stats.trace == own[-1].stats.trace and got[-1].stats.accepted > 0


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_head_stays_close_and_lossless(tmp_path, bits):
    src = ckpts.write(tmp_path / "src", "qwen3_5")
    model, tok = load(str(src))
    out = mtp_converter.convert(src, tmp_path / "q", None, quantize_bits=bits, group_size=32)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": bits}
    assert any(k.endswith(".scales") for k in mx.load(str(out / "model.safetensors")))
    drafter = mlx_spec.load_drafter(out, model)
    assert isinstance(drafter.head.proj, nn.QuantizedLinear)
    full = mlx_spec.load_drafter(src, model, kind="mtp")
    for d in (drafter, full):
        d.bind(model, tok)
    hidden = decoder_stack(model)(mx.array(PROMPT)[None])[0]
    a, _, _ = drafter.head(hidden[:-1], mx.array(PROMPT[1:], mx.uint32), drafter.cache[0], drafter._embed, drafter._lm_head)
    b, _, _ = full.head(hidden[:-1], mx.array(PROMPT[1:], mx.uint32), full.cache[0], full._embed, full._lm_head)
    err = np.abs(np.array(a) - np.array(b)).max() / np.abs(np.array(b)).max()
    assert err < (0.05 if bits == 8 else 0.3)
    want = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=20)]
    got = mlx_spec.stream_generate(model, tok, PROMPT, drafter, max_tokens=20, num_draft_tokens=3)
    assert [r.token for r in got] == want


def test_a_checkpoint_without_mtp_is_refused(tmp_path):
    src = ckpts.write(tmp_path / "src", "mimo", mtp=False)
    with pytest.raises(ConversionError, match="declares 1 MTP module"):
        mtp_converter.convert(src, tmp_path / "out", None)
    assert not (tmp_path / "out").exists()


def test_target_of_another_architecture_is_refused(tmp_path):
    src = ckpts.write(tmp_path / "src", "qwen3_5")
    other = ckpts.write(tmp_path / "other", "mimo", mtp=False)
    with pytest.raises(ConversionError, match="same model"):
        mtp_converter.convert(src, tmp_path / "out", other)


def test_head_loaded_onto_another_model_is_refused(tmp_path):
    src = ckpts.write(tmp_path / "src", "qwen3_5")
    out = mtp_converter.convert(src, tmp_path / "head", None)
    other, _ = load(str(ckpts.write(tmp_path / "other", "mimo", mtp=False)))
    with pytest.raises(ValueError, match="converted for another target"):
        mlx_spec.load_drafter(out, other)  # the core's identity check
    config = json.loads((out / "config.json").read_text())
    with pytest.raises(ValueError, match="is a qwen3_5 MTP head; the target is a mimo model"):
        load_head_folder(out, config, other)  # ours, should the sizes agree
