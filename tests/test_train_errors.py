"""Bad input to `mlx-spec train` fails before any work (no data generated, no folder written),
with one message naming the problem and the fix."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

import mlx_spec
import tiny
from mlx_spec.cli import main as cli_main
from mlx_spec.drafters.eagle import Eagle3Head
from mlx_spec.train.data import DataError, user_header
from mlx_spec.train.export import head_config, write_head
from mlx_spec.train.run import realign, train_eagle3

TEMPLATE = "{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}{% if add_generation_prompt %}w4{% endif %}"
PROMPTS = [[{"role": "user", "content": f"w{5 + i} w{9 + i} w{13 + i}"}] for i in range(4)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.model_folder(tmp_path_factory.mktemp("t") / "model", layers=6, eos=None, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def target(folder):
    return mlx_spec.load(str(folder))


def _fail(fn, match, out):
    with pytest.raises(ValueError, match=match):
        fn()
    assert not out.exists() or not (out / "data.jsonl").exists()


def test_prompts_file_without_usable_rows(tmp_path, folder, capsys):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"text": "no prompt field"}\nnot json\n{"messages": []}\n{"prompt": "  "}\n')
    out = tmp_path / "out"
    # the model is never loaded: a wrong --model would fail later than the prompts file
    code = cli_main(["train", "eagle3", "--model", str(tmp_path / "no-such-model"), "--out", str(out),
                     "--prompts", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and "no usable rows" in err and "4 unreadable" in err and '{"prompt": ' in err
    assert not out.exists()


@pytest.mark.parametrize("vocab,taps,match", [
    (97, [1, 2, 4], r"--draft-vocab 97 is larger than the target's vocabulary \(96\); pass at most 96"),
    (32, [1, 2, 9], r"--tap-layers \[9\]: the target has decoder layers 0..5"),
])
def test_draft_vocab_or_taps_the_target_lacks(tmp_path, target, vocab, taps, match):
    model, tok = target
    out = tmp_path / "out"
    _fail(lambda: train_eagle3(model, tok, out, prompts=PROMPTS, draft_vocab=vocab, tap_layers=taps), match, out)
    assert not out.exists()


def test_unknown_init_fails_before_any_work(tmp_path, target):
    model, tok = target
    out = tmp_path / "out"
    _fail(lambda: train_eagle3(model, tok, out, prompts=PROMPTS, draft_vocab=32, tap_layers=[1, 2, 4],
                               init="zeros"), r"--init 'zeros': choose one of target, random", out)
    assert not out.exists()


def test_head_made_for_another_target(tmp_path, target):
    model, tok = target
    other = tiny.llama_model(layers=6, hidden=32)
    head_dir = tmp_path / "head"
    write_head(head_dir, Eagle3Head(head_config(other, [1, 2, 4], 32)), head_config(other, [1, 2, 4], 32),
               mx.arange(32, dtype=mx.int32))
    out = tmp_path / "out"
    _fail(lambda: realign(model, tok, head_dir, out, prompts=PROMPTS),
          r"converted for another target \(hidden_size: head made for 32, target has 64\)", out)
    assert not out.exists()


def test_resume_with_another_target_or_without_a_run(tmp_path, target):
    model, tok = target
    out = tmp_path / "out"
    _fail(lambda: train_eagle3(model, tok, out, resume=True), "holds no checkpoint of a training run", out)
    train_eagle3(model, tok, out, prompts=PROMPTS, draft_vocab=32, tap_layers=[1, 2, 4], steps=2,
                 eval_prompts=1, eval_tokens=2, max_length=16, log=lambda m: None)
    before = (out / "model.safetensors").read_bytes()
    other = tiny.llama_model(layers=8)
    with pytest.raises(ValueError, match=r"another target \(num_hidden_layers: head made for 6, target has 8\)"):
        train_eagle3(other, tok, out, resume=True)
    with pytest.raises(ValueError, match="exists and is not empty; pass --resume"):
        train_eagle3(model, tok, out, prompts=PROMPTS, draft_vocab=32, tap_layers=[1, 2, 4])
    assert (out / "model.safetensors").read_bytes() == before
    assert json.loads((out / "state.json").read_text())["step"] == 2


def test_no_chat_template_and_no_prompts(tmp_path):
    with pytest.raises(DataError, match="no chat template.*pass --prompts FILE"):
        user_header(tiny.tokenizer())


def test_unknown_magpie_topic_fails_before_any_generation(tmp_path, target):
    model, tok = target
    out = tmp_path / "out"
    _fail(lambda: train_eagle3(model, tok, out, topics=("chat", "poetry"), draft_vocab=32, tap_layers=[1, 2, 4]),
          r"--magpie-topics chat,poetry: choose from chat, code", out)


def test_a_topic_system_turn_comes_before_the_user_header(target):
    _, tok = target
    plain, steered = user_header(tok), user_header(tok, "w7 w8")
    assert steered != plain and tok.decode(steered).split() == ["w2", "w7", "w8", "w3", "w2"]
